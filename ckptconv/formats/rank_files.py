"""verl's and accelerate's per-rank model files told from what a directory holds, without torch: the names
of their model, optimizer and extra-state files, whether a directory is such a run (its first model file a
zip), the files inspect says it left out and verl's `huggingface/` directory (`rank_shards` reads them)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.files import inside, is_directory, listdir, open_regular

VERL = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")
ACCELERATE = re.compile(r"pytorch_model_fsdp_(\d+)_rank(\d+)\.bin")
KINDS = {"verl-fsdp": VERL, "accelerate-fsdp2": ACCELERATE}
# the files beside the model's that hold the optimizer, scheduler and RNG state: named, never opened
TRAINER_FILES = {
    "verl-fsdp": re.compile(r"(optim|extra_state)_world_size_\d+_rank_\d+\.pt"),
    "accelerate-fsdp2": re.compile(r"optimizer_\d+_rank\d+\.bin"),
}
HF_DIR = "huggingface"  # verl's config.json and tokenizer files
FSDP_CONFIG = "fsdp_config.json"


def matches(path: Path) -> tuple[str, dict[str, re.Match[str]]] | None:
    names = listdir(path)
    for kind, pattern in KINDS.items():
        found = {n: m for n in names if (m := pattern.fullmatch(n))}
        if found:
            return kind, found
    return None


def is_rank_dir(path: Path) -> bool:
    """A directory holding verl's or accelerate's per-rank model files, the first of them a zip (reads 4
    bytes: a name alone is not enough)."""
    if not is_directory(path):
        return False
    found = matches(path)
    if found is None:
        return False
    first = path / min(found[1])
    try:
        fd = open_regular(first, path)
    except CkptconvError:
        return False
    try:
        return os.pread(fd, 4, 0) == b"PK\x03\x04"
    except OSError:
        return False
    finally:
        os.close(fd)


def model_files(ckpt: DcpCheckpoint) -> Path | None:
    """verl's `huggingface/` beside its rank files (config.json, tokenizer: what dcp-to-hf copies when no
    --copy-from is given), None for anything else; it must resolve inside the checkpoint."""
    if ckpt.kind != "verl-fsdp":
        return None
    files = ckpt.path / HF_DIR
    if not is_directory(files):
        return None
    inside(files, ckpt.path)
    return files


def left_out(ckpt: DcpCheckpoint) -> list[str]:
    """A note naming the optimizer and extra-state files beside the model files (never read), for inspect;
    [] for any other checkpoint."""
    pattern = TRAINER_FILES.get(ckpt.kind)
    names = sorted(n for n in listdir(ckpt.path) if pattern.fullmatch(n)) if pattern else []
    if not names:
        return []
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return [f"left out, never read: {shown} (optimizer, scheduler and RNG state; only the model converts)"]
