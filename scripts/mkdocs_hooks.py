"""MkDocs hook: pages made from the code when the site is built, so they cannot drift from it.

- `<!-- cli-reference -->` (cli.md): every command of the typer app with its usage, help text, and each
  option's flags, type, default and help, read from the click command typer builds.
- `<!-- report-schema -->` (json.md): ckptconv/report.schema.json as shipped.
- `<!-- benchmark-plots -->` (benchmarks.md): plots (matplotlib, inline SVG) of the results files in
  docs/benchmarks/*.json that the benchmark scripts write with `--out` (scripts/_bench_results.py): time and
  peak memory against size, for ckptconv and each baseline.
"""

from __future__ import annotations

import json
from typing import Any


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_reference())
    if "<!-- report-schema -->" in markdown:
        from ckptconv.schema import load

        markdown = markdown.replace("<!-- report-schema -->", f"```json\n{json.dumps(load(), indent=2)}\n```")
    if "<!-- benchmark-plots -->" in markdown:
        markdown = markdown.replace("<!-- benchmark-plots -->", benchmark_plots())
    return markdown


def benchmark_plots() -> str:
    from pathlib import Path

    out = []
    for path in sorted((Path(__file__).resolve().parent.parent / "docs" / "benchmarks").glob("*.json")):
        doc = json.loads(path.read_text())
        series = SERIES[doc["benchmark"]](doc["results"])
        machine, versions = doc["machine"], doc["versions"]
        out += [
            f"### {TITLES[doc['benchmark']]}",
            "",
            f"`{doc['command']}`, {doc['date']}: {machine['cpus']} CPUs, {machine['memory_gib']} GiB, "
            f"Python {machine['python']}, torch {versions.get('torch')}, ckptconv {versions.get('ckptconv')} "
            f"(docs/benchmarks/{path.name}).",
            "",
            _svg(series, doc["benchmark"]),
            "",
        ]
    return "\n".join(out)


def _plan_series(results: list[dict[str, Any]]) -> tuple[str, dict[str, list[tuple[float, float, float]]]]:
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
    return "chunks in .metadata (millions)", lines


def _lora_series(results: list[dict[str, Any]]) -> tuple[str, dict[str, list[tuple[float, float, float]]]]:
    """LoRA merge: seconds and peak GiB per rank against the checkpoint's size, per method."""
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for r in sorted(results, key=lambda r: r["size_gb"]):
        lines.setdefault(r["method"], []).append((r["size_gb"], r["seconds"], r["rss_rank_gib"]))
    return "checkpoint size (GB)", lines


SERIES = {"planning": _plan_series, "lora-merge": _lora_series}
TITLES = {"planning": "Planning at scale", "lora-merge": "LoRA merge"}


def _svg(series: tuple[str, dict[str, list[tuple[float, float, float]]]], name: str) -> str:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xlabel, lines = series
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, points in lines.items():
        xs = [p[0] for p in points]
        left.plot(xs, [p[1] for p in points], marker="o", label=label)
        right.plot(xs, [p[2] for p in points], marker="o", label=label)
    left.set(xlabel=xlabel, ylabel="seconds", title="time")
    right.set(xlabel=xlabel, ylabel="GiB", title="peak RSS per process")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    right.legend(fontsize=8)
    fig.tight_layout()
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

    from ckptconv.cli import app

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
