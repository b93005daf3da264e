"""Builds quantized releases from a bf16 HF directory with the formats' own code, and writes the reference
dequantization beside them. Run by tests/support/modelopt.py with nvidia-modelopt 0.47.0 on PYTHONPATH.

    KIND SRC DST ..., each KIND one of
    nvfp4 SRC DST   ModelOpt NVFP4 (NVFP4QTensor.quantize), config from ModelOpt's own
                    convert_hf_quant_config_format; DST-mixed: the same with layer 0's q_proj in ModelOpt's
                    FP8 (FP8QTensor.quantize), a MIXED_PRECISION config
    mxfp8 SRC DST   MXFP8 by transformers' Fp8Quantize (weight_block_size [1, 32], scale_fmt ue8m0)
    grid - DST      every FP4 byte under every E4M3 scale, decoded by NVFP4QTensor.dequantize (`grid`)
    dsv4 SRC DST    DeepSeek-V4: dense / shared-expert FP8 by transformers' Fp8Quantize (128 x 128, ue8m0)
                    and routed experts FP4 by ModelOpt's MXFP4QTensor.quantize (E8M0 per 32), `.scale` keys

Beside each DST: DST.reference-bfloat16.safetensors and DST.reference-float32.safetensors, the quantized
weights as the format's reference dequantizes them (NVFP4: NVFP4QTensor.dequantize, FP8:
FP8QTensor.dequantize; MXFP8 and DeepSeek-V4: transformers' Fp8Dequantize._dequantize_one), by logical key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

DTYPES = (torch.bfloat16, torch.float32)
IGNORE = ["lm_head", "*.mlp.gate", "model.layers.1.self_attn.o_proj"]


def _linear(key: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and key.endswith(".weight") and ".layers." in key and "norm" not in key


def _save(dst: Path, tensors: dict[str, torch.Tensor], config: dict, split: str | None) -> None:
    """Into two shards: the keys containing `split` (the scales) in the second, an index for both."""
    dst.mkdir(parents=True)
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    names = list(files)
    for key, value in tensors.items():
        files[names[1] if split and split in key else names[0]][key] = value.contiguous()
    weight_map = {}
    for name, part in files.items():
        save_file(part, dst / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_text(json.dumps(config, indent=1))


def _references(dst: Path, refs: dict[torch.dtype, dict[str, torch.Tensor]]) -> None:
    for dtype, values in refs.items():
        name = str(dtype).removeprefix("torch.")
        path = dst.with_name(f"{dst.name}.reference-{name}.safetensors")
        save_file({k: v.contiguous() for k, v in values.items()}, path)


def nvfp4(src: Path, dst: Path) -> None:
    from fnmatch import fnmatchcase

    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    stored = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    refs: dict[torch.dtype, dict[str, torch.Tensor]] = {d: {} for d in DTYPES}
    layers: dict[str, dict] = {}

    def quantize(w: torch.Tensor) -> tuple:
        q, s, s2 = NVFP4QTensor.quantize(w, 16)
        deq = {d: q.dequantize(dtype=d, scale=s, double_scale=s2, block_sizes={-1: 16}) for d in DTYPES}
        return q._quantized_data, s, s2.to(torch.float32), deq

    # layer 1's experts stacked: gate_up as [E, 2I, H] (packed rows, one shared weight_scale_2), down_proj as
    # ModelOpt exports bmm experts: quantized per expert in [E, H, I], stored transposed [E, I/2, H]
    experts = "model.layers.1.mlp.experts."
    n = len({k.split(".")[5] for k in stored if k.startswith(experts)})
    per = {
        p: torch.stack([stored.pop(f"{experts}{e}.{p}.weight") for e in range(n)])
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    for key, w in stored.items():
        module = key.removesuffix(".weight")
        if not _linear(key, w) or any(fnmatchcase(module, p) for p in IGNORE):
            out[key] = w
            continue
        q, s, s2, deq = quantize(w)
        out |= {key: q, module + ".weight_scale": s, module + ".weight_scale_2": s2}
        out[module + ".input_scale"] = torch.tensor(0.5)  # an activation scale: dropped
        layers[module] = {"quant_algo": "NVFP4", "group_size": 16}
        for d in DTYPES:
            refs[d][key] = deq[d]
    gate_up = torch.cat((per["gate_proj"], per["up_proj"]), dim=1)  # [E, 2I, H]
    q, s, s2, deq = quantize(gate_up)
    key = experts + "gate_up_proj.weight"
    out |= {key: q, key + "_scale": s, key + "_scale_2": s2}
    layers[experts + "gate_up_proj"] = {"quant_algo": "NVFP4", "group_size": 16}
    for d in DTYPES:
        refs[d][key] = deq[d]
    qs, ss, s2s, deqs = zip(*(quantize(per["down_proj"][e]) for e in range(n)), strict=True)
    key = experts + "down_proj"
    out |= {
        key: torch.stack(qs).transpose(1, 2),
        key + "_weight_scale": torch.stack(ss).transpose(1, 2),
        key + "_weight_scale_2": torch.stack(s2s),
        key + "_input_scale": torch.tensor(0.25),
    }
    layers[key] = {"quant_algo": "NVFP4", "group_size": 16}
    for d in DTYPES:
        refs[d][key] = torch.stack([x[d] for x in deqs]).transpose(1, 2)
    config = json.loads((src / "config.json").read_text())
    producer = {"name": "modelopt", "version": "0.47.0"}
    details = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": IGNORE}
    config["quantization_config"] = convert_hf_quant_config_format(
        {"producer": producer, "quantization": details}
    )
    _save(dst, out, config, "_scale")
    _references(dst, refs)
    # the MIXED_PRECISION release: the same, but layer 0's q_proj in ModelOpt's per-tensor FP8
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor

    fp8_module = "model.layers.0.self_attn.q_proj"
    w = stored[fp8_module + ".weight"]
    q8, scale = FP8QTensor.quantize(w, scales=w.float().abs().amax() / 448.0)
    del out[fp8_module + ".weight_scale_2"]
    out |= {fp8_module + ".weight": q8._quantized_data, fp8_module + ".weight_scale": scale.float()}
    layers[fp8_module] = {"quant_algo": "FP8"}
    for d in DTYPES:
        refs[d][fp8_module + ".weight"] = q8.dequantize(dtype=d, scale=scale.float())
    details = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers, "exclude_modules": IGNORE}
    config["quantization_config"] = convert_hf_quant_config_format(
        {"producer": producer, "quantization": details}
    )
    mixed = Path(str(dst) + "-mixed")
    _save(mixed, out, config, "_scale")
    _references(mixed, refs)


def _fp8_ops(block: list[int]) -> tuple:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    qc = SimpleNamespace(scale_fmt="ue8m0", weight_block_size=block)
    quantizer = SimpleNamespace(quantization_config=qc)
    return Fp8Quantize(quantizer), Fp8Dequantize(quantizer)


def mxfp8(src: Path, dst: Path) -> None:
    quant, dequant = _fp8_ops([1, 32])
    out: dict[str, torch.Tensor] = {}
    refs: dict[torch.dtype, dict[str, torch.Tensor]] = {d: {} for d in DTYPES}
    for key, w in load_file(src / "model.safetensors").items():
        if not _linear(key, w):
            out[key] = w
            continue
        pair = quant._quantize_one(key, w)
        out |= pair
        for d in DTYPES:
            refs[d][key] = dequant._dequantize_one(pair[key], pair[key + "_scale_inv"], output_dtype=d)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [1, 32],
        "modules_to_not_convert": ["lm_head"],
    }
    _save(dst, out, config, "_scale_inv")
    _references(dst, refs)


def dsv4(src: Path, dst: Path) -> None:
    from modelopt.torch.quantization.qtensor.mxfp4_tensor import MXFP4QTensor

    quant, dequant = _fp8_ops([128, 128])
    out: dict[str, torch.Tensor] = {}
    refs: dict[torch.dtype, dict[str, torch.Tensor]] = {d: {} for d in DTYPES}
    for key, w in load_file(src / "model.safetensors").items():
        module = key.removesuffix(".weight")
        if ".mlp.experts." in key:  # routed experts: FP4 codes as int8, an E8M0 scale per 32
            q, e8m0 = MXFP4QTensor.quantize(w, 32)
            q, s = q._quantized_data.view(torch.int8), e8m0.view(torch.float8_e8m0fnu).reshape(w.shape[0], -1)
        elif _linear(key, w) and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0:
            pair = quant._quantize_one(key, w)
            q, s = pair[key], pair[key + "_scale_inv"]
        else:
            out[key] = w
            continue
        out |= {key: q, module + ".scale": s}
        for d in DTYPES:
            refs[d][key] = dequant._dequantize_one(q, s, output_dtype=d)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    config["expert_dtype"] = "fp4"  # as DeepSeek-V4's config.json says it (V4.1: in quantization_config)
    _save(dst, out, config, ".scale")
    _references(dst, refs)


def grid(_: Path, dst: Path) -> None:
    """Every byte of packed codes under every finite E4M3 scale byte and three global scales, as
    NVFP4QTensor.dequantize decodes them, in bf16, fp16 and fp32: DST (a .safetensors file)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    scales = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # not NaN
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(scales), 1)  # [254, 256]: 512 values a row
    scale = scales.view(torch.float8_e4m3fn)[:, None].expand(-1, 32).contiguous()  # 32 groups of 16
    out = {"packed": packed, "scale": scale}
    for i, s2 in enumerate((1.0, 0.0123, 3.7e-5)):
        double = torch.tensor(s2, dtype=torch.float32)
        out[f"scale_2.{i}"] = double
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            q = NVFP4QTensor((*packed.shape[:-1], 512), dtype, packed)
            values = q.dequantize(dtype=dtype, scale=scale, double_scale=double, block_sizes={-1: 16})
            out[f"{i}.{str(dtype).removeprefix('torch.')}"] = values
    save_file(out, dst)


if __name__ == "__main__":
    torch.manual_seed(0)
    jobs = sys.argv[1:]  # KIND SRC DST, repeated: one process (ModelOpt imports in seconds) builds them all
    for kind, src, dst in zip(jobs[::3], jobs[1::3], jobs[2::3], strict=True):
        {"nvfp4": nvfp4, "mxfp8": mxfp8, "dsv4": dsv4, "grid": grid}[kind](Path(src), Path(dst))
