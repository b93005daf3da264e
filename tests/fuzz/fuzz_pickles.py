"""Hypothesis strategies for pickles written opcode by opcode: DCP `.metadata` records, Megatron's `common.pt`
and non-tensor items, with memo reuse, shared references, deep nesting and allowlisted constructors given odd
arguments (tests/fuzz/fuzz_torchsave.py puts them in torch.save's zip container).

A pickle here is a little program: values built one after another, each memoized, later ones taking earlier
ones by memo reference (so a value can be shared, or doubled 60 times into a DAG of 2**60 paths in a few
hundred bytes), then a top-level value of the shape its reader expects (a DCP `Metadata`, a dict of common
state, any item). The payload globals (os.system, builtins.eval) only ever touch a file named `fuzz-pwned` in
the working directory, which the oracle's snapshot would show.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

from fuzz_oracle import mostly
from hypothesis import strategies as st

DCP_MD = "torch.distributed.checkpoint.metadata"
DCP_FS = "torch.distributed.checkpoint.filesystem"
PAYLOADS = [("os", "system"), ("posix", "system"), ("builtins", "eval"), ("subprocess", "getoutput")]
PAYLOAD_ARGS = {"eval": "open('fuzz-pwned', 'w')"}
DTYPES = ["float32", "bfloat16", "float16", "int64", "int8", "bool", "float8_e4m3fn", "complex64", "uint16"]
INTS = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    255,
    2**31 - 1,
    2**31,
    2**32,
    2**40,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    -1,
    -(2**63),
]
FLOATS = [0.0, -0.0, 1.5, 1e308, math.inf, -math.inf, math.nan, 5e-324]
STRINGS = ["", "a", "model.w", "step", "__0_0.distcp", "../x", "/etc/hostname", "é", "\udc00", "a.b.c"]
COMMON = [
    ("argparse", "Namespace"),
    ("types", "SimpleNamespace"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("torch", "Size"),
    ("builtins", "getattr"),
    ("__builtin__", "getattr"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("megatron.core.enums", "ModelType"),
    ("builtins", "set"),
    ("builtins", "bytearray"),
    ("_codecs", "encode"),
    ("torch", "FloatStorage"),
    ("torch", "device"),
    ("copyreg", "_reconstructor"),
]
# allowlisted constructors whose result grows with their argument: torch.Size (a tuple) of a string's
# characters, an OrderedDict (a dict) of a list of pairs; each call builds it anew
AMPLIFIERS = [("torch", "Size"), ("collections", "OrderedDict")]
METADATA = [
    (DCP_MD, "Metadata"),
    (DCP_MD, "TensorStorageMetadata"),
    (DCP_MD, "ChunkStorageMetadata"),
    (DCP_MD, "BytesStorageMetadata"),
    (DCP_MD, "TensorProperties"),
    (DCP_MD, "MetadataIndex"),
    (DCP_MD, "StorageMeta"),
    (DCP_MD, "_MEM_FORMAT_ENCODING"),
    (DCP_FS, "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "getattr"),
    ("torch", "Size"),
    ("torch", "float32"),
    ("torch", "uint16"),
]


class Asm:
    """Pickle opcodes, appended; `memo()` memoizes the top of the stack and returns its memo index."""

    def __init__(self, proto: int) -> None:
        self.proto = proto
        self.out = bytearray(b"\x80" + bytes([proto]))
        self.n = 0

    def op(self, code: bytes) -> Asm:
        self.out += code
        return self

    def memo(self) -> int:
        if self.proto >= 4:
            self.out += b"\x94"
        elif self.n < 256:
            self.out += b"q" + bytes([self.n])
        else:
            self.out += b"r" + struct.pack("<I", self.n)
        self.n += 1
        return self.n - 1

    def get(self, i: int) -> Asm:
        self.out += (b"h" + bytes([i])) if i < 256 else (b"j" + struct.pack("<I", i))
        return self

    def int(self, v: int) -> Asm:
        if 0 <= v < 256:
            return self.op(b"K" + bytes([v]))
        if -(2**31) <= v < 2**31:
            return self.op(b"J" + struct.pack("<i", v))
        raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
        return self.op(b"\x8a" + bytes([len(raw)]) + raw)

    def float(self, v: float) -> Asm:
        return self.op(b"G" + struct.pack(">d", v))

    def str(self, s: str) -> Asm:
        raw = s.encode("utf-8", "surrogatepass")
        if len(raw) < 256:
            return self.op(b"\x8c" + bytes([len(raw)]) + raw) if self.proto >= 4 else self._long_str(raw)
        return self._long_str(raw)

    def _long_str(self, raw: bytes) -> Asm:
        return self.op(b"X" + struct.pack("<I", len(raw)) + raw)

    def bytes(self, b: bytes) -> Asm:
        if self.proto < 3:  # protocol 2 has no bytes opcodes: _codecs.encode, as pickle itself does
            return self.glob("_codecs", "encode").str(b.decode("latin1")).str("latin1").op(b"\x86R")
        return self.op((b"C" + bytes([len(b)]) if len(b) < 256 else b"B" + struct.pack("<I", len(b))) + b)

    def glob(self, module: str, name: str) -> Asm:
        if self.proto >= 4:
            return self.str(module).str(name).op(b"\x93")
        return self.op(f"c{module}\n{name}\n".encode("utf-8", "surrogatepass"))

    def mark(self) -> Asm:
        return self.op(b"(")

    def done(self) -> bytes:
        return bytes(self.out + b".")


# -- programs: values built one after another, each memoized ----------------------------------------------

LEAVES = st.one_of(
    st.sampled_from(INTS).map(lambda v: ("int", v)),
    st.sampled_from(FLOATS).map(lambda v: ("float", v)),
    st.sampled_from(STRINGS).map(lambda v: ("str", v)),
    st.sampled_from([1000, 100_000]).map(lambda n: ("str", "x" * n)),
    st.sampled_from([b"", b"\0" * 8, b"\xff" * 300]).map(lambda v: ("bytes", v)),
    st.sampled_from([None, True, False]).map(lambda v: ("const", v)),
)


def emit_leaf(a: Asm, leaf: tuple[str, Any]) -> None:
    kind, v = leaf
    if kind == "int":
        a.int(v)
    elif kind == "float":
        a.float(v)
    elif kind == "str":
        a.str(v)
    elif kind == "bytes":
        a.bytes(v)
    else:
        a.op({None: b"N", True: b"\x88", False: b"\x89"}[v])


@st.composite
def program(draw: st.DrawFn, a: Asm, pool: list[tuple[str, str]], steps: int = 8) -> list[int]:
    """Emit up to `steps` memoized values into `a`; their memo indices (the stack is left empty)."""
    made: list[int] = []
    first = draw(mostly(None, [None, "amplify", "double"]))  # the bombs, before any call that may fail
    for step in range(draw(st.integers(1, steps))):
        ref = st.sampled_from(made) if made else st.nothing()
        kinds = [
            "leaf",
            "leaf",
            "seq",
            "seq",
            "double",
            "nest",
            "call",
            "obj",
            "repeat",
            "amplify",
            "payload",
        ]
        kind = first if step == 0 and first else draw(st.sampled_from(kinds))
        if kind == "leaf" or (not made and kind in ("seq", "repeat")):
            emit_leaf(a, draw(LEAVES))
        elif kind == "seq":
            items = draw(st.lists(ref, max_size=5))
            shape = draw(st.sampled_from(["list", "tuple", "dict"]))
            a.op(b"}(" if shape == "dict" else b"(")
            for n, i in enumerate(items):
                if shape == "dict":
                    a.str(draw(st.sampled_from(["a", "", "a", str(n)])))
                a.get(i)
            a.op({"list": b"l", "tuple": b"t", "dict": b"u"}[shape])
        elif kind == "double":  # [x, x], [[x, x], [x, x]], ...: 2**depth paths in 5 bytes a level
            depth = draw(st.sampled_from([3, 20, 64]))
            if made:
                top = draw(ref)
            else:
                emit_leaf(a, draw(LEAVES))
                top = a.memo()
                a.op(b"0")
            for _ in range(depth):
                a.op(b"(").get(top).get(top).op(draw(st.sampled_from([b"l", b"t"])))
                top = a.memo()
                a.op(b"0")
            a.get(top)
        elif kind == "nest":  # [[[...]]]: two bytes a level
            depth = draw(st.sampled_from([50, 990, 5000, 100_000]))
            a.op(b"(" * depth + draw(st.sampled_from([b"l", b"t"])) * depth)
        elif kind == "amplify":  # one memoized argument fed to an allowlisted constructor again and again
            big = step == 0 or draw(st.booleans())
            g = draw(st.sampled_from([g for g in pool if g in AMPLIFIERS] or pool))
            if g == ("collections", "OrderedDict"):  # a list of 10000 pairs
                a.op(b"(")
                for i in range(10_000 if big else 10):
                    a.int(i).int(i).op(b"\x86")
                a.op(b"l")
            else:
                a.str("x" * (100_000 if big else 1000))
            sm = a.memo()
            a.op(b"0").glob(*g)
            gm = a.memo()
            a.op(b"0(")
            for _ in range(20_000 if big else 10):
                a.get(gm).get(sm).op(b"\x85R")
            a.op(b"l")
        elif kind in ("call", "obj", "repeat"):
            g = draw(st.sampled_from(pool))
            a.glob(*g)
            gm = a.memo()
            a.op(b"0")
            args = draw(st.lists(st.one_of(ref, LEAVES), max_size=3))
            _args(a, args)
            am = a.memo()
            a.op(b"0")
            times = draw(st.sampled_from([1, 1000, 20_000])) if kind == "repeat" else 1
            if times > 1:
                a.mark()
            for _ in range(times):
                a.get(gm).get(am).op(b"\x81" if kind == "obj" else b"R")
                if kind == "obj" and made:
                    a.get(draw(ref)).op(b"b")
            if times > 1:
                a.op(b"l")
        else:
            g = draw(st.sampled_from(PAYLOADS))
            a.glob(*g).str(PAYLOAD_ARGS.get(g[1], "touch fuzz-pwned")).op(b"\x85R")
        made.append(a.memo())
        a.op(b"0")
    return made


def _args(a: Asm, args: list[Any]) -> None:
    a.mark()
    for x in args:
        a.get(x) if isinstance(x, int) else emit_leaf(a, x)
    a.op(b"t")


# -- DCP `.metadata` -----------------------------------------------------------------------------------------


class _Records:
    """DCP's metadata records emitted opcode by opcode, any field sometimes a program value instead."""

    def __init__(self, draw: st.DrawFn, a: Asm, made: list[int]) -> None:
        self.draw, self.a, self.made = draw, a, made
        self.chunk: int | None = None  # a chunk record's memo index, to reuse

    def odd(self) -> bool:
        return self.draw(st.integers(0, 15)) == 0

    def size(self, ndim: int) -> None:
        if self.odd():
            self.a.get(self.draw(st.sampled_from(self.made)))
            return
        self.a.glob("torch", "Size").mark()
        for d in self.draw(st.lists(st.sampled_from(INTS), min_size=ndim, max_size=ndim)):
            self.a.int(d)
        self.a.op(b"t\x85R")

    def record(self, module: str, name: str, state: dict[str, Any]) -> None:
        """NEWOBJ of the class, BUILD with {field: value} (a value: a callable emitting it)."""
        a = self.a
        a.glob(module, name).op(b")\x81}(")
        for key, emit in state.items():
            a.str(key)
            a.get(self.draw(st.sampled_from(self.made))) if self.odd() else emit()
        a.op(b"ub")

    def properties(self) -> None:
        a = self.a
        a.glob(DCP_MD, "TensorProperties").op(b")\x81(").glob("torch", self.draw(st.sampled_from(DTYPES)))
        a.glob("torch.serialization", "_get_layout").str("torch.strided").op(b"\x85R\x89")
        a.glob(DCP_MD, "_MEM_FORMAT_ENCODING").int(self.draw(st.sampled_from([0, 1, 7]))).op(b"\x85R\x89tb")

    def chunks(self, ndim: int) -> None:
        self.a.op(b"](")
        for _ in range(self.draw(st.sampled_from([0, 1, 2, 3, 500]))):
            if self.chunk is not None and self.draw(st.integers(0, 9)) == 0:
                self.a.get(self.chunk)  # the same chunk record twice
                continue
            sizes = functools.partial(self.size, ndim)
            self.record(DCP_MD, "ChunkStorageMetadata", {"offsets": sizes, "sizes": sizes})
            self.chunk = self.a.memo()
        self.a.op(b"e")

    def tensor(self, ndim: int) -> None:
        state = {
            "properties": self.properties,
            "size": functools.partial(self.size, ndim),
            "chunks": functools.partial(self.chunks, ndim),
        }
        self.record(DCP_MD, "TensorStorageMetadata", state)

    def storage(self, fqn: str, ndim: int) -> None:
        a, draw = self.a, self.draw
        offset = functools.partial(a.op, b"N") if fqn == "step" else functools.partial(self.size, ndim)
        self.record(DCP_MD, "MetadataIndex", {"fqn": functools.partial(a.str, fqn), "offset": offset})
        path = draw(st.sampled_from(["__0_0.distcp", "", "../x", ".metadata", "/etc/hostname"]))
        where = {
            "relative_path": functools.partial(a.str, path),
            "offset": functools.partial(a.int, draw(st.sampled_from(INTS))),
            "length": functools.partial(a.int, draw(st.sampled_from(INTS))),
        }
        self.record(DCP_FS, "_StorageInfo", where)


