"""Where each entry of DCP's storage index is: the storage row of each chunk of a tensor, found in C.

torch's writer stores a tensor's index entries together, in the order of its chunk list. Such a tensor's rows
are one slice of the columns, proved by comparing its chunk offsets with the slice's (one pass in C), so
no `{fqn: {offsets: row}}` dict of a million entries is built. Any other layout (entries scattered, or in
another order, or offsets stored twice) is looked up in that dict, built as before on first need, so
either way a chunk gets the row torch's `storage_data[MetadataIndex(fqn, offsets)]` gives: of entries stored
twice, the last.
"""

from __future__ import annotations

from itertools import chain, groupby
from pathlib import Path
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp_columns import Columns

_NONE = type(None)


class Locations:
    """`rows(fqn, offsets)`: the storage row of each chunk (None: not stored); `files(rows)`."""

    def __init__(self, columns: Columns) -> None:
        self.columns = columns
        self._by_fqn: dict[Any, dict[Any, int]] | None = None
        # fqn -> (start, stop) of its storage rows where they are one run of the columns, every key and
        # offset a hashable of known types; None where only the dict can say (built now, as before, so
        # that an unhashable key is refused as it always was)
        self.spans = _spans(columns)
        if self.spans is None:
            self._by_fqn = columns.locations()

    @property
    def by_fqn(self) -> dict[Any, dict[Any, int]]:
        """{fqn: {offsets: storage row}} (the last row of an entry stored twice), made on first use."""
        if self._by_fqn is None:
            self._by_fqn = self.columns.locations()
        return self._by_fqn

    def span(self, fqn: str, offsets: list[Any]) -> range | None:
        """The storage rows of `offsets`, one run of the columns in their order; None when they are not
        (then `rows` says)."""
        run = self.spans.get(fqn) if self.spans is not None else None
        if run is None or run[1] - run[0] != len(offsets):
            return None
        start, stop = run
        if self.columns.index_offsets[start:stop] != offsets or len(set(offsets)) != len(offsets):
            return None
        return range(start, stop)

    def rows(self, fqn: str, offsets: list[Any]) -> list[int | None]:
        return list(map(self.by_fqn.get(fqn, {}).get, offsets))

    def files(self, rows: list[int] | range) -> tuple[list[Any], list[int], list[int]]:
        """(files, starts, lengths) of storage rows."""
        c = self.columns
        if isinstance(rows, range):
            return (
                c.paths[rows.start : rows.stop],
                c.starts[rows.start : rows.stop].tolist(),
                (c.lengths[rows.start : rows.stop].tolist()),
            )
        return (
            list(map(c.paths.__getitem__, rows)),
            list(map(c.starts.__getitem__, rows)),
            list(map(c.lengths.__getitem__, rows)),
        )

    def transforms(self, where: Path) -> tuple[str, ...]:
        """The transform descriptors every record is stored with (torch's writer applies its `_extensions`
        to all of them), () for none; records stored with different ones are refused."""
        found = self.columns.transforms
        if not found:
            return ()
        kinds = set(found.values())
        if len(kinds) > 1 or len(found) != len(self.columns.paths):
            raise CkptconvError(
                f"{where}: its records are stored with different transforms ({sorted(kinds)}, or none), "
                "which torch's writer never does; re-save the checkpoint"
            )
        return kinds.pop()


def _spans(columns: Columns) -> dict[str, tuple[int, int] | None] | None:
    """{fqn: (start, stop) of its storage rows, or None when they are not one run}; None for all when a key
    is not a string or an offset not a tuple of ints (or None), which only the dict's hashing judges."""
    stored = len(columns.paths)  # storage row k is index row k (dcp_columns pairs them so)
    fqns, offsets = columns.fqns[:stored], columns.index_offsets[:stored]
    if set(map(type, fqns)) - {str} or set(map(type, offsets)) - {tuple, _NONE}:
        return None
    if set(map(type, chain.from_iterable(filter(None, offsets)))) - {int}:
        return None
    spans: dict[str, tuple[int, int] | None] = {}
    start = 0
    for fqn, run in groupby(fqns):
        stop = start + len(list(run))
        spans[fqn] = None if fqn in spans else (start, stop)
        start = stop
    return spans
