"""Pure pieces as tables: tiling, dtype rules, sizes, sharding, owners, gather rounds, safetensors headers."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from ckptconv.core.dtype_names import short_name
from ckptconv.core.dtypes import DtypePolicy, st_layout_rank
from ckptconv.core.layout import tiling_problem
from ckptconv.core.sizes import parse_size
from ckptconv.core.specs import ChunkSpec, DcpCheckpoint, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats.hf import read_header
from ckptconv.formats.safetensors_io import Entry, SafetensorsWriter, header_bytes
from ckptconv.plan.to_hf import assign_owners, plan_dcp_to_hf
from ckptconv.stream.gather import gather_rounds, reader_rank


@pytest.mark.parametrize(
    ("shape", "boxes", "problem"),
    [
        ((4, 3), [((0, 0), (2, 3)), ((2, 0), (2, 3))], None),
        ((4, 3), [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (0, 3))], None),  # zero-size chunk
        ((4, 3), [((0, 0), (4, 3)), ((0, 0), (4, 3))], None),  # an exact duplicate (replicated save)
        (
            (4, 4),
            [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))],
            None,
        ),  # 2-D blocks
        ((10,), [((0,), (3,)), ((5,), (3,)), ((3,), (2,)), ((8,), (2,))], None),  # strided rows
        ((), [((), ())], None),  # 0-d
        ((4, 3), [((0, 0), (2, 3))], "hole"),
        ((4, 3), [((0, 0), (3, 3)), ((2, 0), (2, 3))], "overlap"),
        ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((1, 2), (2, 2))], "overlap"),
        ((4, 3), [((0, 0), (5, 3))], "outside"),
        ((4, 3), [((0,), (4,))], "rank"),
    ],
)
def test_tiling(shape, boxes, problem) -> None:
    found = tiling_problem(shape, boxes)
    assert (found is None) if problem is None else (problem in (found or "")), found


def test_tiling_hole_and_overlap_that_cancel_out() -> None:
    # same total volume as the tensor, but one block is covered twice and another never
    boxes = [((0, 0), (2, 2)), ((0, 0), (2, 2)), ((2, 0), (2, 2)), ((0, 2), (2, 2)), ((1, 2), (2, 2))]
    assert "overlap" in (tiling_problem((4, 4), boxes[1:]) or "")


def _cuts(draw, n: int) -> list[int]:
    inner = draw(st.lists(st.integers(1, n - 1), max_size=3, unique=True)) if n > 1 else []
    return [0, *sorted(inner), n]


@st.composite
def _boxes(draw):
    """A grid tiling of a small 2-D shape (DTensor-like), then maybe a cell dropped, repeated, moved, merged
    with its neighbour or resized: every kind of hole and overlap next to the tilings themselves."""
    shape = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    rows, cols = _cuts(draw, shape[0]), _cuts(draw, shape[1])
    boxes = [((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in pairwise(rows) for c0, c1 in pairwise(cols)]
    edit = draw(st.sampled_from(["none", "drop", "repeat", "move", "grow", "merge", "shuffle"]))
    i = draw(st.integers(0, len(boxes) - 1))
    (r, c), (h, w) = boxes[i]
    if edit == "drop":
        del boxes[i]
    elif edit == "repeat":
        boxes.append(boxes[i])
    elif edit == "move":
        boxes[i] = ((draw(st.integers(0, shape[0])), draw(st.integers(0, shape[1]))), (h, w))
    elif edit == "grow":
        boxes[i] = ((r, c), (h + draw(st.integers(-1, 1)), w + draw(st.integers(-1, 1))))
    elif edit == "merge" and i + 1 < len(boxes):
        boxes[i : i + 2] = [((r, c), (h, w + boxes[i + 1][1][1]))]
    elif edit == "shuffle":
        boxes = draw(st.permutations(boxes))
    return shape, boxes


@settings(max_examples=400, deadline=None)
@given(_boxes())
def test_tiling_matches_counting_cells(case) -> None:
    """The fast checks agree with counting how often each element is covered (duplicates counted once)."""
    shape, boxes = case
    count = [[0] * shape[1] for _ in range(shape[0])]
    outside = False
    for (r, c), (h, w) in set(boxes):
        if r < 0 or c < 0 or h < 0 or w < 0 or r + h > shape[0] or c + w > shape[1]:
            outside = outside or h * w > 0
            continue
        for i in range(r, r + h):
            for j in range(c, c + w):
                count[i][j] += 1
    tiles = not outside and all(n == 1 for row in count for n in row)
    assert (tiling_problem(shape, boxes) is None) == tiles, (shape, boxes)


@pytest.mark.parametrize(
    ("key", "dtype", "target", "fp32", "want"),
    [
        ("a.weight", torch.float32, torch.bfloat16, [], torch.bfloat16),
        ("a.A_log", torch.float32, torch.bfloat16, ["A_log$"], torch.float32),
        ("a.A_log", torch.bfloat16, torch.bfloat16, ["A_log$"], torch.float32),
        ("a.A_log_x", torch.float32, torch.bfloat16, ["A_log$"], torch.bfloat16),
        ("pos", torch.int64, torch.bfloat16, ["pos"], torch.int64),
        ("mask", torch.bool, torch.float16, [], torch.bool),
        ("q", torch.float8_e4m3fn, torch.bfloat16, [], torch.float8_e4m3fn),
        ("w", torch.float16, None, [], torch.float16),
    ],
)
def test_dtype_policy(key, dtype, target, fp32, want) -> None:
    assert DtypePolicy(target, fp32).resolve(key, dtype) == want


def test_dtype_policy_unmatched_and_invalid() -> None:
    policy = DtypePolicy(torch.bfloat16, ["A_log$", "never"])
    policy.resolve("x.A_log", torch.float32)
    policy.resolve("never", torch.int64)  # int tensors do not count as a match
    assert policy.unmatched() == ["never"]
    with pytest.raises(CkptconvError, match="--fp32"):
        DtypePolicy(torch.bfloat16, ["(unclosed"])


@pytest.mark.parametrize(
    ("value", "want"),
    [("500MB", 500_000_000), ("5GB", 5_000_000_000), ("1234", 1234), (77, 77), ("2KB", 2000)],
)
def test_parse_size(value, want) -> None:
    assert parse_size(value) == want


@pytest.mark.parametrize("value", ["", "GB", "5 parsecs", "-1", "0", "1.5XB"])
def test_parse_size_rejects(value) -> None:
    with pytest.raises(CkptconvError, match="--max-shard-size"):
        parse_size(value)


def test_assign_owners_balances_bytes_deterministically() -> None:
    assert assign_owners([10, 10, 10], 3) == [0, 1, 2]
    assert assign_owners([1, 100, 50, 50], 2) == [0, 0, 1, 1]  # 100 | 50+50, then the tie to rank 0
    assert assign_owners([5, 5], 4) == [0, 1]


def fake_ckpt(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], ranks: int = 2) -> DcpCheckpoint:
    tensors = {}
    for fqn, (shape, dtype) in shapes.items():
        rows = shape[0] if shape else 1
        step = -(-rows // ranks)
        chunks = (
            tuple(
                ChunkSpec(
                    (r * step, *[0] * (len(shape) - 1)),
                    (min(step, rows - r * step), *shape[1:]),
                    f"__{r}_0.distcp",
                    0,
                    1,
                    "torch_save",
                )
                for r in range(ranks)
                if r * step < rows
            )
            if shape
            else (ChunkSpec((), (), "__0_0.distcp", 0, 1, "torch_save"),)
        )
        tensors[fqn] = TensorSpec(fqn, short_name(dtype), shape, chunks)
    return DcpCheckpoint(Path("/nowhere"), tensors, {}, {fqn: ("model", fqn[6:]) for fqn in tensors})


def test_plan_shards_like_save_pretrained_and_is_rank_independent() -> None:
    ckpt = fake_ckpt(
        {
            "model.layers.10.w": ((4, 4), torch.float32),
            "model.layers.2.w": ((4, 4), torch.float32),
            "model.embed": ((8, 4), torch.float32),
            "model.layers.2.A_log": ((3,), torch.float32),
            "model.pos": ((5,), torch.int64),
        }
    )
    plans = [
        plan_dcp_to_hf(ckpt, DtypePolicy(torch.bfloat16, ["A_log$"]), max_shard_size=70, world_size=n)
        for n in (1, 2, 3)
    ]
    layouts = [[(f.name, [(t.hf_key, t.dtype) for t in f.tensors]) for f in p.files] for p in plans]
    assert layouts[0] == layouts[1] == layouts[2]
    names = [f.name for f in plans[0].files]
    assert names == [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    assert all(f.tensors for f in plans[0].files)
    order = [t.hf_key for f in plans[0].files for t in sorted(f.tensors, key=lambda t: t.hf_key)]
    assert order.index("layers.2.w") < order.index("layers.10.w")
    assert (
        plans[0].weight_map["layers.2.A_log"] and plans[0].total_size == 32 * 2 + 3 * 4 + 5 * 8 + 16 * 2 * 2
    )
    assert {f.owner for f in plans[2].files} == {0, 1, 2} or len(plans[2].files) < 3


def test_gather_rounds_respect_the_budget() -> None:
    ckpt = fake_ckpt({f"model.t{i}": ((64, 4), torch.float32) for i in range(8)})  # 1 KiB each
    plan = plan_dcp_to_hf(ckpt, DtypePolicy(None), max_shard_size=2048, world_size=2)
    rounds = gather_rounds(plan, bucket_bytes=2048)
    for round_ in rounds:
        for _, bucket in round_:
            assert sum(w.src_nbytes for w in bucket) <= 2048 or len(bucket) == 1
    streamed = {
        r: [w.tensor.hf_key for round_ in rounds for k, b in round_ if k == r for w in b] for r in (0, 1)
    }
    assert streamed == {r: [w.tensor.hf_key for w in plan.writes_of(r)] for r in (0, 1)}
    assert [reader_rank(f"__{r}_0.distcp", 3) for r in range(5)] == [0, 1, 2, 0, 1]


dtypes = st.sampled_from(
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int8,
        torch.bool,
        torch.float64,
        torch.uint8,
        torch.int32,
        torch.int16,
        torch.float8_e4m3fn,
    ]
)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9._]{0,12}", fullmatch=True),
        st.tuples(dtypes, shapes),
        min_size=1,
        max_size=6,
    )
)
def test_streamed_writer_equals_safetensors(tmp_path_factory, spec) -> None:
    tensors = {k: (torch.randn(s) * 10).to(d) for k, (d, s) in spec.items()}
    order = sorted(tensors, key=lambda k: (st_layout_rank(tensors[k].dtype), k))
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    writer = SafetensorsWriter(path, [Entry(k, tensors[k].dtype, tuple(tensors[k].shape)) for k in order])
    for k in order:
        writer.write(k, tensors[k])
    writer.close()
    assert path.read_bytes() == save(tensors, metadata={"format": "pt"})
    stored, meta = read_header(path)
    assert meta == {"format": "pt"} and set(stored) == set(tensors)
    assert header_bytes([]) == save({}, metadata={"format": "pt"})


def test_row_reader_equals_safetensors_get_slice(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ckptconv.formats.hf import open_hf
    from ckptconv.formats.safetensors_io import RowReader

    src = {
        "w": torch.randn(7, 3).bfloat16(),
        "s": torch.tensor(1.5),
        "e": torch.zeros(0, 2),
        "i": torch.arange(5),
    }
    save_file(src, tmp_path / "m.safetensors")
    reader = RowReader()
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        for key, stored in open_hf(tmp_path / "m.safetensors").tensors.items():
            rows = stored.shape[0] if stored.shape else 1
            for lo, hi in [(0, rows), (0, 0), (rows // 2, rows)] if stored.shape else [(0, 1)]:
                want = f.get_slice(key)[lo:hi] if stored.shape else f.get_tensor(key)
                got = reader.rows(stored, lo, hi)
                assert got.dtype == want.dtype and torch.equal(got, want), (key, lo, hi)
    reader.close()


def test_gather_moves_one_experts_rows_per_output_within_the_budget(tmp_path: Path) -> None:
    """A stacked [E, F, D] expert tensor sharded over 2 ranks, written per expert: every output tensor moves
    only its expert's rows of one chunk (not the chunk), rounds stay within the budget of gathered bytes, and
    the transfers are the same list on every rank."""
    from ckptconv.mapping import load_mapping
    from ckptconv.stream.gather import round_transfers

    (tmp_path / "m.toml").write_text(
        '[mapping]\nname = "t"\n[[rule]]\nruntime = "w1"\nhf = "experts.{expert}.gate_proj.weight"\n'
        'stack = "expert"\n[[rule]]\nruntime = "embed"\nhf = "embed"\n'
    )
    ckpt = fake_ckpt({"model.w1": ((8, 6, 4), torch.float32), "model.embed": ((10, 4), torch.float32)})
    mapping = load_mapping(str(tmp_path / "m.toml"))
    plan = plan_dcp_to_hf(ckpt, DtypePolicy(None), max_shard_size=400, world_size=2, mapping=mapping)
    budget = 2 * 6 * 4 * 4  # two experts' worth of gathered bytes
    rounds = gather_rounds(plan, bucket_bytes=budget)
    assert len(rounds) > 2
    for round_ in rounds:
        transfers = round_transfers(round_, 2)
        for writer in (0, 1):
            moved = [tr for tr in transfers if tr.writer == writer]
            keys = {tr.write.tensor.hf_key for tr in moved}
            assert sum(tr.nbytes for tr in moved) <= budget or len(keys) == 1
        for tr in transfers:
            if tr.spec.fqn == "model.w1":
                expert = int(tr.write.tensor.hf_key.split(".")[1])
                assert tr.shape == (1, 6, 4) and tr.chunk.offsets[0] + tr.r0 == expert
                assert tr.reader == (0 if expert < 4 else 1)  # the rank that stored that expert
        assert round_transfers(round_, 2) == transfers  # pure: every rank computes the same


def test_enum_pickled_through_getattr_is_accepted_and_nothing_else() -> None:
    """Python 3.11.2 pickles DCP's _MEM_FORMAT_ENCODING as getattr(cls, "NAME"): allowed for that enum's
    member names only; getattr on anything else is refused like any other global."""
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from ckptconv.formats import safe_pickle

    class ByName:
        def __init__(self, owner: object, name: str) -> None:
            self.owner, self.name = owner, name

        def __reduce__(self) -> tuple[object, tuple[object, str]]:
            return getattr, (self.owner, self.name)

    def load(obj: object) -> object:
        return safe_pickle.AllowlistUnpickler(
            pickle.dumps(obj, protocol=4), safe_pickle.METADATA_GLOBALS
        ).load()

    assert load(ByName(_MEM_FORMAT_ENCODING, "TORCH_CHANNELS_LAST")) == 1
    assert load(_MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT) == 2  # however this Python pickles enums
    for owner, name in ((_MEM_FORMAT_ENCODING, "__class__"), (torch.Size, "__init__")):
        with pytest.raises(pickle.UnpicklingError, match="getattr"):
            load(ByName(owner, name))


def test_dtype_names_cover_torch_and_safetensors() -> None:
    """The torch-free dtype tables metadata is read with: every torch dtype by name with its itemsize, and
    each safetensors name meaning what safetensors itself means by it."""
    from safetensors.torch import _TYPES

    from ckptconv.core.dtype_names import ITEMSIZE, ST_TO_NAME, torch_dtype

    torch_names = {short_name(v): v.itemsize for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert torch_names == ITEMSIZE
    assert set(ST_TO_NAME) - set(_TYPES) == {"F8_E8M0"}  # newer than this safetensors' torch table
    assert all(torch_dtype(name) == _TYPES[st] for st, name in ST_TO_NAME.items() if st in _TYPES)


def test_crc32_of_pieces_read_in_any_order_is_the_whole_ranges() -> None:
    import itertools
    import random
    import zlib

    from ckptconv.core.crc32 import combine, whole_crc

    rng = random.Random(7)
    for _ in range(200):
        a, b = rng.randbytes(rng.randrange(0, 200)), rng.randbytes(rng.randrange(0, 5000))
        assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    data = rng.randbytes(10_000)
    cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(30))})
    pieces = [(s, e - s, zlib.crc32(data[s:e])) for s, e in itertools.pairwise(cuts)]
    shuffled = pieces + pieces[:3]  # repeats: the same rows read twice
    rng.shuffle(shuffled)
    assert whole_crc(shuffled, len(data)) == zlib.crc32(data)
    assert whole_crc(pieces[1:], len(data)) is None  # a gap at the start
    assert whole_crc(pieces[:-1], len(data)) is None  # not all of it
    s, n, _ = pieces[1]
    overlap = (s - 1, n + 1, zlib.crc32(data[s - 1 : s + n]))
    assert whole_crc([*pieces, overlap], len(data)) is None  # an overlap that is not a repeat
    assert whole_crc([], 0) == zlib.crc32(b"")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=50, deadline=None)
@given(
    st.dictionaries(st.text(), _json, max_size=3),
    st.lists(st.dictionaries(st.text(), st.integers() | st.text(), max_size=2), min_size=65, max_size=70),
)
def test_json_output_reads_back_as_the_document(doc, records) -> None:
    """The CLI's JSON (records of long lists one per line) is the document, whatever its strings hold."""
    from ckptconv.cli.render import dumps

    whole = {**doc, "nested": [{"chunks": records}], "chunks": records}
    text = dumps(whole)
    assert json.loads(text) == whole
    assert text.count("\n") >= 2 * len(records)  # both long lists: a record per line


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=20000), st.integers(0, 2**32 - 1))
def test_crc32_is_zlibs(data: bytes, start: int) -> None:
    """The CRC-32 ckptconv checks and writes records with gives zlib's numbers (zlib is the reference)."""
    import zlib

    from ckptconv.core.crc32 import crc32

    assert crc32(data, start) == zlib.crc32(data, start)
    assert crc32(memoryview(data)) == zlib.crc32(data)


