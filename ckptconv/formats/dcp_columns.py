"""DCP `.metadata` unpickled into columns: a million chunk records without a million objects.

At 1 TB a `.metadata` holds about a million chunks, each a `ChunkStorageMetadata` in its tensor's list and a
`MetadataIndex -> _StorageInfo` entry of the storage index. Loaded as objects, even plain stand-ins, each is
an instance, a dict and tuples, and pickle's memo keeps every one of them alive to the end of the load: about
1.9 KB a chunk. Here those three classes load into one *sink* each instead. NEWOBJ gives the sink itself (no
instance is made), BUILD hands it the record's state, whose fields go into columns (ints into arrays), and
the state is cleared (the memo then keeps an empty dict). A chunk's or an index record's BUILD is a C call
(`list.append` of its state: no Python frame for a million of them); the `TensorStorageMetadata` built right
after a chunk list holding the sink N times takes the N chunk states built since the last tensor, in one
pass, and each `_StorageInfo` takes the index state built just before it: the storage index's keys and
values alternate in the stream (key, value, key, value). A state stays uncleared only until then; a stream
editing it in between (a memo reference, then SETITEMS) sets the values it could have written in the first
place, and every value is checked after the load as before.

    chunk rows    offsets[i], sizes[i]            one per ChunkStorageMetadata (a tensor's rows: its `rows`)
    index rows    fqns[j], index_offsets[j]       one per MetadataIndex (offset None: a non-tensor item)
    storage rows  key[k] (its index row j), paths[k], starts[k], lengths[k], transforms.get(k)

A stream that does not have that shape is refused (an UnpicklingError), never read with rows shifted onto
another record's data: a record the stream reuses (a memo reference builds nothing), or one built where torch
never puts it. A chunk list must be its sink N times with exactly N new rows since the last tensor; a
`_StorageInfo` must come right after a new index record of its own (row `paired + 1`), with no index record
built between its making (NEWOBJ) and its state (BUILD). Megatron-Core's `all_local_plans`, saved after
the index, leaves index rows without storage and chunk rows no tensor takes: nothing reads them (its plan
records load as one object, their state dropped).

What pickle's memo could reuse to make later work grow (one tensor record under many keys, one long offsets
tuple for every chunk, one long path for every key) is checked once the stream is read, in C over the
columns, before anything walks them: `check_shapes`.
"""

from __future__ import annotations

import pickle
from array import array
from itertools import chain
from operator import itemgetter
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats import safe_pickle as sp
from ckptconv.job.limits import MAX_DEPTH, MAX_DIMS, MAX_RECORD_FIELDS, Budget, size_of


class Columns:
    """The chunk, index and storage rows of one `.metadata` (see the module's table)."""

    def __init__(self) -> None:
        self.offsets: list[Any] = []
        self.sizes: list[Any] = []
        self.fqns: list[Any] = []
        self.index_offsets: list[Any] = []
        self.key = array("q")
        self.paths: list[Any] = []
        self.starts = array("q")
        self.lengths = array("q")
        self.transforms: dict[int, Any] = {}  # storage row -> its transform descriptors, where it has any
        self.paired = -1  # the last index row given a storage row
        self.taken = 0  # chunk rows taken by tensors so far
        self.chunk_states: list[Any] = []  # the states of the chunk records built since the last tensor
        self.index_states: list[Any] = []  # the states of every index record built (rows: those made)

    def take_chunks(self) -> None:
        """Rows of the chunk states built since the last tensor, in C when each is a dict with both fields;
        the states are cleared (the memo keeps them to the end of the load: emptied, they hold nothing)."""
        states = self.chunk_states
        try:  # a state built twice (a memo reference) is refused as the first BUILD's clearing made it do
            if set(map(type, states)) - {dict} or len(set(map(id, states))) != len(states):
                raise KeyError
            offsets, sizes = list(map(_OFFSETS, states)), list(map(_SIZES, states))
        except KeyError:  # one of them is not: record by record, to refuse the first that is wrong
            for state in states:
                state = state if type(state) is dict else _state(state)
                self.offsets.append(state["offsets"])
                self.sizes.append(state["sizes"])
                state.clear()
        else:
            self.offsets += offsets
            self.sizes += sizes
            list(map(dict.clear, states))
        states.clear()

    def index_row(self, row: int) -> None:
        """The row of index record `row` (the next one without a row)."""
        state = self.index_states[row]
        if type(state) is not dict:
            state = _state(state)
        self.fqns.append(state["fqn"])
        self.index_offsets.append(state.get("offset"))
        state.clear()

    def finish(self) -> None:
        """Rows of the records nothing took (Megatron-Core's plans, after the index): nothing reads them,
        but each is refused as it was read if it is malformed."""
        self.take_chunks()
        for row in range(len(self.fqns), len(self.index_states)):
            self.index_row(row)
        self.index_states.clear()  # emptied dicts, a million of them: the memo let go of them with the load

    def locations(self) -> dict[Any, dict[Any, int]]:
        """{fqn: {offsets (None for a non-tensor item): storage row}}, keyed by the index rows' own tuples."""
        found: dict[Any, dict[Any, int]] = {}
        fqns, offsets = self.fqns, self.index_offsets
        for k, j in enumerate(self.key):
            found.setdefault(fqns[j], {})[offsets[j]] = k
        return found


