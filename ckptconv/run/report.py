"""`inspect`: what a checkpoint holds, from metadata and headers only (no tensor bytes are read)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from ckptconv.core.dtype_names import short_name
from ckptconv.core.specs import DcpCheckpoint, StoredTensor
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import is_dcp_dir, open_dcp
from ckptconv.formats.files import exists, is_directory
from ckptconv.formats.hf import is_hf_dir, open_hf
from ckptconv.formats.megatron import megatron_info
from ckptconv.formats.rank_files import left_out
from ckptconv.job.gcpause import paused
from ckptconv.job.ui import human_bytes
from ckptconv.plan.writes import bytes_per_rank
from ckptconv.quant.schemes import described
from ckptconv.remote.urls import is_url

if TYPE_CHECKING:
    from ckptconv.mapping.rules import KeyMapping, Mapped, Target
    from ckptconv.plan.types import DcpSavePlan, HfSavePlan


def inspect(path: Path) -> dict[str, Any]:
    """A JSON-able description of the checkpoint at `path` (DCP dir, HF dir or .safetensors file)."""
    with paused():  # a record per chunk, none of them garbage (gcpause)
        return _inspect(path)


def _inspect(path: Path) -> dict[str, Any]:
    if is_url(path):
        from ckptconv.source.locate import any_source

        path = any_source(str(path))  # object storage: a DCP or an HF checkpoint
    elif not exists(path):
        raise CkptconvError(f"{path}: no such file or directory")
    if is_dcp_dir(path):
        ckpt = open_dcp(path)
        tensors = [
            {
                "key": t.fqn,
                "dtype": t.dtype_name,
                "shape": list(t.shape),
                "nbytes": t.nbytes,
                "chunks": [
                    {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file} for c in t.chunks
                ],
            }
            for t in ckpt.tensors.values()
        ]
        formats = sorted({c.fmt for t in ckpt.tensors.values() for c in t.chunks})
        extra = {"serialization": formats, "non_tensor_items": list(ckpt.items), "release": _release(ckpt)}
        if ckpt.transforms:
            extra["transforms"] = list(ckpt.transforms)
        if ckpt.kind != "dcp":
            extra["writer"] = ckpt.kind
        if ckpt.common is not None:
            extra["common"] = {k: v for k, v in ckpt.common.values.items() if v is not None}
        info = megatron_info(ckpt)
        if info is not None:
            extra["megatron"] = dataclasses.asdict(info)
        kind = "dcp"
    elif is_hf_dir(path) or (not is_directory(path) and path.suffix == ".safetensors"):
        hf = open_hf(path)
        tensors = [_hf_tensor(t) for t in hf.tensors.values()]
        extra = {"files": [f.name for f in hf.files]}
        kind = "safetensors"
    else:
        raise CkptconvError(
            f"{path}: neither a DCP checkpoint (.metadata) nor safetensors; nothing to inspect"
        )
    histogram = Counter(t["dtype"] for t in tensors)
    return {
        "command": "inspect",
        "path": str(path),
        "format": kind,
        "num_tensors": len(tensors),
        "total_bytes": sum(t["nbytes"] for t in tensors),
        "dtypes": dict(sorted(histogram.items())),
        **extra,
        "tensors": tensors,
    }


def _hf_tensor(t: StoredTensor) -> dict[str, Any]:
    """One tensor of an HF checkpoint; a quantized weight as one logical tensor: its stored dtype ("mxfp4" for
    MXFP4 blocks), its logical shape (MXFP4: the [E, in, out] layout transformers loads), the bytes of all its
    parts, and `quantized` (scheme, block size, where the scales are, the dtype it is read in)."""
    if t.quant is None:
        return {
            "key": t.key,
            "dtype": t.dtype_name,
            "shape": list(t.shape),
            "nbytes": t.nbytes,
            "file": t.file.name,
        }
    values, scale = t.quant.parts[:2]
    quantized: dict[str, Any] = {
        "scheme": t.quant.scheme,
        "block_size": t.quant.block_size,
        "scale_key": scale.key,
        "scale_dtype": scale.dtype_name,
        "scale_file": scale.file.name,
        "dequantized_dtype": t.dtype_name,
    }
    quantized["values_key"] = values.key
    if t.quant.scheme == "mxfp4":
        quantized["blocks_key"] = values.key
    if len(t.quant.parts) > 2:
        quantized["other_keys"] = [p.key for p in t.quant.parts[2:]]
    return {
        "key": t.key,
        "dtype": t.quant.stored,
        "shape": list(t.shape),
        "nbytes": t.quant.nbytes,
        "file": values.file.name,
        "quantized": quantized,
    }


def _release(ckpt: DcpCheckpoint) -> dict[str, Any]:
    """What dcp-to-hf would take: the model's tensors (output key -> checkpoint key), what it would stash,
    and the notes saying what it leaves out."""
    from ckptconv.lora.describe import describe
    from ckptconv.plan.release import select_tensors

    selection = select_tensors(ckpt, None)
    stash = [i.fqn for i in selection.stash] + [s.fqn for s in selection.scalars]
    stash += [i.key for i in selection.common]
    shapes = {key: ckpt.tensors[fqn].shape for key, fqn in selection.keys}
    local = None if is_url(ckpt.path) else ckpt.path
    lora = describe(list(shapes), shapes, local)
    notes = [*selection.notes, *(left_out(ckpt) if local is not None else [])]
    return {"model": dict(selection.keys), "stash": stash, "notes": notes, "lora": lora}


def _columns(rows: list[list[str]], indent: str = "") -> list[str]:
    """Plain aligned columns (no truncation, so long keys stay whole and greppable)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _sources(keys: list[str]) -> str:
    unique = list(dict.fromkeys(keys))
    return unique[0] if len(unique) == 1 else f"{unique[0]} (+{len(unique) - 1} more)"


