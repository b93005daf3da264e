"""Under torchrun (gloo, CPU), with megatron-core 0.16.1 on PYTHONPATH (tests/support/megatron.py): write a
Megatron-Core `dist_checkpointing.save` checkpoint in the torch_dist format, or read one back with
megatron-core's own loader. See docs/notes/megatron-torch-dist.md for what the checkpoints hold.

usage: megatron_save.py sharded OUT
       megatron_save.py gpt OUT [--moe] [--optimizer {dist,local,none}]
                                [--sharding {dp_reshardable,fully_reshardable}] [--singleton-local-shards]
                                [--qk-layernorm]
       megatron_save.py deepseek OUT [--no-q-lora]
       megatron_save.py load OUT RESULT [OUT RESULT ...]
       megatron_save.py load-gpt CONFIG CKPT RESULT [CONFIG CKPT RESULT ...]
       megatron_save.py load-deepseek CKPT RESULT [--no-q-lora]

sharded  (2 ranks) a hand-built sharded state dict of megatron-core ShardedTensors in the layout Megatron-LM
         gives a GPT at TP=2: vocab-parallel embedding and output layer, layer-stacked (prepended layer
         axis) column- and row-parallel weights, TP-replicated norms (replica ids), bf16 and fp32 tensors,
         a per-rank ShardedObject, and a common state (iteration, an argparse.Namespace of args,
         checkpoint_version), saved with `dist_checkpointing.save(sharded_state_dict, OUT)`.
gpt      (2 ranks) a tiny megatron-core GPTModel, local (non-TransformerEngine) spec: 2 layers, hidden 32,
         4 heads in 2 query groups (GQA), SwiGLU, RMSNorm, RoPE, untied output layer, vocab 50 padded to
         64, bf16 (Float16Module) at TP=2, norm weights drawn at random (not all ones), one Adam step
         through megatron's optimizer, saved the way
         Megatron-LM 0.16's save_checkpoint does: {"model": model.sharded_state_dict(metadata),
         "optimizer": optimizer.sharded_state_dict(model_sd, metadata), "rng_state": ShardedObject,
         "args": Namespace, "iteration", "checkpoint_version", "opt_param_scheduler", ...} with
         content_metadata=metadata. --optimizer dist (default): DistributedOptimizer; local: megatron's
         Float16OptimizerWithFloat16Params around torch Adam; none: no optimizer. --sharding: the
         DistributedOptimizer's distrib_optim_sharding_type (Megatron-LM's default dp_reshardable, or
         fully_reshardable as with --dist-ckpt-optim-fully-reshardable). --singleton-local-shards: the
         metadata flag NeMo 2 sets (per-layer keys, SwiGLU halves as separate keys). --moe: 3 experts
         (SequentialMLP, top-2 router) in both layers. --qk-layernorm: Qwen3's RMSNorm of each query and
         key head (q_layernorm, k_layernorm).
deepseek (1 rank) a tiny DeepSeek-V3-style GPTModel (MLA, dense + MoE layers, MTP): see megatron_deepseek.py.
load-deepseek (1 rank) that model loaded from CKPT by megatron's own dist_checkpointing.load (default
         strictness): see megatron_deepseek.py.
load     (any number of ranks) `dist_checkpointing.load` of each OUT with every tensor and ShardedObject in
         full (`load_sharded_metadata`); rank 0 torch.save's {"tensors": {key: tensor}, "common": {...}} to
         RESULT with Namespaces and numpy values made plain (loadable with weights_only=True).
load-gpt (any number of ranks: TP = the world size) Megatron-LM's way of loading a model: the GPTModel that
         gpt built (its options from CONFIG, the config.json gpt wrote) at this TP, `dist_checkpointing.load`
         of its `sharded_state_dict(metadata)` from CKPT (metadata: CKPT's content_metadata), then
         `load_state_dict(strict=True)`; rank 0 torch.save's {"model": every parameter gathered into the TP=1
         layout, "logits": the logits of the fixed tokens, "tokens"} to RESULT.

sharded and gpt also write OUT/../expected.pt (rank 0, plain torch.save, loadable with weights_only=True):
  "tensors": {checkpoint key: full global tensor}, computed here without megatron's checkpoint code;
  "shapes":  {checkpoint key: global shape};
  "common":  the non-tensor values saved (Namespaces as dicts);
  "model":   (gpt) {GPTModel.state_dict() name: full tensor}, the TP=1 in-memory names and layout;
  "logits", "logits_tokens": (gpt) the eval-mode logits [2, 8, padded vocab] (fp32, gathered over TP) of a
             fixed token batch [2, 8], computed with the weights saved;
  "objects": {ShardedObject key: value} where the values are plain;
  "dp_reshardable_index": (gpt, dp_reshardable) {flat optimizer key: [[model key, [index], start, end]]};
and gpt writes OUT/../config.json (the model's sizes and the save options).

CPU stand-ins, only where megatron-core 0.16.1 needs them on a machine without CUDA (the files are still
written by megatron-core's code):
- `torch.cuda.current_device()` -> "cpu": the torch_dist save broadcasts a failure flag created on it
  (strategies/state_dict_saver.py, save_state_dict_async_finalize); the MoE router moves its weight to it
  (transformer/moe/router.py); DDP's grad buffers are allocated on it (param_and_grad_buffer.py).
- `torch.cuda.synchronize()` -> no-op: called after the (non-blocking) device-to-host staging copy of
  every torch_dist save (strategies/filesystem_async.py, preload_tensors).
- `cuda_on_cpu()`, a torch-function mode, around model/optimizer construction, the training step and the
  optimizer's sharded_state_dict only: `device="cuda"` tensors (optimizer.py's loss-scale and found-inf
  tensors), `.cuda()` (fully_reshardable's DP gather) and the `param.type() == "torch.cuda.FloatTensor"`
  checks with which megatron's optimizers reject CPU parameters.
- the CUDA RNG tracker: megatron's inference tracker (fork() is a no-op) instead of
  model_parallel_cuda_manual_seed, which needs torch.cuda RNG state; dropout is 0.
- MoE only: `moe_utils.te_general_gemm = None` (0.16.1 reads that name, defined only when
  TransformerEngine imports), and the step runs in eval mode (MoELayer refuses TP>1 training without
  sequence parallelism, which the local spec's torch norms do not support).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|TransformerEngine).*")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _finish import finish  # noqa: E402


def cpu_stand_ins() -> None:
    """torch.cuda.current_device() and torch.cuda.synchronize() for a CPU-only torch (see the docstring)."""
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


def cuda_on_cpu() -> Any:
    """A torch-function mode in which a CUDA device is the CPU, `Tensor.cuda()` is the identity and a
    no-argument `Tensor.type()` names the CUDA tensor type of the same dtype ("torch.cuda.BFloat16Tensor"),
    for megatron's DDP wrapper and optimizers (see the module docstring)."""
    from torch.overrides import TorchFunctionMode

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = dict(kwargs or {})
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                return func(*args).replace("torch.", "torch.cuda.", 1)
            return func(*args, **kwargs)

    return CudaOnCpu()


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    cpu_stand_ins()
    if mode == "sharded":
        save_sharded(out)
    elif mode == "gpt":
        p = argparse.ArgumentParser(prog="megatron_save.py gpt OUT")
        p.add_argument("--moe", action="store_true")
        p.add_argument("--optimizer", choices=("dist", "local", "none"), default="dist")
        p.add_argument(
            "--sharding", choices=("dp_reshardable", "fully_reshardable"), default="dp_reshardable"
        )
        p.add_argument("--singleton-local-shards", action="store_true")
        p.add_argument("--qk-layernorm", action="store_true")
        o = p.parse_args(sys.argv[3:])
        save_gpt(out, o.moe, o.optimizer, o.sharding, o.singleton_local_shards, o.qk_layernorm)
    elif mode == "deepseek":
        from megatron_deepseek import save_deepseek

        save_deepseek(out, sys.argv[3:])
    elif mode == "load-deepseek":
        from megatron_deepseek import load_deepseek

        load_deepseek(out, Path(sys.argv[3]), sys.argv[4:])
    elif mode == "load":
        paths = [Path(a) for a in sys.argv[2:]]
        for ckpt, result in zip(paths[::2], paths[1::2], strict=True):
            load(ckpt, result)
    elif mode == "load-gpt":
        paths = [Path(a) for a in sys.argv[2:]]
        for options, ckpt, result in zip(paths[::3], paths[1::3], paths[2::3], strict=True):
            load_gpt(json.loads(options.read_text()), ckpt, result)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    stop_results_manager()
    finish()


