"""Under torchrun: ckptconv.save_hf / load_hf inside a "training job" holding a sharded Tiny model.

usage: live.py save OUT LAYOUT [BACKEND]
           seeded model (no training step: the same values at any world size), sharded per LAYOUT (fsdp2 |
           mesh2d); save_hf -> OUT/live (and quantize="fp8" -> OUT/live_fp8), dcp.save -> OUT/dcp (for
           dcp-to-hf to compare against), rank 0 writes the full values to OUT/ref.pt and save_hf's report
           (+ the number of shard steps) to OUT/report.json
       live.py save-url OUT LAYOUT URL OPTIONS_JSON
           save_hf -> OUT/live and -> URL (object storage)
       live.py load OUT LAYOUT [BACKEND]
           a differently seeded bf16 model sharded per LAYOUT; load_hf(OUT/live); rank 0 prints one JSON line:
           the report, which keys equal the reference bits, and the devices of the tensors after the load
BACKEND: gloo (default; the model on the CPU), or one with nccl ("nccl", "cpu:gloo,cuda:nccl"): the model is
made on the CPU (the same seeded values), then moved to this rank's GPU (LOCAL_RANK) and sharded on "cuda".
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from make_dcp import Tiny, shard
from torch.distributed.tensor import DTensor

import ckptconv
from ckptconv.live.save import LoadSpec

BUCKET = 512  # bytes of gathered tensors per round: several rounds even for this tiny model


def full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()


def main() -> None:
    mode, out, layout = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    backend = sys.argv[4] if mode in ("save", "load") and len(sys.argv) > 4 else "gloo"
    device = "cuda" if "nccl" in backend else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    torch.manual_seed(0 if mode == "save" else 1)
    model = Tiny()
    if mode == "load":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    shard(model, layout, dist.get_world_size(), device)
    sd = model.state_dict()
    if mode == "save-url":
        for where, options in ((out / "live", None), (sys.argv[4], json.loads(sys.argv[5]))):
            kw = {"max_shard_size": 300, "bucket_size": BUCKET, "storage_options": options}
            ckptconv.save_hf(sd, where, extra={"step": 7}, **kw)
    elif mode == "save":
        report = ckptconv.save_hf(sd, out / "live", extra={"step": 7}, max_shard_size=300, bucket_size=BUCKET)
        fp8 = {"quantize": "fp8", "max_shard_size": 300, "bucket_size": BUCKET}
        ckptconv.save_hf(sd, out / "live_fp8", extra={"step": 7}, **fp8)
        dcp.save({"model": sd, "step": 7}, checkpoint_id=str(out / "dcp"))
        ref = {k: full(v) for k, v in sd.items()}
        if dist.get_rank() == 0:
            torch.save(ref, out / "ref.pt")
            steps = sum(len(LoadSpec.from_tensor(k, v).steps) for k, v in sd.items())
            (out / "report.json").write_text(json.dumps(vars(report) | {"steps": steps}))
    else:
        report = ckptconv.load_hf(sd, out / "live")
        ref = torch.load(out / "ref.pt", weights_only=True)
        same = {}
        for key, value in sd.items():
            got = full(value)
            want = ref[key].to(got.dtype)
            same[key] = [str(got.dtype).removeprefix("torch."), bool(torch.equal(got, want))]
        model_params = {k: str(v.dtype) for k, v in model.state_dict().items()}
        if dist.get_rank() == 0:
            doc = {"replaced": report.replaced, "missing": report.missing, "unexpected": report.unexpected}
            devices = sorted({str(getattr(v, "device", "-")) for v in sd.values()})
            doc.update(loaded=len(report.loaded), same=same, model=model_params, devices=devices)
            print(json.dumps(doc), flush=True)
    finish()


if __name__ == "__main__":
    main()