_state = sp.record_state  # a BUILD state as one dict of a few fields (the (dict, slots) pair merged)
_OFFSETS, _SIZES = itemgetter("offsets"), itemgetter("sizes")


class _ChunkSink:
    """A chunk record's BUILD appends its state to `chunk_states` (a C call: no Python frame per chunk); the
    tensor built right after its chunk list turns them into rows, all at once (`Columns.take_chunks`)."""

    def __init__(self, columns: Columns) -> None:
        self.__setstate__ = columns.chunk_states.append


class _IndexSink:
    """An index record's BUILD appends its state to `index_states` (a C call); the storage record paired
    with it makes its row (`Columns.index_row`)."""

    def __init__(self, columns: Columns) -> None:
        self.__setstate__ = columns.index_states.append


class _StorageSink:
    def __init__(self, columns: Columns) -> None:
        self.columns, self.built = columns, columns.index_states
        self.key, self.paths = columns.key.append, columns.paths.append
        self.starts, self.lengths = columns.starts.append, columns.lengths.append
        self.opened = -1  # the index records built when the record being loaded was made (NEWOBJ)

    def open(self, cls: type) -> _StorageSink:
        """NEWOBJ of a `_StorageInfo`."""
        self.opened = len(self.built)
        return self

    def __setstate__(self, state: Any) -> None:
        if type(state) is not dict:
            state = _state(state)
        c = self.columns
        row = len(self.built) - 1
        if row != c.paired + 1 or self.opened != row + 1:  # its key: the index record just before it
            raise pickle.UnpicklingError("a storage entry without an index key of its own just before it")
        c.paired = row
        c.index_row(row)
        self.key(row)
        self.paths(state["relative_path"])
        self.starts(state["offset"])
        self.lengths(state["length"])
        if state.get("transform_descriptors"):
            c.transforms[len(c.paths) - 1] = _transforms(state["transform_descriptors"])
        state.clear()


def _transforms(found: Any) -> tuple[str, ...]:
    """A storage entry's transform descriptors (torch: a sequence of strings), a few short strings at most:
    an error message names them."""
    if type(found) not in (list, tuple) or len(found) > MAX_RECORD_FIELDS:
        raise pickle.UnpicklingError("malformed transform descriptors")
    if set(map(type, found)) - {str} or max(map(len, found)) > 200:
        raise pickle.UnpicklingError("malformed transform descriptors")
    return tuple(found)


class _Discard:
    """Megatron-Core's save-plan records (nothing reads them): each loads as one shared object whose
    `__setstate__` is `len`, a C call that keeps and copies nothing."""

    __setstate__ = staticmethod(len)


def _sink_class(name: str, sink: object) -> type:
    """A class for NEWOBJ whose `__new__` (a dict's `get`: no Python frame) gives `sink`."""
    made: dict[type, object] = {}
    cls = type(name, (), {"__new__": staticmethod(made.get)})
    made[cls] = sink
    return cls


def _storage_class(sink: _StorageSink) -> type:
    """`_StorageInfo`'s: NEWOBJ notes how many index rows there are (its key must be the last of them)."""
    return type("_StorageInfo", (), {"__new__": staticmethod(sink.open)})


def _tensor_class(columns: Columns, chunk: _ChunkSink) -> type:
    class TensorStorageMetadata(sp.TensorStorageMetadata):
        """A tensor's record; its chunks as `rows`, the chunk rows its list was built into."""

        rows: range

        def __setstate__(self, state: Any) -> None:
            state = dict(_state(state))
            if size_of(state.get("size")) > MAX_DIMS:
                raise pickle.UnpicklingError(f"a tensor size of more than {MAX_DIMS} dimensions")
            chunks = state.pop("chunks", None)
            if type(chunks) is not list or chunks.count(chunk) != len(chunks):
                raise pickle.UnpicklingError("a tensor's chunk list holds something else than chunks")
            if len(columns.chunk_states) != len(chunks):
                raise pickle.UnpicklingError("a tensor's chunk list reuses chunk records")
            columns.take_chunks()
            self.rows = range(columns.taken, len(columns.offsets))
            columns.taken = len(columns.offsets)
            chunks.clear()
            self.__dict__.update(state)

    return TensorStorageMetadata


