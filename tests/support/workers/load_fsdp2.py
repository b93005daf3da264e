"""Under torchrun: dcp.load a ckptconv hf-to-dcp checkpoint into an FSDP2-sharded transformers model.

Checks every parameter and buffer bit for bit against the HF safetensors it came from; prints "loaded N".
usage: load_fsdp2.py HF_DIR DCP_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    hf_dir, dcp_dir = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(dist.get_rank() + 100)  # a different random init on every rank: the load must win
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=dcp_dir)
    want: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        want.update(load_file(f))
    assert set(state) == set(want), set(state) ^ set(want)
    uneven = 0
    for key, value in state.items():
        if isinstance(value, DTensor):
            uneven += value.to_local().shape[0] != -(-value.shape[0] // dist.get_world_size())
            value = value.full_tensor()
        assert value.dtype == want[key].dtype and torch.equal(value, want[key]), key
    if dist.get_rank() == 0:
        print(f"loaded {len(state)} uneven-on-rank0 {uneven}")
    finish()


if __name__ == "__main__":
    main()
