"""Load an fsdp_dtensor checkpoint as Megatron-LM's `_load_base_checkpoint` does, with megatron-core 0.16.1's
own functions where they run on CPU (run by tests/interop/test_megatron_fsdp_write.py with megatron-core on
PYTHONPATH, one process, no torch.distributed).

    python megatron_fsdp_load.py CKPT SPEC.json OUT.pt

SPEC: {"num_experts": E or null, "loads": [{"ep_size": N, "ep_rank": R, "keys": {module key: shape}}]}, each
load's keys the model's state dict after `handle_swiglu_in_state_dict` (which needs Megatron-FSDP's CUDA
parameters: the test names its `_w` / `_v` keys as it does), with the rank's local expert numbers. Each load:
megatron-core's `handle_experts_in_state_dict` at that EP rank (global expert numbers), then
`dcp.load({"model": ...})` with strict keys; first, as the rank-0 pass does, `dcp.load` of
`{"args": None, "iteration": None, "checkpoint_version": None}`. OUT.pt: {"items": {...: args as a dict},
"loads": [{global key: tensor}]}.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


def main() -> None:
    ckpt, spec_path, out = sys.argv[1:4]
    with open(spec_path) as f:
        spec = json.load(f)
    items = {"args": None, "iteration": None, "checkpoint_version": None}
    dcp.load(items, checkpoint_id=ckpt, no_dist=True)  # the loader's rank-0 pass (load_args_from_checkpoint)
    loads = []
    for load in spec["loads"]:
        parallel_state.set_expert_model_parallel_world_size(load["ep_size"])
        parallel_state.set_expert_model_parallel_rank(load["ep_rank"])
        model = {k: torch.zeros(shape, dtype=torch.float32) for k, shape in load["keys"].items()}
        if spec["num_experts"]:
            model = handle_experts_in_state_dict(model, spec["num_experts"])
        state = {"model": model}
        planner = DefaultLoadPlanner(allow_partial_load=False)
        dcp.load(state, checkpoint_id=ckpt, planner=planner, no_dist=True)
        loads.append(state["model"])
    args = items["args"]
    torch.save(
        {"items": {**items, "args": vars(args), "args_type": type(args).__name__}, "loads": loads}, out
    )


if __name__ == "__main__":
    main()
