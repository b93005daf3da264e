"""torch.save's on-disk record of one tensor, written from a stream of byte slabs; its data.pkl read back.

`read_tensor_record` reads the `data.pkl` of a torch.save zip into a plain description of the tensor (dtype,
storage key, offset, size, stride) without building anything, through safe_pickle's allowlist, within the
read's `limits.Budget`: a typed storage with `_rebuild_tensor_v2`, or (fp8, uint16 and the other dtypes
without a typed storage) an untyped one with `_rebuild_tensor_v3`.

DCP's `FileSystemReader` `torch.load`s every tensor record, so hf-to-dcp writes torch.save records. torch.save
computes the zip CRC-32 with miniz's byte-at-a-time table (about 0.35 GB/s here), which made it the bottleneck
of hf-to-dcp. This module writes the same bytes torch.save writes (tested byte for byte), with `crc32.crc32`
(ISA-L's or zlib's: several GB/s, releasing the GIL) and the data streamed slab by slab, so the tensor is
never whole in memory.

The layout is miniz's as torch uses it: stored (uncompressed) entries, each local header padded with an "FB"
extra field so the entry's data starts at a multiple of 64 bytes from the start of the record, data
descriptors after the data (general purpose flags 0x0808), the central directory, a zip64 end record and
locator, and the end record. Records whose offsets or sizes need zip64 fields (4 GiB and more) and dtypes
(none here) are left to torch.save itself: `fast_path` says which.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import torch

from ckptconv.core.crc32 import crc32
from ckptconv.core.dtype_names import ITEMSIZE
from ckptconv.errors import CkptconvError
from ckptconv.formats.pieces import write_pieces
from ckptconv.formats.safe_pickle import SIZE, AllowlistUnpickler, Charged, charged_dict
from ckptconv.job.limits import MAX_DIMS, Budget, size_of

MAX_RECORD_PICKLE = 1 << 20  # a plain tensor's data.pkl is a few hundred bytes
ALIGNMENT = 64
_LIMIT = 0xFFFFFFFF - (1 << 16)  # below this, no offset or size of a record needs zip64 fields
_UTF8, _DESCRIPTOR = 0x0800, 0x0008  # general purpose flags: UTF-8 names; a data descriptor follows the data
_PREFIX = b"archive/"


def _storage_names() -> dict[torch.dtype, str]:
    from torch.storage import _dtype_to_storage_type_map  # the names torch.save pickles (no public API)

    return dict(_dtype_to_storage_type_map())


@dataclass(frozen=True)
class TensorRecord:
    """What a torch.save'd tensor's data.pkl says, without building the tensor."""

    dtype: torch.dtype
    storage_key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.size), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


class _StorageType:
    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype  # None: an untyped storage (its numel counts bytes)


def _storage_globals() -> dict[tuple[str, str], Any]:
    # the legacy typed-storage names torch.save writes into data.pkl, e.g. ("torch", "BFloat16Storage")
    return {("torch", name): _StorageType(dtype) for dtype, name in _storage_names().items()}


def _dims(value: Any) -> tuple[int, ...]:
    if size_of(value) > MAX_DIMS:
        raise pickle.UnpicklingError(f"a size or stride of more than {MAX_DIMS} dimensions")
    return tuple(value)


def _rebuild_tensor_v2(storage: Any, storage_offset: int, size: Any, stride: Any, *_: Any) -> TensorRecord:
    dtype, key, numel = storage
    if dtype is None:
        raise pickle.UnpicklingError("an untyped storage without a dtype")
    return TensorRecord(dtype, key, numel, int(storage_offset), _dims(size), _dims(stride))


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: int,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    *_: Any,
) -> TensorRecord:
    stored, key, nbytes = storage
    if stored is not None or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("_rebuild_tensor_v3 of a typed storage")
    return TensorRecord(dtype, key, nbytes // dtype.itemsize, int(storage_offset), _dims(size), _dims(stride))


_DTYPES = {
    name: getattr(torch, name) for name in ITEMSIZE if isinstance(getattr(torch, name, None), torch.dtype)
}
_TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("collections", "OrderedDict"): Charged(charged_dict),
    ("torch", "Size"): SIZE,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("torch", "UntypedStorage"): _StorageType(None),
    **{
        ("torch", name): getattr(torch, name)
        for name in ITEMSIZE
        if isinstance(getattr(torch, name, None), torch.dtype)
    },
    **_storage_globals(),
}


class _TensorRecordUnpickler(AllowlistUnpickler):
    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError("unexpected storage type")
        return (storage_type.dtype, str(key), int(numel))


def read_tensor_record(data_pkl: bytes, budget: Budget | None = None) -> TensorRecord | None:
    """The tensor a torch.save data.pkl describes, or None when it is anything but one plain tensor; a limit
    of `budget` reached is a `LimitExceeded`."""
    try:
        record = _TensorRecordUnpickler(data_pkl, _TENSOR_GLOBALS, budget).load()
    except CkptconvError:
        raise
    except Exception:
        return None
    return record if isinstance(record, TensorRecord) else None


class _Storage:
    """Stands for the tensor's storage in data.pkl (pickled as a persistent id, like torch.save does)."""


