"""What makes hf-to-dcp's output a Megatron-FSDP `fsdp_dtensor` checkpoint (`--format fsdp_dtensor` with a
Megatron mapping), and the `--format` / `--megatron-gdn` / `--megatron-tp` choices a Megatron mapping takes.

Megatron-LM's `_load_base_checkpoint` (megatron/training/checkpointing.py) reads an fsdp_dtensor checkpoint
as a plain torch DCP directory (no metadata.json, no common.pt): first `dcp.load` of
`{"args": None, "iteration": None, "checkpoint_version": None}` (pickled bytes items), then the model's
DTensors under `model.module.<fqn>` after `preprocess_fsdp_dtensor_state_dict` renamed them (SwiGLU
`linear_fc1` as `weight_w` / `weight_v`, experts by global number: the mapping's "fsdp_dtensor" layout).
What `load_checkpoint` and `check_checkpoint_args` then read, and what this writes:

- `checkpoint_version`: 3.0 (below 2.0 Megatron reorders every `linear_qkv`'s rows: wrong for these);
- `iteration`: the source's (a Megatron source's stash, through dcp-to-hf), else 0; Megatron exits without it
  unless `--finetune` or the checkpoint is a `release`;
- `args`: an argparse.Namespace made here from config.json (no object of the source's is ever unpickled or
  written): what `check_checkpoint_args` compares (num_layers, hidden_size, num_attention_heads,
  tensor_model_parallel_size, pipeline_model_parallel_size, max_position_embeddings,
  make_vocab_size_divisible_by, padded_vocab_size, tokenizer_type) and the model arguments
  `load_args_from_checkpoint` (--use-checkpoint-args) takes from it. Values config.json does not give
  (seq_length, dropouts, batch sizes) are left out: Megatron then keeps the run's own.

The weights are fp32 unless --dtype says otherwise: Megatron-FSDP's checkpointed parameters are its main
weights (`dist_main_weight`, MixedPrecisionPolicy.main_params_dtype, float32 by default), and dcp.load
copies into them whatever is stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptconv.core.specs import StashedItem
from ckptconv.errors import CkptconvError
from ckptconv.plan.megatron import iteration_of
from ckptconv.plan.megatron_tp import TP_KEY, TP_NAME

if TYPE_CHECKING:
    from ckptconv.mapping.types import KeyMapping
    from ckptconv.plan.types import DcpSavePlan

FSDP_DTENSOR = "fsdp_dtensor"
PREFIX = "model.module."  # Megatron-FSDP's model keys (virtual pipeline stages: model0.module., ...)
CHECKPOINT_VERSION = 3.0
FORMAT_GROUP = "format"  # the layout groups of a Megatron mapping these flags pick
GDN_GROUP = "gdn"
NORM_GROUP = "pre-MLP norm"
SEPARATE_NORM = "norm-separate"  # an MoE layer's pre_mlp_layernorm, its own module
GROUPED_EXPERTS = "experts-grouped"
_ITEMS = ("args", "iteration", "checkpoint_version")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json's names for the count


def runtime_layouts(
    mapping: KeyMapping,
    requested: str | None,
    fmt: str | None,
    gdn: str | None,
    tp: int | None,
    config: Mapping[str, Any],
) -> str | None:
    """`--runtime-layout` with what `--format` and `--megatron-gdn` (sugar for the "format" and "gdn" layout
    groups) add, and, for fsdp_dtensor of a model config.json gives experts, the MoE layers' separate
    pre-MLP norm (unless `--runtime-layout` names a layout of that group). Refuses the flags on a mapping
    that is not Megatron's or has no such layouts."""
    where = f"--mapping {mapping.name}"
    if mapping.checkpoint != "megatron":
        for flag, value in (("--format", fmt), ("--megatron-gdn", gdn), ("--megatron-tp", tp)):
            if value is not None:
                raise CkptconvError(
                    f'{flag} applies to a Megatron mapping (checkpoint = "megatron"); {where} is not one: '
                    f"leave {flag} out"
                )
        return requested
    names = [n.strip() for n in requested.split(",")] if requested else []
    by_name = {layout.name: layout for layout in mapping.layouts}
    if fmt is not None:
        if fmt not in by_name or by_name[fmt].group != FORMAT_GROUP:
            raise CkptconvError(f"--format {fmt}: {where} has no {fmt} layout; leave --format out")
        names.append(fmt)
    if gdn is not None:
        name = f"gdn-{gdn}"
        if name not in by_name or by_name[name].group != GDN_GROUP:
            raise CkptconvError(
                f"--megatron-gdn {gdn}: {where} has no GDN layouts (gdn-split / gdn-fused); leave it out"
            )
        names.append(name)
    names = list(dict.fromkeys(names))  # a layout named by both flags is named once
    groups = {by_name[n].group for n in names if n in by_name}
    written = _format_of(mapping, names)
    if written == FSDP_DTENSOR and SEPARATE_NORM in by_name and NORM_GROUP not in groups and _moe(config):
        names.append(SEPARATE_NORM)
    return ",".join(names) or None


def _format_of(mapping: KeyMapping, names: Sequence[str]) -> str | None:
    """The "format" layout `names` (else the default) picks."""
    chosen = {layout.group: layout.name for layout in mapping.layouts if layout.default}
    for layout in mapping.layouts:
        if layout.name in names:
            chosen[layout.group] = layout.name
    return chosen.get(FORMAT_GROUP)


