"""Pure: which byte ranges of an object one request fetches (coalescing neighbours across small gaps, never
across bytes another rank reads)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

Range = tuple[int, int]  # [start, end) of an object's bytes


def merged(ranges: Sequence[Range]) -> list[Range]:
    """`ranges` sorted, overlapping ones merged (touching ones stay apart: `span_around` joins them when
    they fit in one request)."""
    out: list[Range] = []
    for start, end in sorted(ranges):
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def joined(ranges: Sequence[Range]) -> list[Range]:
    """`ranges` sorted, overlapping and touching ones joined: the fewest ranges holding the same bytes (the
    bytes other ranks read are kept so, the rows of neighbouring ranks being one range).

        joined([(5, 8), (0, 5), (10, 12), (11, 15)])  ->  [(0, 8), (10, 15)]
    """
    out: list[Range] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def free(others: Sequence[Range], gap: Range) -> bool:
    """Whether no byte of `gap` is in `others` (sorted, disjoint: `joined` or `merged`). An empty gap (two
    touching ranges) is always free.

        free([(10, 20)], (0, 10))  ->  True;   free([(10, 20)], (5, 11))  ->  False
    """
    if gap[1] <= gap[0]:
        return True
    i = bisect.bisect_left(others, (gap[1],))  # the ranges starting before the gap ends: others[:i]
    return i == 0 or others[i - 1][1] <= gap[0]  # disjoint and sorted: the last of them ends last


def span_around(
    expected: Sequence[Range], want: Range, gap: int, limit: int, others: Sequence[Range] = ()
) -> tuple[int, int] | None:
    """The indices [i, j) of the ranges of `expected` (sorted, disjoint: `merged`) that one request fetches
    to serve `want`: the expected range holding `want`, grown over neighbours whose gap to it is at most
    `gap` bytes and holds no byte of `others` (the bytes other ranks read, sorted and disjoint: each of them
    fetches its own, so no byte goes over the network twice) while the span stays within `limit` bytes (a
    range longer than `limit` is still fetched whole). None when no expected range holds `want`: then
    exactly `want` is fetched.

        expected  [0, 10) [12, 20) [40, 50)     want (13, 15), gap 2  ->  (0, 2): bytes [0, 20)
        the same, others [(10, 12)]                                   ->  (1, 2): bytes [12, 20)
    """
    i = bisect.bisect_right(expected, (want[0], float("inf"))) - 1
    if i < 0 or not (expected[i][0] <= want[0] and want[1] <= expected[i][1]):
        return None
    lo, hi = i, i + 1
    while (
        lo > 0
        and expected[lo][0] - expected[lo - 1][1] <= gap
        and expected[hi - 1][1] - expected[lo - 1][0] <= limit
        and free(others, (expected[lo - 1][1], expected[lo][0]))
    ):
        lo -= 1
    while (
        hi < len(expected)
        and expected[hi][0] - expected[hi - 1][1] <= gap
        and expected[hi][1] - expected[lo][0] <= limit
        and free(others, (expected[hi - 1][1], expected[hi][0]))
    ):
        hi += 1
    return lo, hi


def spans(expected: Sequence[Range], gap: int, limit: int, others: Sequence[Range] = ()) -> list[Range]:
    """The spans one rank's requests fetch when it reads its `expected` ranges (any order, overlaps allowed)
    front to back, each request taking what `span_around` gives the first range not yet fetched (as
    `RemoteFiles` does when reads come in file order): every expected byte once, and the bytes of the gaps
    it reads across, none of them in `others`.

        spans([(0, 4), (6, 8), (10, 12), (20, 30)], 2, 100, others=[(8, 9)])  ->  [(0, 8), (10, 12), (20, 30)]
    """
    left = merged(expected)
    out: list[Range] = []
    while left:
        found = span_around(left, left[0], gap, limit, others)
        assert found is not None  # left[0] is held by itself
        lo, hi = found
        out.append((left[lo][0], left[hi - 1][1]))
        del left[lo:hi]
    return out


def pieces(start: int, end: int, limit: int) -> list[Range]:
    """[start, end) cut into consecutive pieces of at most `limit` bytes (one request each).

    pieces(0, 10, 4)  ->  [(0, 4), (4, 8), (8, 10)]
    """
    return [(a, min(a + limit, end)) for a in range(start, end, limit)]


def without(ranges: Sequence[Range], cut: Range) -> list[Range]:
    """`ranges` (sorted, disjoint) less the bytes of `cut`.

    without([(0, 10), (20, 30)], (5, 25))  ->  [(0, 5), (25, 30)]
    """
    out: list[Range] = []
    for a, b in ranges:
        if b <= cut[0] or cut[1] <= a:
            out.append((a, b))
            continue
        if a < cut[0]:
            out.append((a, cut[0]))
        if cut[1] < b:
            out.append((cut[1], b))
    return out
