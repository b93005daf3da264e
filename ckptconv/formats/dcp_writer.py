"""Writing a DCP checkpoint through torch's public `dcp.save`, one tensor record streamed at a time.

`dcp.save` plans (which rank writes which chunk, the global `.metadata`) exactly as for any trainer; only the
storage writer's `write_data` is ours. It writes each tensor chunk as the torch.save record `FileSystemReader`
expects (`torch_record`: byte-identical to torch.save, CRC-32 by zlib), reading the chunk's rows slab by slab
as it goes, so a writer thread holds one slab, not a chunk, and the files are what `dcp.load` reads at any
world size.

A rank's items go into files of about `max_file_size` bytes each (`bins`), at least one per writer thread,
and the threads write them in turn, so a run finishes files all along: an interrupted one leaves those for
`--resume` (torch's own writer makes one file per thread, all finished at the very end). A signal or a
failure stops every writer thread at its next slab (a chunk of 4 GiB or more, which torch.save writes whole,
is finished first): the files in progress are left unfinished (not recorded), the ones not begun are not
begun, and the error said is the one that stopped them.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo  # what FileSystemReader reads back
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptconv.core.crc32 import crc32
from ckptconv.errors import CkptconvError
from ckptconv.formats.byte_views import byte_view
from ckptconv.formats.sinks import ObjectStore
from ckptconv.formats.torch_record import fast_path, record_size, write_tensor_record
from ckptconv.job.env import env_int

SLAB_BYTES = 8 * 2**20  # read, checksummed and written at once per writer thread (4-8 MiB measured best)
DEFAULT_FILE_BYTES = 4 * 10**9  # hf-to-dcp's --max-file-size
ReadRows = Callable[[str, int, int, "torch.Tensor | None"], torch.Tensor]
# a data file's item: (fqn, its chunk's offsets, MetadataIndex.index, where it starts in the file, length)
Item = tuple[str, tuple[int, ...], "int | None", int, int]


@dataclass(frozen=True)
class Resumed:
    """`--resume`: the data files kept from an interrupted run, and what records each file written."""

    kept: dict[str, tuple[Item, ...]]
    """{file name: its items, as its record says}: the file is not written again (nor its rows read)."""
    record: Callable[[str, int, int, list[Item]], None]
    """record(name, size, CRC-32, items) of a data file once written whole (and fsynced)."""
    reused: set[str] = field(default_factory=set)
    """The kept files whose write results were made from their records (the others were written again)."""
    sized: dict[str, int] = field(default_factory=dict)
    """In object storage, {file name: its size} of the kept objects, which have no records: each item's
    place is computed from torch's plan (`_sized_results`), the file kept when they add up to its size."""


def write_dcp(
    directory: Path,
    state_dict: dict[str, Any],
    read_rows: ReadRows,
    raw_items: dict[str, bytes],
    on_bytes: Callable[[int], None] = lambda n: None,
    fsync: bool = True,
    store: ObjectStore | None = None,
    resumed: Resumed | None = None,
    file_bytes: int = DEFAULT_FILE_BYTES,
) -> None:
    """Collective: `dcp.save` the `state_dict` of meta tensors / meta-backed DTensors into `directory`.

    When a chunk is written, `read_rows(fqn, lo, hi, scratch)` returns rows [lo, hi) of that tensor in its
    output dtype, in the bytes of `scratch` (a writer thread's reused slab buffer) when they fit, or in a
    tensor of its own; the result is used before the next call. Non-tensor items are torch.save'd by DCP,
    except those in `raw_items`, whose original torch.save bytes are written verbatim.
    CKPTCONV_WRITE_THREADS (default 2) files per rank are written at once, each of about `file_bytes` at
    most (`bins`).
    `fsync` (torch's default, and ckptconv's): each writer thread fsyncs each data file as soon as it is
    written, before `dcp.save` gathers the results and writes `.metadata` (which torch fsyncs too); the
    directory entries are `outdir`'s to fsync. `--no-fsync` turns it off for scratch work.
    `store`: an OUT in object storage (`directory` a URL), which takes the data files as uploads.
    `resumed` (`--resume`): the data files kept (their write results made from their records, not written)
    and the record of each file written.
    """
    threads = write_threads()
    single = not (dist.is_available() and dist.is_initialized())
    writer = _RecordWriter(directory, threads, read_rows, raw_items, on_bytes, store, resumed, file_bytes)
    writer.sync_files = fsync
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(state_dict, storage_writer=writer, no_dist=single)
    except BaseException as e:
        error = _one_error(e, writer.failed, directory)
        if error is None:
            raise
        raise error from None


