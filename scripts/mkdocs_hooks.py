"""MkDocs hook: pages made from the code when the site is built, so they cannot drift from it.

- `<!-- cli-reference -->` (cli.md): every command of the typer app with its usage, help text, and each
  option's flags, type, default and help, read from the click command typer builds.
- `<!-- report-schema -->` (json.md): ckptconv/cli/report.schema.json as shipped.
- `<!-- benchmark-plots -->` (benchmarks.md): plots (matplotlib, inline SVG) of the results files in
  docs/benchmarks/*.json that the benchmarks write with `--out` (`scripts/bench.py NAME --out FILE`; the
  envelope is `write_results` of scripts/benchmarks/runner.py): for the conversions, throughput and peak RSS
  per rank against checkpoint size, per direction and shape; for planning and the LoRA merge, time and peak
  memory against size; one line per method, ckptconv's and each baseline's; save_hf's runs as a table.
"""

from __future__ import annotations

import json
from typing import Any


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_reference())
    if "<!-- report-schema -->" in markdown:
        from ckptconv.cli.schema import load

        markdown = markdown.replace("<!-- report-schema -->", f"```json\n{json.dumps(load(), indent=2)}\n```")
    if "<!-- benchmark-plots -->" in markdown:
        markdown = markdown.replace("<!-- benchmark-plots -->", benchmark_plots())
    return markdown


def benchmark_plots() -> str:
    from pathlib import Path

    out = []
    for path in sorted((Path(__file__).resolve().parent.parent / "docs" / "benchmarks").glob("*.json")):
        doc = json.loads(path.read_text())
        name = doc["benchmark"]
        machine, versions = doc["machine"], doc["versions"]
        gpus = f", GPUs: {', '.join(machine['gpus'])}" if machine.get("gpus") else ""
        out += [
            f"### {TITLES.get(name, name)}",
            "",
            f"`{doc['command']}`, {doc['date']}: {machine['cpus']} CPUs{gpus}, {machine['memory_gib']} GiB, "
            f"Python {machine['python']}, torch {versions.get('torch')}, ckptconv {versions.get('ckptconv')} "
            f"(docs/benchmarks/{path.name}).",
            "",
        ]
        for heading, xlabel, panels in FIGURES[name](doc["results"]) if name in FIGURES else []:
            out += [f"#### {heading}", ""] if heading else []
            out += [_svg(xlabel, panels), ""]
        out += [*TABLES[name](doc["results"]), ""] if name in TABLES else []
    return "\n".join(out)


Lines = dict[str, list[tuple[float, float]]]  # label -> (x, y) points
Panel = tuple[str, str, Lines]  # title, y label, lines
Figure = tuple[str, str, list[Panel]]  # heading (or ""), x label, panels side by side


def _time_and_memory(xlabel: str, points: dict[str, list[tuple[float, float, float]]]) -> list[Figure]:
    """One figure: seconds (left) and peak GiB (right) against x, from (x, seconds, GiB) per method."""
    times = {k: [(x, t) for x, t, _ in v] for k, v in points.items()}
    peaks = {k: [(x, m) for x, _, m in v] for k, v in points.items()}
    return [("", xlabel, [("time", "seconds", times), ("peak RSS per process", "GiB", peaks)])]


def _plan_figures(results: list[dict[str, Any]]) -> list[Figure]:
    """Planning: seconds and peak GiB against the checkpoint's chunks (millions), per method."""
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for r in results:
        if "chunks" not in r:
            continue
        for name, row in r["rows"].items():
            lines.setdefault(name, []).append((r["chunks"] / 1e6, row["seconds"], row["peak_gib"]))
        for rank in r.get("shared", []):
            name = f"plan under torchrun, rank {rank['rank']}"
            lines.setdefault(name, []).append((r["chunks"] / 1e6, rank["seconds"], rank["peak_gib"]))
    return _time_and_memory("chunks in .metadata (millions)", lines)


def _lora_figures(results: list[dict[str, Any]]) -> list[Figure]:
    """LoRA merge: seconds and peak GiB per rank against the checkpoint's size, per method."""
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for r in sorted(results, key=lambda r: r["size_gb"]):
        lines.setdefault(r["method"], []).append((r["size_gb"], r["seconds"], r["rss_rank_gib"]))
    return _time_and_memory("checkpoint size (GB)", lines)


