"""The fast paths of reading `.metadata` give what the record-by-record paths give, field for field.

dcp_columns takes chunk and index states in bulk, dcp_locations finds a tensor stored as one run of the index
by a slice, dcp_specs checks each tiling layout once. Compared here with those paths turned off (storage
rows looked up in the `{fqn: {offsets: row}}` dict, every tiling checked) and with torch's own unpickling,
on checkpoints torch's `dcp.save` writes, on random metadata pickled from torch's own classes (uneven grids,
empty and 0-d tensors, bytes items, nested planner paths, the index in torch's order or shuffled), and on the
synthetic 70B metadata of `scripts/bench.py plan`; streams off torch's layout take the dict and are refused
with the same message either way.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import random
import sys
from fractions import Fraction
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_dcp_columns import _torchs  # torch's own unpickling of .metadata, as rows
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptconv.core.layout import tiling_problem
from ckptconv.core.specs import DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats import dcp_specs
from ckptconv.formats.dcp import open_dcp
from ckptconv.formats.dcp_columns import load_dcp_metadata
from ckptconv.formats.dcp_locations import Locations
from ckptconv.plan.to_hf import plan_dcp_to_hf

ROOT = Path(__file__).resolve().parents[2]
MAGIC = b"PK\x03\x04"  # where a torch.save record starts (what the reader sniffs)


def _slow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Locations, "span", lambda self, fqn, offsets: None)
    monkeypatch.setattr(
        dcp_specs, "_tiling", lambda shape, o, s, known: tiling_problem(shape, list(zip(o, s, strict=True)))
    )


def _both(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[DcpCheckpoint, DcpCheckpoint, int]:
    """(fast, slow, how many tensors the fast path found as one run)."""
    runs = []
    span = Locations.span

    def counted(self: Locations, fqn: str, offsets: list[Any]) -> range | None:
        found = span(self, fqn, offsets)
        if offsets != [None]:  # a tensor's (a bytes item's is [None])
            runs.append(found is not None)
        return found

    with monkeypatch.context() as m:
        m.setattr(Locations, "span", counted)
        fast = open_dcp(ckpt)
    with monkeypatch.context() as m:
        _slow(m)
        slow = open_dcp(ckpt)
    return fast, slow, sum(runs)


def _same(fast: DcpCheckpoint, slow: DcpCheckpoint) -> None:
    """Every field equal, and of the same types (a `repr` tells 1 from True and 1.0)."""
    assert fast == slow
    assert repr(fast) == repr(slow)


def _ours(ckpt: DcpCheckpoint) -> dict[str, list[tuple[Any, ...]]]:
    return {
        fqn: [(c.offsets, c.sizes, c.file, c.byte_offset, c.byte_length) for c in t.chunks]
        for fqn, t in ckpt.tensors.items()
    }


def _plan_equal(fast: DcpCheckpoint, slow: DcpCheckpoint) -> None:
    from ckptconv.core.dtypes import DtypePolicy, parse_dtype_flag

    policy = DtypePolicy(parse_dtype_flag("keep"))
    a = plan_dcp_to_hf(fast, policy, max_shard_size=10**6, world_size=3)
    b = plan_dcp_to_hf(slow, policy, max_shard_size=10**6, world_size=3)
    assert repr(a) == repr(b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torch's `dcp.save` in one process: tensors of several dtypes (an empty one, a 0-d one), nested
    non-tensor items; once plain, once through torch's ZStandard extension."""
    from torch.distributed.checkpoint._extension import ZStandard

    root = tmp_path_factory.mktemp("fastmd")
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {
            "w": torch.randn(6, 5, generator=g),
            "b": torch.arange(7, dtype=torch.int64),
            "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
            "scalar": torch.tensor(2.5),
            "mask": torch.tensor([True, False]),
        },
        "step": 3,
        "args": {"lr": 0.1, "names": ["a", "b"]},
    }
    dcp.save(state, checkpoint_id=str(root / "plain"), no_dist=True)
    dcp.save(state, storage_writer=FileSystemWriter(root / "zstd", _extensions=[ZStandard()]), no_dist=True)
    return {"plain": root / "plain", "zstd": root / "zstd"}