def writes_fsdp(mapping: KeyMapping | None) -> bool:
    """Whether hf-to-dcp with `mapping` (its runtime layouts chosen) writes an fsdp_dtensor checkpoint."""
    return mapping is not None and mapping.written_layouts().get(FORMAT_GROUP) == FSDP_DTENSOR


def _moe(config: Mapping[str, Any]) -> bool:
    config = language_model(config)
    return any(isinstance(config.get(k), int) and config[k] > 0 for k in _EXPERTS)


def language_model(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's sizes: config.json's own, with a multimodal model's `text_config` (Qwen3.5's
    Qwen3_5ForConditionalGeneration) over them."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else dict(config)


def with_tp(config: Mapping[str, Any], tp: int | None) -> dict[str, Any]:
    """config.json with `--megatron-tp`: the TP size the vocabulary is padded for and fused GDN tensors are
    grouped by. A config.json naming another `tensor_model_parallel_size` is refused."""
    out = dict(config)
    if tp is None:
        return out
    given = config.get(TP_KEY)
    if given is not None and given != tp:
        raise CkptconvError(
            f"--megatron-tp {tp}: config.json says tensor_model_parallel_size {given!r}; "
            "make them agree or leave one out"
        )
    out[TP_KEY] = tp
    out[TP_NAME] = tp
    return out


def megatron_args(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], grouped_experts: bool
) -> argparse.Namespace:
    """The `args` Megatron-LM's load reads, from config.json (`config`, with the mapping's defaults and
    --megatron-tp applied) and the planned tensors' runtime keys and shapes (the padded vocabulary,
    qk_layernorm)."""
    config = language_model(config)
    heads = _int(config, "num_attention_heads")
    hidden = _int(config, "hidden_size")
    groups = config.get("num_key_value_heads") or heads
    tp = int(config.get("tensor_model_parallel_size", 1))
    embedding = next((s for k, s in shapes.items() if k.endswith("embedding.word_embeddings.weight")), None)
    rope = config.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}
    theta = config.get("rope_theta", rope.get("rope_theta"))
    values: dict[str, Any] = {
        "num_layers": _int(config, "num_hidden_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": config.get("intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "group_query_attention": groups != heads,
        "kv_channels": config.get("head_dim") or hidden // heads,
        "max_position_embeddings": config.get("max_position_embeddings"),
        "position_embedding_type": "rope",
        "add_position_embedding": False,
        "use_rotary_position_embeddings": True,
        "rotary_base": int(theta) if isinstance(theta, int | float) and theta == int(theta) else theta,
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "add_bias_linear": False,
        "add_qkv_bias": bool(config.get("attention_bias", False)),
        "squared_relu": False,
        "swiglu": True,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "normalization": "RMSNorm",
        "norm_epsilon": config.get("rms_norm_eps"),
        "apply_layernorm_1p": False,
        "qk_layernorm": any(k.endswith("self_attention.q_layernorm.weight") for k in shapes),
        "vocab_size": config.get("vocab_size"),
        "padded_vocab_size": embedding[0] if embedding else None,
        "make_vocab_size_divisible_by": int(config.get("make_vocab_size_divisible_by", 128)),
        "tokenizer_type": "HuggingFaceTokenizer",  # compared only with a --vocab-file tokenizer: it differs
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 1,
        "ckpt_format": FSDP_DTENSOR,
        "use_megatron_fsdp": True,
    }
    experts = next((config[k] for k in _EXPERTS if isinstance(config.get(k), int) and config[k] > 0), None)
    if experts is not None:
        values["num_experts"] = experts
        values["moe_ffn_hidden_size"] = config.get("moe_intermediate_size")
        values["moe_router_topk"] = config.get("num_experts_per_tok")
        values["moe_grouped_gemm"] = grouped_experts
    return argparse.Namespace(**{k: v for k, v in values.items() if v is not None})


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if type(value) is not int:
        raise CkptconvError(
            f"--format {FSDP_DTENSOR}: config.json has no {key} (the `args` Megatron's load checks); "
            "pass --config"
        )
    return value


def with_items(plan: DcpSavePlan, config: Mapping[str, Any], mapping: KeyMapping) -> DcpSavePlan:
    """`plan` with the bytes items Megatron-FSDP's load reads (`args`, `iteration`, `checkpoint_version`)
    instead of any the stash brought, and without a torch_dist source's `_extra_state` objects."""
    import torch

    lead = "".join(part + "." for part in plan.nesting)
    shapes = {t.key[len(lead) :]: t.shape for t in plan.tensors}
    grouped = mapping.written_layouts().get("experts") == GROUPED_EXPERTS
    iteration = iteration_of(plan.stash) or 0
    buffer = io.BytesIO()
    torch.save(megatron_args(config, shapes, grouped), buffer)  # our own Namespace: nothing of the source's
    kept = [i for i in plan.stash if i.key not in _ITEMS and "._extra_state/shard_" not in i.key]
    added = [
        StashedItem("args", ("args",), buffer.getvalue()),
        StashedItem("iteration", ("iteration",), _saved(iteration), iteration, True),
        StashedItem("checkpoint_version", ("checkpoint_version",), _saved(CHECKPOINT_VERSION), 3.0, True),
    ]
    return dataclasses.replace(plan, stash=(*kept, *added))


def _saved(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