def test_crc32_is_isals_where_installed() -> None:
    import zlib

    from ckptconv.core.crc32 import crc32

    pytest.importorskip("isal", reason="no isal wheel for this platform: zlib's CRC-32 is used")
    assert crc32 is not zlib.crc32


def test_buffer_pool_reuses_given_back_memory() -> None:
    from ckptconv.stream.buffers import BufferPool

    pool = BufferPool(keep_bytes=10_000)
    a = pool.take((10, 100), torch.float32)  # 4,000 bytes
    where = a.data_ptr()
    a.fill_(7)
    pool.give(a)
    b = pool.take((20, 90), torch.bfloat16)  # 3,600 bytes: fits in a's buffer
    assert b.data_ptr() == where and b.shape == (20, 90) and b.dtype == torch.bfloat16
    c = pool.take((5,), torch.float32, zeroed=True)  # no free buffer: a new one, zeroed
    assert c.data_ptr() != where and torch.equal(c, torch.zeros(5))
    pool.give(b)
    d = pool.take((1, 10), torch.float32)  # 40 bytes: a's buffer is more than twice as large, not used
    assert d.data_ptr() != where
    e = pool.take((3, 300), torch.float32, zeroed=True)  # 3,600 bytes in a's buffer, zeroed although reused
    assert e.data_ptr() == where and torch.equal(e, torch.zeros(3, 300))
    pool.give(torch.ones(3))  # not the pool's: ignored
    pool.give(e)
    big = pool.take((4000,), torch.float32)  # 16,000 bytes: over keep_bytes once given back
    pool.give(big)
    assert pool.take((4000,), torch.float32).data_ptr() != big.data_ptr()


