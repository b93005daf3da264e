"""Under torchrun: ckptconv.load_hf of a quantized HF checkpoint into an FSDP2-sharded transformers model.

usage: load_hf_quantized.py CONFIG_DIR HF_DIR REF_PT DTYPE
    the model is built from CONFIG_DIR's config.json (the unquantized source) in DTYPE (bfloat16 | float32),
    a different random init on every rank, every decoder layer and the model fully_shard-ed over all ranks;
    load_hf(HF_DIR); rank 0 prints one JSON line: the report and the keys whose full tensor is not bit for bit
    REF_PT's value (the reference dequantization in DTYPE).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _finish import finish
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

import ckptconv


def main() -> None:
    config_dir, hf_dir, ref_path, dtype = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(dist.get_rank() + 100)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).to(getattr(torch, dtype))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    report = ckptconv.load_hf(state, hf_dir)
    want = torch.load(ref_path, weights_only=True)
    differ = []
    for key, value in state.items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if value.dtype != want[key].dtype or not torch.equal(value, want[key]):
            differ.append(key)
    if dist.get_rank() == 0:
        doc = {"loaded": len(report.loaded), "missing": report.missing, "unexpected": report.unexpected}
        doc |= {"replaced": report.replaced, "differ": differ}
        print(json.dumps(doc), flush=True)
    finish()


if __name__ == "__main__":
    main()