def mapped_targets(
    info: dict[str, Any], mapping: KeyMapping, config: dict[str, Any], allow_unmapped: bool
) -> Mapped:
    """What `mapping` makes of the tensors `inspect` found: to HF names for DCP, to runtime names for HF."""
    from ckptconv.mapping.rules import Direction, map_keys
    from ckptconv.plan.megatron_tp import check_tp_known

    direction: Direction = "to_hf" if info["format"] == "dcp" else "to_runtime"
    shapes = {t["key"]: tuple(t["shape"]) for t in info["tensors"]}
    if direction == "to_hf":  # the model's tensors, as dcp-to-hf takes them
        shapes = {key: shapes[fqn] for key, fqn in info["release"]["model"].items()}
        check_tp_known(mapping, shapes, config)
    return map_keys(mapping, direction, shapes, config, allow_unmapped=allow_unmapped)


def mapped_view(targets: list[Target]) -> list[dict]:
    return [{"key": t.key, "op": t.op, "sources": t.sources, "shape": list(t.shape)} for t in targets]


def render_mapped(view: list[dict], console: Console) -> None:
    rows = [["target", "op", "source", "shape"]]
    rows += [[v["key"], v["op"], _sources(v["sources"]), str(v["shape"])] for v in view]
    for line in _columns(rows, "  "):
        console.print(line, markup=False)


