"""config.json beside an hf-to-dcp output whose source was quantized: without the `quantization_config` that
described weights the DCP now holds dequantized. Pure (bytes in, bytes out); no torch.

    {"dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", ...}, ...}
    ->  {"dtype": "bfloat16", ...}            (re-serialized by `config_edit`, as transformers writes it)

Any other config (no quantization_config, or one of a scheme hf-to-dcp does not dequantize) keeps its bytes.
"""

from __future__ import annotations

from ckptconv.formats.documents import load_json
from ckptconv.plan.config import QUANT_FIELD, edit_config

DEQUANTIZED_METHODS = ("fp8", "mxfp4")  # what `formats.hf_quant` reads dequantized


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
