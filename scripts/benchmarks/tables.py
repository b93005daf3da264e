"""The conversion benchmarks' results per size (`SizeReport`: each method's `runner.Result`), rendered as the
text and markdown tables and the headline ratios printed and written to bench.md, and as the rows of the
results file (`result_rows`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoints import size_label
from .methods import BY_KEY, NPROC, READ_LIMIT, REFERENCE, Method
from .runner import GIB, Result


def case_label(size_gb: float, shape: str) -> str:
    return f"{size_label(size_gb)} {shape}"


@dataclass
class SizeReport:
    size_gb: float
    ckpt: Path
    ckpt_bytes: int
    shape: dict[str, Any]
    methods: tuple[Method, ...]
    direction: str = "dcp-to-hf"
    kind: str = "dense"  # the --shapes entry
    largest: int = 0  # bytes of the largest stored tensor (the memory direction)
    results: dict[str, Result] = field(default_factory=dict)
    cache: str = "warm"  # "cold": every run started with the page cache dropped (`--cold`)
    not_cold: str | None = None  # asked for cold runs: why they are not

    @property
    def label(self) -> str:
        return case_label(self.size_gb, self.kind) + (" cold" if self.cache == "cold" else "")

    def method(self, key: str) -> Method:
        return next(m for m in self.methods if m.key == key)

    def seconds(self, key: str) -> float | None:
        r = self.results.get(key)
        return r.seconds if r is not None and r.ok else None

    def vs_ckptconv(self, key: str) -> float | None:
        """This method's median time over ckptconv 1 rank's (>1: slower than ckptconv)."""
        t, ref = self.seconds(key), self.seconds(REFERENCE[self.direction][0])
        return t / ref if t is not None and ref else None

    def vs_read_limit(self, key: str) -> float | None:
        """This method's median time over the read limit's (`cat` of every source file; >1: slower), for
        the conversions and `cp -r`; None where the direction has no read-limit row (durable, memory)."""
        limit = READ_LIMIT.get(self.direction)
        t = self.seconds(key)
        ref = self.seconds(limit) if limit is not None and limit in self.results else None
        if self.method(key).kind == "startup" or t is None or not ref:
            return None
        return t / ref

    def beyond_startup_over_cp(self, key: str) -> float | None:
        """(time - start-up time) / cp -r time, for the conversions."""
        m = self.method(key)
        t, start, cp = (
            self.seconds(key),
            self.seconds(m.startup_key),
            self.seconds(REFERENCE[self.direction][1]),
        )
        if m.kind != "convert" or t is None or start is None or not cp:
            return None
        return (t - start) / cp


COLUMNS = (
    ("size", "<"),
    ("method", "<"),
    ("ranks", ">"),
    ("median s", ">"),
    ("GB/s", ">"),
    ("RSS/rank GiB", ">"),
    ("RSS sum GiB", ">"),
    ("vs ckptconv 1r", ">"),
    ("beyond start-up / cp", ">"),
)
# convert's: each row against `cat` of the source, and whether its output is fsynced (- : writes nothing, or
# fsyncs only part: torch's HF writer fsyncs its sharded files, not the consolidated ones)
LIMIT_COLUMNS = (*COLUMNS, ("x read limit", ">"), ("fsync", "<"))
FSYNC_CELL = {True: "yes", False: "no", None: "-"}


def failed_row(head: list[str], columns: Sequence[Any]) -> list[str]:
    """A method's row when its run failed: FAILED, then a dash in each remaining column."""
    return [*head, "FAILED", *["-"] * (len(columns) - len(head) - 1)]


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def table_rows(reports: Sequence[SizeReport], limit: bool = False) -> list[list[str]]:
    """The table's rows; with `limit`, each ends with the time over the read limit's (LIMIT_COLUMNS)."""
    rows = []
    columns = LIMIT_COLUMNS if limit else COLUMNS
    for rep in reports:
        for m in rep.methods:
            r = rep.results[m.key]
            head = [rep.label, m.label, str(m.ranks)]
            if not r.ok:
                rows.append(failed_row(head, columns))
                continue
            gbps = rep.ckpt_bytes / 1e9 / r.seconds if m.kind != "startup" else None
            rows.append(
                [
                    *head,
                    f"{r.seconds:.2f}",
                    _fmt(gbps, ".2f"),
                    f"{r.rss_rank / GIB:.2f}",
                    f"{r.rss_sum / GIB:.2f}",
                    _fmt(rep.vs_ckptconv(m.key), ".2f", "x"),
                    _fmt(rep.beyond_startup_over_cp(m.key), ".2f"),
                    *([_fmt(rep.vs_read_limit(m.key), ".2f", "x"), FSYNC_CELL[m.fsync]] if limit else []),
                ]
            )
    return rows


def result_rows(reports: Sequence[SizeReport]) -> list[dict[str, Any]]:
    """The results file's rows: one per (direction, shape, size, method, cache). GB/s is the checkpoint's
    bytes (1e9) over the median seconds (none for the start-up floors); RSS in bytes, the peak over the runs;
    `cache` "cold" when every run started with the page cache dropped, else "warm" (`not_cold`: why, when
    cold runs were asked for); `vs_read_limit` the median over `cat`'s of the same source and cache."""
    out = []
    for rep in reports:
        limit = READ_LIMIT.get(rep.direction)
        for m in rep.methods:
            r = rep.results[m.key]
            ok = r.ok
            out.append(
                {
                    "direction": rep.direction,
                    "shape": rep.kind,
                    "size_gb": rep.size_gb,
                    "method": m.key,
                    "label": m.label,
                    "kind": m.kind,
                    "ranks": m.ranks,
                    "checkpoint_bytes": rep.ckpt_bytes,
                    "runs": len(r.samples),
                    "median_seconds": r.seconds if ok else None,
                    "gb_per_s": rep.ckpt_bytes / 1e9 / r.seconds if ok and m.kind != "startup" else None,
                    "rss_rank_bytes": r.rss_rank if ok else None,
                    "rss_sum_bytes": r.rss_sum if ok else None,
                    "fsync": m.fsync,
                    "cache": r.cache if ok else rep.cache,
                    **({"not_cold": r.not_cold} if r.not_cold else {}),
                    **({"vs_read_limit": rep.vs_read_limit(m.key)} if limit in rep.results else {}),
                    "error": r.error,
                }
            )
    return out


