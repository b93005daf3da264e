"""Under torchrun: save a Megatron-FSDP `fsdp_dtensor`-style checkpoint with torch DCP over gloo. usage:
fsdp_dtensor_save.py STATE_PT OUT TP|none

STATE_PT holds plain tensors keyed by Megatron fqn (torch.save'd by the test). Each is saved as a DTensor
sharded by rows over all ranks in Megatron-FSDP's uneven blocks, its chunk metadata set by megatron-core's
own `preprocess_state_dict_for_uneven_dtensor` (_uneven.py), under `model` -> `module.<fqn>`, which DCP
flattens to
`model.module.<fqn>` as Megatron-LM's fsdp_dtensor save does; beside them the pickled items Megatron-LM
writes: `args` (an argparse.Namespace with tensor_model_parallel_size = TP; left out for `none`),
`iteration` and `checkpoint_version`.
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from _uneven import megatron_fsdp_dtensor, megatron_fsdp_state
from torch.distributed.device_mesh import init_device_mesh


def main() -> None:
    state = torch.load(sys.argv[1], weights_only=True)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = {"module." + k: megatron_fsdp_dtensor(v, mesh) for k, v in state.items()}
    sd: dict = megatron_fsdp_state({"model": model})
    sd |= {"iteration": 7, "checkpoint_version": 3.0}
    if sys.argv[3] != "none":
        sd["args"] = argparse.Namespace(tensor_model_parallel_size=int(sys.argv[3]), iteration=7)
    dcp.save(sd, checkpoint_id=sys.argv[2])
    finish()


if __name__ == "__main__":
    main()
