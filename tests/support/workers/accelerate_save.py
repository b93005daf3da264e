"""Under torchrun (gloo, CPU), with accelerate 1.15.0 on PYTHONPATH: write what `Accelerator.save_state`
writes for an FSDP2 model with a SHARDED_STATE_DICT plugin, through accelerate's own `save_fsdp_model` and
`save_fsdp_optimizer` (accelerate refuses FSDP on a CPU-only machine, so the model is sharded with torch's
`fully_shard` and the two writers are called as `save_state` calls them). Rank 0 saves the full weights to
OUT/../expected.pt. usage: accelerate_save.py OUT"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
from torch.distributed.fsdp import fully_shard


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)  # MULTI_CPU over gloo
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5))  # 5 rows: uneven over 2 ranks
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    save_fsdp_model(plugin, accelerator, model, str(out))
    save_fsdp_optimizer(plugin, accelerator, opt, model, str(out))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(full, out.parent / "expected.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