def render_text(rows: list[list[str]], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    names = [c for c, _ in columns]
    widths = [max(len(r[i]) for r in [names, *rows]) for i in range(len(names))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, (_, a), w in zip(cells, columns, widths, strict=True)).rstrip()

    out = [line(names), "  ".join("-" * w for w in widths)]
    prev = rows[0][0] if rows else ""
    for r in rows:
        if r[0] != prev:
            out.append("")
            prev = r[0]
        out.append(line(r))
    return "\n".join(out)


def render_markdown(rows: list[list[str]], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    names = [c for c, _ in columns]
    sep = ["---" if a == "<" else "---:" for _, a in columns]
    return "\n".join("| " + " | ".join(r) + " |" for r in [names, sep, *rows])


def _faster(ref: float | None, other: float | None) -> str:
    if ref is None or other is None:
        return "n/a (a run failed)"
    ratio = other / ref
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"


def headlines(reports: Sequence[SizeReport]) -> list[str]:
    """The summary lines of one direction's reports (one report per size, in --sizes order)."""
    lines = []
    for rep in reports:
        size = rep.label
        if rep.direction == "hf-to-dcp":
            t1, t2 = rep.seconds("h_ckptconv_1"), rep.seconds("h_ckptconv_2")
            base = rep.seconds("h_load_save")
            lines.append(f"hf-to-dcp @{size}: ckptconv 1 rank is {_faster(t1, base)} than load_file+dcp.save")
            lines.append(
                f"hf-to-dcp @{size}: ckptconv {NPROC} ranks is {_faster(t2, base)} than load_file+dcp.save"
            )
            keys: tuple[str, ...] = ("h_ckptconv_1", "h_ckptconv_2")
        else:
            t1, t2 = rep.seconds("ckptconv_1"), rep.seconds("ckptconv_2_direct")
            fu, dl = rep.seconds("format_utils"), rep.seconds("dcp_load")
            lines.append(
                f"dcp-to-hf @{size}: ckptconv 1 rank is {_faster(t1, fu)} than format_utils+save_file, "
                f"{_faster(t1, dl)} than dcp.load+save_torch_state_dict (ckptconv fsyncs its output, these "
                "baselines do not: `scripts/bench.py durable` compares like with like)"
            )
            lines.append(
                f"dcp-to-hf @{size}: ckptconv {NPROC} ranks (direct) is {_faster(t2, fu)} than "
                f"format_utils+save_file, {_faster(t2, dl)} than dcp.load+save_torch_state_dict"
            )
            q, qb = rep.seconds("ckptconv_fp8"), rep.seconds("dcp_load_fp8")
            lines.append(f"dcp-to-hf @{size}: --quantize fp8 is {_faster(q, qb)} than dcp.load+quantize+save")
            keys = ("ckptconv_1", "ckptconv_2_direct", "ckptconv_2_gather")
        parts = [f"{BY_KEY[k].label} {_fmt(rep.beyond_startup_over_cp(k), '.1f')}" for k in keys]
        lines.append(f"{rep.direction} @{size}: time beyond start-up / cp -r = " + ", ".join(parts))
        lines += _read_limit_line(rep, keys)
    for kind in dict.fromkeys(r.kind for r in reports):
        same = [r for r in reports if r.kind == kind]
        if len(same) < 2:
            continue
        first, last = same[0], same[-1]
        for key in RSS_KEYS[first.direction]:
            a, b = first.results[key], last.results[key]
            if a.ok and b.ok:
                lines.append(
                    f"{first.direction} {kind} peak RSS per rank {size_label(first.size_gb)} vs "
                    f"{size_label(last.size_gb)} "
                    f"({BY_KEY[key].label}): {a.rss_rank / GIB:.2f} GiB vs {b.rss_rank / GIB:.2f} GiB"
                )
    return lines


def _read_limit_line(rep: SizeReport, keys: Sequence[str]) -> list[str]:
    """ckptconv's throughput against the read limit's (`cat` of every source file), where it was measured."""
    limit = rep.seconds(READ_LIMIT.get(rep.direction, ""))
    if limit is None:
        return []
    gb = rep.ckpt_bytes / 1e9
    parts = [
        f"{BY_KEY[k].label} {gb / t:.2f} GB/s ({t / limit:.2f}x the time)"
        for k in keys
        if (t := rep.seconds(k)) is not None
    ]
    return [f"{rep.direction} @{rep.label}: read limit (cat) {gb / limit:.2f} GB/s; " + ", ".join(parts)]


RSS_KEYS = {
    "dcp-to-hf": ("ckptconv_1", "ckptconv_2_direct", "ckptconv_2_gather", "ckptconv_fp8"),
    "hf-to-dcp": ("h_ckptconv_1", "h_ckptconv_2"),
}
SECTION_TITLES = {
    "dcp-to-hf": f"dcp-to-hf: fp32 DCP (FSDP2, {NPROC} ranks) -> bf16 safetensors",
    "hf-to-dcp": "hf-to-dcp: fp32 safetensors (ckptconv dcp-to-hf --dtype keep --max-shard-size 2GB) -> DCP",
}
