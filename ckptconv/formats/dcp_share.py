"""One rank reads `.metadata`, every rank gets the checkpoint: `open_dcp_shared(world, path)`.

At 512 ranks, each of them unpickling a 150 MB `.metadata` is 512 reads of one file on a shared file system,
a million records unpickled and validated 512 times, and 8 copies of them per node. Instead rank 0 runs
`open_dcp` (the one that validates everything: names, sizes, tilings, record formats) and broadcasts the
result in a compact form: the specs as plain tuples, `marshal`led (no classes, no code: marshal builds
only built-in values), which the other ranks turn back into specs without checking them again.

Outside torchrun this is `open_dcp`. A failure on rank 0 reaches every rank as the same error, so all of
them leave together (no rank waits in a collective the others left).
"""

from __future__ import annotations

import dataclasses
import marshal
import pickle
from pathlib import Path
from typing import Any

from ..errors import CkptconvError
from ..specs import TensorSpec, new_chunk
from ..world import World, from_main
from .dcp import DcpCheckpoint, open_dcp

_FORMAT = 1


def pack(ckpt: DcpCheckpoint) -> bytes:
    """`ckpt` as bytes: the tensors' specs marshalled as tuples, the small rest (items, paths, file stamps,
    Megatron's common.pt) pickled, as they are made by this process from a validated checkpoint."""
    specs: Any = tuple(
        (t.fqn, t.dtype_name, t.shape, tuple(map(tuple, t.chunks))) for t in ckpt.tensors.values()
    )
    rest = dataclasses.replace(ckpt, tensors={})
    return marshal.dumps((_FORMAT, specs, pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL)))


def unpack(data: bytes) -> DcpCheckpoint:
    """The checkpoint `pack` made (on another rank of the same job, the only source of these bytes)."""
    version, specs, rest = marshal.loads(data)
    if version != _FORMAT:
        raise CkptconvError(f"ranks run different ckptconv versions (metadata form {version}, not {_FORMAT})")
    ckpt: DcpCheckpoint = pickle.loads(rest)
    tensors = {
        fqn: TensorSpec(fqn, dtype, shape, tuple(map(new_chunk, chunks)))
        for fqn, dtype, shape, chunks in specs
    }
    return dataclasses.replace(ckpt, tensors=tensors)


def open_dcp_shared(world: World, path: Path) -> DcpCheckpoint:
    """`open_dcp(path)` on rank 0, its result (or its error) on every rank. Collective (see `from_main`)."""
    return from_main(world, lambda: open_dcp(path), pack, unpack)