def stop_results_manager() -> None:
    """Shut down the multiprocessing Manager (a "spawn" server process) that megatron-core's
    FileSystemWriterAsync starts on a rank's first save to collect write results and keeps for the life of
    the job. finish() leaves with os._exit, which never stops it: it would outlive the worker, holding
    torchrun's stdout and stderr open (a caller reading them waits forever) and spinning a CPU."""
    module = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(module, "_results_queue", None)
    if queue is not None:
        queue._manager.shutdown()
        module._results_queue = None  # type: ignore[union-attr]


def plain(value: Any) -> Any:
    """`value` with Namespaces as dicts, numpy arrays as tensors and numpy scalars as Python numbers, so
    that torch.load(weights_only=True) reads it back."""
    import numpy as np

    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    return value


# --- sharded: a hand-built sharded state dict -----------------------------------------------------------

LAYERS, HIDDEN, VOCAB, FFN, QKV = 2, 8, 16, 12, 24  # QKV: rows of the fused projection


def _global(seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A deterministic full tensor (every rank computes the same one and takes its part)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def save_sharded(out: Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "sharded: 2 ranks, TP=2"
    tp = rank  # TP=2, DP=1, PP=1: the TP rank is the rank
    emb, out_layer = "embedding.word_embeddings.weight", "output_layer.weight"
    qkv, qkv_bias = (
        "decoder.layers.self_attention.linear_qkv.weight",
        "decoder.layers.self_attention.linear_qkv.bias",
    )
    proj = "decoder.layers.self_attention.linear_proj.weight"
    fc1, fc2 = "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight"
    norm, final_norm = (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.final_layernorm.weight",
    )
    full = {
        emb: _global(1, (VOCAB, HIDDEN)),
        qkv: _global(2, (LAYERS, QKV, HIDDEN)),
        qkv_bias: _global(3, (LAYERS, QKV)),
        proj: _global(4, (LAYERS, HIDDEN, HIDDEN)),
        fc1: _global(5, (LAYERS, FFN, HIDDEN), torch.bfloat16),
        fc2: _global(6, (LAYERS, HIDDEN, FFN), torch.bfloat16),
        norm: _global(7, (LAYERS, HIDDEN)),
        final_norm: _global(8, (HIDDEN,)),
        out_layer: _global(9, (VOCAB, HIDDEN)),
    }

    def part(t: torch.Tensor, axis: int) -> torch.Tensor:
        return t.chunk(2, dim=axis)[tp].clone()

    # replica ids are tuples; the all-zero one is the main replica, the only one written
    main_replica, tp_replica = (0, 0, 0), (0, tp, 0)
    model: dict[str, Any] = {}
    for key in (emb, out_layer):  # vocab-parallel: rows split over TP
        model[key] = ShardedTensor.from_rank_offsets(
            key, part(full[key], 0), (0, tp, 2), replica_id=main_replica
        )
    for layer in range(LAYERS):  # one ShardedTensor per layer, the layer index a prepended axis 0
        # column-parallel (output rows split: local axis 0) and row-parallel (input columns: local axis 1)
        for key, axis in ((qkv, 0), (qkv_bias, 0), (fc1, 0), (proj, 1), (fc2, 1)):
            model[f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(
                key,
                part(full[key][layer], axis),
                (0, layer, LAYERS),
                (axis + 1, tp, 2),
                replica_id=main_replica,
                prepend_axis_num=1,
            )
        model[f"{norm}.{layer}"] = ShardedTensor.from_rank_offsets(  # replicated over TP
            norm, full[norm][layer].clone(), (0, layer, LAYERS), replica_id=tp_replica, prepend_axis_num=1
        )
    model[final_norm] = ShardedTensor.from_rank_offsets(
        final_norm, full[final_norm].clone(), replica_id=tp_replica
    )
    objects = {
        f"rng_state/shard_{r}_{world}": {"random_rng_state": [r, 1.5], "seed": torch.arange(4) + r}
        for r in range(world)
    }
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=HIDDEN, tensor_model_parallel_size=2, lr=1e-4)
    common = {
        "iteration": 7,
        "args": args,
        "checkpoint_version": 3.0,
        "num_floating_point_operations_so_far": 0,
    }
    content = {"singleton_local_shards": False, "note": "ckptconv test"}
    sd = {
        "model": model,
        # Megatron-LM saves each rank's RNG state like this: one pickled object per rank in the .distcp files
        "rng_state": ShardedObject(
            "rng_state", objects[f"rng_state/shard_{rank}_{world}"], (world,), (rank,)
        ),
        **common,
    }
    out.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sd, str(out), content_metadata=content)
    if rank == 0:
        expected = {
            "tensors": full,
            "shapes": {k: list(v.shape) for k, v in full.items()},
            "common": plain({**common, "content_metadata": content}),
            "objects": objects,
        }
        torch.save(expected, out.parent / "expected.pt")


# --- gpt: a tiny GPTModel ------------------------------------------------------------------------------

VOCAB_SIZE, PADDED_VOCAB = 50, 64  # Megatron-LM pads to make_vocab_size_divisible_by (32) x TP (2)
GPT = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 8,
    "ffn_hidden_size": 40,
    "vocab_size": VOCAB_SIZE,
    "padded_vocab_size": PADDED_VOCAB,
    "make_vocab_size_divisible_by": 32,
    "tensor_model_parallel_size": 2,
    "max_position_embeddings": 16,
    "gated_linear_unit": True,
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "share_embeddings_and_output_weights": False,
    "params_dtype": "bfloat16",
    "layernorm_epsilon": 1e-5,
    "rotary_base": 10000,
}
MOE = {"num_moe_experts": 3, "moe_router_topk": 2, "moe_ffn_hidden_size": 24}

