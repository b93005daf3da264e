"""Pure: which byte ranges of an object one request fetches (coalescing neighbours across small gaps)."""

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


def span_around(expected: Sequence[Range], want: Range, gap: int, limit: int) -> tuple[int, int] | None:
    """The indices [i, j) of the ranges of `expected` (sorted, disjoint: `merged`) that one request fetches
    to serve `want`: the expected range holding `want`, grown over neighbours whose gap to it is at most
    `gap` bytes while the span stays within `limit` bytes (a range longer than `limit` is still fetched
    whole). None when no expected range holds `want`: then exactly `want` is fetched.

        expected  [0, 10) [12, 20) [40, 50)     want (13, 15), gap 2  ->  (0, 2): bytes [0, 20)
    """
    i = bisect.bisect_right(expected, (want[0], float("inf"))) - 1
    if i < 0 or not (expected[i][0] <= want[0] and want[1] <= expected[i][1]):
        return None
    lo, hi = i, i + 1
    while (
        lo > 0
        and expected[lo][0] - expected[lo - 1][1] <= gap
        and expected[hi - 1][1] - expected[lo - 1][0] <= limit
    ):
        lo -= 1
    while (
        hi < len(expected)
        and expected[hi][0] - expected[hi - 1][1] <= gap
        and expected[hi][1] - expected[lo][0] <= limit
    ):
        hi += 1
    return lo, hi


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
