"""MkDocs hook: pages made from the code when the site is built, so they cannot drift from it.

- `<!-- cli-reference -->` (cli.md): every command of the typer app with its usage, help text, and each
  option's flags, type, default and help, read from the click command typer builds.
- `<!-- report-schema -->` (json.md): ckptconv/cli/report.schema.json as shipped.
- `<!-- benchmark-plots -->` (benchmarks.md): plots (matplotlib, inline SVG) of the results files in
  docs/benchmarks/*.json that the benchmarks write with `--out` (`scripts/bench.py NAME --out FILE`; the
  envelope is `write_results` of scripts/benchmarks/runner.py): for the conversions, throughput and peak RSS
  per rank against checkpoint size, per direction and shape; for planning and the LoRA merge, time and peak
  memory against size; one line per method, ckptconv's and each baseline's; save_hf's runs as a table.
  And bar charts drawn here as SVG (`bar_chart`, no plotting library): seconds per method with the page cache
  warm and cold side by side, for each size a conversions file has cold rows of (`scripts/bench.py convert
  --cold`), and planning's seconds by scale, torch's own unpickling against ckptconv's dry run.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
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


def benchmark_plots(folder: Path | None = None) -> str:
    """The plots and tables of every results file in `folder` (default docs/benchmarks), as markdown."""
    folder = folder or Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
    out = []
    for path in sorted(folder.glob("*.json")):
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
        for heading, chart in BARS[name](doc["results"]) if name in BARS else []:
            out += [f"#### {heading}", "", chart, ""]
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
    results = [r for r in results if r.get("cache", "warm") == "warm"]  # the cold rows: bar charts
    for case in dict.fromkeys((r["direction"], r["shape"]) for r in results):
        rows = sorted(
            (r for r in results if (r["direction"], r["shape"]) == case), key=lambda r: r["size_gb"]
        )
        if len({r["size_gb"] for r in rows}) < 2:
            continue  # one size: nothing to draw against size (its bars are below)
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


def _resume_table(results: list[dict[str, Any]]) -> list[str]:
    """A run stopped by SIGTERM once some of its files were finished, then finished with --resume or run
    again: one row per direction and stopping point."""
    columns = ("direction", "files", "stopped at", "kept", "full run (s)", "--resume (s)", "run again (s)")
    ratios = ("--resume / run again", "--resume / full")
    lines = ["| " + " | ".join((*columns, *ratios)) + " |", "|" + " --- |" * (len(columns) + 2)]
    for r in results:
        for s in r["stopped"]:
            cells = (r["direction"], r["files"], f"{s['at_percent']}%", s["kept_files"], f"{r['full_s']:.2f}")
            cells += (f"{s['resumed_s']:.2f}", f"{s['rerun_s']:.2f}", f"{s['resumed_over_rerun']:.2f}x")
            cells += (f"{s['resumed_over_full']:.2f}x",)
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return lines


def _scaling_table(results: list[dict[str, Any]]) -> list[str]:
    """Scaling: per direction, size and rank count the median seconds, the speedup over the fewest ranks and
    the peak RSS per rank; then the GPU rows (save_hf / load_hf against their baselines) and the notes."""
    lines = [
        "| direction | GB | ranks | seconds | speedup | peak RSS per rank (GiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if r.get("part") == "cpu" and r.get("median_seconds"):
            lines.append(
                f"| {r['direction']} | {r['size_gb']:g} | {r['ranks']} | {r['median_seconds']:.2f} | "
                f"{r['speedup']:.2f}x | {r['rss_rank_bytes'] / 2**30:.2f} |"
            )
    gpu = [r for r in results if r.get("part") == "gpu"]
    if gpu:
        head = "| on the GPU | method | ranks | GB | seconds | extra RSS per rank (GiB) | extra GPU (GiB) |"
        lines += ["", head]
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        lines += [
            f"| {r['op']} | {r['method']} | {r['nproc']} | {r['gb']:g} | {r['seconds']:.2f} | "
            f"{r['extra_rss_rank_gib']:.2f} | {r['extra_gpu_gib']:.2f} |"
            for r in gpu
        ]
    return [*lines, "", *(r["note"] for r in results if r.get("part") == "note")]


# durable: (ckptconv, torch's path) pairs that both fsync, then neither (scripts/benchmarks/durable.py's keys)
DURABLE_PAIRS = {
    "dcp-to-hf": (("ckptconv_1", "d_dcp_load_fsync"), ("d_nofsync_1", "dcp_load")),
    "hf-to-dcp": (("h_ckptconv_1", "h_load_save"), ("h_nofsync_1", "h_load_save_nofsync")),
}


def _durable_table(results: list[dict[str, Any]]) -> list[str]:
    """What fsync costs, like for like: ckptconv against torch's path with both fsyncing their output, then
    with neither (each row's `fsync` says which); median seconds, the ratio, peak RSS per rank."""
    lines = [
        "| direction, size | fsync | ckptconv | torch's path | ckptconv / torch | peak RSS per rank (GiB) |",
        "| --- | --- | --- | --- | ---: | ---: |",
    ]
    for case in dict.fromkeys((r["direction"], r["shape"], r["size_gb"]) for r in results):
        by = {r["method"]: r for r in results if (r["direction"], r["shape"], r["size_gb"]) == case}
        for ours, theirs in DURABLE_PAIRS.get(case[0], ()):
            a, b = by.get(ours), by.get(theirs)
            if a is None or b is None or not a["median_seconds"] or not b["median_seconds"]:
                continue
            if a.get("fsync") is None or a.get("fsync") != b.get("fsync"):
                continue  # never a row that fsyncs against one that does not
            t, u = a["median_seconds"], b["median_seconds"]
            lines.append(
                f"| {case[0]} {case[2]:g} GB {case[1]} | {'yes, both' if a['fsync'] else 'no, neither'} | "
                f"{a['label']} {t:.2f} s | {b['label']} {u:.2f} s | {t / u:.2f}x | "
                f"{a['rss_rank_bytes'] / 2**30:.2f} / {b['rss_rank_bytes'] / 2**30:.2f} |"
            )
    return lines


Bars = list[tuple[str, dict[str, float]]]  # (group label, series -> value), drawn top to bottom


def _convert_bars(results: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """For each direction, shape and size with cold rows: seconds per method, warm and cold side by side."""
    charts = []
    cases = dict.fromkeys(
        (r["direction"], r["shape"], r["size_gb"]) for r in results if r.get("cache") == "cold"
    )
    for direction, shape, size in cases:
        groups: dict[str, dict[str, float]] = {}
        for r in results:
            if (r["direction"], r["shape"], r["size_gb"]) == (direction, shape, size) and r["median_seconds"]:
                groups.setdefault(r["label"], {})[r.get("cache", "warm")] = r["median_seconds"]
        title = f"{direction}, {shape}, {size:g} GB: median seconds per method, page cache warm and cold"
        charts.append(
            (f"{direction}, {shape}, {size:g} GB: warm and cold", bar_chart(title, list(groups.items())))
        )
    return charts


def _plan_bars(results: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Planning: seconds by scale, torch's own unpickling of `.metadata` against ckptconv's dry run."""
    keys = ("torch unpickle", "ckptconv dry-run")
    groups = [
        (
            f"{r['scale']:g}x ({r['chunks']:,} chunks)",
            {k: r["rows"][k]["seconds"] for k in keys if k in r["rows"]},
        )
        for r in results
        if "chunks" in r
    ]
    if not groups:
        return []
    title = "Planning: seconds by scale, torch's own unpickling of .metadata against ckptconv's dry run"
    return [("Planning: torch's unpickling against the dry run", bar_chart(title, groups))]


COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")  # one per series, in the order they first appear
LABEL_W, BAR_W, VALUE_W, BAR_H, GAP = 230, 380, 70, 12, 10  # pixels


def bar_chart(title: str, groups: Bars, unit: str = "s") -> str:
    """A horizontal bar chart as inline SVG: for each group (a method, a scale) one bar per series (warm,
    cold), each labelled with its value, on one scale from 0. Accessible: `role="img"`, a `<title>` and a
    `<desc>` that lists every value, a `<title>` on each bar; every label is text."""
    series = list(dict.fromkeys(k for _, values in groups for k in values))
    top = max((v for _, values in groups for v in values.values()), default=1.0) or 1.0
    legend_h = 22
    height = legend_h + sum(len(values) * (BAR_H + 2) + GAP for _, values in groups) + 4
    width = LABEL_W + BAR_W + VALUE_W
    ident = "bars-" + "".join(c if c.isalnum() else "-" for c in title.lower())[:60]
    desc = "; ".join(
        f"{label}: " + ", ".join(f"{k} {v:.2f} {unit}" for k, v in values.items()) for label, values in groups
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" aria-labelledby="{ident}-t {ident}-d" font-family="sans-serif" '
        'font-size="11">',
        f'<title id="{ident}-t">{escape(title)}</title>',
        f'<desc id="{ident}-d">{escape(desc)}</desc>',
    ]
    for i, name in enumerate(series):
        x = LABEL_W + i * 110
        parts.append(f'<rect x="{x}" y="4" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>')
        parts.append(f'<text x="{x + 14}" y="13">{escape(name)}</text>')
    y = legend_h
    for label, values in groups:
        block = len(values) * (BAR_H + 2)
        parts.append(
            f'<text x="{LABEL_W - 6}" y="{y + block / 2 + 4:.1f}" text-anchor="end">{escape(label)}</text>'
        )
        for name, value in values.items():
            w = max(1.0, BAR_W * value / top)
            color = COLORS[series.index(name) % len(COLORS)]
            tip = escape(f"{label}, {name}: {value:.2f} {unit}")
            parts.append(
                f'<rect x="{LABEL_W}" y="{y}" width="{w:.1f}" height="{BAR_H}" fill="{color}">'
                f"<title>{tip}</title></rect>"
            )
            parts.append(f'<text x="{LABEL_W + w + 4:.1f}" y="{y + BAR_H - 2}">{value:.2f} {unit}</text>')
            y += BAR_H + 2
        y += GAP
    parts.append("</svg>")
    return f'<figure class="ckptconv-bars">{"".join(parts)}</figure>'


BARS = {"convert": _convert_bars, "planning": _plan_bars}
FIGURES = {"planning": _plan_figures, "lora-merge": _lora_figures, "convert": _convert_figures}
TABLES = {
    "save-hf": _save_hf_table,
    "dequant": _dequant_table,
    "durable": _durable_table,
    "scaling": _scaling_table,
    "resume": _resume_table,
}
TITLES = {
    "planning": "Planning at scale",
    "lora-merge": "LoRA merge",
    "convert": "Conversions: dcp-to-hf and hf-to-dcp",
    "memory": "Memory of verify and --read gather",
    "s3": "Object storage",
    "save-hf": "save_hf in a training job",
    "dequant": "Dequantizing quantized releases",
    "durable": "Durable output: fsync against fsync, no fsync against no fsync",
    "scaling": "Scaling with ranks, and save_hf / load_hf on GPUs",
    "resume": "Resuming an interrupted conversion",
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
