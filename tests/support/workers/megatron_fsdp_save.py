"""Save a checkpoint laid out as Megatron-LM's `--ckpt-format fsdp_dtensor` writes it, with torch's own DCP.

Megatron-LM's `save_checkpoint` (training/checkpointing.py, fsdp_dtensor) hands `dcp.save` the dict
`{"model": {"module.<fqn>": DTensor}, "optimizer": {"state": {"module.module.module.<fqn>": {"exp_avg": ...}},
"param_to_group_meta": ...}, "rng_state": [...], "opt_param_scheduler": {...}, "rerun_state_machine": {...},
"args": argparse.Namespace, "iteration": int, "checkpoint_version": 3.0}`; with virtual pipeline stages the
model is `model0`, `model1`, ... (each chunk its own global layer numbers). SwiGLU's `linear_fc1` is `_w` and
`_v`. Under torchrun (gloo) every model and optimizer tensor is a DTensor sharded by rows over all ranks
in Megatron-FSDP's uneven row blocks, their chunk metadata set by megatron-core's own
`preprocess_state_dict_for_uneven_dtensor` (_uneven.py); alone, plain tensors.

usage: megatron_fsdp_save.py OUT [plain|vpp] [TP|none]   (TP: args.tensor_model_parallel_size; none: left out)
Under torchrun rank 0 also writes `OUT.ref.pt`: {stripped model key: full tensor}.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

OPT_VALUE = 1234.5  # every optimizer value: its bytes must never land in a release


class AttnBackend(enum.Enum):  # a class of the trainer's own, as Megatron-LM's args hold
    auto = 5


def model_chunks(vpp: bool) -> dict[str, dict[str, torch.Tensor]]:
    """{"model": {"module.<fqn>": tensor}}, or two virtual pipeline chunks `model0` / `model1`."""
    shapes = {
        "embedding.word_embeddings.weight": (5, 4),
        "decoder.layers.0.self_attention.linear_qkv.weight": (6, 4),
        "decoder.layers.0.mlp.linear_fc1.weight_w": (3, 4),
        "decoder.layers.0.mlp.linear_fc1.weight_v": (3, 4),
        "decoder.layers.0.mlp.linear_fc2.weight": (4, 3),
        "decoder.layers.1.self_attention.linear_qkv.weight": (6, 4),
        "decoder.layers.1.mlp.linear_fc2.weight": (4, 3),
        "decoder.final_layernorm.weight": (4,),
        "output_layer.weight": (5, 4),
    }
    tensors = {}
    for i, (key, shape) in enumerate(shapes.items()):
        n = 1
        for d in shape:
            n *= d
        tensors[key] = (torch.arange(n, dtype=torch.float32) * 0.25 + i).reshape(shape)
    if not vpp:
        return {"model": {f"module.{k}": v for k, v in tensors.items()}}
    first = [k for k in tensors if k.startswith(("embedding.", "decoder.layers.0."))]
    return {
        "model0": {f"module.{k}": tensors[k] for k in first},
        "model1": {f"module.{k}": v for k, v in tensors.items() if k not in first},
    }


def megatron_args(tp: int | None, vpp: bool) -> argparse.Namespace:
    """An `args` as Megatron-LM saves it: sizes, a torch dtype and one of its own enums."""
    args = argparse.Namespace(
        pipeline_model_parallel_size=1,
        num_layers=2,
        hidden_size=4,
        iteration=7,
        swiglu=True,
        params_dtype=torch.bfloat16,
        attention_backend=AttnBackend.auto,
        virtual_pipeline_model_parallel_size=2 if vpp else None,
    )
    if tp is not None:
        args.tensor_model_parallel_size = tp
    return args


def state(vpp: bool, tp: int | None, place: Any = lambda t: t) -> dict[str, Any]:
    """The whole dict Megatron-LM saves, each model and optimizer tensor through `place`."""
    chunks = model_chunks(vpp)
    models = {name: {k: place(v) for k, v in chunk.items()} for name, chunk in chunks.items()}
    params = {k for chunk in chunks.values() for k in chunk}
    full = {k: v for chunk in chunks.values() for k, v in chunk.items()}
    optimizer = {
        "state": {
            f"module.module.{k}": {
                "exp_avg": place(torch.full_like(full[k], OPT_VALUE)),
                "exp_avg_sq": place(torch.full_like(full[k], OPT_VALUE)),
            }
            for k in sorted(params)
        },
        "param_to_group_meta": {f"module.module.{k}": {"lr": 1e-3, "wd_mult": 1.0} for k in sorted(params)},
    }
    return {
        **models,
        "optimizer": optimizer,
        "rng_state": [{"random_rng_state": (3, (1, 2, 3), None), "torch_rng_state": torch.get_rng_state()}],
        "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 7},
        "rerun_state_machine": {"mode": "disabled"},
        "args": megatron_args(tp, vpp),
        "iteration": 7,
        "checkpoint_version": 3.0,
    }


def expected(vpp: bool) -> dict[str, torch.Tensor]:
    """{model key with its chunk prefix stripped: full tensor}: what a release holds."""
    return {k.removeprefix("module."): v for chunk in model_chunks(vpp).values() for k, v in chunk.items()}


def main() -> None:
    out = sys.argv[1]
    vpp = len(sys.argv) > 2 and sys.argv[2] == "vpp"
    tp = None if len(sys.argv) > 3 and sys.argv[3] == "none" else int(sys.argv[3]) if len(sys.argv) > 3 else 2
    if "WORLD_SIZE" not in os.environ:
        dcp.save(state(vpp, tp), checkpoint_id=out, no_dist=True)
        return
    import torch.distributed as dist
    from _finish import finish
    from _uneven import megatron_fsdp_dtensor, megatron_fsdp_state
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    uneven = state(vpp, tp, lambda t: megatron_fsdp_dtensor(t, mesh))
    dcp.save(megatron_fsdp_state(uneven), checkpoint_id=out)
    if dist.get_rank() == 0:
        torch.save(expected(vpp), out + ".ref.pt")
    finish()


if __name__ == "__main__":
    main()
