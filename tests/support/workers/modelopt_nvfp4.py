"""With nvidia-modelopt 0.47.0 on PYTHONPATH (tests/support/modelopt.py): ModelOpt's own NVFP4 of
the weights in WORK/in.safetensors, and the quantization_config its HF export writes.

usage: modelopt_nvfp4.py WORK

Each weight W (2-D, in the dtype it is quantized in) -> WORK/out.safetensors: W (packed uint8), W_scale
(float8_e4m3fn per 16 values) and W_scale_2 (fp32), as `NVFP4QTensor.quantize(W, 16)` returns them (the
dynamic path ModelOpt's export takes for a weight quantizer without a static global amax), and
W_dequantized, what `NVFP4QTensor.dequantize` makes of them in W's dtype. WORK/config.json:
`convert_hf_quant_config_format` of the hf_quant_config `get_quant_config` makes for an NVFP4 model (producer
modelopt 0.47.0, quant_algo NVFP4, group_size 16, exclude_modules = WORK/exclude.json, no KV-cache scheme),
what `export_hf_checkpoint` puts in config.json.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")  # modelopt warns that it has not been tested with this transformers

from modelopt import __version__  # noqa: E402
from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format  # noqa: E402
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def main() -> None:
    work = Path(sys.argv[1])
    out = {}
    for key, w in load_file(work / "in.safetensors").items():
        packed, scale, scale_2 = NVFP4QTensor.quantize(w.clone(), 16)  # `_cast_fp4` works in place
        out[key] = packed._quantized_data
        out[key + "_scale"] = scale
        out[key + "_scale_2"] = scale_2
        out[key + "_dequantized"] = packed.dequantize(
            dtype=w.dtype, scale=scale, double_scale=scale_2, block_sizes={-1: 16}
        )
    save_file({k: v.contiguous() for k, v in out.items()}, work / "out.safetensors")
    exclude = json.loads((work / "exclude.json").read_text())
    hf_quant_config = {
        "producer": {"name": "modelopt", "version": __version__},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": exclude,
        },
    }
    (work / "config.json").write_text(json.dumps(convert_hf_quant_config_format(hf_quant_config)))


if __name__ == "__main__":
    main()