def test_buffer_pool_for_a_bucket_keeps_a_layers_large_weights() -> None:
    """Tensors made up to one bucket ahead of the one written (as `unshard.direct_tensors` does), ten layers
    whose three largest weights each take most of the bucket (an 8 GB Llama's MLP against the default
    bucket): each size is made new about once, not once a layer."""
    from collections import deque

    from ckptconv.stream.buffers import BufferPool

    bucket = 128_000
    layer = [32_000, 8_000, 8_000, 32_000, 92_000, 92_000, 92_000]

    def made(pool: BufferPool) -> int:
        in_flight: deque[torch.Tensor] = deque()
        for nbytes in layer * 10:
            while in_flight and sum(t.numel() for t in in_flight) + nbytes > bucket:
                pool.give(in_flight.popleft())  # written
            in_flight.append(pool.take((nbytes,), torch.uint8))
        return pool.allocated

    assert made(BufferPool.for_bucket(bucket)) <= 2 * sum(layer)  # against 10 * sum(layer) taken
    assert made(BufferPool(keep_bytes=bucket)) > 5 * sum(layer)  # one bucket kept: made again every layer


@given(
    st.lists(st.tuples(st.integers(0, 500), st.integers(1, 60)), min_size=1, max_size=30),
    st.integers(0, 40),
    st.integers(1, 400),
    st.data(),
)
def test_coalesced_span(pieces: list[tuple[int, int]], gap: int, limit: int, data: st.DataObject) -> None:
    """One request for a wanted range: the expected range holding it, grown over neighbours no more than
    `gap` apart while within `limit` (a longer range alone is still one request); the whole of every range
    it takes, and no byte in a gap wider than `gap`."""
    from ckptconv.remote.ranges import merged, span_around

    expected = merged([(s, s + n) for s, n in pieces])
    k = data.draw(st.integers(0, len(expected) - 1))
    a = data.draw(st.integers(expected[k][0], expected[k][1] - 1))
    b = data.draw(st.integers(a + 1, expected[k][1]))
    found = span_around(expected, (a, b), gap, limit)
    assert found is not None
    lo, hi = found
    assert lo <= k < hi
    taken = expected[lo:hi]
    assert all(nxt[0] - prev[1] <= gap for prev, nxt in pairwise(taken))
    assert hi - lo == 1 or taken[-1][1] - taken[0][0] <= limit
    grown = [(lo - 1, hi), (lo, hi + 1)]  # no neighbour left out that would have fitted
    for i, j in grown:
        if i >= 0 and j <= len(expected) and (i, j) != (lo, hi):
            more = expected[i:j]
            fits = all(n[0] - p[1] <= gap for p, n in pairwise(more)) and more[-1][1] - more[0][0] <= limit
            assert not fits
    end = expected[-1][1]  # a range no expected one holds: fetched exactly as asked
    assert span_around(expected, (end + 1, end + 2), gap, limit) is None