@pytest.mark.parametrize("which", ["plain", "zstd"])
def test_dcp_save_reads_the_same_fast_and_slow(
    which: str, saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, slow, runs = _both(saved[which], monkeypatch)
    _same(fast, slow)
    assert runs == len(fast.tensors) and fast.items
    assert _ours(fast) == _torchs(saved[which])
    _plan_equal(fast, slow)


def test_a_sharded_dcp_save_reads_the_same(fsdp2_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ranks of FSDP2 (DTensor chunks, uneven), optimizer state, items, planner paths."""
    fast, slow, _ = _both(fsdp2_ckpt, monkeypatch)
    _same(fast, slow)
    assert _ours(fast) == _torchs(fsdp2_ckpt)
    _plan_equal(fast, slow)


def _cuts(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """An uneven split of n into (offset, size) parts, empty ones among them."""
    points = sorted({0, n, *(rng.randint(0, n) for _ in range(rng.randint(0, 3)))})
    parts = [(a, b - a) for a, b in pairwise(points)]
    return parts or [(0, 0)]


def _random_metadata(root: Path, seed: int, order: str, fixed: bool = False) -> Path:
    """A checkpoint of random tensors, each a random uneven grid of chunks spread over a few files, pickled
    from torch's own metadata classes; the storage index as torch orders it ("torch"), shuffled, or with
    the tensors' entries interleaved. `fixed`: tensor 1 is 7 x 16 in 2 x 2 chunks."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    files = [f"__{i}_0.distcp" for i in range(rng.randint(1, 4))]
    ends = dict.fromkeys(files, 0)
    starts: dict[str, list[int]] = {f: [] for f in files}
    state: dict[str, Any] = {}
    storage: list[tuple[MetadataIndex, _StorageInfo]] = []
    planner: dict[str, Any] = {}
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    for t in range(rng.randint(2 if fixed else 1, 8)):
        fqn = f"model.layers.{t}.w"
        shape = tuple(rng.choice([0, 1, 3, 7, 16]) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice(dtypes)
        grid: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())]
        if fixed and t == 1:
            shape, grid = (7, 16), [((a, b), (7 - a if a else 3, 8)) for a in (0, 3) for b in (0, 8)]
        for n in shape if grid == [((), ())] else ():
            grid = [((*o, a), (*s, b)) for o, s in grid for a, b in _cuts(rng, n)]
        chunks = []
        for offsets, sizes in grid:
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            file = rng.choice(files)
            length = 64 + dtype.itemsize * int(torch.Size(sizes).numel())
            starts[file].append(ends[file])
            storage.append(
                (
                    MetadataIndex(fqn, torch.Size(offsets), len(chunks) - 1),
                    _StorageInfo(file, ends[file], length),
                )
            )
            ends[file] += length
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
        planner[fqn] = ("model", "layers", t, "w")
    for name in ("step", "lr"):
        file = rng.choice(files)
        state[name] = BytesStorageMetadata()
        storage.append((MetadataIndex(name), _StorageInfo(file, ends[file], 16)))
        starts[file].append(ends[file])
        ends[file] += 16
        planner[name] = ("extra", name)
    if order == "shuffled":
        rng.shuffle(storage)
    elif order == "interleaved":
        storage = storage[0::2] + storage[1::2]
    metadata = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=dict(storage))
    (root / ".metadata").write_bytes(pickle.dumps(metadata))
    for file in files:
        with open(root / file, "wb") as f:
            f.truncate(ends[file])
            for at in starts[file]:
                f.seek(at)
                f.write(MAGIC)
    return root