# the local spec's sharded_state_dict_keys_map: its norms are saved under TransformerEngine's names
NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def checkpoint_keys(name: str, singleton: bool) -> list[tuple[str, tuple[int, ...], int | None]]:
    """Where the in-memory parameter `name` (GPTModel.state_dict(), TP=1 layout) goes in the checkpoint:
    [(key, index into the key's leading stacked axes, SwiGLU half or None)]. Layers (and experts) are
    stacked along prepended axes, unless singleton_local_shards: then every layer has its own keys and
    the SwiGLU fc1 is two keys, `_w` (gate half) and `_v` (up half)."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m is None:
        return [(name, (), None)]
    layer, rest = int(m.group(1)), m.group(2)
    for old, new in NORM_KEYS.items():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
    index: tuple[int, ...] = (layer,)
    e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(.+)", rest)
    if e is not None:  # SequentialMLP's experts
        index, rest = (layer, int(e.group(1))), f"mlp.experts.experts.{e.group(2)}"
    glu = rest.endswith("linear_fc1.weight")
    if not singleton:
        return [(f"decoder.layers.{rest}", index, None)]
    if e is not None:
        rest = f"mlp.experts.experts.{e.group(1)}.{e.group(2)}"  # one key per layer and expert
    key = f"decoder.layers.{layer}.{rest}"
    return [(f"{key}_w", (), 0), (f"{key}_v", (), 1)] if glu else [(key, (), None)]


def _stack(entries: dict[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
    """Tensors at index tuples (all the same length) stacked into one tensor with those leading axes."""
    if list(entries) == [()]:
        return entries[()]
    firsts = sorted({i[0] for i in entries})
    assert firsts == list(range(len(firsts))), sorted(entries)
    return torch.stack([_stack({i[1:]: t for i, t in entries.items() if i[0] == f}) for f in firsts])


def build_gpt(options: dict[str, Any]) -> tuple[Any, Any]:
    """The tiny GPTModel (GPT, plus MOE with `num_moe_experts`, and `qk_layernorm`) at TP = the world size,
    wrapped in Float16Module as Megatron-LM does for --bf16: (GPTModel, the wrapper)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)  # use_cpu_initialization: every rank draws the full weight and keeps its part
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)  # see the module docstring
    moe = options.get("num_moe_experts") is not None
    qk = bool(options.get("qk_layernorm", False))
    config = TransformerConfig(
        num_layers=GPT["num_layers"],
        hidden_size=GPT["hidden_size"],
        num_attention_heads=GPT["num_attention_heads"],
        num_query_groups=GPT["num_query_groups"],
        kv_channels=GPT["kv_channels"],
        ffn_hidden_size=GPT["ffn_hidden_size"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        layernorm_epsilon=GPT["layernorm_epsilon"],
        qk_layernorm=qk,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        **(MOE if moe else {}),
    )
    spec = get_gpt_layer_local_spec(
        num_experts=MOE["num_moe_experts"] if moe else None, normalization="RMSNorm", qk_layernorm=qk
    )
    if moe:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)  # see the module docstring
    with cuda_on_cpu():
        gpt = GPTModel(
            config,
            spec,
            vocab_size=PADDED_VOCAB,
            max_sequence_length=GPT["max_position_embeddings"],
            position_embedding_type="rope",
            rotary_base=GPT["rotary_base"],
            share_embeddings_and_output_weights=False,
        )
        # as Megatron-LM's get_model does for --bf16: every parameter (the torch norms too) becomes bf16
        model = Float16Module(config, gpt)
    return gpt, model


