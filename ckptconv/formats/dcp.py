"""DCP checkpoints opened: `.metadata` read safely and without importing torch, then checked (dcp_specs).

Call order: `open_dcp(path)` on every rank (reads `.metadata` and the file sizes, no tensor bytes), then
`dcp_reader.DcpReader(ckpt)` on the ranks that read chunks. Writing is `dcp_writer.write_dcp`.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp_columns import load_dcp_metadata
from ckptconv.formats.dcp_specs import specs_from_metadata
from ckptconv.formats.files import (
    BoundedReader,
    mode_of,
    open_regular,
    read_error,
)
from ckptconv.formats.megatron import MARKER_FILE as MEGATRON_MARKER
from ckptconv.formats.megatron import is_megatron, read_common, read_common_state
from ckptconv.formats.megatron_fsdp import is_fsdp_dtensor, read_items
from ckptconv.job.gcpause import paused
from ckptconv.remote.files import RemoteFiles
from ckptconv.remote.urls import UrlPath

METADATA_FILE = ".metadata"


def is_dcp_dir(path: Path) -> bool:
    """Whether `path` is a directory with a `.metadata` (of any kind: `open_dcp` refuses a FIFO by name), or
    the per-rank safetensors shards torch's distributed HF writer leaves (`hf_sharded`), or verl's and
    accelerate's per-rank torch.save model files (`rank_shards`)."""
    if isinstance(path, UrlPath):
        return METADATA_FILE in RemoteFiles(path).sizes()
    mode = mode_of(path)
    if mode is None or not stat.S_ISDIR(mode):
        return False
    if mode_of(path / METADATA_FILE) is not None:
        return True
    from ckptconv.formats.deepspeed import is_deepspeed_dir
    from ckptconv.formats.hf_sharded import is_sharded_dir
    from ckptconv.formats.rank_files import is_rank_dir

    return is_sharded_dir(path) or is_rank_dir(path) or is_deepspeed_dir(path)


def open_dcp(path: Path) -> DcpCheckpoint:
    """Read and validate `path/.metadata`; raise CkptconvError naming the problem and the fix.

    `.metadata` and every file it names must be regular files resolving inside `path`. A directory of torch's
    distributed HF writer shards (no `.metadata`) is read from their headers (`hf_sharded.open_sharded`)."""
    md_path = path / METADATA_FILE
    remote = RemoteFiles(path) if isinstance(path, UrlPath) else None
    if remote is None and mode_of(md_path) is None:
        from ckptconv.formats.hf_sharded import is_sharded_dir, open_sharded

        if is_sharded_dir(path):
            return open_sharded(path)
        from ckptconv.formats.rank_files import is_rank_dir
        from ckptconv.formats.rank_shards import open_rank_shards

        if is_rank_dir(path):
            return open_rank_shards(path)
        from ckptconv.formats.deepspeed import is_deepspeed_dir
        from ckptconv.formats.deepspeed_open import open_deepspeed

        if is_deepspeed_dir(path):
            return open_deepspeed(path)
    with paused():  # a million records, none of them garbage: see gcpause
        if remote is not None:
            metadata, columns = load_dcp_metadata(_remote_metadata(remote), str(md_path))
        else:  # streamed: the file's bytes are never all held beside the records they make
            with os.fdopen(open_regular(md_path, path), "rb", buffering=1 << 20) as f:
                try:
                    metadata, columns = load_dcp_metadata(
                        BoundedReader(f, os.fstat(f.fileno()).st_size), str(md_path)
                    )
                except OSError as e:
                    raise read_error(md_path, e) from None
        try:
            ckpt = specs_from_metadata(path, md_path, metadata, columns, remote)
        except (AttributeError, TypeError, ValueError) as e:
            raise CkptconvError(
                f"{md_path}: malformed DCP metadata ({e}); re-save or re-copy the checkpoint"
            ) from None
        # gone by reference counting now, not walked by the collector once it is back on (a million tuples)
        del metadata, columns
    if remote is None and is_megatron(path):  # common.pt beside, or (0.19) the common_state item inside
        common = read_common(path) or read_common_state(ckpt)
        ckpt = dataclasses.replace(ckpt, kind="megatron", common=common)
    elif is_fsdp_dtensor(ckpt):
        ckpt = dataclasses.replace(ckpt, kind="fsdp_dtensor", common=read_items(ckpt, remote))
    return ckpt


def _remote_metadata(remote: RemoteFiles) -> bytes:
    """`.metadata` of a checkpoint in object storage (Megatron-Core's are read from a file system only)."""
    sizes = remote.sizes()
    if METADATA_FILE not in sizes:
        raise CkptconvError(f"{remote.root}: not a DCP checkpoint (no .metadata object under it)")
    if MEGATRON_MARKER in sizes and b"torch_dist" in remote.read_all(MEGATRON_MARKER)[: 1 << 20]:
        raise CkptconvError(
            f"{remote.root}: a Megatron-Core checkpoint; ckptconv reads those from a file system only "
            "(copy it to a local or mounted path)"
        )
    return remote.read_all(METADATA_FILE)