@pytest.mark.parametrize("order", ["torch", "shuffled", "interleaved"])
def test_random_metadata_reads_the_same(order: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in range(12):
        ckpt = _random_metadata(tmp_path / f"s{seed}", seed, order)
        fast, slow, runs = _both(ckpt, monkeypatch)
        _same(fast, slow)
        assert _ours(fast) == _torchs(ckpt), seed
        _plan_equal(fast, slow)
        if order == "torch":
            assert runs == len(fast.tensors), seed


def test_the_synthetic_70b_metadata_reads_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`scripts/bench.py plan` at one layer (FSDP 64 x TP 8: 12 thousand chunks over 2048 files)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from benchmarks.plan import make
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    make(tmp_path / "plan", 0.0125, 512)
    fast, slow, runs = _both(tmp_path / "plan", monkeypatch)
    _same(fast, slow)
    assert runs == len(fast.tensors)
    assert _ours(fast) == _torchs(tmp_path / "plan")


def _refusal(ckpt: Path, monkeypatch: pytest.MonkeyPatch, slow: bool) -> str:
    with monkeypatch.context() as m:
        if slow:
            _slow(m)
        with pytest.raises(CkptconvError) as e:
            open_dcp(ckpt)
    return str(e.value)


def _rewrite(ckpt: Path, edit: Any) -> None:
    if edit is _list_offsets:
        edit(ckpt)
        return
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    edit(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _drop_an_entry(metadata: Any) -> None:
    key = next(k for k in metadata.storage_data if k.offset is not None and k.fqn.endswith("1.w"))
    del metadata.storage_data[key]


def _double_a_chunk(metadata: Any) -> None:
    """A tensor lists one of its chunks twice (two records of one block): a tiling allows it, the run
    does not (its entries are stored once), so the dict finds it."""
    entry = metadata.state_dict_metadata["model.layers.1.w"]
    first = entry.chunks[0]
    entry.chunks.append(ChunkStorageMetadata(first.offsets, first.sizes))


class _ListOffset(pickle.Pickler):
    """Pickles the first index key with its offset as a list (a dict key torch's own load cannot hash)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is MetadataIndex and obj.offset is not None and not getattr(self, "done", False):
            self.done = True
            state = {"fqn": obj.fqn, "offset": list(obj.offset), "index": obj.index}
            return copyreg.__newobj__, (MetadataIndex,), state
        return NotImplemented


def _list_offsets(ckpt: Path) -> None:
    """An index key whose offset is a list: the dict's hashing refuses it, as it always did."""
    buffer = io.BytesIO()
    _ListOffset(buffer, protocol=4).dump(pickle.loads((ckpt / ".metadata").read_bytes()))
    (ckpt / ".metadata").write_bytes(buffer.getvalue())


def _shape_off(metadata: Any) -> None:
    entry = metadata.state_dict_metadata["model.layers.1.w"]
    entry.size = torch.Size([n + 1 for n in entry.size])


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_drop_an_entry, "no stored data"),
        (_double_a_chunk, None),
        (_list_offsets, "malformed DCP metadata"),
        (_shape_off, "the checkpoint is incomplete"),
    ],
)
def test_streams_off_torchs_layout_read_or_are_refused_the_same(
    edit: Any, needle: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _random_metadata(tmp_path / "ckpt", 5, "torch", fixed=True)
    _rewrite(ckpt, edit)
    if needle is None:
        fast, slow, _ = _both(ckpt, monkeypatch)
        _same(fast, slow)
        assert _ours(fast) == _torchs(ckpt)
        return
    fast_error = _refusal(ckpt, monkeypatch, slow=False)
    assert fast_error == _refusal(ckpt, monkeypatch, slow=True)
    assert needle in fast_error and str(ckpt / ".metadata") in fast_error


class _SharedChunkState(pickle.Pickler):
    """Pickles the first two chunk records of `chunks` with one state dict (the second a memo reference)."""

    def __init__(self, buffer: io.BytesIO, chunks: list[Any]) -> None:
        super().__init__(buffer, protocol=4)
        self.targets, self.shared = {id(c) for c in chunks[:2]}, dict(vars(chunks[0]))

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self.targets:
            return copyreg.__newobj__, (ChunkStorageMetadata,), self.shared
        return NotImplemented


def test_a_chunk_state_built_twice_is_refused(tmp_path: Path) -> None:
    """Taken in bulk, a state built for two records would give two rows; it is refused as when each state
    was cleared at its record's BUILD (the second then had no fields)."""
    ckpt = _random_metadata(tmp_path / "ckpt", 5, "torch", fixed=True)
    buffer = io.BytesIO()
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    _SharedChunkState(buffer, metadata.state_dict_metadata["model.layers.1.w"].chunks).dump(metadata)
    (ckpt / ".metadata").write_bytes(buffer.getvalue())
    with pytest.raises(CkptconvError) as e:
        open_dcp(ckpt)
    assert "not a readable DCP metadata file (KeyError: 'offsets')" in str(e.value)
    assert str(ckpt / ".metadata") in str(e.value)


class _SharedState(pickle.Pickler):
    """Pickles the first two records of type `kind` in the storage index with one state dict (the second a
    memo reference)."""

    def __init__(self, buffer: io.BytesIO, kind: type, records: list[Any]) -> None:
        super().__init__(buffer, protocol=4)
        self.kind, self.targets, self.shared = kind, {id(r) for r in records[:2]}, dict(vars(records[0]))

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self.targets:
            return copyreg.__newobj__, (self.kind,), self.shared
        return NotImplemented


def _key_inside_its_value(metadata: Any) -> None:
    """The first storage entry under a string key, its index record an extra field of its own state: built
    between the entry's NEWOBJ and its BUILD (the pairs that follow are torch's)."""
    (key, value), *rest = metadata.storage_data.items()
    value.extra = key
    metadata.storage_data = {"moved": value, **dict(rest)}


def _a_value_without_its_key(metadata: Any) -> None:
    """The second storage entry under a string key: no index record is built just before it."""
    first, (_, value), *rest = metadata.storage_data.items()
    metadata.storage_data = {first[0]: first[1], "lost": value, **dict(rest)}


def _the_last_value_without_its_key_then_a_payload(metadata: Any) -> None:
    """The last storage entry under a string key, and a global outside the allowlist after the index: the
    entry, read first, is what is refused."""
    *rest, (_, value) = metadata.storage_data.items()
    metadata.storage_data = {**dict(rest), "lost": value}
    metadata.all_local_plans = [Fraction(1, 3)]


UNPAIRED = "(UnpicklingError: a storage entry without an index key of its own just before it)"


@pytest.fixture(scope="module")
def plan_metadata(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The `.metadata` of `scripts/bench.py plan` at one layer (12 thousand chunks: a few hundred frames)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from benchmarks.plan import make
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    ckpt = tmp_path_factory.mktemp("plan") / "plan"
    make(ckpt, 0.0125, 512)
    return (ckpt / ".metadata").read_bytes()


@pytest.mark.parametrize(
    ("craft", "needle"),
    [
        (_key_inside_its_value, UNPAIRED),
        (_a_value_without_its_key, UNPAIRED),
        (_the_last_value_without_its_key_then_a_payload, UNPAIRED),
        (_StorageInfo, "(KeyError: 'relative_path')"),
        (MetadataIndex, "(KeyError: 'fqn')"),
    ],
)
def test_storage_records_off_torchs_layout_are_refused_as_record_by_record(
    craft: Any, needle: str, plan_metadata: bytes
) -> None:
    """The storage index is taken in bulk where it is torch's `key, value` pairs, each state a dict of its
    own: a value without a key built just before it, a key built inside its value, a state built for two
    records (which the record-by-record hooks had cleared at the first) are refused as those hooks did, at
    the first wrong record, among the thousands of torch's pairs of the synthetic metadata."""
    metadata = pickle.loads(plan_metadata)
    buffer = io.BytesIO()
    if isinstance(craft, type):  # a state shared by the first two records of that kind
        records = list(
            metadata.storage_data.keys() if craft is MetadataIndex else metadata.storage_data.values()
        )
        _SharedState(buffer, craft, records).dump(metadata)
    else:
        craft(metadata)
        pickle.dump(metadata, buffer, protocol=4)
    with pytest.raises(CkptconvError) as e:
        load_dcp_metadata(buffer.getvalue(), "x/.metadata")
    assert str(e.value).startswith(f"x/.metadata: not a readable DCP metadata file {needle}")
