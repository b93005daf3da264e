"""Limits on the work of every reader of pickles, zips, JSON and TOML: depth, objects built, bytes inflated.

A file of a few hundred bytes can describe gigabytes: pickle's memo lets one object be referenced, or fed to
a constructor, any number of times (a list of two references to the list before it, forty times over, is a
tree of 2^40 leaves to anything that walks it); a zip entry inflates a thousandfold; nesting a thousand levels
deep stops a recursive reader. So each read of a file carries a `Budget`, charged as the reader goes (never
after the fact, when the memory is already spent):

    depth     levels of nesting a walk of a value, or a JSON / TOML document, may go down
    objects   objects a reader builds or visits beyond what the file's own bytes bound: elements copied
              by a constructor, nodes of a walk (a shared node once per reference), JSON and TOML
              containers and strings
    bytes     bytes inflated from a zip entry, or built by joining (paths, names), from one file

Objects a pickle's opcodes make themselves are not counted: an opcode makes at most one object and takes at
least one byte, so a file's size bounds them. The defaults are far above what real checkpoints, configs
and mapping files need (a 1 TB checkpoint's 143 MB `.metadata` charges almost nothing); each can be raised
with its environment variable when a genuine file needs more.
"""

from __future__ import annotations

import functools
import os

from ckptconv.errors import CkptconvError
from ckptconv.job.env import env_int

MAX_DEPTH = 100  # nesting levels (HF configs nest 3 deep, Megatron's args 5; safetensors allows 127)
MAX_OBJECTS = 2_000_000  # objects built or visited beyond the file's own opcodes, per file
MAX_BYTES = 256 * 2**20  # bytes inflated or joined, per file
MAX_RECORD_FIELDS = 64  # fields of one unpickled record's state (DCP's records have at most 6)
MAX_DIMS = 64  # dimensions of a tensor shape, offset or stride in a pickle
MAX_INT_BITS = 4096  # an int a JSON document can hold: Python prints at most 4300 digits (14,000 bits)

VARIABLES = {
    "depth": ("CKPTCONV_READ_DEPTH", MAX_DEPTH, "levels of nesting"),
    "objects": ("CKPTCONV_READ_OBJECTS", MAX_OBJECTS, "objects built"),
    "bytes": ("CKPTCONV_READ_BYTES", MAX_BYTES, "bytes inflated"),
}


def limit(kind: str) -> int:
    """The limit of `kind` ("depth", "objects", "bytes"): its environment variable, or the default."""
    name, default, _ = VARIABLES[kind]
    return _parsed(name, default, os.environ.get(name, ""))


@functools.lru_cache(maxsize=32)
def _parsed(name: str, default: int, raw: str) -> int:
    """The limit `raw` sets, parsed once per value (a budget is made per chunk read)."""
    return env_int(name, default, maximum=2**62)


class LimitExceeded(CkptconvError):
    """A reader went past one of the limits: the file is hostile, or bigger than any seen so far."""


def exceeded(where: object, kind: str, limit_value: int, what: str = "") -> LimitExceeded:
    name, _, unit = VARIABLES[kind]
    return LimitExceeded(
        f"{where}: more than {limit_value} {unit} reading it{f' ({what})' if what else ''}, a limit against "
        f"hostile files; if the file is genuine, set {name} to a larger number"
    )


class Budget:
    """What one read of one file (`where`, named in the error) may still build; each charge checks at once."""

    __slots__ = ("_bytes", "_max_bytes", "_max_objects", "_objects", "depth", "where")

    def __init__(self, where: object) -> None:
        self.where = where
        self.depth = limit("depth")
        self._max_objects = self._objects = limit("objects")
        self._max_bytes = self._bytes = limit("bytes")

    def objects(self, n: int = 1, what: str = "") -> None:
        self._objects -= n
        if self._objects < 0:
            raise exceeded(self.where, "objects", self._max_objects, what)

    def bytes(self, n: int, what: str = "") -> None:
        self._bytes -= n
        if self._bytes < 0:
            raise exceeded(self.where, "bytes", self._max_bytes, what)

    def objects_left(self) -> int:
        return max(0, self._objects)

    def bytes_left(self) -> int:
        return max(0, self._bytes)

    def nested(self, level: int, what: str = "") -> None:
        """Refuse a walk or a document that has gone down to `level`, past the depth limit."""
        if level > self.depth:
            raise exceeded(self.where, "depth", self.depth, what)


def size_of(value: object) -> int:
    """How many elements a constructor given `value` may copy: its length, 1 when it has none."""
    try:
        return len(value)  # type: ignore[arg-type]
    except TypeError:
        return 1


def check_all() -> None:
    """Validate the variables (called with the other CKPTCONV_* checks, before any work)."""
    for kind in VARIABLES:
        limit(kind)