def _convert_figures(results: list[dict[str, Any]]) -> list[Figure]:
    """Conversions, per direction and shape: throughput (checkpoint GB / median s; `cp -r` included, the
    start-up floors left out) and peak RSS per rank (the conversions) against the checkpoint's size."""
    figures = []
    for case in dict.fromkeys((r["direction"], r["shape"]) for r in results):
        rows = sorted(
            (r for r in results if (r["direction"], r["shape"]) == case), key=lambda r: r["size_gb"]
        )
        speed: Lines = {}
        peak: Lines = {}
        for r in rows:
            x = r["checkpoint_bytes"] / 1e9
            if r["kind"] != "startup" and r["gb_per_s"] is not None:
                speed.setdefault(r["label"], []).append((x, r["gb_per_s"]))
            if r["kind"] == "convert" and r["rss_rank_bytes"] is not None:
                peak.setdefault(r["label"], []).append((x, r["rss_rank_bytes"] / 2**30))
        panels = [("throughput", "GB/s", speed), ("peak RSS per rank", "GiB", peak)]
        figures.append((f"{case[0]}, {case[1]}", "checkpoint size (GB)", panels))
    return figures


def _save_hf_table(results: list[dict[str, Any]]) -> list[str]:
    """save_hf in a training job: one row per method and run setting (median seconds, extra memory)."""
    lines = [
        "| method | device | ranks | GB | seconds | extra RSS per rank (GiB) | extra GPU memory (GiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        gpu = r.get("extra_gpu_gib")
        lines.append(
            f"| {r['method']} | {r.get('device', 'cpu')} | {r['nproc']} | {r['gb']:g} | {r['seconds']:.2f} | "
            f"{r['extra_rss_rank_gib']:.2f} | {'-' if gpu is None else f'{gpu:.2f}'} |"
        )
    return lines


def _dequant_table(results: list[dict[str, Any]]) -> list[str]:
    """hf-to-dcp of quantized releases against the format's own dequantizer: one row per release and method
    (median seconds, the ratio to compressed-tensors', peak RSS per rank)."""
    lines = [
        "| release | stored GB | method | seconds | vs compressed-tensors | peak RSS per rank (GiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    base = {(r["kind"], r["size_gb"]): r["seconds"] for r in results if r["method"] == "compressed-tensors"}
    for r in results:
        ratio = r["seconds"] / base[(r["kind"], r["size_gb"])]
        lines.append(
            f"| {r['kind']} | {r['size_gb']:g} | {r['method']} | {r['seconds']:.2f} | {ratio:.2f}x | "
            f"{r['rss_rank_gib']:.2f} |"
        )
    return lines


FIGURES = {"planning": _plan_figures, "lora-merge": _lora_figures, "convert": _convert_figures}
TABLES = {"save-hf": _save_hf_table, "dequant": _dequant_table}
TITLES = {
    "planning": "Planning at scale",
    "lora-merge": "LoRA merge",
    "convert": "Conversions: dcp-to-hf and hf-to-dcp",
    "memory": "Memory of verify and --read gather",
    "s3": "Object storage",
    "save-hf": "save_hf in a training job",
    "dequant": "Dequantizing quantized releases",
}


def _svg(xlabel: str, panels: list[Panel]) -> str:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for _, _, lines in panels for label in lines))
    cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    color = {label: cmap(i) for i, label in enumerate(labels)}  # one color per method in every panel
    fig, grid = plt.subplots(1, len(panels), figsize=(10, 3.6), layout="constrained", squeeze=False)
    axes = list(grid[0])
    for ax, (title, ylabel, lines) in zip(axes, panels, strict=True):
        for label, points in lines.items():
            points = sorted(points)
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], marker="o", label=label, color=color[label]
            )
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    fig.legend([handles[k] for k in labels], labels, loc="outside right upper", fontsize=8)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]  # drop the XML prolog: the figure is inline HTML
    return f'<figure class="ckptconv-plot">{" ".join(svg.split())}</figure>'


def cli_reference() -> str:
    """From the click command typer builds, through the calls click and typer's own copy of it share
    (typer 0.29 vendors click): `context_class`, `get_usage`, `get_help_record`."""
    import typer

    from ckptconv.cli.app import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="ckptconv")
    out = []
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        sub = command.context_class(command, info_name=name, parent=ctx)
        usage = command.get_usage(sub).replace("Usage: ", "")
        out += [f"## `ckptconv {name}`", "", (command.help or "").strip(), "", "```text", usage, "```", ""]
        rows = ["| argument / option | help |", "| --- | --- |"]
        for param in command.params:
            record = param.get_help_record(sub)
            if record is None:
                continue
            flags, help_text = record
            cell = " ".join(help_text.split()).replace("|", "\\|")
            rows.append(f"| `{flags}` | {cell} |")
        out += [*rows, ""]
    return "\n".join(out)