def render_inspect(info: dict[str, Any], console: Console) -> None:
    console.print(
        f"{info['path']}: {info['format']}, {info['num_tensors']} tensors, "
        f"{human_bytes(info['total_bytes'])}, " + ", ".join(f"{d}: {n}" for d, n in info["dtypes"].items()),
        markup=False,
    )
    rows = [["key", "dtype", "shape", "bytes", "chunks" if info["format"] == "dcp" else "file"]]
    for t in info["tensors"]:
        where = str(len(t["chunks"])) if "chunks" in t else t["file"]
        rows.append([t["key"], _dtype_cell(t), str(t["shape"]), human_bytes(t["nbytes"]), where])
    for line in _columns(rows, "  "):
        console.print(line, markup=False)
    quantized = [t for t in info["tensors"] if "quantized" in t]
    if quantized:
        console.print(_quantized_line(quantized), markup=False)
    if info.get("non_tensor_items"):
        console.print("non-tensor items: " + ", ".join(info["non_tensor_items"]), markup=False)
    if info.get("transforms"):
        console.print(
            f"chunks and items ZStandard-compressed ({', '.join(info['transforms'])}): each chunk is "
            "decompressed whole to be read",
            markup=False,
        )
    megatron = info.get("megatron")
    if megatron is not None:
        console.print(megatron_line(megatron), markup=False)
    release = info.get("release")
    if release:
        console.print(
            f"dcp-to-hf takes {len(release['model'])} tensors"
            + (f" and stashes {', '.join(release['stash'])}" if release["stash"] else ""),
            markup=False,
        )
        for note in release["notes"]:
            console.print(f"  {note}", markup=False)
        for adapter in release.get("lora", ()):
            from ckptconv.lora.describe import line as lora_line

            console.print(lora_line(adapter), markup=False)


def megatron_line(megatron: dict[str, Any]) -> str:
    """The line `inspect` prints: "Megatron-FSDP fsdp_dtensor checkpoint, iteration 7, TP at save 2"."""
    fsdp = megatron["format"] == "fsdp_dtensor"
    what = "Megatron-FSDP fsdp_dtensor" if fsdp else "Megatron-Core torch_dist"
    iteration = megatron["iteration"]
    line = f"{what} checkpoint, iteration {'?' if iteration is None else iteration}"
    tp = megatron["tensor_model_parallel_size"]
    return line if tp is None else f"{line}, TP at save {tp}"


def _dtype_cell(t: dict[str, Any]) -> str:
    """`float8_e4m3fn` or, for a quantized weight, `float8_e4m3fn [fp8 128x128 -> bfloat16]`."""
    q = t.get("quantized")
    if q is None:
        return str(t["dtype"])
    block = "x".join(map(str, q["block_size"])) if isinstance(q["block_size"], list) else str(q["block_size"])
    return f"{t['dtype']} [{q['scheme']} {block} -> {q['dequantized_dtype']}]"


def _quantized_line(tensors: list[dict[str, Any]]) -> str:
    """The note under the table: how many weights are quantized, where their scales are, what reads them."""
    schemes: dict[str, int] = {}
    for t in tensors:
        schemes[t["quantized"]["scheme"]] = schemes.get(t["quantized"]["scheme"], 0) + 1
    what = [described(scheme, n) for scheme, n in schemes.items()]
    return (
        f"quantized: {', '.join(what)}; hf-to-dcp, verify and load_hf read them dequantized "
        "(--dtype keep: the dtype after ->) and drop the scales"
    )


def file_writers(plan: HfSavePlan) -> dict[str, list[int]]:
    """{file name: the ranks writing its bytes}."""
    out: dict[str, set[int]] = {f.name: set() for f in plan.files}
    for w in plan.writes:
        out[w.file.name].add(w.rank)
    return {name: sorted(ranks) for name, ranks in out.items()}


