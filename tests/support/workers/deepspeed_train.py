"""Under torchrun (gloo, CPU), with DeepSpeed on PYTHONPATH (tests/support/deepspeed.py): train a tiny
transformers Llama one step under ZeRO stage STAGE and save it with DeepSpeed's own `engine.save_checkpoint`;
then rank 0 writes what DeepSpeed's own `zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` makes of it
(the expected fp32 weights) and the engine's 16-bit `module` weights. Several runs in one job (one start).

usage: deepspeed_train.py OUT SPEC [SPEC ...]     SPEC: STAGE[_tied][_frozen][_universal], e.g. 3_tied_frozen
(no "+" in SPEC: ds_to_universal.py puts its output path into a regular expression unescaped)

OUT/SPEC/ckpt       the checkpoint (`latest`, `global_step1/`)
OUT/SPEC/fp32.pt    {name: tensor} from zero_to_fp32 (torch.save, loadable with weights_only=True)
OUT/SPEC/module.pt  {name: tensor}: the module's bf16 state dict as the engine holds it after the step
                    (ZeRO-3: as `_zero3_consolidated_16bit_state_dict` gathers it)
OUT/SPEC/config     the model's config.json (save_pretrained of its config)
_tied               tie the input embedding and the LM head (DeepSpeed records the head as a shared param)
_frozen             freeze the first layer's input layernorm (ZeRO-2/3 record it as a frozen param)
_universal          also OUT/SPEC/universal: DeepSpeed's own ds_to_universal.py of the checkpoint (rank 0;
                    --inject_missing_state, as a plain model records no universal_checkpoint_info)
"""

from __future__ import annotations

import os
import subprocess
import sys

import deepspeed
import deepspeed.comm.torch  # (shadowed by torch as an attribute of deepspeed.comm)
import torch
import torch.distributed as dist
import transformers
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint


def main() -> None:
    # DeepSpeed's CPU shared-memory allreduce is a C++ op compiled on first use (a minute here); gloo does
    # the same collectives, and the checkpoint it saves does not depend on which did them
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    for spec in sys.argv[2:]:
        stage, *flags = spec.split("_")
        out = os.path.join(sys.argv[1], spec)
        train(int(stage), out, "tied" in flags, "frozen" in flags)
        if "universal" in flags and dist.get_rank() == 0:
            universal(out)
        dist.barrier()
    dist.destroy_process_group()


def train(stage: int, out: str, tied: bool, frozen: bool) -> None:
    """One step of a tiny Llama under ZeRO `stage`, saved to OUT/ckpt, with the expected weights beside."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,  # odd-sized partitions: 80*64 etc. split unevenly over the ranks
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from all ones, so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    if frozen:
        model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    ckpt = os.path.join(out, "ckpt")
    engine.save_checkpoint(ckpt)
    if stage == 3:
        module = engine._zero3_consolidated_16bit_state_dict()
    else:
        module = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    dist.barrier()
    if rank == 0:
        fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt)
        torch.save({k: v.contiguous() for k, v in fp32.items()}, os.path.join(out, "fp32.pt"))
        torch.save({k: v.contiguous() for k, v in module.items()}, os.path.join(out, "module.pt"))
        config.save_pretrained(os.path.join(out, "config"))
    dist.barrier()


def universal(out: str) -> None:
    """DeepSpeed's ds_to_universal.py of OUT/ckpt/global_step1 into OUT/universal (one worker each way)."""
    args = ["--input_folder", os.path.join(out, "ckpt", "global_step1"), "--output_folder"]
    args += [os.path.join(out, "universal"), "--inject_missing_state"]
    args += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    torchrun = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {k: v for k, v in os.environ.items() if k not in torchrun and not k.startswith("TORCHELASTIC")}
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", *args]
    subprocess.run(cmd, check=True, env=env, stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
