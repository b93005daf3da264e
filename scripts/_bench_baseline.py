"""Baseline conversions for scripts/bench.py, DCP -> safetensors and back: the obvious one-process recipes.

usage: python scripts/_bench_baseline.py {format_utils,dcp_load,load_file_dcp_save} SRC OUT

format_utils: `dcp_to_torch_save(CKPT, OUT/tmp.pt)`, `torch.load(weights_only=True)`, take the "model" group,
              cast floating tensors to bf16, `safetensors.torch.save_file(OUT/model.safetensors)`.
dcp_load:     preallocate the full tensors from `FileSystemReader(CKPT).read_metadata()`,
              `dcp.load(no_dist=True)` into them, cast to bf16, `huggingface_hub.save_torch_state_dict(OUT)`.
load_file_dcp_save (hf-to-dcp): `safetensors.torch.load_file` of every shard of the HF directory SRC into one
              state dict, then `dcp.save(sd, checkpoint_id=OUT, no_dist=True)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

GROUP = "model."


def to_bf16(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}


def format_utils(ckpt: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = out / "tmp.pt"
    dcp_to_torch_save(ckpt, tmp)
    full = torch.load(tmp, weights_only=True)
    model = to_bf16({k: v for k, v in full["model"].items() if isinstance(v, torch.Tensor)})
    del full
    save_file(model, out / "model.safetensors", metadata={"format": "pt"})
    tmp.unlink()


def dcp_load(ckpt: Path, out: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    metadata = FileSystemReader(ckpt).read_metadata()
    sd: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(GROUP) and isinstance(md, TensorStorageMetadata):
            sd[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    model = to_bf16({k.removeprefix(GROUP): v for k, v in sd.items()})
    del sd
    save_torch_state_dict(model, out)


def load_file_dcp_save(hf_dir: Path, out: Path) -> None:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(shard))
    dcp.save(sd, checkpoint_id=out, no_dist=True)


def main() -> None:
    mode, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    modes = {"format_utils": format_utils, "dcp_load": dcp_load, "load_file_dcp_save": load_file_dcp_save}
    modes[mode](ckpt, out)


if __name__ == "__main__":
    main()