def distinct_norms(gpt: Any) -> None:
    """Every norm weight (initialised to ones) set to 1 + 0.1 * randn from a seeded generator, the same on
    every rank (norms are replicated over TP): a mapping that swapped two norms would show."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))


def gpt_logits(model: Any) -> torch.Tensor:
    """The model's logits [2, 8, padded vocab] (fp32, gathered over TP) for logits_tokens(), in eval mode."""
    from megatron.core import parallel_state

    model.eval()
    tokens = logits_tokens()
    with torch.no_grad(), cuda_on_cpu():
        local = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None).float()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def logits_tokens() -> torch.Tensor:
    """The fixed token batch [2, 8] whose logits gpt and load-gpt record."""
    return torch.randint(0, VOCAB_SIZE, (2, 8), generator=torch.Generator().manual_seed(7))


def save_gpt(out: Path, moe: bool, optimizer: str, sharding: str, singleton: bool, qk: bool) -> None:
    import random

    import numpy as np
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    assert dist.get_world_size() == 2, "gpt: 2 ranks, TP=2"
    options: dict[str, Any] = {**(MOE if moe else {}), "qk_layernorm": qk}
    gpt, model = build_gpt(options)
    distinct_norms(gpt)
    config = gpt.config
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ddp = opt = None
    if optimizer != "none":
        distributed = optimizer == "dist"
        with cuda_on_cpu():
            ddp = DistributedDataParallel(
                config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model
            )
            opt = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=1e-3,
                    weight_decay=0.0,
                    clip_grad=0.0,
                    use_distributed_optimizer=distributed,
                    bf16=True,
                    params_dtype=torch.bfloat16,
                ),
                [ddp],
            )
            if moe:
                ddp.eval()  # see the module docstring
            g = torch.Generator().manual_seed(5)
            tokens = torch.randint(0, VOCAB_SIZE, (2, 8), generator=g)
            position_ids = torch.arange(8).expand(2, 8)
            loss = ddp(tokens, position_ids, None, labels=tokens.roll(-1, 1)).float().mean()
            loss.backward()
            ddp.finish_grad_sync()
            opt.step()
    logits = gpt_logits(model)  # of the weights saved (after the step)
    # Megatron-LM 0.16's metadata for sharded_state_dict (checkpointing.py), less its process group
    metadata = {
        "distrib_optim_sharding_type": sharding,
        "singleton_local_shards": singleton,
        "chained_optim_avoid_prefix": True,
    }
    sd: dict[str, Any] = {"model": model.sharded_state_dict(metadata=metadata)}
    if opt is not None:
        with cuda_on_cpu():
            sd["optimizer"] = opt.sharded_state_dict(sd["model"], metadata=metadata)
    # Megatron-LM's rng_state: one object per (pp, tp) rank, replicated over dp; numpy's state included
    rng = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": {},
    }
    sd["rng_state"] = ShardedObject("rng_state", [rng], (1, 2), (0, tp_rank), replica_id=0)
    args = argparse.Namespace(**GPT, **(MOE if moe else {}), qk_layernorm=qk)
    common = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 1,
        "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 16, "decay_style": "cosine"},
        "num_floating_point_operations_so_far": 123,
    }
    sd.update(common)
    out.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sd, str(out), content_metadata=metadata)

    expected = gpt_expected(gpt, opt, optimizer, sharding, singleton)
    expected["logits"], expected["logits_tokens"] = logits, logits_tokens()
    if dist.get_rank() == 0:
        # megatron adds its dp_cp_group to `metadata` and drops it again from the saved content_metadata
        content = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
        expected["common"] = plain({**common, "content_metadata": content})
        torch.save(expected, out.parent / "expected.pt")
        config_json = {**GPT, **(MOE if moe else {}), "optimizer": optimizer, "sharding": sharding}
        config_json["singleton_local_shards"] = singleton
        config_json["qk_layernorm"] = qk
        (out.parent / "config.json").write_text(json.dumps(config_json, indent=1) + "\n")


