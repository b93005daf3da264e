"""ckptconv: convert LLM checkpoints between PyTorch DCP and Hugging Face safetensors, on one rank or many."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The public names, each with the module it lives in, imported on first use: torch is slow to import, and
# `import ckptconv` or `ckptconv --help` should not pay for it. Anything not named here is internal, whatever
# its module's name. tests/unit/test_public_api.py holds this table, `__all__` and the imports under
# TYPE_CHECKING (which type checkers and the docs' reference read) to one another.
_SUBMOD_ATTRS: dict[str, list[str]] = {
    "ckptconv.run.dcp_to_hf": ["dcp_to_hf"],
    "ckptconv.run.hf_to_dcp": ["hf_to_dcp"],
    "ckptconv.options": ["DcpToHfOptions", "HfToDcpOptions", "MappingOptions"],
    "ckptconv.live.save": ["save_hf", "load_specs", "LoadSpec", "SaveReport"],
    "ckptconv.live.load": ["load_hf", "LoadReport"],
    "ckptconv.errors": ["CkptconvError", "VerifyMismatch"],
}
_ATTR_TO_MODULE: dict[str, str] = {name: module for module, names in _SUBMOD_ATTRS.items() for name in names}

__all__ = [
    "CkptconvError",
    "DcpToHfOptions",
    "HfToDcpOptions",
    "LoadReport",
    "LoadSpec",
    "MappingOptions",
    "SaveReport",
    "VerifyMismatch",
    "__version__",
    "dcp_to_hf",
    "hf_to_dcp",
    "load_hf",
    "load_specs",
    "save_hf",
]


def __getattr__(name: str) -> object:
    """A public name of `_SUBMOD_ATTRS`, imported from its module on first use (then kept in the package)."""
    module = _ATTR_TO_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptconv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """What the package holds now, and the public names not imported yet."""
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ckptconv.errors import CkptconvError, VerifyMismatch
    from ckptconv.live.load import LoadReport, load_hf
    from ckptconv.live.save import LoadSpec, SaveReport, load_specs, save_hf
    from ckptconv.options import DcpToHfOptions, HfToDcpOptions, MappingOptions
    from ckptconv.run.dcp_to_hf import dcp_to_hf
    from ckptconv.run.hf_to_dcp import hf_to_dcp
