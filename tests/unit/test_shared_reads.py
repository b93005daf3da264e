"""Reads from object storage shared out between ranks (`remote.ranges.spans` with the other ranks' bytes):
a request coalesces a rank's own ranges across small gaps, never across bytes another rank reads, so the
ranks together fetch each needed byte once (the bytes several ranks read excepted)."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from ckptconv.core.layout import shard_rows
from ckptconv.remote.ranges import Range, free, joined, merged, span_around, spans

MB = 1 << 20


def _bytes(ranges: list[Range]) -> set[int]:
    return {x for a, b in ranges for x in range(a, b)}


def _size(ranges: list[Range]) -> int:
    return sum(b - a for a, b in joined(ranges))


def _fetched(needs: list[list[Range]], gap: int, limit: int) -> list[list[Range]]:
    """Each rank's spans, told the others' needs (as `RemoteFiles.elsewhere` is)."""
    return [
        spans(mine, gap, limit, joined([r for j, theirs in enumerate(needs) if j != i for r in theirs]))
        for i, mine in enumerate(needs)
    ]


def test_examples() -> None:
    assert joined([(5, 8), (0, 5), (10, 12), (11, 15)]) == [(0, 8), (10, 15)]
    assert free([(10, 20)], (0, 10)) and not free([(10, 20)], (5, 11)) and free([(10, 20)], (15, 15))
    expected = [(0, 10), (12, 20), (40, 50)]
    assert span_around(expected, (13, 15), 2, 100) == (0, 2)
    assert span_around(expected, (13, 15), 2, 100, [(10, 12)]) == (1, 2)
    assert spans([(0, 4), (6, 8), (10, 12), (20, 30)], 2, 100, [(8, 9)]) == [(0, 8), (10, 12), (20, 30)]


@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(0, 7)), min_size=1, max_size=40),
    st.integers(2, 4),
    st.integers(0, 50),
    st.integers(1, 400),
)
def test_no_rank_fetches_bytes_only_another_reads(
    units: list[tuple[int, int, int]], world: int, gap: int, limit: int
) -> None:
    """Units laid out one after another (a gap of bytes nobody reads before each), each read by any set of
    ranks (a bit mask; none: bytes nobody reads). Every rank fetches all it reads; a byte it fetches is one
    it reads or one nobody reads (never one that only others read); its requests read across gaps of at most
    `gap` bytes, and stop short of a neighbour only for another rank's bytes or the `limit`."""
    needs: list[list[Range]] = [[] for _ in range(world)]
    at = 0
    for skip, n, mask in units:
        at += skip
        for r in range(world):
            if mask >> r & 1:
                needs[r].append((at, at + n))
        at += n
    fetched = _fetched(needs, gap, limit)
    everyone = _bytes([r for mine in needs for r in mine])
    for r, (mine, got) in enumerate(zip(needs, fetched, strict=True)):
        own, others = _bytes(mine), everyone - _bytes(mine)
        assert got == merged(got)  # sorted, each byte once
        assert own <= _bytes(got)
        assert not (_bytes(got) & others), r  # another rank's bytes: fetched by those who read them only
        own_ranges = merged(mine)
        others_ranges = joined([x for j, theirs in enumerate(needs) if j != r for x in theirs])
        for a, b in got:  # across gaps of at most `gap`, none holding another's bytes
            inside = [x for x in own_ranges if a <= x[0] and x[1] <= b]
            assert inside and inside[0][0] == a and inside[-1][1] == b
            assert all(q[0] - p[1] <= gap and free(others_ranges, (p[1], q[0])) for p, q in pairwise(inside))
        for first, second in pairwise(got):  # split only where the gap is wide, another's, or at the limit
            nxt = next(x for x in own_ranges if x[0] >= second[0])
            joinable = nxt[0] - first[1] <= gap and free(others_ranges, (first[1], nxt[0]))
            assert not joinable or nxt[1] - first[0] > limit
    needed_fetched = sum(len(_bytes(got) & everyone) for got in fetched)
    assert needed_fetched == sum(len(_bytes(mine)) for mine in needs)  # once per rank that reads it


# realistic layouts: a Llama-like layer's tensors (rows, bytes per row), small enough to test quickly
_LAYER = [(64, 512), (16, 512), (16, 512), (64, 512), (176, 512), (176, 512), (64, 1408), (1, 256), (1, 256)]


