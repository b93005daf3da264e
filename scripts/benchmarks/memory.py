"""The memory section of scripts/bench.py (`--direction memory`): peak RSS per rank of `verify`, `--verify`
and `dcp-to-hf --read gather`, against what they should hold.

  verify 1 rank            `ckptconv verify DCP RELEASE` (fp32 DCP vs its bf16 release: A cast to B's dtype)
  verify 1r --atol         the same with `--atol 1e-2` (fp32 arithmetic)
  verify 2r                under torchrun, keys shared out over 2 ranks
  dcp-to-hf --verify 1r    the conversion, re-read and compared before it is published
  gather 2r 128MB          `dcp-to-hf --read gather` on 2 ranks, the default bucket
  gather 2r 32MB           the same with `--bucket-size 32MB`

The release (`RELEASE`, bf16 safetensors) is made once from the DCP checkpoint by ckptconv and reused.
Columns: "beyond start-up" = RSS/rank minus the RSS/rank of the start-up row of the same rank count;
"largest" = the largest stored tensor (fp32 bytes); "bound" = what the command should hold beyond start-up:
the largest pair (fp32 + bf16: 1.5x largest) for verify, the bucket + the largest tensor for gather.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GIB = 1024**3
MB = 10**6

# key -> (what it holds: "pair" or bucket bytes); the commands are built in bench.py
BOUNDS: dict[str, str | int] = {
    "m_verify_1": "pair",
    "m_verify_atol": "pair",
    "m_verify_2": "pair",
    "m_convert_verify": "pair",
    "m_gather_128": 128 * MB,
    "m_gather_32": 32 * MB,
}
COLUMNS = (
    ("size", "<"),
    ("method", "<"),
    ("ranks", ">"),
    ("median s", ">"),
    ("RSS/rank GiB", ">"),
    ("beyond start-up GiB", ">"),
    ("largest GiB", ">"),
    ("bound GiB", ">"),
    ("beyond / bound", ">"),
)


def release_of(ckpt: Path) -> Path:
    """Where the bf16 release of DCP checkpoint `ckpt` (named dcp-STEM) is kept."""
    return ckpt.with_name("release-" + ckpt.name.removeprefix("dcp-"))


def ensure_release(ckpt: Path, flags: Sequence[str], env: dict[str, str]) -> Path:
    """The bf16 HF release of `ckpt`, made once by `ckptconv dcp-to-hf` (with the shape's mapping flags)."""
    release = release_of(ckpt)
    if (release / "model.safetensors.index.json").is_file() or (release / "model.safetensors").is_file():
        return release
    tmp = release.with_name(release.name + ".partial")
    argv = [sys.executable, "-m", "ckptconv", "dcp-to-hf", str(ckpt), str(tmp), "--quiet", "--overwrite"]
    subprocess.run([*argv, *flags], check=True, env=env, stdin=subprocess.DEVNULL)
    tmp.rename(release)
    return release


def largest_tensor_bytes(ckpt: Path, env: dict[str, str]) -> int:
    """The largest stored tensor of a DCP checkpoint, in bytes (from `ckptconv inspect --json`)."""
    argv = [sys.executable, "-m", "ckptconv", "inspect", str(ckpt), "--json"]
    doc: dict[str, Any] = json.loads(subprocess.run(argv, check=True, env=env, capture_output=True).stdout)
    return max(t["nbytes"] for t in doc["tensors"])


def bound_bytes(key: str, largest: int) -> int:
    """What the command `key` should hold beyond start-up: the largest fp32/bf16 pair, or bucket + largest."""
    what = BOUNDS[key]
    return largest + largest // 2 if what == "pair" else int(what) + largest


def failed_row(head: list[str], columns: Sequence[str]) -> list[str]:
    """A method's row when its run failed: FAILED, then a dash in each remaining column."""
    return [*head, "FAILED", *["-"] * (len(columns) - len(head) - 1)]


def table_rows(reports: Sequence[Any]) -> list[list[str]]:
    """Rows of the memory table. `reports`: bench.SizeReport of the memory direction, with `.largest` set."""
    rows = []
    for rep in reports:
        startup = {m.ranks: rep.results[m.key] for m in rep.methods if m.kind == "startup"}
        for m in rep.methods:
            r = rep.results[m.key]
            head = [rep.label, m.label, str(m.ranks)]
            if not r.ok:
                rows.append(failed_row(head, COLUMNS))
                continue
            base = startup.get(m.ranks)
            beyond = (
                r.rss_rank - base.rss_rank if base is not None and base.ok and m.kind == "convert" else None
            )
            bound = bound_bytes(m.key, rep.largest) if m.key in BOUNDS else None
            rows.append(
                [
                    *head,
                    f"{r.seconds:.2f}",
                    f"{r.rss_rank / GIB:.2f}",
                    "-" if beyond is None else f"{beyond / GIB:.2f}",
                    f"{rep.largest / GIB:.2f}",
                    "-" if bound is None else f"{bound / GIB:.2f}",
                    "-" if beyond is None or not bound else f"{beyond / bound:.2f}",
                ]
            )
    return rows


def headlines(reports: Sequence[Any], labels: dict[str, str]) -> list[str]:
    """One line per report: each bounded command's peak beyond start-up as a fraction of its bound."""
    lines = []
    for rep, row in zip(reports, _per_report(reports), strict=True):
        parts = [f"{labels[key]} {ratio}" for key, ratio in row]
        lines.append(f"memory @{rep.label}: peak RSS per rank beyond start-up / bound = " + ", ".join(parts))
    return lines


def _per_report(reports: Sequence[Any]) -> list[list[tuple[str, str]]]:
    out = []
    for rep in reports:
        start = {m.ranks: rep.results[m.key] for m in rep.methods if m.kind == "startup"}
        row = []
        for m in rep.methods:
            r, base = rep.results[m.key], start.get(m.ranks)
            if m.key in BOUNDS and r.ok and base is not None and base.ok:
                row.append((m.key, f"{(r.rss_rank - base.rss_rank) / bound_bytes(m.key, rep.largest):.2f}"))
        out.append(row)
    return out
