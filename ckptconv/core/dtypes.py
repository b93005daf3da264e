"""Which dtype each output tensor gets: `--dtype` for floating tensors, `--fp32` patterns beat it.

Only the ordinary floating dtypes (fp64, fp32, fp16, bf16) are ever cast. Integer, bool, complex and fp8
tensors keep their dtype and bytes whatever the flags say.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ckptconv.core.dtype_names import DTYPE_FLAG_NAMES, NAME_TO_ST, check_dtype_flag
from ckptconv.core.user_regex import UserRegex
from ckptconv.errors import CkptconvError

DTYPE_NAMES: dict[str, torch.dtype | None] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "keep": None,
}
assert tuple(DTYPE_NAMES) == DTYPE_FLAG_NAMES  # one list of names, checked without torch (dtype_names)

CASTABLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})

# torch dtypes -> safetensors dtype names (those both sides know; this torch may predate some)
_TORCH_TO_ST = {getattr(torch, name): st for name, st in NAME_TO_ST.items() if hasattr(torch, name)}


# safetensors lays data out by its Dtype enum, last variant first (then by key); this is that order
_ST_LAYOUT = (
    "U64",
    "I64",
    "F64",
    "C64",
    "F32",
    "U32",
    "I32",
    "BF16",
    "F16",
    "U16",
    "I16",
    "F8_E8M0",
    "F8_E4M3",
    "F8_E5M2",
    "I8",
    "U8",
    "BOOL",
)


def st_layout_rank(dtype: torch.dtype) -> int:
    """Where safetensors puts tensors of `dtype` in a file: lower comes first."""
    return _ST_LAYOUT.index(st_name(dtype))


def st_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise CkptconvError(f"dtype {dtype} cannot be stored in safetensors") from None


def parse_dtype_flag(value: str, flag: str = "--dtype") -> torch.dtype | None:
    """The torch dtype a --dtype value names (None: keep); refused with one line naming `flag`."""
    return DTYPE_NAMES[check_dtype_flag(value, flag)]


@dataclass
class DtypePolicy:
    """`target=None` keeps every dtype; `fp32` are regexes searched in the output key; `by_key`: the dtype of
    named output keys (hf-to-dcp's `--reference` without `--dtype`), beaten by `fp32`, beating `target`."""

    target: torch.dtype | None = torch.bfloat16
    fp32: Sequence[str] = ()
    by_key: Mapping[str, torch.dtype] = field(default_factory=dict)
    _compiled: list[UserRegex] = field(init=False, repr=False)
    _matched: set[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._compiled = []
        for pattern in self.fp32:
            self._compiled.append(UserRegex(pattern, "--fp32"))
        self._matched = set()

    def resolve(self, hf_key: str, dtype: torch.dtype) -> torch.dtype:
        """The output dtype of the tensor `hf_key` stored as `dtype`."""
        if dtype not in CASTABLE:
            return dtype
        for compiled in self._compiled:
            if compiled.search(hf_key):
                self._matched.add(compiled.pattern)
                return torch.float32
        if self.by_key.get(hf_key) in CASTABLE:  # a floating tensor takes a floating reference's dtype only
            return self.by_key[hf_key]
        return dtype if self.target is None else self.target

    def forces_fp32(self, hf_key: str) -> bool:
        """Whether an --fp32 pattern matches `hf_key` (it then beats --quantize too)."""
        return any(compiled.search(hf_key) for compiled in self._compiled)

    def unmatched(self) -> list[str]:
        """The --fp32 patterns that matched no floating tensor so far."""
        return [p.pattern for p in self._compiled if p.pattern not in self._matched]

    def warnings(self) -> Iterable[str]:
        for pattern in self.unmatched():
            yield f"--fp32 {pattern!r} matched no floating-point tensor"


def check_range(key: str, source: torch.dtype, data: torch.Tensor) -> None:
    """`data`, tensor `key` cast to fp16 from a wider-ranged `source` dtype: a value beyond fp16's +-65504
    became inf, which is refused with one line rather than written. (Other casts are not checked: bf16
    overflows only fp32 values within 0.2% of fp32's own maximum, and a check of every bf16 release would
    cost a pass over it.)"""
    if data.dtype != torch.float16 or source not in (torch.float32, torch.float64, torch.bfloat16):
        return
    if bool(torch.isinf(data).any()):
        raise CkptconvError(
            f"{key!r}: holds values beyond float16's range (+-65504), or infinities, which --dtype fp16 "
            "would write as inf; keep it wider with an --fp32 pattern matching it, or --dtype bf16"
        )
