"""Under torchrun (gloo, 2 ranks): a Megatron-FSDP-style fsdp_dtensor checkpoint of the deepseek model.

usage: fsdp_dtensor_deepseek.py EXPECTED OUT {local,grouped} {transformer_layer,mtp_model_layer}

EXPECTED is megatron_deepseek.py's expected.pt (GPTModel.state_dict() names, TP=1). Every tensor goes under
`model.module.<name>` as a DTensor sharded by rows over the 2 ranks in Megatron-FSDP's uneven blocks (chunk
metadata by megatron-core's own `preprocess_state_dict_for_uneven_dtensor`: _uneven.py), with Megatron-FSDP's
renames (megatron/core/transformer/fsdp_dtensor_checkpoint.py, handle_swiglu_in_state_dict /
handle_experts_in_state_dict): each SwiGLU linear_fc1 as `weight_w` (gate half) and `weight_v` (up half),
routed experts as `mlp.experts.local_experts.{e}.` (SequentialMLP, "local") or
`mlp.experts.linear_fc1.weight{e}_w` / `linear_fc2.weight{e}` (TransformerEngine's grouped GEMM, "grouped"),
the MTP inner layer as `transformer_layer` or `mtp_model_layer`; and `args`, `iteration`, `checkpoint_version`
as the bytes items Megatron-LM writes beside them. Saved with torch's own dcp.save."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _finish import finish
from _uneven import megatron_fsdp_dtensor, megatron_fsdp_state


def fsdp_names(model: dict[str, torch.Tensor], experts: str, mtp: str) -> dict[str, torch.Tensor]:
    """The tensors under Megatron-FSDP's on-disk names (without the `model.module.` prefix)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.items():
        name = name.replace("mtp.layers.0.transformer_layer.", f"mtp.layers.0.{mtp}.")
        m = re.fullmatch(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight", name)
        if m is not None and experts == "grouped":
            stem = f"{m.group(1)}{m.group(3)}.weight{m.group(2)}"
        else:
            stem = name
        if name.endswith("linear_fc1.weight"):
            gate, up = t.chunk(2, dim=0)
            out[stem + "_w"], out[stem + "_v"] = gate, up
        else:
            out[stem] = t
    return out


def main() -> None:
    expected, out, experts, mtp = sys.argv[1:5]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.load(expected, weights_only=True)["model"]
    module = {
        f"module.{k}": megatron_fsdp_dtensor(v, mesh) for k, v in fsdp_names(model, experts, mtp).items()
    }
    state: dict[str, object] = megatron_fsdp_state({"model": module})
    state["args"] = argparse.Namespace(tensor_model_parallel_size=1, num_layers=2)
    state["iteration"] = 7
    state["checkpoint_version"] = 3.0
    dcp.save(state, checkpoint_id=out)
    finish()


if __name__ == "__main__":
    main()
