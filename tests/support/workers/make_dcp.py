"""Under torchrun: train a tiny model one step with FSDP2 (optionally x TP) and save it with dcp.save.

Also writes `<out>.ref.pt` (rank 0): the full values of every saved tensor, to compare conversions against.
usage: make_dcp.py OUT {fsdp2,mesh2d,tiny} [torch_save|safetensors|zstd]
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 10)  # 10 rows: uneven over 3 and 4 ranks
        self.down = torch.nn.Linear(10, 6, bias=False)
        self.A_log = torch.nn.Parameter(torch.randn(5))  # odd size: uneven over 2 ranks
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.down(torch.relu(self.up(h)))) * self.A_log.exp().sum()


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(6, 3, bias=False)  # 3 rows: a zero-size chunk on a 4th rank
        self.register_buffer("position_ids", torch.arange(7, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.layers:
            h = b(h)
        return self.head(h)


def shard(model: Tiny, layout: str, world: int, device: str = "cpu") -> None:
    """FSDP2 over all ranks, or (mesh2d) a (world/2, 2) mesh: TP on the MLPs, FSDP2 over dp; on `device`'s
    mesh (the model already there)."""
    if layout == "mesh2d":
        mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for b in model.layers:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for b in model.layers:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        mesh = init_device_mesh(device, (world,))
        for b in model.layers:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)


def main() -> None:
    out, layout = sys.argv[1], sys.argv[2]
    fmt = (
        SerializationFormat.SAFETENSORS if sys.argv[3:] == ["safetensors"] else SerializationFormat.TORCH_SAVE
    )
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = Tiny()
    shard(model, layout, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(7).reshape(1, 7) % 11).float().pow(2).mean().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "step": 3,
        "args": {"lr": 0.01, "name": "tiny", "sizes": [6, 10]},
    }
    if layout == "tiny":
        state = {"model": model_sd}
    zstd = sys.argv[3:] == ["zstd"]  # through torch's ZStandard extension, and an uncompressed twin beside
    writer = FileSystemWriter(out, serialization_format=fmt, _extensions=[ZStandard()] if zstd else None)
    dcp.save(state, storage_writer=writer)
    if zstd:
        dcp.save(state, storage_writer=FileSystemWriter(out + ".plain"))
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model_sd.items()
    }
    if dist.get_rank() == 0:
        torch.save(full, out + ".ref.pt")
    finish()


if __name__ == "__main__":
    main()
