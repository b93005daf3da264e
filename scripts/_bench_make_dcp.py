"""Torchrun worker for scripts/bench.py: save a synthetic LLM-shaped fp32 model with FSDP2 and `dcp.save`.

usage: python -m torch.distributed.run --standalone --nproc-per-node 2 scripts/_bench_make_dcp.py OUT SIZE_GB

The model is built on the meta device, sharded with `fully_shard` (each layer, then the root) over a 1-D
gloo mesh of all ranks, materialized with `to_empty` and filled with uniform noise shard by shard, so no rank
ever holds more than its own shards. It is saved as `{"model": model.state_dict()}` into OUT.partial, which
rank 0 renames to OUT once every rank is done (an existing OUT is always complete); the shape goes to
OUT.shape.json.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

VOCAB = 32_000
HEAD_DIM = 64
KV_GROUPS = 4  # grouped-query attention: 4 query heads per key/value head


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int

    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * HEAD_DIM
        return 2 * h * h + 2 * kv * h + 3 * self.ffn * h + 2 * h + self.heads

    def params(self) -> int:
        return 2 * self.vocab * self.hidden + self.hidden + self.layers * self.layer_params()


def shape_for(size_gb: float) -> Shape:
    """An LLM-like shape whose fp32 weights come to about `size_gb` * 1e9 bytes."""
    hidden = 512 if size_gb < 0.5 else 1024 if size_gb < 2 else 2048 if size_gb < 8 else 4096
    ffn = (hidden * 11 // 4 + 63) // 64 * 64
    heads = hidden // HEAD_DIM
    base = Shape(hidden, ffn, VOCAB, 0, heads, max(1, heads // KV_GROUPS))
    layers = max(1, round((size_gb * 1e9 / 4 - base.params()) / base.layer_params()))
    return Shape(hidden, ffn, VOCAB, layers, heads, base.kv_heads)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        kv = s.kv_heads * HEAD_DIM
        self.q_proj = nn.Linear(s.hidden, s.hidden, bias=False)
        self.k_proj = nn.Linear(s.hidden, kv, bias=False)
        self.v_proj = nn.Linear(s.hidden, kv, bias=False)
        self.o_proj = nn.Linear(s.hidden, s.hidden, bias=False)
        self.A_log = nn.Parameter(torch.zeros(s.heads))


class Mlp(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.ffn, bias=False)
        self.down_proj = nn.Linear(s.ffn, s.hidden, bias=False)


class Layer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden)
        self.mlp = Mlp(s)


class Decoder(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden)


class CausalLM(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.model = Decoder(s)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)


def main() -> None:
    out, size_gb = Path(sys.argv[1]), float(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shape = shape_for(size_gb)
    with torch.device("meta"):
        model = CausalLM(shape)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(1234 + rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.uniform_(-0.05, 0.05)
    partial = out.with_name(out.name + ".partial")
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(partial))
    dist.barrier()
    if rank == 0:
        n = shape.params()
        info = {**asdict(shape), "params": n, "fp32_bytes": 4 * n, "ranks": mesh.size()}
        out.with_name(out.name + ".shape.json").write_text(json.dumps(info, indent=2) + "\n")
        partial.rename(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
