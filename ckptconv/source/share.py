"""One rank reads `.metadata`, every rank gets the checkpoint: `open_dcp_shared(world, path)`.

At 512 ranks, each of them unpickling a 150 MB `.metadata` is 512 reads of one file on a shared file system,
a million records unpickled and validated 512 times, and 8 copies of them per node. Instead rank 0 runs
`open_dcp` (the one that validates everything: names, sizes, tilings, record formats) and broadcasts the
result in a compact form: the specs as plain tuples, `marshal`led (no classes, no code: marshal builds
only built-in values) one tensor at a time into one buffer, sent as it lies in memory; the other ranks turn
it back into specs without checking them again. A tensor's chunk records stay in that buffer until a rank
first reads them (`PackedChunks`): a rank makes the records of the tensors it reads, not a million.

Outside torchrun this is `open_dcp`. A failure on rank 0 reaches every rank as the same error, so all of
them leave together (no rank waits in a collective the others left). The command line has rank 0 (or the only
process) open the checkpoint before torch is imported (`early_open`).
"""

from __future__ import annotations

import dataclasses
import marshal
import pickle
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from ckptconv.core.specs import ChunkSpec, DcpCheckpoint, TensorSpec, new_chunk
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import open_dcp
from ckptconv.job.world import World, from_main

if TYPE_CHECKING:
    from ckptconv.source.early import Early

_FORMAT = 3
_LENGTH = struct.Struct("<Q")


def pack(ckpt: DcpCheckpoint) -> bytearray:
    """`ckpt` as bytes, made one tensor at a time (never a second copy of all the specs): length-prefixed
    marshalled tuples, first (format, the small rest pickled: items, paths, file stamps, Megatron's common.pt;
    the number of tensors), then for each tensor its (fqn, dtype, shape) and its chunks, as made by this
    process from a validated checkpoint."""
    out = bytearray()

    def put(value: Any) -> None:
        blob = marshal.dumps(value)
        out.extend(_LENGTH.pack(len(blob)))
        out.extend(blob)

    rest = dataclasses.replace(ckpt, tensors={})
    put((_FORMAT, pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL), len(ckpt.tensors)))
    for t in ckpt.tensors.values():
        put((t.fqn, t.dtype_name, t.shape))
        put(tuple(map(tuple, t.chunks)))
    return out


def unpack(data: bytearray) -> DcpCheckpoint:
    """The checkpoint `pack` made (on another rank of the same job, the only source of these bytes)."""
    view, at = memoryview(data), 0

    def raw() -> memoryview:
        nonlocal at
        (n,) = _LENGTH.unpack_from(view, at)
        at += _LENGTH.size + n
        return view[at - n : at]

    def take() -> Any:
        return marshal.loads(raw())

    version, rest, count = take()
    if version != _FORMAT:
        raise CkptconvError(f"ranks run different ckptconv versions (metadata form {version}, not {_FORMAT})")
    ckpt: DcpCheckpoint = pickle.loads(rest)
    tensors = {}
    for _ in range(count):
        fqn, dtype, shape = take()
        tensors[fqn] = TensorSpec(fqn, dtype, shape, PackedChunks(raw()))
    return dataclasses.replace(ckpt, tensors=tensors)


class PackedChunks(Sequence[ChunkSpec]):
    """A tensor's chunks as `pack` sent them (a view of the received buffer), made into `ChunkSpec`s when
    first read and kept from then on; equal to the tuple of them."""

    __slots__ = ("_made", "_raw")

    def __init__(self, raw: memoryview) -> None:
        self._raw: memoryview | None = raw
        self._made: tuple[ChunkSpec, ...] = ()

    def _chunks(self) -> tuple[ChunkSpec, ...]:
        if self._raw is not None:
            self._made, self._raw = tuple(map(new_chunk, marshal.loads(self._raw))), None
        return self._made

    @overload
    def __getitem__(self, index: int) -> ChunkSpec: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[ChunkSpec, ...]: ...
    def __getitem__(self, index: int | slice) -> ChunkSpec | tuple[ChunkSpec, ...]:
        return self._chunks()[index]

    def __len__(self) -> int:
        return len(self._chunks())

    def __iter__(self) -> Iterator[ChunkSpec]:
        return iter(self._chunks())

    def __eq__(self, other: object) -> bool:
        return self._chunks() == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self._chunks())

    def __repr__(self) -> str:
        return repr(self._chunks())

    def __reduce__(self) -> tuple[Any, ...]:
        return tuple, (self._chunks(),)


def open_dcp_shared(world: World, path: Path, early: Early | None = None) -> DcpCheckpoint:
    """`open_dcp(path)` on rank 0, its result (or its error) on every rank. Collective (see `from_main`).
    `early`: rank 0's checkpoint as opened before torch was imported (`early_open`), used when it is
    `path`'s."""
    if early is not None and early.path == path:
        return from_main(world, early.take, pack, unpack, raw=True)
    if early is not None:  # SRC changed in between: not kept for the rest of the run
        early.drop()
    return from_main(world, lambda: open_dcp(path), pack, unpack, raw=True)