def gather(t: torch.Tensor, param: torch.nn.Parameter, name: str) -> torch.Tensor:
    """`t` (the parameter `name`, or a state of it, as this TP rank holds it) in the TP=1 layout, with
    plain all_gathers over its TP group (the SwiGLU fc1's halves each gathered on its own)."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return t.detach().clone()
    expert = not getattr(param, "allreduce", True)
    group = (
        parallel_state.get_expert_tensor_parallel_group()
        if expert
        else parallel_state.get_tensor_model_parallel_group()
    )
    dim = param.partition_dim

    def cat(x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x, dtype=torch.float32) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.detach().float().contiguous(), group=group)
        return torch.cat(parts, dim).to(x.dtype)

    if name.endswith("linear_fc1.weight"):  # SwiGLU: each rank holds [gate_r; up_r]
        return torch.cat([cat(half) for half in t.chunk(2, dim)], dim)
    return cat(t)


def gpt_expected(gpt: Any, opt: Any, optimizer: str, sharding: str, singleton: bool) -> dict[str, Any]:
    """Every parameter (and its optimizer state) gathered over TP into the TP=1 layout with plain
    all_gathers, then placed under its checkpoint key(s) by `checkpoint_keys`: what the checkpoint should
    hold, computed without megatron's sharded_state_dict or checkpoint code."""
    states: dict[int, dict[str, torch.Tensor]] = {}  # id(model param) -> its optimizer tensors
    if opt is not None:
        inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
        for _, p in gpt.named_parameters():
            main = p.main_param
            assert main.numel() == p.numel(), "DP=1: the main param covers the whole parameter"
            st = next(o.state[main] for o in inner if main in o.state)
            fp32 = "fp32_param" if optimizer == "local" else "param"
            states[id(p)] = {
                fp32: main.detach().view(p.shape),
                "exp_avg": st["exp_avg"].view(p.shape),
                "exp_avg_sq": st["exp_avg_sq"].view(p.shape),
            }

    model_full: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    params = dict(gpt.named_parameters())
    for name, p in params.items():
        values = {"": gather(p, p, name)}
        model_full[name] = values[""]
        flat_sharded = optimizer == "dist" and sharding == "dp_reshardable"
        if id(p) in states and not flat_sharded:
            values.update({f"optimizer.state.{k}.": gather(v, p, name) for k, v in states[id(p)].items()})
        for prefix, full in values.items():
            for key, index, half in checkpoint_keys(name, singleton):
                value = full if half is None else full.chunk(2, 0)[half]
                stacked.setdefault(prefix + key, {})[index] = value
    tensors = {key: _stack(entries) for key, entries in stacked.items()}
    expected: dict[str, Any] = {"model": model_full, "tensors": tensors}

    if optimizer == "dist" and sharding == "dp_reshardable":
        # one flat fp32 tensor per (grad buffer, bucket) and state, per TP rank (dp_group_idx): each
        # parameter's main param and moments at its range in the bucket, zeros in padding
        names = {id(p): n for n, p in params.items()}
        flat: dict[str, torch.Tensor] = {}
        index: dict[str, list[Any]] = {}
        for o in getattr(opt, "chained_optimizers", [opt]):
            for gbuf_idx, buffer in enumerate(o.buffers):
                dtype = (buffer.param_dtype, buffer.grad_dtype)
                for bucket_idx, bucket in enumerate(buffer.buckets):
                    stem = (
                        f"optimizer.distributed.dp_group_idx_{o.data_parallel_group_idx}.gbuf_idx_{gbuf_idx}"
                        f".dtype_{dtype}.bucket_idx_{bucket_idx}."
                    )
                    rows = []
                    for k in ("param", "exp_avg", "exp_avg_sq"):
                        flat[stem + k] = torch.zeros(bucket.numel_unpadded, dtype=torch.float32)
                    for p in bucket.params_list:
                        start, end, _ = buffer.param_index_map[p]
                        start, end = start - bucket.offset, end - bucket.offset
                        for k, v in states[id(p)].items():
                            flat[stem + k][start:end] = v.reshape(-1)
                        key, idx, _ = checkpoint_keys(names[id(p)], False)[0]
                        rows.append([names[id(p)], key, list(idx), start, end])
                    for k in ("param", "exp_avg", "exp_avg_sq"):
                        index[stem + k] = sorted(rows, key=lambda r: r[3])
        # every rank's flat tensors, under their own dp_group_idx
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (flat, index))
        for f, i in everyone:
            tensors.update(f)
            expected.setdefault("dp_reshardable_index", {}).update(i)
    expected["shapes"] = {k: list(v.shape) for k, v in tensors.items()}
    return expected


