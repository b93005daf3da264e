"""Under torchrun, 4 ranks: LoadSpec.from_tensor for every placement kind, checked against the full tensor.

Prints one JSON line from rank 0: {case: true} when, on every rank, the block LoadSpec names holds exactly the
rank's local data, and the blocks of all ranks tile the tensor (ckptconv.core.layout.tiling_problem is None).
"""

import json

import torch
import torch.distributed as dist
from _finish import finish
from make_dcp import Tiny, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptconv.core.layout import tiling_problem
from ckptconv.live.save import LoadSpec


def check(key: str, value: torch.Tensor, full: torch.Tensor) -> bool:
    spec = LoadSpec.from_tensor(key, value)
    local = value.to_local() if isinstance(value, DTensor) else value
    block = full
    for dim, (offset, size) in enumerate(zip(spec.offsets, spec.sizes, strict=True)):
        block = block.narrow(dim, offset, size)
    ok = spec.shape == tuple(full.shape) and torch.equal(block, local)
    boxes: list = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, (spec.offsets, spec.sizes))
    return bool(ok and tiling_problem(spec.shape, boxes) is None)


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    full = torch.arange(7 * 10 * 6, dtype=torch.float32).reshape(7, 10, 6)
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    mesh3 = init_device_mesh("cpu", (2, world // 2, 1))
    cases = {
        "shard0_uneven": distribute_tensor(full, mesh1, [Shard(0)]),  # 7 rows over 4 ranks: 2, 2, 2, 1
        "shard1": distribute_tensor(full, mesh1, [Shard(1)]),
        "shard2": distribute_tensor(full, mesh1, [Shard(2)]),
        "replicate": distribute_tensor(full, mesh1, [Replicate()]),
        "2d_shard0_shard1": distribute_tensor(full, mesh2, [Shard(0), Shard(1)]),
        "2d_shard1_shard1": distribute_tensor(full, mesh2, [Shard(1), Shard(1)]),
        "2d_replicate_shard2": distribute_tensor(full, mesh2, [Replicate(), Shard(2)]),
        "3d": distribute_tensor(full, mesh3, [Shard(0), Shard(1), Replicate()]),
        "plain": full.clone(),
        "zero_rows": distribute_tensor(full[:2].clone(), mesh1, [Shard(0)]),  # empty blocks on ranks 2 and 3
    }
    result = {
        name: check(name, value, full[:2] if name == "zero_rows" else full) for name, value in cases.items()
    }
    torch.manual_seed(0)
    model = Tiny()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shard(model, "mesh2d", world)  # FSDP2 x TP: _StridedShard on the TP-sharded rows
    for key, value in model.state_dict().items():
        placements = [type(p).__name__ for p in value.placements] if isinstance(value, DTensor) else []
        result[f"mesh2d:{key}:{','.join(placements)}"] = check(key, value, reference[key])
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    finish()


if __name__ == "__main__":
    main()
