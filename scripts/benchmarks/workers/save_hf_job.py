"""Worker of the save-hf benchmark (scripts/benchmarks/save_hf.py): one rank of the simulated training job.

usage: python -m torch.distributed.run --standalone --nproc-per-node N save_hf_job.py METHOD OUT GB

Holds L layers of two [4096, 4096] fp32 weights as DTensors sharded on dim 0 (about GB of fp32), this rank
filling only its own shards, then saves them with METHOD (`ckptconv`: `save_hf`; `full_tensor+rank0`: every
tensor's `full_tensor()`, rank 0 casting and keeping them, then `save_torch_state_dict`), timed from a barrier
to a barrier; writes OUT.rankR.json: {"rank", "seconds", "extra_rss_gib"}.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

ROWS = 4096


def worker(method: str, out: Path, gb: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    layers = max(1, round(gb * 1e9 / (2 * ROWS * ROWS * 4)))
    rows = ROWS // world
    g = torch.Generator().manual_seed(rank)
    sd = {}
    for i in range(layers):
        for name in ("q_proj", "o_proj"):
            local = torch.empty(rows, ROWS).uniform_(-0.05, 0.05, generator=g)
            sd[f"model.layers.{i}.{name}.weight"] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False
            )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.barrier()
    start = time.perf_counter()
    if method == "ckptconv":
        from ckptconv.live import save_hf

        save_hf(sd, out, dtype="bf16", fp32=(), bucket_size="256MB")
    else:
        from huggingface_hub import save_torch_state_dict

        full = {}
        for key, value in sd.items():
            whole = value.full_tensor()
            if rank == 0:
                full[key] = whole.to(torch.bfloat16)
            del whole
        if rank == 0:
            out.mkdir(parents=True)
            save_torch_state_dict(full, out)
    dist.barrier()
    seconds = time.perf_counter() - start
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    doc = {"rank": rank, "seconds": seconds, "extra_rss_gib": extra}
    out.with_name(f"{out.name}.rank{rank}.json").write_text(json.dumps(doc))
    os._exit(0)


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]))