# --- load: megatron's own reader ------------------------------------------------------------------------


def load_gpt(options: dict[str, Any], ckpt: Path, result: Path) -> None:
    """Megatron-LM's way to load a model: the same GPTModel built at TP = the world size, its
    `sharded_state_dict(metadata)` (metadata: the checkpoint's content_metadata, {} without one) filled by
    `dist_checkpointing.load` (megatron's default strictness) and put into the model with
    `load_state_dict(strict=True)`. Rank 0 saves {"model": every parameter in the TP=1 layout, "logits": the
    logits of logits_tokens(), "tokens"} to RESULT."""
    from megatron.core import dist_checkpointing, parallel_state

    gpt, model = build_gpt(options)
    with torch.no_grad():  # nothing of the model as built survives: whatever the load misses shows as 0
        for p in gpt.parameters():
            p.zero_()
    metadata = dist_checkpointing.load_content_metadata(str(ckpt)) or {}
    with cuda_on_cpu():
        # under "model", as Megatron-LM asks for it: the common values land beside it
        sharded = {"model": gpt.sharded_state_dict(metadata=metadata)}
        loaded = dist_checkpointing.load(sharded, str(ckpt))
    gpt.load_state_dict(loaded["model"], strict=True)
    full = {name: gather(p, p, name) for name, p in gpt.named_parameters()}
    logits = gpt_logits(model)
    if dist.get_rank() == 0:
        torch.save({"model": full, "logits": logits, "tokens": logits_tokens()}, result)
    parallel_state.destroy_model_parallel()


def load(out: Path, result: Path) -> None:
    """Every tensor and ShardedObject in full: `load_sharded_metadata` describes each unsharded,
    `dist_checkpointing.load` fills them in on top of the common state dict."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    loaded = dist_checkpointing.load(
        load_sharded_metadata(str(out)), str(out), validate_access_integrity=False
    )
    if dist.get_rank() == 0:
        tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
        common = plain({k: v for k, v in loaded.items() if not isinstance(v, torch.Tensor)})
        torch.save({"tensors": tensors, "common": common}, result)


if __name__ == "__main__":
    main()
