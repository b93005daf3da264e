""".metadata loaded into columns (formats/dcp_columns): what torch's own unpickling gives, on checkpoints
torch writes; a record the stream reuses (a memo reference) is refused, never read as another chunk's data."""

from __future__ import annotations

import copyreg
import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp  # noqa: F401 (torch's metadata classes, for pickle.loads)
from test_bad_input import assert_one_line, run
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ckptconv.formats.dcp import open_dcp
from ckptconv.formats.dcp_columns import load_dcp_metadata


def _torchs(ckpt: Path) -> dict[str, list[tuple[Any, ...]]]:
    """{fqn: [(offsets, sizes, file, start, length)]} as torch's own unpickling of `.metadata` reads it."""
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    found = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            rows = []
            for chunk in entry.chunks:
                info = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
                where = (info.relative_path, info.offset, info.length)
                rows.append((tuple(chunk.offsets), tuple(chunk.sizes), *where))
            found[fqn] = rows
    return found


def _ours(ckpt: Path) -> dict[str, list[tuple[Any, ...]]]:
    return {
        fqn: [(c.offsets, c.sizes, c.file, c.byte_offset, c.byte_length) for c in t.chunks]
        for fqn, t in open_dcp(ckpt).tensors.items()
    }


@pytest.mark.parametrize("made", ["fsdp2_ckpt", "mesh2d_ckpt"])
def test_the_columns_hold_what_torch_reads(made: str, request: pytest.FixtureRequest) -> None:
    ckpt = request.getfixturevalue(made)
    assert _ours(ckpt) == _torchs(ckpt)


class _SlotsState(pickle.Pickler):
    """Pickles the chunk, index and storage records as a dataclass with `__slots__` would: (None, {...})."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in (ChunkStorageMetadata, MetadataIndex, _StorageInfo):
            return copyreg.__newobj__, (type(obj),), (None, dict(vars(obj)))
        return NotImplemented


def test_records_pickled_with_slots_state_read_the_same(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    ckpt = shutil.copytree(fsdp2_ckpt, tmp_path / "ckpt")
    buffer = io.BytesIO()
    _SlotsState(buffer, protocol=4).dump(pickle.loads((ckpt / ".metadata").read_bytes()))
    (ckpt / ".metadata").write_bytes(buffer.getvalue())
    assert _ours(ckpt) == _torchs(fsdp2_ckpt)


def _first_tensor(metadata: Any) -> tuple[str, Any]:
    """The first tensor stored in more than one chunk."""
    tensors = metadata.state_dict_metadata.items()
    return next((k, v) for k, v in tensors if isinstance(v, TensorStorageMetadata) and len(v.chunks) > 1)


def _reuse_a_chunk(metadata: Any) -> None:
    """The first tensor's list names its first chunk twice (one object: pickled, then a memo reference)."""
    _, entry = _first_tensor(metadata)
    entry.chunks = [entry.chunks[0], *entry.chunks]


def _reuse_a_storage_entry(metadata: Any) -> None:
    """Two index keys of one tensor share one storage entry object."""
    fqn, entry = _first_tensor(metadata)
    keys = [MetadataIndex(fqn, c.offsets) for c in entry.chunks]
    first = metadata.storage_data[keys[0]]
    metadata.storage_data = {k: (first if k == keys[1] else v) for k, v in metadata.storage_data.items()}


def _swap_keys_inside_values(metadata: Any) -> None:
    """Each of two storage entries carries the other's key in an extra field: built between a key and its
    entry, it would pair the entries crosswise if pairing went by "the last key made"."""
    fqn, entry = _first_tensor(metadata)
    a, b = (MetadataIndex(fqn, c.offsets) for c in entry.chunks[:2])
    metadata.storage_data[a].extra = MetadataIndex(fqn, b.offset)
    metadata.storage_data[b].extra = MetadataIndex(fqn, a.offset)


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (_reuse_a_chunk, "chunk list reuses"),
        (_reuse_a_storage_entry, "index key of its own"),
        (_swap_keys_inside_values, "index key of its own"),
    ],
)
def test_a_reused_record_is_refused_not_read_as_another(
    damage: Any, needle: str, fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = shutil.copytree(fsdp2_ckpt, tmp_path / "ckpt")
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    damage(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out))
    assert_one_line(code, err, str(ckpt / ".metadata"), needle)
    assert not out.exists()


def test_megatron_plans_after_the_index_are_left_unread(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """Megatron-Core's `all_local_plans` (torch's SavePlans, with index keys and chunks of their own) after
    the index add rows nothing takes: the checkpoint reads as without them."""
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    ckpt = shutil.copytree(fsdp2_ckpt, tmp_path / "ckpt")
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    fqn, entry = _first_tensor(metadata)
    chunk = ChunkStorageMetadata(entry.chunks[0].offsets, entry.chunks[0].sizes)  # an object of its own
    item = WriteItem(
        MetadataIndex(fqn, chunk.offsets, 0),
        WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk, entry.properties, entry.size),
    )
    metadata.all_local_plans = [SavePlan([item])]
    blob = pickle.dumps(metadata)
    (ckpt / ".metadata").write_bytes(blob)
    assert _ours(ckpt) == _torchs(fsdp2_ckpt)
    _, columns = load_dcp_metadata(blob, "x")
    assert len(columns.fqns) == len(columns.key) + 1 and columns.taken == len(columns.offsets) - 1


def test_the_columns_are_freed_with_the_collector_off(fsdp2_ckpt: Path) -> None:
    """The classes made for a load are reference cycles, which only the collector frees, and runs keep it
    off: once the load is over they must hold nothing of it, or every record would live for the whole run."""
    import gc
    import weakref

    was = gc.isenabled()
    gc.disable()
    try:
        metadata, columns = load_dcp_metadata((fsdp2_ckpt / ".metadata").read_bytes(), "x")
        assert columns.offsets
        gone = weakref.ref(columns)
        del metadata, columns
        assert gone() is None
    finally:
        if was:
            gc.enable()
