"""Under torchrun: save a seeded runtime-named state dict (torchtitan-style names) as DTensors with DCP.

Every rank builds the same full tensors from the seed, shards them (experts on dim 0 or dim 1, others on
dim 0, norms replicated) and saves {"model": ...}. usage: save_runtime.py OUT SPEC_JSON [HF_OUT PRESET CONFIG]
SPEC_JSON maps key -> [shape, dtype, placement] with placement "shard0", "shard1" or "replicate".
With HF_OUT, the same DTensors are also written by ckptconv.save_hf (mapping PRESET, dtypes kept, 8KB
shards, sizes from the config.json CONFIG), for comparison with dcp-to-hf of OUT.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def full_tensors(spec: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out = {}
    for key, (shape, dtype, _) in spec.items():
        out[key] = torch.randn(shape, generator=g).to(getattr(torch, dtype))
    return out


def main() -> None:
    out, spec = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placements = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}
    sd = {k: distribute_tensor(v, mesh, [placements[spec[k][2]]]) for k, v in full_tensors(spec).items()}
    dcp.save({"model": sd, "step": 11}, checkpoint_id=out)
    if len(sys.argv) > 3:
        import ckptconv

        config = json.loads(Path(sys.argv[5]).read_text())
        ckptconv.save_hf(
            {"model": sd, "step": 11},
            sys.argv[3],
            mapping=sys.argv[4],
            dtype="keep",
            fp32=(),
            max_shard_size="8KB",
            config=config,
        )
    finish()


if __name__ == "__main__":
    main()
