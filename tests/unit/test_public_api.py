"""The public API: `import ckptconv` and `--help` stay free of torch, and `__all__`, the table of lazily
imported names and the imports type checkers read agree with one another."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _env

import ckptconv

PACKAGE = Path(ckptconv.__file__).resolve().parent


def _imported(*argv: str) -> list[str]:
    """The modules a new interpreter imports to run `python -X importtime ARGV...` (which must exit 0)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        capture_output=True,
        text=True,
        env=_env(),
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # each line: "import time: SELF | CUMULATIVE | [indent]MODULE"
    lines = proc.stderr.splitlines()
    return [line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")]


def _torch(modules: list[str]) -> list[str]:
    """torch and its submodules among `modules`."""
    return [m for m in modules if m == "torch" or m.startswith("torch.")]


def test_import_ckptconv_does_not_import_torch() -> None:
    """`import ckptconv`, its `__all__`, `dir()` and `__version__` leave torch unimported (in sys.modules, and
    in what `-X importtime` lists)."""
    code = (
        "import sys, ckptconv; ckptconv.__all__; dir(ckptconv); ckptconv.__version__; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    modules = _imported("-c", "import ckptconv")
    assert "ckptconv" in modules and not _torch(modules)


@pytest.mark.parametrize(
    "argv",
    [
        # the `ckptconv` console script: its entry point, ckptconv.cli:run
        ("-c", "import sys; sys.argv[0] = 'ckptconv'; from ckptconv.cli import run; run()", "--help"),
        ("-m", "ckptconv", "--help"),
        ("-m", "ckptconv", "dcp-to-hf", "--help"),
    ],
    ids=["ckptconv --help", "python -m ckptconv --help", "python -m ckptconv dcp-to-hf --help"],
)
def test_help_does_not_import_torch(argv: tuple[str, ...]) -> None:
    """The help of the console script, of `python -m ckptconv` and of a command is printed without torch."""
    modules = _imported(*argv)
    assert "ckptconv.cli.app" in modules and not _torch(modules)


def test_early_open_does_not_import_torch() -> None:
    """What dcp-to-hf runs before torch (source.early: `.metadata` read and OUT checked, so that the read's
    peak and torch's do not add up) imports no torch, nor does the OUT check it calls (publish.outcheck)."""
    modules = _imported("-c", "import ckptconv.source.early, ckptconv.publish.outcheck")
    assert "ckptconv.source.early" in modules and not _torch(modules)


@pytest.mark.parametrize("name", ckptconv.__all__)
def test_public_name_resolves(name: str) -> None:
    """Every name of `__all__` is an attribute of the package, and `from ckptconv import NAME` gives the
    object its module defines."""
    value = getattr(ckptconv, name)
    if name == "__version__":
        assert isinstance(value, str)
        return
    assert value is getattr(importlib.import_module(ckptconv._ATTR_TO_MODULE[name]), name)
    namespace: dict[str, object] = {}
    exec(f"from ckptconv import {name}", namespace)
    assert namespace[name] is value


def test_dir_lists_public_names_and_unknown_names_raise() -> None:
    """`dir(ckptconv)` lists the public names (imported or not yet); any other name is an AttributeError."""
    listed = dir(ckptconv)
    assert set(ckptconv.__all__) <= set(listed) and listed == sorted(listed)
    with pytest.raises(AttributeError, match="module 'ckptconv' has no attribute 'no_such_name'"):
        ckptconv.no_such_name  # noqa: B018
    assert not hasattr(ckptconv, "saveHF")
    with pytest.raises(ImportError):
        exec("from ckptconv import no_such_name", {})


def test_table_modules_are_in_the_package() -> None:
    """Every module of the table is a module of ckptconv (a file that exists), nothing from outside it."""
    for module in ckptconv._SUBMOD_ATTRS:
        assert module.startswith("ckptconv."), module
        path = PACKAGE.joinpath(*module.split(".")[1:])
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


def test_table_and_all_agree() -> None:
    """`__all__` is exactly the table's names and `__version__`, each named once, and the imports under
    TYPE_CHECKING (what type checkers and the docs' reference see) are the table itself."""
    table = ckptconv._SUBMOD_ATTRS
    names = [name for module_names in table.values() for name in module_names]
    assert len(names) == len(set(names)), "a name is in the table twice"
    assert len(ckptconv.__all__) == len(set(ckptconv.__all__)), "a name is in __all__ twice"
    assert set(ckptconv.__all__) == {*names, "__version__"}
    assert {name: module for module in table for name in table[module]} == ckptconv._ATTR_TO_MODULE

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    guarded = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    ]
    assert len(guarded) == 1
    typed: dict[str, list[str]] = {}
    for node in guarded[0].body:
        assert isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        typed.setdefault(node.module, []).extend(alias.name for alias in node.names if alias.asname is None)
    assert {m: sorted(n) for m, n in typed.items()} == {m: sorted(n) for m, n in table.items()}