@st.composite
def metadata_pickles(draw: st.DrawFn) -> bytes:
    """A `Metadata` whose records (tensors, chunks, index, storage) are built opcode by opcode from
    hypothesis' sizes, with any field swapped for a program value (shared, doubled, nested, a call)."""
    a = Asm(draw(mostly(4, [2])))
    made = draw(program(a, [*METADATA, PAYLOADS[0]], steps=draw(st.sampled_from([1, 6]))))
    r = _Records(draw, a, made)
    if draw(st.integers(0, 9)) == 0:  # not a Metadata at all
        a.get(draw(st.sampled_from(made)))
        return a.done()
    a.glob(DCP_MD, "Metadata").op(b")\x81}(")
    a.str("state_dict_metadata").op(b"}(")
    for fqn in draw(st.lists(st.sampled_from(["model.w", "model.v", "step", "", "model.w"]), max_size=3)):
        a.str(fqn)
        r.record(DCP_MD, "BytesStorageMetadata", {}) if fqn == "step" else r.tensor(draw(st.integers(0, 3)))
    a.op(b"u")
    a.str("storage_data").op(b"}(")
    for fqn in draw(st.lists(st.sampled_from(["model.w", "model.v", "step", ""]), max_size=4)):
        r.storage(fqn, draw(st.integers(0, 3)))
    a.op(b"u")
    a.str("planner_data")
    a.get(draw(st.sampled_from(made))) if draw(st.booleans()) else a.op(b"N")
    a.str("version").str("1.0.0").op(b"ub")
    return a.done()


