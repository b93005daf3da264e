"""The benchmarks page's bar charts (scripts/mkdocs_hooks.py) drawn from small results files: seconds per
method with the page cache warm and cold side by side, and planning's seconds by scale; each an SVG that
parses, with a title and a text label for every method and value."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def envelope(benchmark: str, results: list[dict[str, object]]) -> dict[str, object]:
    machine = {"cpus": 2, "memory_gib": 23.5, "python": "3.11.7"}
    return {
        "benchmark": benchmark,
        "command": "scripts/bench.py x",
        "date": "2026-11-27",
        "machine": machine,
        "versions": {"torch": "2.13.0", "ckptconv": "0.1.0"},
        "results": results,
    }


def row(method: str, label: str, cache: str, seconds: float) -> dict[str, object]:
    return {
        "direction": "dcp-to-hf",
        "shape": "dense",
        "size_gb": 1.0,
        "method": method,
        "label": label,
        "kind": "convert",
        "ranks": 1,
        "checkpoint_bytes": 10**9,
        "runs": 3,
        "median_seconds": seconds,
        "gb_per_s": 1 / seconds,
        "rss_rank_bytes": 1,
        "rss_sum_bytes": 1,
        "cache": cache,
        "error": None,
    }


def charts(markdown: str) -> list[ET.Element]:
    return [
        ET.fromstring(line[line.index("<svg") : line.rindex("</svg>") + 6])
        for line in markdown.splitlines()
        if "ckptconv-bars" in line
    ]


def test_warm_and_cold_bars_per_method(tmp_path: Path) -> None:
    rows = [
        row("cat", "cat (read limit)", "warm", 0.4),
        row("cat", "cat (read limit)", "cold", 1.6),
        row("ckptconv_1", "ckptconv 1 rank", "warm", 2.2),
        row("ckptconv_1", "ckptconv 1 rank", "cold", 7.5),
        row("dcp_load", "dcp.load+save_torch_sd", "warm", 3.5),
    ]  # no cold run: one bar
    (tmp_path / "convert.json").write_text(json.dumps(envelope("convert", rows)))
    markdown = hooks().benchmark_plots(tmp_path)
    [svg] = charts(markdown)
    assert "#### dcp-to-hf, dense, 1 GB: warm and cold" in markdown
    title = svg.find(f"{SVG}title")
    assert title is not None and "warm and cold" in (title.text or "")
    assert svg.get("role") == "img" and svg.get("aria-labelledby")
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert {"warm", "cold", "cat (read limit)", "ckptconv 1 rank", "dcp.load+save_torch_sd"} <= set(texts)
    assert {"0.40 s", "1.60 s", "2.20 s", "7.50 s", "3.50 s"} <= set(texts)
    bars = [r for r in svg.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(bars) == 5
    widths = {r.find(f"{SVG}title").text: float(r.get("width", 0)) for r in bars}  # type: ignore[union-attr]
    assert widths["ckptconv 1 rank, cold: 7.50 s"] == max(widths.values())  # one scale, from 0
    assert widths["ckptconv 1 rank, warm: 2.20 s"] < widths["ckptconv 1 rank, cold: 7.50 s"]


def test_planning_bars_by_scale(tmp_path: Path) -> None:
    results = [
        {
            "scale": s,
            "chunks": c,
            "rows": {
                "torch unpickle": {"seconds": t, "peak_gib": 1.0},
                "ckptconv dry-run": {"seconds": d, "peak_gib": 0.5},
            },
        }
        for s, c, t, d in ((0.1, 92352, 4.55, 2.1), (1.0, 894144, 13.17, 5.98))
    ]
    (tmp_path / "plan.json").write_text(json.dumps(envelope("planning", results)))
    module = hooks()
    module._plan_figures = lambda results: []  # the matplotlib line plots are not this test's
    module.FIGURES["planning"] = module._plan_figures
    [svg] = charts(module.benchmark_plots(tmp_path))
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert {"torch unpickle", "ckptconv dry-run", "0.1x (92,352 chunks)", "1x (894,144 chunks)"} <= set(texts)
    assert {"4.55 s", "2.10 s", "13.17 s", "5.98 s"} <= set(texts)


def test_scaling_and_durable_tables(tmp_path: Path) -> None:
    cpu = [
        {
            "part": "cpu",
            "direction": "dcp-to-hf",
            "size_gb": 16.0,
            "ranks": n,
            "median_seconds": t,
            "speedup": 40.0 / t,
            "rss_rank_bytes": 2**29,
            "error": None,
        }
        for n, t in ((1, 40.0), (8, 7.5))
    ]
    note = {"part": "note", "note": "no CUDA device: the GPU part (save_hf / load_hf) was skipped"}
    (tmp_path / "scaling.json").write_text(json.dumps(envelope("scaling", [*cpu, note])))
    durable = [
        {**row("ckptconv_1", "ckptconv 1 rank", "warm", 3.84), "fsync": True},
        {**row("d_nofsync_1", "ckptconv 1r --no-fsync", "warm", 3.81), "fsync": False},
        {**row("dcp_load", "dcp.load+save_torch_sd", "warm", 12.31), "fsync": False},
        {**row("d_dcp_load_fsync", "dcp.load+save_torch_sd+fsync", "warm", 11.24), "fsync": True},
    ]
    (tmp_path / "durable.json").write_text(json.dumps(envelope("durable", durable)))
    markdown = hooks().benchmark_plots(tmp_path)
    assert "| dcp-to-hf | 16 | 8 | 7.50 | 5.33x | 0.50 |" in markdown
    assert note["note"] in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| dcp-to-hf 1 GB dense")]
    assert rows == [  # like with like only: fsync against fsync, no fsync against no fsync
        "| dcp-to-hf 1 GB dense | yes, both | ckptconv 1 rank 3.84 s | dcp.load+save_torch_sd+fsync 11.24 s "
        "| 0.34x | 0.00 / 0.00 |",
        "| dcp-to-hf 1 GB dense | no, neither | ckptconv 1r --no-fsync 3.81 s "
        "| dcp.load+save_torch_sd 12.31 s | 0.31x | 0.00 / 0.00 |",
    ]