def write_threads() -> int:
    """CKPTCONV_WRITE_THREADS: the data files each rank writes at once (and so writes at most)."""
    return env_int("CKPTCONV_WRITE_THREADS", 2, maximum=256)


def _one_error(e: BaseException, failed: OSError | None, directory: Path) -> BaseException | None:
    """The one-line error for what stopped `dcp.save` on any rank (the same on every rank), the interrupt
    itself, or None for a bug. dcp.save wraps what `write_data` or `finish` raised, on any rank, into a
    CheckpointException (a BaseException) that every rank raises, with each failed rank's exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    failures: list[tuple[int, BaseException]] = [(-1, failed)] if failed is not None else []
    if isinstance(e, CheckpointException):
        failures += [(rank, exc) for rank, (exc, _) in sorted(e.failures.items())]
    else:
        failures.append((-1, e))
    # every rank raises the same CheckpointException: rank 0 alone prints it
    agreed = isinstance(e, CheckpointException) and dist.is_initialized()
    for rank, exc in failures:
        if isinstance(exc, _Stopped):  # a writer thread another failure stopped: that one is said
            continue
        prefix = f"rank {rank}: " if rank >= 0 and dist.is_initialized() and dist.get_rank() != rank else ""
        if isinstance(exc, KeyboardInterrupt):
            return exc
        if isinstance(exc, CkptconvError):
            return CkptconvError(prefix + str(exc), exit_code=exc.exit_code, agreed=agreed)
        if isinstance(exc, OSError):
            where = exc.filename or directory
            return CkptconvError(
                f"{prefix}{where}: cannot write ({exc.strerror}); check free space and permissions",
                agreed=agreed,
            )
    return None


def _rows(item: Any) -> tuple[int, int]:
    """The row range [lo, hi) a tensor write item covers (0-d: (0, 1))."""
    chunk = item.tensor_data.chunk
    if not len(chunk.sizes):
        return 0, 1
    return int(chunk.offsets[0]), int(chunk.offsets[0]) + int(chunk.sizes[0])


def _nbytes(item: Any) -> int:
    n = item.tensor_data.properties.dtype.itemsize
    for size in item.tensor_data.chunk.sizes:
        n *= int(size)
    return n


def file_count(nbytes: int, tensors: int, threads: int, file_bytes: int) -> int:
    """How many files a rank's `tensors` items of `nbytes` in all go into: about `file_bytes` each, at least
    one per writer thread, at most one per item (however small `file_bytes`)."""
    return min(max(1, threads, -(-nbytes // file_bytes)), max(1, threads, tensors))


def bins(items: list[Any], threads: int, file_bytes: int) -> list[list[Any]]:
    """Split write items over `file_count` files: tensors largest first onto the lightest file (a file is
    then at most `file_bytes` plus one chunk), then the other items round robin; empty files dropped."""
    tensors = sorted((i for i in items if i.tensor_data is not None), key=_nbytes, reverse=True)
    count = file_count(sum(map(_nbytes, tensors)), len(tensors), threads, file_bytes)
    out: list[list[Any]] = [[] for _ in range(count)]
    loads = [0] * len(out)
    for item in tensors:
        k = loads.index(min(loads))
        out[k].append(item)
        loads[k] += _nbytes(item)
    for k, item in enumerate(i for i in items if i.tensor_data is None):
        out[k % len(out)].append(item)
    return [b for b in out if b]


class _RecordWriter(FileSystemWriter):
    """FileSystemWriter whose `write_data` streams torch.save records (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        threads: int,
        read_rows: ReadRows,
        raw_items: dict[str, bytes],
        on_bytes: Callable[[int], None],
        store: ObjectStore | None,
        resumed: Resumed | None = None,
        file_bytes: int = DEFAULT_FILE_BYTES,
    ) -> None:
        # object storage: data files streamed to the URL, torch's `.metadata` left in the run's local
        # directory for the store to upload last
        self.store = store
        local = store.local_dir() if store is not None else directory
        super().__init__(str(local), thread_count=threads)
        self.directory, self.read_rows, self.raw_items = directory, read_rows, raw_items
        self.on_bytes = on_bytes
        self.scratch = threading.local()  # each writer thread's slab buffer
        self.failed: OSError | None = None  # the first write error, reported as such by write_dcp
        self.resumed = resumed
        self.file_bytes = file_bytes
        self.stop = threading.Event()  # on a signal or a failure: each writer thread stops at its next slab
        self.first: BaseException | None = None  # the first failure of a writer thread (not a `_Stopped`)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """torch's: `.metadata` (through `.metadata.tmp`), on rank 0; a write error names the file."""
        try:
            super().finish(metadata, results)
        except OSError as e:
            if e.filename is None:
                e.filename = str(self.directory / ".metadata")
            raise

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        files = bins(plan.items, self.thread_count, self.file_bytes)
        named = [(f"{plan.storage_data.prefix}{k}.distcp", items) for k, items in enumerate(files)]
        pool = ThreadPoolExecutor(max(1, min(self.thread_count, len(files))))
        try:  # the files in order, `thread_count` at a time, until one fails
            futures = [pool.submit(self._write_file, name, items, planner) for name, items in named]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f.exception() for f in futures if f.done() and f.exception()), None)
            if failed is not None:  # the failure that stopped the others, not a thread it stopped
                raise self.first or failed
        except BaseException:
            self.stop.set()  # the threads stop at their next slab, the files not begun are not begun
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()
        done = [f.result() for f in futures]
        future: Future[list[WriteResult]] = Future()
        future.set_result([r for results in done for r in results])
        return future

    def _write_file(self, name: str, items: list[Any], planner: Any) -> list[WriteResult]:
        kept = self._kept(name, items, planner)
        if kept is not None:
            assert self.resumed is not None
            self.resumed.reused.add(name)
            self.on_bytes(sum(_nbytes(i) for i in items if i.tensor_data is not None))
            return kept
        if self.stop.is_set():  # another file failed: this one is not begun
            raise _Stopped
        try:
            return self._write_items(self.directory / name, name, items, planner)
        except BaseException as e:
            if self.first is None and not isinstance(e, _Stopped):
                self.first = e  # (before `stop`: every `_Stopped` comes after it)
            self.stop.set()  # before this thread takes the next file
            if isinstance(e, OSError):
                if e.filename is None:
                    e.filename = str(self.directory / name)
                self.failed = self.failed or e
            raise

    def _kept(self, name: str, items: list[Any], planner: Any) -> list[WriteResult] | None:
        """The write results of `name` when --resume keeps it (from its record, or in object storage from
        its size), else None: it is written."""
        if self.resumed is None:
            return None
        if name in self.resumed.sized:
            return _sized_results(name, items, self.resumed.sized[name], self._byte_sizes(items, planner))
        return _kept_results(name, items, self.resumed.kept.get(name))

    def _byte_sizes(self, items: list[Any], planner: Any) -> dict[str, int]:
        """{fqn: length} of the non-tensor items, as `_write_items` writes them."""
        out = {}
        for item in items:
            if item.tensor_data is None:
                raw = self.raw_items.get(item.index.fqn)
                out[item.index.fqn] = len(raw if raw is not None else planner.resolve_data(item).getbuffer())
        return out

    def _write_items(self, path: Path, name: str, items: list[Any], planner: Any) -> list[WriteResult]:
        results = []
        f: Any
        sink = self.store.whole(path) if self.store is not None else None
        recording = self.resumed is not None and self.store is None  # (in object storage the uploads are
        # the records: nothing to checksum)
        with sink if sink is not None else open(path, "wb") as opened:
            f = _Crc32Writer(opened) if recording else opened
            for item in items:
                offset = f.tell()
                if item.tensor_data is None:
                    raw = self.raw_items.get(item.index.fqn)
                    data = raw if raw is not None else planner.resolve_data(item).getbuffer()
                    f.write(data)
                else:
                    self._write_tensor(f, item)
                length = f.tell() - offset
                results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
            if self.sync_files and self.store is None:
                f.flush()
                os.fsync(f.fileno())
            size = f.tell()
        if recording:  # closed (and fsynced): its bytes are on the device
            assert self.resumed is not None
            crc = f.crc if f.exact else _file_crc(path)
            self.resumed.record(name, size, crc, [_item(r) for r in results])
        return results

    def _write_tensor(self, f: BinaryIO, item: Any) -> None:
        fqn, dtype = item.index.fqn, item.tensor_data.properties.dtype
        shape = tuple(int(s) for s in item.tensor_data.chunk.sizes)
        lo, hi = _rows(item)
        if fast_path(_nbytes(item)):
            write_tensor_record(f, dtype, shape, self._slabs(fqn, lo, hi, _nbytes(item)))
        else:  # 4 GiB and more: torch.save's zip64 layout, the chunk whole in memory (a stop waits for it)
            if self.stop.is_set():
                raise _Stopped
            tensor = self.read_rows(fqn, lo, hi, None)
            torch.save(tensor, f)
            self.on_bytes(_nbytes(item))

    def _slabs(self, fqn: str, lo: int, hi: int, nbytes: int) -> Iterator[memoryview]:
        if hi == lo or nbytes == 0:
            return
        step = max(1, SLAB_BYTES * (hi - lo) // nbytes)
        scratch = getattr(self.scratch, "buffer", None)
        if scratch is None:
            scratch = self.scratch.buffer = torch.empty(SLAB_BYTES, dtype=torch.uint8)
        for a in range(lo, hi, step):
            if self.stop.is_set():
                raise _Stopped
            slab = self.read_rows(fqn, a, min(hi, a + step), scratch)
            yield byte_view(slab)
            self.on_bytes(slab.numel() * slab.element_size())
            del slab


class _Stopped(Exception):
    """A writer thread stopped by `_RecordWriter.stop` (the run is unwinding from another error)."""


def _item(r: WriteResult) -> Item:
    """A write result as its record keeps it."""
    info = r.storage_data
    return (r.index.fqn, tuple(int(o) for o in r.index.offset or ()), r.index.index, info.offset, info.length)


def _kept_results(name: str, items: list[Any], recorded: tuple[Item, ...] | None) -> list[WriteResult] | None:
    """The write results of the kept file `name` made from its record, when it holds exactly these items
    (torch's plan's, in order) laid out end to end; else None: the file is written again."""
    if recorded is None or len(recorded) != len(items):
        return None
    results, at = [], 0
    for item, (fqn, offsets, index, start, length) in zip(items, recorded, strict=True):
        ours = (item.index.fqn, tuple(int(o) for o in item.index.offset or ()), item.index.index)
        if ours != (fqn, offsets, index) or start != at:
            return None
        results.append(WriteResult(item.index, length, _StorageInfo(name, start, length)))
        at += length
    return results


def _sized_results(
    name: str, items: list[Any], size: int, byte_sizes: dict[str, int]
) -> list[WriteResult] | None:
    """The write results of the kept object `name` of `size` bytes, each item's length computed as it
    would be written (a tensor's record: `record_size`; a non-tensor item: `byte_sizes`), end to end; None
    where they do not add up to `size`, or a chunk takes torch.save's own (zip64) path: written again."""
    results, at = [], 0
    for item in items:
        if item.tensor_data is None:
            length = byte_sizes[item.index.fqn]
        else:
            if not fast_path(_nbytes(item)):
                return None
            shape = tuple(int(s) for s in item.tensor_data.chunk.sizes)
            length = record_size(item.tensor_data.properties.dtype, shape)
        results.append(WriteResult(item.index, length, _StorageInfo(name, at, length)))
        at += length
    return results if at == size else None


def _file_crc(path: Path) -> int:
    """The CRC-32 of a file, read back (a record written by torch.save, which may seek)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(SLAB_BYTES):
            crc = crc32(chunk, crc)
    return crc


class _Crc32Writer:
    """A binary file that keeps the CRC-32 of what is written through it (`crc`), from the bytes in memory;
    `exact` turns False when anything but write, tell, flush or fileno is used (torch.save's zip64 writer
    may seek: the file is then read back)."""

    def __init__(self, f: Any) -> None:
        self._f, self.crc, self.exact = f, 0, True

    def write(self, data: Any) -> int:
        self.crc = crc32(data, self.crc)
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def __getattr__(self, name: str) -> Any:
        self.exact = False
        return getattr(self._f, name)
