"""Baselines of the convert benchmark, DCP -> safetensors and back: the obvious one-process recipes.

usage: python baseline.py MODE SRC OUT, MODE one of format_utils, dcp_load, dcp_load_fsync, dcp_load_fp8,
       hf_storage_writer, load_file_dcp_save, load_file_dcp_save_nofsync

format_utils: `dcp_to_torch_save(CKPT, OUT/tmp.pt)`, `torch.load(weights_only=True)`, take the "model" group,
              cast floating tensors to bf16, `safetensors.torch.save_file(OUT/model.safetensors)`.
dcp_load:     preallocate the full tensors from `FileSystemReader(CKPT).read_metadata()`,
              `dcp.load(no_dist=True)` into them, cast to bf16, `huggingface_hub.save_torch_state_dict(OUT)`.
dcp_load_fsync: as dcp_load (which fsyncs nothing, as save_torch_state_dict and save_file do), then every file
              written, OUT and OUT's parent fsynced one after the other: the same path made durable.
dcp_load_fp8: as dcp_load, then every 2-D `*.weight` but embeddings, norms, router gates and lm_head block-FP8
              quantized with torch ops, the whole tensor at once (DeepSeek-V3's math, as `--quantize fp8`:
              fp32 copy, 128x128 amax / 448, divide, clamp, cast; `weight_scale_inv` beside).
hf_storage_writer (under torchrun): every rank `dcp.load`s its `Shard(0)` rows of the "model" group into
              DTensors, casts them to bf16, and `dcp.save`s them with torch's own HuggingFaceStorageWriter
              (save_distributed=True, enable_consolidation=True): per-rank shards, then torch's consolidation
              into OUT/*.safetensors.
load_file_dcp_save (hf-to-dcp): `safetensors.torch.load_file` of every shard of the HF directory SRC into one
              state dict, then `dcp.save(sd, checkpoint_id=OUT, no_dist=True)`: torch's default writer, which
              fsyncs each file it writes (`FileSystemWriter(sync_files=True)`).
load_file_dcp_save_nofsync: the same with `FileSystemWriter(OUT, sync_files=False)`.

MoE-shaped checkpoints (torchtitan's stacked experts, `..._EFD` / `..._EDF` [E, ...]): format_utils and
dcp_load write one tensor per expert, as the HF layout has it (`w[e]` cast to bf16; the keys keep their stored
names plus `.{e}`, renaming costs nothing); load_file_dcp_save stacks the per-expert tensors
(`...mlp.experts.{e}.gate_proj.weight`) back into [E, ...] tensors with `torch.stack`. hf_storage_writer
writes the experts stacked, as loaded: less work than the real conversion, which favours the baseline.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

GROUP = "model."
STACKED = ("_EFD", "_EDF")  # torchtitan's stacked routed experts
PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")  # HF: one tensor per expert


def to_bf16(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    wide = (torch.float64, torch.float32, torch.float16)  # fp8 stays fp8
    return {k: v.to(torch.bfloat16) if v.dtype in wide else v for k, v in sd.items()}


def split_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked experts [E, ...] -> one view per expert (the cast after this makes each one a tensor)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith(STACKED):
            out.update((f"{k}.{e}", v[e]) for e in range(v.shape[0]))
        else:
            out[k] = v
    return out


def stack_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF per-expert tensors -> torchtitan-like stacked [E, ...] tensors (in expert order)."""
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = PER_EXPERT.match(k)
        if m:
            groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = v
        else:
            out[k] = v
    for k, experts in groups.items():
        out[k] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def format_utils(ckpt: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp = out / "tmp.pt"
    dcp_to_torch_save(ckpt, tmp)
    full = torch.load(tmp, weights_only=True)
    model = to_bf16(split_experts({k: v for k, v in full["model"].items() if isinstance(v, torch.Tensor)}))
    del full
    save_file(model, out / "model.safetensors", metadata={"format": "pt"})
    tmp.unlink()


def load_model(ckpt: Path) -> dict[str, torch.Tensor]:
    """The "model" group of a DCP checkpoint: `dcp.load` into tensors preallocated from its metadata."""
    metadata = FileSystemReader(ckpt).read_metadata()
    sd: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(GROUP) and isinstance(md, TensorStorageMetadata):
            sd[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    return {k.removeprefix(GROUP): v for k, v in sd.items()}


def dcp_load(ckpt: Path, out: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(to_bf16(split_experts(load_model(ckpt))), out)


def dcp_load_fsync(ckpt: Path, out: Path) -> None:
    import os

    dcp_load(ckpt, out)
    for path in sorted(out.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    for directory in (out, out.parent):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)


def quantize_fp8(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        linear = k.endswith(".weight") or re.search(r"_E(FD|DF)\.\d+$", k)  # stacked experts' views
        if v.dim() != 2 or not linear or re.search(r"embed|lm_head|norm|(^|\.)gate\.weight$|router", k):
            out[k] = v
            continue
        rows, cols = v.shape
        sr, sc = -(-rows // 128), -(-cols // 128)
        x = torch.nn.functional.pad(v.float(), (0, sc * 128 - cols, 0, sr * 128 - rows)).view(
            sr, 128, sc, 128
        )
        amax = x.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        q = (x / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        out[k] = q.view(sr * 128, sc * 128)[:rows, :cols].contiguous()
        out[k + "_scale_inv"] = scale
    return out


def dcp_load_fp8(ckpt: Path, out: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    model = quantize_fp8(split_experts(load_model(ckpt)))
    scales = {k: v for k, v in model.items() if k.endswith("_scale_inv")}  # fp32, as released
    save_torch_state_dict({**to_bf16(model), **scales}, out)


def hf_storage_writer(ckpt: Path, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    metadata = FileSystemReader(ckpt).read_metadata()
    sd: dict[str, DTensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(GROUP) and isinstance(md, TensorStorageMetadata) and len(md.size):
            shape = tuple(md.size)
            rows = list(torch.empty(shape[0], device="meta").chunk(world))
            local_rows = rows[rank].shape[0] if rank < len(rows) else 0
            local = torch.empty((local_rows, *shape[1:]), dtype=md.properties.dtype)
            stride = torch.empty(shape, device="meta").stride()
            sd[key] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=md.size, stride=stride
            )
    dcp.load(sd, checkpoint_id=ckpt)
    bf16 = {
        k.removeprefix(GROUP): DTensor.from_local(
            v.to_local().to(torch.bfloat16) if v.is_floating_point() else v.to_local(),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=v.shape,
            stride=v.stride(),
        )
        for k, v in sd.items()
    }
    del sd
    writer = HuggingFaceStorageWriter(str(out), save_distributed=True, enable_consolidation=True)
    dcp.save(bf16, storage_writer=writer)
    dist.barrier()
    dist.destroy_process_group()


def load_file_dcp_save(hf_dir: Path, out: Path, sync_files: bool = True) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemWriter

    sd: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(shard))
    sd = stack_experts(sd)
    if sync_files:
        dcp.save(sd, checkpoint_id=out, no_dist=True)  # torch's default writer: sync_files=True
    else:
        dcp.save(sd, storage_writer=FileSystemWriter(out, sync_files=False), no_dist=True)


def load_file_dcp_save_nofsync(hf_dir: Path, out: Path) -> None:
    load_file_dcp_save(hf_dir, out, sync_files=False)


def main() -> None:
    mode, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    modes = {
        "format_utils": format_utils,
        "dcp_load": dcp_load,
        "dcp_load_fsync": dcp_load_fsync,
        "dcp_load_fp8": dcp_load_fp8,
        "hf_storage_writer": hf_storage_writer,
        "load_file_dcp_save": load_file_dcp_save,
        "load_file_dcp_save_nofsync": load_file_dcp_save_nofsync,
    }
    modes[mode](ckpt, out)


if __name__ == "__main__":
    main()
