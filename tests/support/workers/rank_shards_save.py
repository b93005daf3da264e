"""Under torchrun (2 ranks, gloo, CPU), with accelerate 1.15.0 on PYTHONPATH: a tiny bf16 Llama saved as
verl's FSDP checkpoint manager and accelerate's `use_dcp=False` writer save it. usage: rank_shards_save.py OUT

- OUT/expected: the model before sharding, by transformers' `save_pretrained` (what each must convert to).
- OUT/verl (FSDP2 over both ranks) and OUT/verl_tp (FSDP2 x TP, a (1, 2) mesh of dp x tp: q/k/v/gate/up
  column-wise, o/down row-wise, so `_StridedShard` over dp and `Shard` over tp): what verl's
  `FSDPCheckpointManager.save_checkpoint` writes for FSDP2 (verl/utils/checkpoint/fsdp_checkpoint_manager.py
  at commit 01ee5e04e14f2b3723d2fe34f6f5099661733f51): under FSDP2 its `get_fsdp_state_ctx` is a null
  context, so each rank `torch.save`s `model.state_dict()` to `model_world_size_{W}_rank_{R}.pt`,
  `optimizer.state_dict()` to `optim_world_size_{W}_rank_{R}.pt` and `{"lr_scheduler": ..., "rng": ...}` to
  `extra_state_world_size_{W}_rank_{R}.pt`; rank 0 saves the config and tokenizer with `save_pretrained`
  into `huggingface/` and `fsdp_config.json` (`asdict(FSDPConfig(FSDP_version=2, world_size=W))`, indent 4).
  verl itself is not installed (it needs ray, vllm and a GPU stack), so these lines are reproduced here.
- OUT/accelerate: accelerate 1.15.0's own `save_fsdp_model` / `save_fsdp_optimizer` with `use_dcp=False`
  (`pytorch_model_fsdp_0_rank{R}.bin`, `optimizer_0_rank{R}.bin`); 1.15's `save_state` does not pass
  `use_dcp` on (and refuses FSDP without a GPU), so the writers are called as it calls them.
The optimizer takes one step at lr 0: its moments exist, the weights stay as saved.
"""

import copy
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
from tokenizers import Tokenizer, models
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CONFIG = {
    "vocab_size": 99,  # rows split unevenly over 2 ranks
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def _step(model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _verl(model: LlamaForCausalLM, out: Path, tokenizer: PreTrainedTokenizerFast, tp: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = _step(model)
    out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # save_checkpoint's model / optim / extra lines (FSDP2: no state dict context)
    torch.save(model.state_dict(), out / f"model_world_size_{world}_rank_{rank}.pt")
    torch.save(opt.state_dict(), out / f"optim_world_size_{world}_rank_{rank}.pt")
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    torch.save({"lr_scheduler": None, "rng": rng}, out / f"extra_state_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        model.config.save_pretrained(out / "huggingface")
        tokenizer.save_pretrained(out / "huggingface")
        with open(out / "fsdp_config.json", "w") as f:
            json.dump({"FSDP_version": 2, "world_size": world}, f, indent=4)
    dist.barrier()


def _accelerate(model: LlamaForCausalLM, out: Path) -> None:
    accelerator = Accelerator(cpu=True)  # MULTI_CPU over gloo
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = _step(model)
    save_fsdp_model(plugin, accelerator, model, str(out), use_dcp=False)
    save_fsdp_optimizer(plugin, accelerator, opt, model, str(out), use_dcp=False)
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"] - 1)} | {"<unk>": CONFIG["vocab_size"] - 1}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    )
    if dist.get_rank() == 0:
        model.save_pretrained(out / "expected")
    _verl(copy.deepcopy(model), out / "verl", tokenizer, tp=False)
    _verl(copy.deepcopy(model), out / "verl_tp", tokenizer, tp=True)
    _accelerate(copy.deepcopy(model), out / "accelerate")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
