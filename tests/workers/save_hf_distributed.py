"""Under torchrun: save a state dict of plain tensors (torch.save'd by the test, weights_only) as DTensors
sharded Shard(0) over all ranks (uneven when rows do not divide; 0-d tensors replicated) with torch's own
`HuggingFaceStorageWriter(save_distributed=True)`, as NeMo Automodel's training saves: one safetensors file
per rank with DCP_SHARDING_INFO. usage: save_hf_distributed.py STATE_PT OUT"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main() -> None:
    state = torch.load(sys.argv[1], weights_only=True)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {k: distribute_tensor(v, mesh, [Shard(0) if v.dim() else Replicate()]) for k, v in state.items()}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(sys.argv[2], save_distributed=True))
    finish()


if __name__ == "__main__":
    main()
