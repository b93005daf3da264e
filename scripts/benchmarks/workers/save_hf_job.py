"""Worker of the save-hf benchmark (scripts/benchmarks/save_hf.py): one rank of the simulated training job.

usage: python -m torch.distributed.run --standalone --nproc-per-node N save_hf_job.py METHOD OUT GB [DEVICE]

DEVICE: cpu (gloo, the default) or cuda (nccl alone, as a training job on GPUs sets it up; one GPU a rank).
Holds L layers of two [4096, 4096] fp32 weights as DTensors sharded on dim 0 (about GB of fp32), this rank
filling only its own shards, then saves them with METHOD (`ckptconv`: `save_hf`; `full_tensor+rank0`: every
tensor's `full_tensor()`, rank 0 casting and keeping them, then `save_torch_state_dict`), timed from a barrier
to a barrier; writes OUT.rankR.json: {"rank", "seconds", "extra_rss_gib", "extra_gpu_gib"} (the GPU memory
the save allocated beyond the model's: torch.cuda's peak during the save minus before it; 0 on the CPU).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

ROWS = 4096


def worker(method: str, out: Path, gb: float, device: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device, (world,))
    layers = max(1, round(gb * 1e9 / (2 * ROWS * ROWS * 4)))
    rows = ROWS // world
    g = torch.Generator().manual_seed(rank)
    sd = {}
    for i in range(layers):
        for name in ("q_proj", "o_proj"):
            local = torch.empty(rows, ROWS).uniform_(-0.05, 0.05, generator=g).to(device)
            sd[f"model.layers.{i}.{name}.weight"] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False
            )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    gpu_before = torch.cuda.memory_allocated() if cuda else 0
    dist.barrier()
    start = time.perf_counter()
    if method == "ckptconv":
        from ckptconv.live.save import save_hf

        save_hf(sd, out, dtype="bf16", fp32=(), bucket_size="256MB")
    else:
        from huggingface_hub import save_torch_state_dict

        full = {}
        for key, value in sd.items():
            whole = value.full_tensor()
            if rank == 0:
                full[key] = whole.to(torch.bfloat16).cpu()  # the model gathered on the host
            del whole
        if rank == 0:
            out.mkdir(parents=True)
            save_torch_state_dict(full, out)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    extra_gpu = (torch.cuda.max_memory_allocated() - gpu_before) / 2**30 if cuda else 0.0
    doc = {"rank": rank, "seconds": seconds, "extra_rss_gib": extra, "extra_gpu_gib": extra_gpu}
    out.with_name(f"{out.name}.rank{rank}.json").write_text(json.dumps(doc))
    os._exit(0)


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "cpu")