def allowed(columns: Columns) -> dict[tuple[str, str], Any]:
    """The `.metadata` allowlist (safe_pickle's), with the chunk, index and storage records and the tensors
    loading into `columns`."""
    chunk = _ChunkSink(columns)
    discard = _Discard()
    return {
        **sp.METADATA_GLOBALS,
        (sp.DCP_MD, "ChunkStorageMetadata"): _sink_class("ChunkStorageMetadata", chunk),
        (sp.DCP_MD, "MetadataIndex"): _sink_class("MetadataIndex", _IndexSink(columns)),
        (sp.DCP_FS, "_StorageInfo"): _storage_class(_StorageSink(columns)),
        (sp.DCP_MD, "TensorStorageMetadata"): _tensor_class(columns, chunk),
        **{(sp.DCP_PLANNER, name): _sink_class(name, discard) for name in sp.PLAN_RECORDS},
    }


def _release(hooks: dict[tuple[str, str], Any]) -> None:
    """Unhook the classes made for one load from its sinks and columns. A class is a reference cycle of its
    own, which only the cyclic collector frees, and the runs keep it off (gcpause): a class still holding
    its sinks would keep every loaded record's tuples alive for the whole run (0.1 GiB at 1x)."""
    for cls in hooks.values():
        for name in ("__new__", "__setstate__"):
            if isinstance(cls, type) and cls.__module__ == __name__ and name in vars(cls):
                delattr(cls, name)


def load_dcp_metadata(data: bytes | sp.Readable, where: str) -> tuple[sp.Metadata, Columns]:
    """Unpickle DCP `.metadata` (its bytes, or a file read frame by frame as the unpickler goes: a 128 MB
    `.metadata` is then never held whole beside what it makes), allowing only the DCP metadata classes; the
    chunk and storage records as `Columns`."""
    columns = Columns()
    hooks = allowed(columns)
    try:
        metadata = sp.MetadataUnpickler(data, hooks, Budget(where)).load()
        columns.finish()
    except (OSError, CkptconvError):
        raise  # reading the file failed (the caller names the path and the cause), or a limit was reached
    except sp.Refused as e:
        raise CkptconvError(
            f"{where}: refusing to load: the metadata references {e}, which is not part of DCP metadata "
            "(a pickle payload or a non-standard planner); ckptconv never runs code from a checkpoint "
            "(--trust-pickle loads it anyway, for checkpoints you trust)"
        ) from None
    except Exception as e:
        raise CkptconvError(
            f"{where}: not a readable DCP metadata file ({type(e).__name__}{f': {e}' if str(e) else ''}); "
            "the checkpoint is truncated or corrupt, re-save or re-copy it"
        ) from None
    finally:
        _release(hooks)
    if not isinstance(metadata, sp.Metadata):
        raise CkptconvError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    problem = check_shapes(metadata, columns)
    if problem:
        raise CkptconvError(f"{where}: malformed DCP metadata ({problem}); re-save or re-copy the checkpoint")
    return metadata, columns


def check_shapes(metadata: sp.Metadata, columns: Columns) -> str | None:
    """What is wrong with the shape of what was loaded, or None: each tensor record under one key only (its
    chunk rows are its own), offsets and sizes of at most `MAX_DIMS` numbers, planner paths of at most
    `MAX_DEPTH` strings and numbers. Each check is a pass in C over a column."""
    for name, column, signed in (
        ("chunk offsets", columns.offsets, False),  # a negative one is refused (_int_tuples) before use
        ("chunk sizes", columns.sizes, False),
        ("index offsets", list(filter(None, columns.index_offsets)), True),  # None: a non-tensor item's
    ):
        try:
            longest = max(map(len, column), default=0)
        except TypeError:  # something else than sequences among them: the specs' checks name it
            longest = max(map(size_of, column), default=0)
        if longest > MAX_DIMS:
            return f"{name} of more than {MAX_DIMS} dimensions"
        numbers = chain.from_iterable(column)
        try:
            largest = max(map(abs, numbers) if signed else numbers, default=0)
        except TypeError:  # something else than numbers among them: the specs' checks name it
            sequences = (t for t in column if type(t) in (tuple, list))
            largest = max((abs(v) for t in sequences for v in t if type(v) is int), default=0)
        if largest >= 2**63:
            return f"{name} beyond 2^63"
    state = metadata.state_dict_metadata
    if isinstance(state, dict):
        rows = [e.rows for e in state.values() if isinstance(getattr(e, "rows", None), range)]
        if sum(map(len, rows)) > columns.taken:
            return "a tensor record stored under more than one key"
    planner = metadata.planner_data
    if isinstance(planner, dict):
        paths = [p for p in planner.values() if type(p) in (list, tuple)]
        if max(map(len, paths), default=0) > MAX_DEPTH:
            return f"a planner path of more than {MAX_DEPTH} parts"
        if set(map(type, chain.from_iterable(paths))) - {str, int}:
            return "a planner path holding something else than strings and numbers"
    return None
