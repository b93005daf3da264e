"""Under torchrun: save_hf of an FSDP2-sharded model holding a runtime state dict, with a reference model.

usage: save_reference.py STATE OUT KWARGS_JSON
STATE: a safetensors file of the runtime tensors (torchtitan names, as its adapter's from_hf writes them);
every rank makes a module tree holding them as parameters under their dotted names, fully_shard's each layer
and the root over all ranks (FSDP2: every parameter a Shard(0) DTensor), and calls
`ckptconv.save_hf(model.state_dict(), OUT, **KWARGS)`. Rank 0 prints the report's `reference` (one JSON
line).
"""

import json
import sys

import torch
import torch.distributed as dist
from _finish import finish
from safetensors.torch import load_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ckptconv


def holder(state: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree whose state dict is `state`, each tensor a parameter under its own dotted name."""
    root = nn.Module()
    for key, value in state.items():
        *path, name = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(name, nn.Parameter(value.clone(), requires_grad=False))
    return root


def main() -> None:
    state, out, kwargs = load_file(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = holder(state)
    for layer in model.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = ckptconv.save_hf(model.state_dict(), out, **kwargs)
    if dist.get_rank() == 0:
        print(json.dumps(report.reference), flush=True)
    finish()


if __name__ == "__main__":
    main()
