"""Under torchrun: load a state dict of plain tensors (torch.save'd by the test, weights_only) and save it
with DCP as DTensors sharded Shard(0) over all ranks (uneven when rows do not divide; 0-d tensors
replicated), the way FSDP2 saves. usage: save_sharded_state.py STATE_PT OUT"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main() -> None:
    state = torch.load(sys.argv[1], weights_only=True)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {k: distribute_tensor(v, mesh, [Shard(0) if v.dim() else Replicate()]) for k, v in state.items()}
    dcp.save({"model": sd}, checkpoint_id=sys.argv[2])
    finish()


if __name__ == "__main__":
    main()
