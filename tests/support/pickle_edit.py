"""A torch.save file's data.pkl loaded as a tree of stand-ins (nothing of it runs), edited, and written back.

Globals load as `Global`s, each call (REDUCE, NEWOBJ) as a `Call` holding its arguments, dict items (SETITEMS)
and BUILD state, storages as `Pid`s; `dump` pickles the tree back to the same opcodes (protocol 2), so a test
can change one field of a DTensor's spec in a genuine rank file. `Raw` pickles as the bytes it holds: a
structure too deep for the pickler's recursion, spelled as opcodes.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any


class Global:
    """A global `module.name` of the pickle; calling it (REDUCE) or its `__new__` (NEWOBJ) makes a `Call`."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name
        self.__dict__["__new__"] = lambda _cls, *args: Call(self, args, newobj=True)

    def __call__(self, *args: Any) -> Call:
        return Call(self, args)


class Call:
    """`func(*args)` (or `func.__new__(func, *args)`), then its dict items and BUILD state."""

    def __init__(self, func: Global, args: tuple[Any, ...], newobj: bool = False) -> None:
        self.func, self.args, self.newobj = func, list(args), newobj
        self.items: list[tuple[Any, Any]] = []
        self.state: Any = None

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    def __setstate__(self, state: Any) -> None:
        self.state = state


class Pid:
    """A persistent id (a tensor's storage)."""

    def __init__(self, pid: Any) -> None:
        self.pid = pid


class Raw:
    """Pickles as `opcodes`, which push one object."""

    def __init__(self, opcodes: bytes) -> None:
        self.opcodes = opcodes


class _Loader(pickle._Unpickler):  # type: ignore[name-defined,misc]
    def find_class(self, module: str, name: str) -> Global:
        return Global(module, name)

    def persistent_load(self, pid: Any) -> Pid:
        return Pid(pid)


class _Dumper(pickle._Pickler):  # type: ignore[name-defined,misc]
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, Pid) else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, Raw):
            self.write(obj.opcodes)
        elif isinstance(obj, Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif isinstance(obj, Call):
            self.save(obj.func)
            self.save(tuple(obj.args))
            self.write(pickle.NEWOBJ if obj.newobj else pickle.REDUCE)
            if obj.items:
                self.write(pickle.MARK)
                for key, value in obj.items:
                    self.save(key)
                    self.save(value)
                self.write(pickle.SETITEMS)
            if obj.state is not None:
                self.save(obj.state)
                self.write(pickle.BUILD)
        else:
            super().save(obj, save_persistent_id)


def load(file: Path) -> Any:
    """The tree of `file`'s data.pkl."""
    with zipfile.ZipFile(file) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        return _Loader(io.BytesIO(z.read(name))).load()


def save(file: Path, tree: Any) -> None:
    """Rewrite `file` with `tree` as its data.pkl, every other entry as it was (stored)."""
    out = io.BytesIO()
    _Dumper(out, protocol=2).dump(tree)
    with zipfile.ZipFile(file) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as z:
        for name, raw in entries:
            z.writestr(name, out.getvalue() if name.endswith("/data.pkl") else raw)