@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(1, 30)), max_size=10),
    st.integers(0, 250),
    st.integers(0, 60),
)
def test_ranges_without_a_cut(pieces: list[tuple[int, int]], a: int, n: int) -> None:
    """A fetched span's unread ranges less a read: exactly the bytes not in it, still sorted and disjoint."""
    from ckptconv.remote.ranges import merged, without

    ranges = merged([(s, s + k) for s, k in pieces])
    left = without(ranges, (a, a + n))
    covered = {x for r in ranges for x in range(*r)} - set(range(a, a + n))
    assert {x for r in left for x in range(*r)} == covered
    assert left == merged(left) and all(e > s for s, e in left)


def test_lock_record_leaves_out_storage_options() -> None:
    """Another run's error shows the command line the lock recorded: never the credentials."""
    from ckptconv.publish.outlock import _without_options

    secret = '{"key": "AKIA", "secret": "do-not-show"}'
    for argv in (["ckptconv", "dcp-to-hf", "s3://b/x", "out", "--storage-options", secret, "-q"],
                 ["ckptconv", "dcp-to-hf", "s3://b/x", "out", f"--storage-options={secret}"]):  # fmt: skip
        shown = _without_options(argv)
        assert "do-not-show" not in shown and "AKIA" not in shown and "s3://b/x out" in shown


def test_the_two_lock_files_pin_the_same_versions() -> None:
    """constraints.txt (what scripts/setup.sh installs) and pylock.toml (the same lock in PEP 751's format,
    with hashes) name the same packages at the same versions: scripts/lock.sh writes both."""
    import re
    import tomllib

    from conftest import ROOT as root

    def name(n: str) -> str:
        return re.sub(r"[-_.]+", "-", n).lower()

    lines = (root / "constraints.txt").read_text().splitlines()
    pins = {name(k): v for k, v in (line.split("==") for line in lines if "==" in line)}
    lock = tomllib.loads((root / "pylock.toml").read_text())["packages"]
    locked = {name(p["name"]): p["version"].removesuffix("+cpu") for p in lock if "version" in p}
    assert locked == {k: v for k, v in pins.items() if k != "pip"}
    assert all(w.get("hashes", {}).get("sha256") for p in lock for w in p.get("wheels", []))
