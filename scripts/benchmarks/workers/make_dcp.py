"""Torchrun worker of the convert benchmark: save a synthetic LLM-shaped fp32 model with FSDP2 and `dcp.save`.

usage: python -m torch.distributed.run --standalone --nproc-per-node 2 make_dcp.py OUT GB [moe]

The default is a dense decoder (a Llama/Qwen-like decoder under Hugging Face's own names, so no key mapping
is needed); `moe` makes a torchtitan Qwen3-MoE-like decoder under torchtitan's names
(`layers.N.attention.qkv_linear.wq`, `moe.router.gate`, the routed experts stacked as
`moe.routed_experts.inner_experts.w1_EFD` / `w3_EFD` [E, F, D] and `w2_EDF` [E, D, F]), converted with
`--mapping torchtitan-qwen3`. FSDP2 shards the stacked experts on dim 0, so each rank stores whole
experts, as expert parallelism does.

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


EXPERTS = 32  # routed experts per MoE layer (Qwen3-30B-A3B has 128 of 768 x 2048; scaled down)


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int  # the MLP's intermediate size; per expert for MoE
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    experts: int = 0  # 0: dense

    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * HEAD_DIM
        attention = 2 * h * h + 2 * kv * h + 2 * h
        if self.experts:  # + q_norm, k_norm, router, stacked experts
            return attention + 2 * HEAD_DIM + self.experts * h + 3 * self.experts * self.ffn * h
        return attention + 3 * self.ffn * h + self.heads

    def params(self) -> int:
        return 2 * self.vocab * self.hidden + self.hidden + self.layers * self.layer_params()


def shape_for(size_gb: float, kind: str = "dense") -> Shape:
    """An LLM-like shape whose fp32 weights come to about `size_gb` * 1e9 bytes."""
    hidden = 512 if size_gb < 0.5 else 1024 if size_gb < 2 else 2048 if size_gb < 8 else 4096
    experts = EXPERTS if kind == "moe" else 0
    ffn = (hidden * (3 if experts else 22) // 8 + 63) // 64 * 64
    heads = hidden // HEAD_DIM
    base = Shape(hidden, ffn, VOCAB, 0, heads, max(1, heads // KV_GROUPS), experts)
    layers = max(1, round((size_gb * 1e9 / 4 - base.params()) / base.layer_params()))
    return Shape(hidden, ffn, VOCAB, layers, heads, base.kv_heads, experts)


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


class QkvLinear(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        kv = s.kv_heads * HEAD_DIM
        self.wq = nn.Linear(s.hidden, s.hidden, bias=False)
        self.wk = nn.Linear(s.hidden, kv, bias=False)
        self.wv = nn.Linear(s.hidden, kv, bias=False)


class TitanAttention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.qkv_linear = QkvLinear(s)
        self.wo = nn.Linear(s.hidden, s.hidden, bias=False)
        self.q_norm = RMSNorm(HEAD_DIM)
        self.k_norm = RMSNorm(HEAD_DIM)


class Router(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate = nn.Linear(s.hidden, s.experts, bias=False)


class GroupedExperts(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.empty(s.experts, s.ffn, s.hidden))
        self.w3_EFD = nn.Parameter(torch.empty(s.experts, s.ffn, s.hidden))
        self.w2_EDF = nn.Parameter(torch.empty(s.experts, s.hidden, s.ffn))


class RoutedExperts(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.inner_experts = GroupedExperts(s)


class Moe(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.router = Router(s)
        self.routed_experts = RoutedExperts(s)


class MoeLayer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.attention = TitanAttention(s)
        self.attention_norm = RMSNorm(s.hidden)
        self.ffn_norm = RMSNorm(s.hidden)
        self.moe = Moe(s)


class TitanMoe(nn.Module):
    """torchtitan's Qwen3-MoE module tree (the state dict keys it saves), without the forward pass."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(MoeLayer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)


def main() -> None:
    out, size_gb = Path(sys.argv[1]), float(sys.argv[2])
    kind = sys.argv[3] if len(sys.argv) > 3 else "dense"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shape = shape_for(size_gb, kind)
    with torch.device("meta"):
        model: CausalLM | TitanMoe = TitanMoe(shape) if kind == "moe" else CausalLM(shape)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layers = model.layers if isinstance(model, TitanMoe) else model.model.layers
    for layer in layers:
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
        info = {**asdict(shape), "kind": kind, "params": n, "fp32_bytes": 4 * n, "ranks": mesh.size()}
        out.with_name(out.name + ".shape.json").write_text(json.dumps(info, indent=2) + "\n")
        partial.rename(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
