"""Under torchrun: resume LoRA training from a DCP that `hf-to-dcp BASE OUT --lora-adapter ADAPTER --prefix
model` wrote. Every rank builds the PEFT-wrapped model (LoraConfig from ADAPTER/adapter_config.json, fresh
factors), shards it with FSDP2, and `dcp.load`s {"model": ...} into it; rank 0 then compares the full state
dict with `PeftModel.from_pretrained(BASE, ADAPTER)`'s (bit for bit, every key) and its logits on IDS with
LOGITS (the trained model's). usage: peft_load.py BASE ADAPTER DCP IDS LOGITS
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM


def main() -> None:
    base, adapter, ckpt, ids, logits = sys.argv[1:6]
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank() + 100)  # fresh factors differ from the adapter's, and between ranks
    config = LoraConfig.from_pretrained(adapter)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).state_dict()
        assert sorted(full) == sorted(want), sorted(set(full) ^ set(want))
        for key, value in want.items():
            assert torch.equal(full[key], value), key
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
        reference.load_state_dict(full)
        with torch.no_grad():
            assert torch.equal(reference(input_ids=torch.load(ids)).logits, torch.load(logits))
        print("peft_load: identical")
    finish()


if __name__ == "__main__":
    main()
