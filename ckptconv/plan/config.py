"""config.json follows the conversion: the dtype it names and its quantization section. Pure.

When `--copy-from` brings a config.json along, the release's weights may no longer be what it says: a bf16
export of an fp32 model, an FP8 release (`--quantize fp8`), or a bf16 export copied from an FP8 release's
directory. `edit_config` makes it say what was written:

- `dtype` (transformers 5) and `torch_dtype` (before): every one present, at the top level and in nested
  configs (`text_config`, `vision_config`, ...), is set to the dtype written; an FP8 release gets a top-level
  `dtype` if it has neither (transformers would otherwise take the first float tensor's dtype: a scale's);
- `quantization_config`: set to the release's for `--quantize`, removed from an unquantized release.

The edits are returned as lines for the report; a config that needs none keeps its bytes. The other copied
files are never touched.

hf-to-dcp from a quantized source (`dequantized_config`) keeps config.json without the
`quantization_config` that described weights the DCP now holds dequantized:

    {"dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", ...}, ...}
    ->  {"dtype": "bfloat16", ...}            (re-serialized by `edit_config`, as transformers writes it)

Any other config (no quantization_config, or one of a scheme hf-to-dcp does not dequantize) keeps its bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ckptconv.core.dtype_names import ITEMSIZE
from ckptconv.formats.documents import load_json
from ckptconv.quant.schemes import METHODS

DTYPE_FIELDS = ("dtype", "torch_dtype")
QUANT_FIELD = "quantization_config"
DEQUANTIZED_METHODS = METHODS  # what `formats.hf_quant` reads dequantized


def edit_config(
    raw: bytes, dtype: str | None, quantization: dict[str, Any] | None
) -> tuple[bytes, list[str]]:
    """(the config.json bytes for a release of `dtype` weights quantized as `quantization`, the edits)."""
    try:
        doc = load_json(raw, "config.json")
    except ValueError:
        return raw, []  # not JSON: copied as it is (transformers would refuse it anyway)
    if not isinstance(doc, dict):
        return raw, []
    edits: list[str] = []
    if dtype is not None:
        _set_dtypes(doc, dtype, "", edits)
        if quantization is not None and not any(f in doc for f in DTYPE_FIELDS):
            doc["dtype"] = dtype
            edits.append(f"dtype: added {dtype!r}")
    if quantization is not None and doc.get(QUANT_FIELD) != quantization:
        edits.append(
            f"{QUANT_FIELD}: {'replaced' if QUANT_FIELD in doc else 'added'} ({quantization['quant_method']})"
        )
        doc[QUANT_FIELD] = quantization
    elif quantization is None and QUANT_FIELD in doc:
        method = doc[QUANT_FIELD].get("quant_method") if isinstance(doc[QUANT_FIELD], dict) else None
        edits.append(f"{QUANT_FIELD}: removed ({method}; the weights written are not quantized)")
        del doc[QUANT_FIELD]
    if not edits:
        return raw, []
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), edits


def _set_dtypes(node: dict[str, Any], dtype: str, where: str, edits: list[str]) -> None:
    for name in DTYPE_FIELDS:
        if name in node and node[name] != dtype:
            edits.append(f"{where}{name}: {node[name]!r} -> {dtype!r}")
            node[name] = dtype
    for key, value in node.items():
        if isinstance(value, dict) and key != QUANT_FIELD:
            _set_dtypes(value, dtype, f"{where}{key}.", edits)


def release_dtype(written: Iterable[tuple[str, int]]) -> str | None:
    """The dtype a config should name for tensors written as (dtype name, bytes): the floating dtype holding
    the most bytes, fp8 and other 1-byte formats aside (a quantized release is named by its unquantized
    dtype). None when nothing floating was written."""
    totals: dict[str, int] = {}
    for name, nbytes in written:
        if name in ("float64", "float32", "float16", "bfloat16") and ITEMSIZE[name] > 1:
            totals[name] = totals.get(name, 0) + nbytes
    return max(totals, key=lambda n: (totals[n], n)) if totals else None


def dequantized_config(raw: bytes) -> bytes:
    """`raw` config.json bytes -> the same config without a top-level `quantization_config` whose
    `quant_method` hf-to-dcp dequantizes; the same bytes otherwise (and for what is not a JSON object:
    whoever reads the config reports that)."""
    try:
        doc = load_json(raw, "config.json")
    except (ValueError, RecursionError):
        return raw
    section = doc.get(QUANT_FIELD) if isinstance(doc, dict) else None
    if not isinstance(section, dict) or section.get("quant_method") not in DEQUANTIZED_METHODS:
        return raw
    return edit_config(raw, None, None)[0]
