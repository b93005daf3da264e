"""Worker of the scaling benchmark's GPU part (scripts/benchmarks/scaling.py): one rank of a job loading a
model into FSDP2-style DTensors.

usage: python -m torch.distributed.run --standalone --nproc-per-node N load_hf_job.py METHOD SRC GB [DEVICE]

The model: L layers of two [4096, 4096] fp32 weights as DTensors sharded on dim 0 (about GB of fp32), as the
save-hf benchmark's (workers/save_hf_job.py). METHOD:
  prepare    fill it with random values and write it twice, untimed: SRC/hf by `ckptconv.save_hf` (fp32
             safetensors) and SRC/dcp by `dcp.save`
  ckptconv   `ckptconv.load_hf(sd, SRC/hf)` into zeroed DTensors on DEVICE (each rank reads its own rows)
  dcp.load   `dcp.load(sd, checkpoint_id=SRC/dcp)` into the same
timed from a barrier to a barrier; writes SRC/METHOD.rankR.json: {"rank", "seconds", "extra_rss_gib",
"extra_gpu_gib", "checksum"} (the sum of this rank's loaded values in float64: both methods' must agree).
DEVICE: cpu (gloo, the default) or cuda (nccl, one GPU a rank).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

ROWS = 4096


def worker(method: str, src: Path, gb: float, device: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device, (world,))
    layers = max(1, round(gb * 1e9 / (2 * ROWS * ROWS * 4)))
    g = torch.Generator().manual_seed(rank)
    sd = {}
    for i in range(layers):
        for name in ("q_proj", "o_proj"):
            local = torch.zeros(ROWS // world, ROWS)
            if method == "prepare":
                local.uniform_(-0.05, 0.05, generator=g)
            sd[f"model.layers.{i}.{name}.weight"] = DTensor.from_local(
                local.to(device), mesh, [Shard(0)], run_check=False
            )
    if method == "prepare":
        from ckptconv.live.save import save_hf

        save_hf(sd, src / "hf", dtype="fp32", fsync=False)  # fp32: the load reads what it fills
        dcp.save(sd, checkpoint_id=str(src / "dcp"))
        dist.barrier()
        dist.destroy_process_group()
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    gpu_before = torch.cuda.memory_allocated() if cuda else 0
    dist.barrier()
    start = time.perf_counter()
    if method == "ckptconv":
        from ckptconv.live.load import load_hf

        load_hf(sd, src / "hf")
    else:
        dcp.load(sd, checkpoint_id=str(src / "dcp"))
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - start
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    extra_gpu = (torch.cuda.max_memory_allocated() - gpu_before) / 2**30 if cuda else 0.0
    checksum = sum(float(v.to_local().double().sum()) for v in sd.values())
    doc = {"rank": rank, "seconds": seconds, "extra_rss_gib": extra, "extra_gpu_gib": extra_gpu}
    (src / f"{method}.rank{rank}.json").write_text(json.dumps({**doc, "checksum": checksum}))
    os._exit(0)


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "cpu")
