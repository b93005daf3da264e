"""megatron_save.py's `deepseek` and `load-deepseek` modes: a tiny DeepSeek-V3-style megatron-core 0.16.1
GPTModel, torch_dist, saved and loaded by megatron's own code.

usage (under torchrun, 1 rank, TP=1): megatron_save.py deepseek OUT [--no-q-lora]
                                       megatron_save.py load-deepseek CKPT RESULT [--no-q-lora]

The model: local (non-TransformerEngine) spec built by megatron's own get_gpt_decoder_block_spec and
get_gpt_mtp_block_spec from an MLATransformerConfig: 2 layers, the first dense and the second MoE
(moe_layer_freq [0, 1]), hidden 32, 4 heads of MLA (q_lora_rank 24, or none with --no-q-lora; kv_lora_rank 16,
nope 8, rope 4, v 8), 4 routed experts (SequentialMLP) of 16 with one shared expert, a sigmoid router with
expert bias, one MTP layer, vocab 50 padded to 64, bf16 (Float16Module), norms and expert biases drawn at
random. Saved with `dist_checkpointing.save({"model": gpt.sharded_state_dict(), "args", "iteration",
"checkpoint_version"}, OUT)`. Writes OUT/../expected.pt {"model": GPTModel.state_dict() names -> tensors
(parameters and the routers' expert_bias)} and OUT/../config.json (the sizes).

Two more CPU stand-ins than megatron_save.py's, for building only (nothing here runs the model forward):
- megatron-core 0.16.1's MLASelfAttention passes `k_channels` and `v_channels` to its core attention, which
  the local spec's DotProductAttention does not take ("TypeError: DotProductAttention.__init__() got an
  unexpected keyword argument 'k_channels'"): the two are dropped (core attention has no weights).
- multi_latent_attention.HAVE_TE is True on a machine without TransformerEngine (megatron's import stubs
  TELinear with a MagicMock), and `isinstance(self.linear_proj, TELinear)` then raises "isinstance() arg 2
  must be a type, a tuple of types, or a union": HAVE_TE is set to False there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DS: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "ffn_hidden_size": 48,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_head_dim": 8,
    "qk_pos_emb_head_dim": 4,
    "v_head_dim": 8,
    "num_moe_experts": 4,
    "moe_layer_freq": [0, 1],
    "moe_ffn_hidden_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "moe_router_topk": 2,
    "moe_router_num_groups": 2,
    "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.5,
    "mtp_num_layers": 1,
    "vocab_size": 50,
    "padded_vocab_size": 64,
    "make_vocab_size_divisible_by": 64,
    "tensor_model_parallel_size": 1,
    "layernorm_epsilon": 1e-6,
    "rotary_base": 10000,
    "max_position_embeddings": 64,
}


def _stand_ins() -> None:
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe import moe_utils

    init = DotProductAttention.__init__

    def without_channels(
        self: Any, *args: Any, k_channels: Any = None, v_channels: Any = None, **kw: Any
    ) -> None:
        init(self, *args, **kw)

    DotProductAttention.__init__ = without_channels  # type: ignore[method-assign]
    multi_latent_attention.HAVE_TE = False
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)


def build_deepseek(sizes: dict[str, Any]) -> Any:
    """The tiny GPTModel of `sizes` (DS, or DS without q_lora_rank) at TP=1, bf16 as Float16Module makes it,
    its parameters from a fixed seed."""
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron_save import cuda_on_cpu

    _stand_ins()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(1234)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    names = ("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings")
    config = MLATransformerConfig(
        **{k: v for k, v in sizes.items() if k not in names},
        rope_type="rope",
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=False,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    with cuda_on_cpu():
        gpt = GPTModel(
            config,
            spec,
            vocab_size=DS["padded_vocab_size"],
            max_sequence_length=DS["max_position_embeddings"],
            position_embedding_type="rope",
            rotary_base=DS["rotary_base"],
            share_embeddings_and_output_weights=False,
            mtp_block_spec=mtp,
        )
        Float16Module(config, gpt)  # as Megatron-LM's get_model does for --bf16: every tensor bf16
    return gpt


def model_tensors(gpt: Any) -> dict[str, torch.Tensor]:
    """GPTModel.state_dict() without the `_extra_state` entries and the routers' token counters: the
    parameters and the routers' expert_bias."""
    model = {k: v.detach().clone() for k, v in gpt.state_dict().items() if "_extra_state" not in k}
    return {k: v for k, v in model.items() if not k.endswith("local_tokens_per_expert")}


def _sizes(argv: list[str], prog: str) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--no-q-lora", action="store_true")
    o = p.parse_args(argv)
    assert dist.get_world_size() == 1, "deepseek: 1 rank, TP=1"
    return {**DS, "q_lora_rank": None if o.no_q_lora else DS["q_lora_rank"]}


def save_deepseek(out: Path, argv: list[str]) -> None:
    from megatron.core import dist_checkpointing

    sizes = _sizes(argv, "megatron_save.py deepseek OUT")
    gpt = build_deepseek(sizes)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # distinct norms and biases: a mapping that swapped two would show
        for name, t in gpt.state_dict().items():
            if "norm" in name or name.endswith("expert_bias"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
    model = model_tensors(gpt)
    args = argparse.Namespace(**sizes)
    sd = {"model": gpt.sharded_state_dict(), "args": args, "iteration": 1, "checkpoint_version": 3.0}
    out.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sd, str(out))
    torch.save({"model": model}, out.parent / "expected.pt")
    (out.parent / "config.json").write_text(json.dumps(sizes, indent=1) + "\n")


def load_deepseek(ckpt: Path, result: Path, argv: list[str]) -> None:
    """megatron's own load of CKPT into the model save_deepseek builds: every parameter and expert_bias set
    to zero (whatever the load misses shows), `dist_checkpointing.load({"model": gpt.sharded_state_dict()},
    CKPT)` with megatron's default strictness (a missing or unexpected key or ShardedObject raises), then
    `load_state_dict(strict=True)`. Saves {"model": model_tensors(gpt)} to RESULT."""
    from megatron.core import dist_checkpointing
    from megatron_save import cuda_on_cpu

    gpt = build_deepseek(_sizes(argv, "megatron_save.py load-deepseek CKPT RESULT"))
    with torch.no_grad():
        for name, t in gpt.state_dict().items():
            if "_extra_state" not in name and t.is_floating_point():
                t.zero_()
    with cuda_on_cpu():  # under "model", as Megatron-LM asks for it: the common values land beside it
        loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, str(ckpt))
    gpt.load_state_dict(loaded["model"], strict=True)
    torch.save({"model": model_tensors(gpt)}, result)