@given(st.integers(2, 8), st.sampled_from([0, 64 << 10, MB, 8 * MB]), st.integers(1, 6))
def test_hf_rows_of_every_tensor(world: int, gap: int, layers: int) -> None:
    """hf-to-dcp: each rank reads its `Shard(0)` rows of every tensor of a safetensors file (tensors back to
    back after the header). Before, a rank's rows of neighbouring tensors, the other ranks' rows apart, were
    read across (2 ranks: about twice the bytes); now the ranks together fetch the data once, and a rank's
    rows that touch (a tensor's last rows, the next one's first) are still one request."""
    needs: list[list[Range]] = [[] for _ in range(world)]
    at = 4096  # the header: read once by rank 0, apart
    for rows, row_bytes in _LAYER * layers:
        for r in range(world):
            lo, hi = shard_rows(rows, world, r)
            if hi > lo:
                needs[r].append((at + lo * row_bytes, at + hi * row_bytes))
        at += rows * row_bytes
    fetched = _fetched(needs, gap, 32 * MB)
    union = _size([x for mine in needs for x in mine])
    assert sum(b - a for got in fetched for a, b in got) == union  # <= 1.05x: exactly once
    before = [spans(mine, gap, 32 * MB) for mine in needs]
    if gap >= MB:
        assert sum(b - a for got in before for a, b in got) > 1.5 * union  # what it was
    # at most one request per tensor and rank (a rank whose rows of two tensors touch, as when the other
    # ranks have no rows of a 1-row tensor between them, reads them in one)
    assert all(len(got) <= len(_LAYER) * layers for got in fetched)


def _records(names: list[str], data: int, head: int = 900, tail: int = 400) -> dict[str, Range]:
    """torch.save records one after another, each its zip head, data and tail."""
    out, at = {}, 0
    for name in names:
        out[name] = (at, at + head + data + tail)
        at += head + data + tail
    return out


@given(st.integers(11, 40), st.sampled_from([2, 3, 4]), st.sampled_from([4 << 10, 64 << 10, 256 << 10]))
def test_dcp_records_of_interleaved_writers(layers: int, world: int, data: int) -> None:
    """dcp-to-hf of the model part of a checkpoint (its optimizer state after it, read by nobody): the HF
    file lists `layers.N` in name order (0, 1, 10, 11, ..., 2, ...), each rank writes a contiguous share
    of it, so in the DCP file (numeric order) the ranks' records alternate in runs a few records apart. A
    tensor a share's cut falls in is read as rows by two ranks: each knows only that the other reads part of
    that record (the whole record counts as the other's). Fetched over needed (whole records): <= 1.05, where
    coalescing across the other ranks' runs fetched up to about 1.8x."""
    numeric = [f"model.layers.{i}.w" for i in range(layers)]
    optim = [f"optim.layers.{i}.w.{s}" for i in range(layers) for s in ("m", "v")]
    records = _records([*numeric, *optim], data)
    in_hf = sorted(numeric)
    head, rows, row_bytes = 900, 64, data // 64
    needs: list[list[Range]] = [[] for _ in range(world)]
    others_extra: list[list[Range]] = [[] for _ in range(world)]  # records read in part: the whole record
    for k, name in enumerate(in_hf):  # the stream of HF bytes cut in `world` equal shares, rows at a cut
        a, b = k * rows, (k + 1) * rows  # this tensor's rows in the stream of all rows
        cuts = [shard_rows(len(in_hf) * rows, world, r) for r in range(world)]
        owners = [(r, max(a, lo), min(b, hi)) for r, (lo, hi) in enumerate(cuts) if max(a, lo) < min(b, hi)]
        start, end = records[name]
        for r, lo, hi in owners:
            if len(owners) == 1:
                needs[r].append((start, end))  # a whole record
            else:
                data_at = start + head
                needs[r].append((data_at + (lo - a) * row_bytes, data_at + (hi - a) * row_bytes))
                for other, _, _ in owners:
                    if other != r:
                        others_extra[other].append((start, end))
    fetched = [
        spans(
            mine,
            MB,
            32 * MB,
            joined([x for j, theirs in enumerate(needs) if j != i for x in theirs] + others_extra[i]),
        )
        for i, mine in enumerate(needs)
    ]
    needed = _size([records[name] for name in numeric])
    total = sum(b - a for got in fetched for a, b in got)
    assert total <= 1.05 * needed, total / needed
    before = sum(b - a for mine in needs for a, b in spans(mine, MB, 32 * MB))
    assert before >= total