class _Rebuild:
    def __init__(self, args: tuple[object, ...]) -> None:
        self.args = args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        rebuild = torch._utils._rebuild_tensor_v2 if len(self.args) == 6 else torch._utils._rebuild_tensor_v3
        return rebuild, self.args


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, storage_id: tuple[object, ...]) -> None:
        super().__init__(file, protocol=2)
        self.storage_id = storage_id

    def persistent_id(self, obj: object) -> object:
        return self.storage_id if isinstance(obj, _Storage) else None


def data_pkl(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The `data.pkl` torch.save writes for a contiguous CPU tensor of `dtype` and `shape`."""
    numel = 1
    for n in shape:
        numel *= n
    stride = tuple(torch.empty(shape, dtype=dtype, device="meta").stride())
    typed = _storage_names().get(dtype)
    args: tuple[object, ...]
    if typed is not None:  # legacy typed storages: _rebuild_tensor_v2 with a FloatStorage etc.
        pid = ("storage", getattr(torch, typed), "0", "cpu", numel)
        args = (_Storage(), 0, shape, stride, False, collections.OrderedDict())
    else:  # fp8, uint16 ...: an UntypedStorage of bytes and the dtype, _rebuild_tensor_v3
        pid = ("storage", torch.UntypedStorage, "0", "cpu", numel * dtype.itemsize)
        args = (_Storage(), 0, shape, stride, False, collections.OrderedDict(), dtype)
    buf = io.BytesIO()
    _Pickler(buf, pid).dump(_Rebuild(args))
    return buf.getvalue()


def fast_path(nbytes: int) -> bool:
    """Whether `write_tensor_record` writes a tensor of `nbytes` (else use torch.save: zip64 fields)."""
    return nbytes < _LIMIT


class _Zip:
    """Sequential writer of one stored zip archive in miniz's layout, positions relative to its start."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.pos = 0
        self.entries: list[tuple[bytes, int, int, int, int]] = []  # name, header offset, flags, crc, size

    def _write(self, data: bytes | memoryview) -> None:
        write_pieces(self.out, data)
        self.pos += len(data)

    def add(self, name: bytes, size: int, chunks: Iterable[bytes | memoryview] | None) -> None:
        """One entry of `size` bytes, the concatenation of `chunks`; CRC and sizes go in a data descriptor.
        `chunks` None: the entry's place only, nothing written (`record_size`)."""
        offset, crc, done = self.pos, 0, 0
        flags = _UTF8 | (_DESCRIPTOR if size else 0)  # miniz writes no descriptor for an empty entry
        pad = -(self.pos + 30 + len(name) + 4) % ALIGNMENT
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra))
        self._write(header + name + extra)
        if chunks is None:
            self.pos, done = self.pos + size, size
        for chunk in chunks or ():
            crc = crc32(chunk, crc)
            done += len(chunk)
            self._write(chunk)
        if done != size:
            raise ValueError(f"{name.decode()}: got {done} bytes, expected {size}")
        if size:
            self._write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self.entries.append((name, offset, flags, crc, size))

    def finish(self) -> None:
        cd_start = self.pos
        for name, offset, flags, crc, size in self.entries:
            self._write(
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    0,
                    0,
                    flags,
                    0,
                    0,
                    0,
                    crc,
                    size,
                    size,
                    len(name),
                    0,
                    0,
                    0,
                    0,
                    0,
                    offset,
                )
                + name
            )
        cd_size, n = self.pos - cd_start, len(self.entries)
        zip64_end = self.pos
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, cd_start))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, zip64_end, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_start, 0))


def record_size(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The length `write_tensor_record` gives a tensor of `dtype` and `shape`, whatever its values (its
    serialization id has 40 digits whatever the CRCs); nothing is read or written."""
    return write_tensor_record(cast(BinaryIO, _Nowhere()), dtype, shape, None)


class _Nowhere:
    """A sink that keeps nothing (`record_size`)."""

    def write(self, data: bytes | memoryview) -> int:
        return len(data)


def write_tensor_record(
    out: BinaryIO,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    slabs: Iterable[bytes | memoryview] | None,
    serialization_id: bytes | None = None,
) -> int:
    """Write the torch.save record of a contiguous tensor whose bytes `slabs` yields in order; its length
    (`slabs` None: its length only, `record_size`).

    Only for `fast_path(nbytes)`. `serialization_id` (40 digits) defaults to one derived from the
    contents, so the same tensor gives the same bytes (torch.save draws a random one; readers only log it).
    """
    pkl = data_pkl(dtype, shape)
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    z = _Zip(out)
    for name, value in (
        (b"data.pkl", pkl),
        (b".format_version", b"1"),
        (b".storage_alignment", str(ALIGNMENT).encode()),
        (b"byteorder", b"little"),
    ):
        z.add(_PREFIX + name, len(value), [value])
    z.add(_PREFIX + b"data/0", nbytes, slabs)
    data_crc = z.entries[-1][3]
    z.add(_PREFIX + b"version", 2, [b"3\n"])
    if serialization_id is None:
        serialization_id = b"%020d%020d" % (crc32(pkl), data_crc)
    z.add(_PREFIX + b".data/serialization_id", len(serialization_id), [serialization_id])
    z.finish()
    return z.pos
