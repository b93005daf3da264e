"""Worker of the dequant benchmark (scripts/benchmarks/dequant.py), run by path in a process of its own.

usage: python ct_release.py make KIND PATH GB   PATH/bf16 (a Llama of about GB of bf16 weights) and PATH/KIND,
                                                that model quantized by compressed-tensors (KIND int4: its
                                                W4A16 preset, pack-quantized, group 128; nvfp4: its NVFP4A16
                                                preset, nvfp4-pack-quantized)
       python ct_release.py dequant SRC OUT      the baseline: compressed-tensors' own dequantizer,
                                                convert_checkpoint(SRC, OUT, CompressedTensorsDequantizer) in
                                                bf16 on the CPU, one worker (file by file, as it documents)

make builds the release with the tests' builder (tests/support/ct.py `release`: compressed-tensors'
apply_quantization_config, calculate_qparams and ModelCompressor); lm_head stays bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HIDDEN, FFN, VOCAB, HEADS = 2048, 5632, 32000, 16
PRESETS = {"int4": "W4A16", "nvfp4": "NVFP4A16"}


def make(kind: str, path: Path, gb: float) -> None:
    import torch
    import transformers as tf

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from ct import release, scheme  # the tests' builder: compressed-tensors' own code

    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN
    layers = max(1, round((gb * 1e9 / 2 - 2 * VOCAB * HIDDEN) / per_layer))
    src = path / "bf16"
    if not src.exists():
        config = tf.LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            num_hidden_layers=layers,
            vocab_size=VOCAB,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(src)
    release(src, path / kind, {"group_0": scheme(PRESETS[kind], ["Linear"])})


def dequant(src: Path, out: Path) -> None:
    import torch
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )

    convert_checkpoint(
        src, out, CompressedTensorsDequantizer(src, dtype=torch.bfloat16), max_workers=1, device="cpu"
    )


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]))
    else:
        dequant(Path(sys.argv[2]), Path(sys.argv[3]))
