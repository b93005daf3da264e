"""Under torchrun: a PEFT LoRA model trained one step under FSDP2 and saved whole with DCP, and PEFT's own
outputs for it (the oracles ckptconv is held to).

usage: peft_save.py BASE_DIR OUT_DIR LORA_CONFIG_JSON
BASE_DIR: a tiny transformers model (tests/support/families.py). Every rank builds the same PEFT model from it
(seeded; `init_lora_weights: false` makes B non-zero), wraps every decoder layer and the root with
`fully_shard`, runs one AdamW step on a fixed batch, and saves {"model": get_model_state_dict(model),
"step": 1} with `dcp.save` to OUT_DIR/dcp. Rank 0 then gathers the trained model
(`get_model_state_dict(full_state_dict=True)`) into an unsharded copy and writes, with PEFT's own code:
  OUT_DIR/adapter   `save_pretrained`: adapter_model.safetensors + adapter_config.json
  OUT_DIR/merged    `merge_and_unload()` then `save_pretrained` (fp32)
  OUT_DIR/logits.pt the trained PEFT model's logits on OUT_DIR's fixed input ids (input_ids.pt)
Last, every rank calls `ckptconv.save_hf` on the live sharded model with lora="adapter", "merge" (fp32) and
"drop": OUT_DIR/save_hf_MODE.
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM


def build(base: str, config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(**config))


def main() -> None:
    base, out, config = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    model = build(base, config)
    reference = copy.deepcopy(model)  # unsharded, for rank 0's oracles
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.arange(24).remainder(model.config.vocab_size).view(2, 12)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    dcp.save({"model": get_model_state_dict(model), "step": 1}, checkpoint_id=str(out / "dcp"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        missing, unexpected = reference.load_state_dict(full, strict=True)
        assert not missing and not unexpected
        reference.eval()
        reference.save_pretrained(out / "adapter")
        torch.save(ids, out / "input_ids.pt")
        with torch.no_grad():
            torch.save(reference(input_ids=ids).logits, out / "logits.pt")
        reference.merge_and_unload().save_pretrained(out / "merged")
    dist.barrier()
    import ckptconv  # the library path: the live sharded PEFT model, each mode

    state = get_model_state_dict(model)
    config = out / "adapter" / "adapter_config.json"
    for mode in ("adapter", "merge", "drop"):
        dtype = "fp32" if mode == "merge" else None  # adapter: its own dtype by default
        ckptconv.save_hf(state, out / f"save_hf_{mode}", lora=mode, lora_config=config, dtype=dtype, fp32=())
    finish()


if __name__ == "__main__":
    main()