def _ranks(ranks: list[int]) -> str:
    """ "rank 3", "ranks 0-2, 5"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def plan_summary(plan: HfSavePlan) -> dict[str, Any]:
    writers = file_writers(plan)
    return {
        "files": [
            {
                "name": f.name,
                "ranks": writers[f.name],
                "nbytes": f.nbytes,
                "tensors": [
                    {
                        "key": t.hf_key,
                        "sources": list(dict.fromkeys(sp.spec.fqn for sp in t.parts)),
                        "op": t.op,
                        "dtype": short_name(t.dtype),
                        "source_dtype": short_name(t.src.dtype),
                        "shape": list(t.file_shape),
                        "nbytes": t.nbytes,
                    }
                    for t in f.tensors
                ],
            }
            for f in plan.files
        ],
        "total_size": plan.total_size,
        "num_tensors": sum(len(f.tensors) for f in plan.files),
        "stash": plan.stashed,
        "quantization": plan.quantization,
        "world_size": plan.world_size,
        "planned_bytes_written": bytes_per_rank(plan.writes, plan.world_size),
        "notes": list(plan.notes),
        "warnings": list(plan.warnings),
        "lora": None
        if plan.lora is None
        else {"mode": plan.lora.mode, "adapter": plan.lora.adapter, "adapter_config": plan.lora.config},
    }


def render_plan(plan: HfSavePlan, console: Console) -> None:
    console.print(
        f"plan: {len(plan.files)} file(s), {sum(len(f.tensors) for f in plan.files)} tensors, "
        f"{human_bytes(plan.total_size)}, {plan.world_size} rank(s)",
        markup=False,
    )
    writers = file_writers(plan)
    for f in plan.files:
        console.print(
            f"{f.name}  written by {_ranks(writers[f.name])}  {human_bytes(f.nbytes)}", markup=False
        )
        rows = [["key", "op", "source", "dtype", "shape", "bytes"]]
        for t in f.tensors:
            src, dst = short_name(t.src.dtype), short_name(t.dtype)
            rows.append(
                [
                    t.hf_key,
                    t.op,
                    _sources([sp.spec.fqn for sp in t.parts]),
                    dst if src == dst else f"{src} -> {dst}",
                    str(list(t.file_shape)),
                    human_bytes(t.nbytes),
                ]
            )
        for line in _columns(rows, "  "):
            console.print(line, markup=False)
    if plan.stashed:
        console.print("stashed non-tensor items: " + ", ".join(plan.stashed), markup=False)


def _stored_dtype(t: StoredTensor) -> str:
    """What an HF tensor is stored as: a quantized weight's stored type (`float8_e4m3fn`, `mxfp4`), which
    hf-to-dcp dequantizes, else its dtype."""
    if t.quant is None:
        return short_name(t.dtype)
    return t.quant.stored


def dcp_plan_summary(plan: DcpSavePlan) -> dict[str, Any]:
    return {
        "tensors": [
            {
                "key": t.key,
                "sources": list(dict.fromkeys(stored.key for stored, _ in t.parts)),
                "op": t.op,
                "dtype": short_name(t.dtype),
                "source_dtype": _stored_dtype(t.src),
                "shape": list(t.shape),
                "nbytes": t.nbytes,
                "rows_per_rank": [list(plan.rows_of(t, r)) for r in range(plan.world_size)]
                if t.shape
                else None,
            }
            for t in plan.tensors
        ],
        "num_tensors": len(plan.tensors),
        "total_size": plan.total_size,
        "non_tensor_items": [i.key for i in plan.stash],
        "world_size": plan.world_size,
        "warnings": list(plan.warnings),
    }


def render_dcp_plan(plan: DcpSavePlan, console: Console) -> None:
    console.print(
        f"plan: {len(plan.tensors)} tensors, {human_bytes(plan.total_size)}, saved as Shard(0) rows over "
        f"{plan.world_size} rank(s)",
        markup=False,
    )
    rows = [["key", "op", "source", "dtype", "shape", "bytes", "rows per rank"]]
    for t in plan.tensors:
        src, dst = _stored_dtype(t.src), short_name(t.dtype)
        split = " ".join(f"{lo}:{hi}" for lo, hi in (plan.rows_of(t, r) for r in range(plan.world_size)))
        rows.append(
            [
                t.key,
                t.op,
                _sources([stored.key for stored, _ in t.parts]),
                dst if src == dst else f"{src} -> {dst}",
                str(list(t.shape)),
                human_bytes(t.nbytes),
                split if t.shape else "replicated",
            ]
        )
    for line in _columns(rows, "  "):
        console.print(line, markup=False)
    if plan.stash:
        console.print("restored non-tensor items: " + ", ".join(i.key for i in plan.stash), markup=False)
