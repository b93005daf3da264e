"""Under torchrun: a seeded random state dict of DTensors, saved with dcp.save (property-based round trips).

usage: random_dcp.py OUT SEED. Shapes include 0-d, empty and odd sizes; dtypes fp32, bf16, fp16, fp8, int8,
int64, bool; placements Shard on any dim (uneven, zero-size blocks), Replicate, and 2-D meshes when the world
size is even. Rank 0 writes every full value to OUT.ref.pt.
"""

import random
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int8,
    torch.int64,
    torch.bool,
]


def value(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def main() -> None:
    out, seed = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    rng = random.Random(seed)
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, world // 2)) if world % 2 == 0 and world > 2 else None
    state, ref = {}, {}  # every rank draws the same values (same seed): no scatter (gloo has none for fp8)
    for i in range(rng.randint(6, 12)):
        ndim = rng.choice([0, 1, 1, 2, 2, 3])
        shape = tuple(
            rng.choice([0, 1, 2, 3, 5, 7, 9]) if rng.random() < 0.15 else rng.randint(1, 9)
            for _ in range(ndim)
        )
        dtype = rng.choice(DTYPES)
        full = value(rng, shape, dtype)
        key = f"layers.{i}.{rng.choice(['w', 'b', 'A_log', 'mask'])}"
        if ndim == 0 or rng.random() < 0.2:
            t = distribute_tensor(full, mesh1, [Replicate()], src_data_rank=None)
        elif mesh2 is not None and ndim >= 2 and rng.random() < 0.5:
            t = distribute_tensor(
                full, mesh2, [Shard(rng.randrange(ndim)), Shard(rng.randrange(ndim))], src_data_rank=None
            )
        else:
            t = distribute_tensor(full, mesh1, [Shard(rng.randrange(ndim))], src_data_rank=None)
        state[key], ref[key] = t, full
    dcp.save({"model": state, "step": seed}, checkpoint_id=out)
    if dist.get_rank() == 0:
        torch.save(ref, out + ".ref.pt")
    finish()


if __name__ == "__main__":
    main()