# -- common.pt and non-tensor items --------------------------------------------------------------------------


@st.composite
def state_pickles(draw: st.DrawFn, pool: list[tuple[str, str]], top_dict: bool) -> bytes:
    """A protocol-2 pickle (as torch.save writes) of a dict of string keys (Megatron's common state) or of
    any value (a non-tensor item), made of a program's values; tensors' storages are persistent ids "0"-"3"
    (the container holds their records)."""
    a = Asm(2)
    made = draw(program(a, pool, steps=8))
    tensors = draw(st.integers(0, 2))
    for _ in range(tensors):  # torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, {})
        a.glob("torch._utils", "_rebuild_tensor_v2").mark()
        a.mark().str("storage").glob(
            "torch", draw(st.sampled_from(["FloatStorage", "LongStorage", "BadStorage"]))
        )
        a.str(draw(st.sampled_from(["0", "1", "3", "9"]))).str("cpu").int(
            draw(st.sampled_from([*INTS[:6], 2**40]))
        )
        a.op(b"tQ")
        a.int(draw(st.sampled_from([0, 1, 2**40, -1])))
        for _ in range(2):
            a.mark()
            for d in draw(st.lists(st.sampled_from([*INTS[:8], 2**40, -1]), max_size=3)):
                a.int(d)
            a.op(b"t")
        a.op(b"\x89").glob("collections", "OrderedDict").op(b")R")
        a.op(b"tR")
        made.append(a.memo())
        a.op(b"0")
    if not top_dict:
        a.get(draw(st.sampled_from(made)))
        return a.done()
    a.op(b"}").mark()
    keys = ["iteration", "args", "checkpoint_version", "optimizer", "rng_state", "", "args"]
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=5)):
        a.str(key).get(draw(st.sampled_from(made)))
    a.op(b"u")
    return a.done()
