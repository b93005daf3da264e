"""Under torchrun: save a state dict of plain tensors (torch.save'd by the test, weights_only) as DTensors
sharded Shard(0) over all ranks (uneven when rows do not divide; 0-d tensors replicated) with torch's own
`HuggingFaceStorageWriter(save_distributed=True)`, as NeMo Automodel's training saves: one safetensors file
per rank with DCP_SHARDING_INFO. usage: save_hf_distributed.py STATE_PT OUT [LAYOUT_JSON]

LAYOUT_JSON ({"split": {key: file number from 1}, "config": {...}}): the writer gets the split as its
`fqn_to_index_mapping` (shard files `shard-0000R-model-0000I-of-0000N`), and rank 0 leaves what NeMo
Automodel's checkpointer leaves beside the shards: `.hf_metadata/fqn_to_file_index_mapping.json` (the same
split) and `.hf_metadata/config.json`."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _finish import finish
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def main() -> None:
    state = torch.load(sys.argv[1], weights_only=True)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {k: distribute_tensor(v, mesh, [Shard(0) if v.dim() else Replicate()]) for k, v in state.items()}
    layout = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else {}
    split = layout.get("split")
    writer = HuggingFaceStorageWriter(sys.argv[2], save_distributed=True, fqn_to_index_mapping=split)
    dcp.save(sd, storage_writer=writer)
    if split is not None and dist.get_rank() == 0:
        meta = Path(sys.argv[2]) / ".hf_metadata"
        meta.mkdir()
        (meta / "fqn_to_file_index_mapping.json").write_text(json.dumps(split, indent=2))
        (meta / "config.json").write_text(json.dumps(layout["config"], indent=2))
    finish()


if __name__ == "__main__":
    main()
