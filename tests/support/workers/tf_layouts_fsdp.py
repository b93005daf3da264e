"""Under torchrun: a tiny transformers-5 model (support/tf_layouts.py) sharded with FSDP2, saved with DCP.

usage: tf_layouts_fsdp.py MODEL_TYPE OUT_DIR
Every rank builds the same seeded model, wraps every decoder layer and the root with `fully_shard` (gloo, CPU:
dim 0 of each parameter split over the ranks, 3 experts unevenly), and saves `model.state_dict()` (DTensors)
with `dcp.save` to OUT_DIR: the runtime layout a transformers-5 FSDP2 training job writes.
"""

import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # support/: tf_layouts, families
from tf_layouts import build


def main() -> None:
    model_type, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    model = build(model_type)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    dcp.save(model.state_dict(), checkpoint_id=out)
    finish()


if __name__ == "__main__":
    main()
