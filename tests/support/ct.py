"""compressed-tensors releases built with compressed-tensors' own code, and its own dequantization of them.

`release` loads a tiny transformers model (families.sized), applies a QuantizationConfig of
compressed-tensors' preset schemes (apply_quantization_config), sets each weight's qparams with
compressed-tensors' calculate_qparams (and generate_gparam for NVFP4's global scale) from the weight's
min / max over each scale's cell (what llm-compressor's min-max observers compute), compresses it with
ModelCompressor, and saves the state dict with safetensors and config.json with the quantization_config
ModelCompressor writes. `oracle` is compressed-tensors' decompress of every quantized module (the
compressors' classmethods, as CompressedTensorsDequantizer.process calls them) followed by `.to(dtype)`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def scheme(preset: str, targets: list[str], **weights: Any) -> Any:
    """compressed-tensors' preset `preset` for `targets`, its weight args overridden by `weights`."""
    from compressed_tensors.quantization import preset_name_to_scheme

    s = preset_name_to_scheme(preset, targets)
    if weights:
        s.weights = s.weights.model_copy(update=weights)
    return s


def release(
    src: Path,
    dst: Path,
    groups: dict[str, Any],
    ignore: tuple[str, ...] = ("lm_head",),
    split: Callable[[str], int] | None = None,
) -> Path:
    """`src` (a bf16 transformers directory) quantized by the config_groups `groups` and saved into `dst`;
    `split(key)` puts each tensor in shard 0 or 1 (with an index) when given."""
    import transformers as tf
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import save_file

    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    config = QuantizationConfig(config_groups=groups, ignore=list(ignore))
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _calibrate(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    dst.mkdir(parents=True)
    if split is None:
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    else:
        names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        shards: list[dict[str, torch.Tensor]] = [{}, {}]
        for key, value in state.items():
            shards[split(key)][key] = value
        for name, part in zip(names, shards, strict=True):
            save_file(part, dst / name, metadata={"format": "pt"})
        weight_map = {k: names[split(k)] for k in state}
        index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    model.config.save_pretrained(dst)
    compressor.update_config(str(dst))
    return dst


def _calibrate(module: torch.nn.Module) -> None:
    """The weight's scale (and zero point, global scale) from its min / max over each scale's cell."""
    from compressed_tensors.quantization import QuantizationStrategy as S
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = module.quantization_scheme.weights  # type: ignore[union-attr]
    w = module.weight.data  # type: ignore[union-attr]
    global_scale = None
    if args.strategy == S.TENSOR_GROUP:
        module.weight_global_scale.data.copy_(generate_gparam(w.amin(), w.amax()))  # type: ignore[union-attr,operator]
        global_scale = module.weight_global_scale.data  # type: ignore[union-attr]
    if args.strategy == S.CHANNEL:
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy in (S.GROUP, S.TENSOR_GROUP):
        cells = w.unflatten(-1, (-1, args.group_size))
        lo, hi = cells.amin(-1), cells.amax(-1)
    elif args.strategy == S.BLOCK:
        (b0, b1), (o, i) = args.block_structure, w.shape
        padded = torch.nn.functional.pad(w, (0, -i % b1, 0, -o % b0))
        cells = padded.reshape(-(-o // b0), b0, -(-i // b1), b1)
        lo, hi = cells.amin((1, 3)), cells.amax((1, 3))
    else:
        lo, hi = w.amin(), w.amax()
    scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
    module.weight_scale.data = scale.to(module.weight_scale.dtype)  # type: ignore[union-attr]
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)  # type: ignore[union-attr]


def oracle(dst: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every quantized module of `dst` as compressed-tensors decompresses it, `.to(dtype)` (the scheme of a
    module found as CompressedTensorsDequantizer finds it: the compressor of the group's inferred format)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name
    from safetensors.torch import load_file

    config = json.loads((dst / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(config)
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(dst.glob("*.safetensors")):
        stored |= load_file(f)
    out = {}
    for s in qc.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(infer_module_format(torch.nn.Linear, s).value)
        names = compressor.compression_param_names(s)
        for key in list(stored):
            module, _, param = key.rpartition(".")
            if param != names[0] or f"{module}.weight_scale" not in stored:
                continue
            if not ("Linear" in s.targets or any(match_name(module, t) for t in s.targets)):
                continue
            state = {n: stored[f"{module}.{n}"] for n in names if f"{module}.{n}" in stored}
            out[f"{module}.weight"] = compressor.decompress(state, s)["weight"].to(dtype)
            for n in names:
                stored.pop(f"{module}.{n}", None)
    return out


def expected(dst: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What hf-to-dcp writes for `dst` in `dtype`: the oracle's weights and every other weight cast; the
    activation scales dropped."""
    from safetensors.torch import load_file

    quantized = oracle(dst, dtype)
    out = {}
    for f in sorted(dst.glob("*.safetensors")):
        for key, value in load_file(f).items():
            module, _, param = key.rpartition(".")
            if param.startswith(("weight_", "input_", "output_")) or f"{module}.weight" in quantized:
                continue
            out[key] = value.to(dtype)
    return out | quantized
