"""DeepSpeed ZeRO-1/2/3 checkpoints read as a DCP source: `CKPT/latest` names the tag directory (or `CKPT`
is `global_stepN/` itself), whose `mp_rank_00_model_states.pt` (ZeRO-3: one
`zero_pp_rank_R_mp_rank_00_model_states.pt` per rank) lists the parameters (`param_shapes`,
`frozen_param_shapes`, `shared_params`, `buffer_names`) and whose
`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` hold each rank's fp32 master partition
(`single_partition_of_fp32_groups`, ZeRO-3: `fp32_flat_groups`). The parameters are put back together by
the rules of DeepSpeed's own `zero_to_fp32.py` (deepspeed_layout), as raw chunks read in place from the
files: the pickles are read through an allowlist (deepspeed_pickle), the Adam moments never.

`--deepspeed-weights module` reads the 16-bit `module` state dict of the model states file instead. Frozen
parameters come from `frozen_param_fragments` (ZeRO-2/3); a ZeRO-1 checkpoint records none, so those come
from `module`. A shared (tied) parameter is the one it shares, under both names; buffers come from `module`
as stored (zero_to_fp32 makes floating ones fp32).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ckptconv.core.specs import DcpCheckpoint, TensorSpec
from ckptconv.errors import CkptconvError
from ckptconv.formats.deepspeed import MODEL, OPTIM, step_dir, weights
from ckptconv.formats.deepspeed_layout import Piece, Span, chunks, zero2_pieces, zero3_pieces
from ckptconv.formats.deepspeed_pickle import PickledFile, read_pickled
from ckptconv.formats.deepspeed_universal import is_universal, universal_tensors
from ckptconv.formats.files import inside, listdir
from ckptconv.formats.safe_pickle import short
from ckptconv.formats.torch_record import TensorRecord
from ckptconv.job.limits import MAX_DIMS

_UNIVERSAL = "ds_to_universal.py"


def _fail(where: object, what: str) -> CkptconvError:
    return CkptconvError(f"{where}: {what}")


def open_deepspeed(path: Path) -> DcpCheckpoint:
    """The parameters of the DeepSpeed checkpoint `path` (as `--deepspeed-weights` says) as a checkpoint of
    raw chunks; a layout it cannot put back together is refused, pointing to DeepSpeed's
    ds_to_universal.py."""
    found = step_dir(path)
    if found is None:
        raise _fail(path, "not a DeepSpeed checkpoint (no `latest` and no *_model_states.pt)")
    step, prefix = found
    inside(step, path)
    names = sorted(listdir(step))
    models = {n: MODEL.fullmatch(n) for n in names if MODEL.fullmatch(n)}
    optims = {n: OPTIM.fullmatch(n) for n in names if OPTIM.fullmatch(n)}
    for n, m in [*models.items(), *optims.items()]:
        if m is not None and m.group(2) != "00":
            raise _fail(
                step / n,
                f"a model-parallel rank file (mp_rank_{m.group(2)}): ckptconv puts back "
                f"data-parallel ZeRO partitions only; convert with DeepSpeed's {_UNIVERSAL} first",
            )
    model_name = "mp_rank_00_model_states.pt"
    if model_name not in models:
        model_name = "zero_pp_rank_0_mp_rank_00_model_states.pt"
        if model_name not in models:
            raise _fail(step, "no mp_rank_00_model_states.pt (nor zero_pp_rank_0_mp_rank_00_model_states.pt)")
    model = read_pickled(path, prefix + model_name)
    state = _dict(model.value, model.path)
    _refuse_unsupported(path / model.rel, state)
    module = _dict(state.get("module"), f"{model.path}: module")
    stamps = {model.rel: model.stamp}
    if weights() == "module":
        tensors = _module_tensors(path, model, module, state)
        return DcpCheckpoint(path, tensors, {}, {k: (k,) for k in tensors}, stamps, kind="deepspeed")
    if not optims and is_universal(step):
        listed = {
            k: _shape(v, model.path)
            for g in state.get("param_shapes") or []
            for k, v in _dict(g, model.path).items()
        }
        tensors, more = universal_tensors(path, prefix, listed)
        stamps.update(more)
        if state.get("frozen_param_shapes"):  # not in zero/: the model states files' fragments
            ranks = sorted(int(m.group(1)) for m in models.values() if m and m.group(1) is not None)
            files = [model] + [read_pickled(path, prefix + _zero3_model(r)) for r in ranks[1:]]
            stamps.update({f.rel: f.stamp for f in files})
            tensors.update(_frozen(path, 3 if ranks else 2, state, files))
        return _finish(path, model, module, state, tensors, stamps)
    if not optims:
        raise _fail(
            step,
            "no *_optim_states.pt: the fp32 master weights are not there; "
            "use --deepspeed-weights module for the 16-bit module weights",
        )
    rank0 = read_pickled(path, prefix + _optim_file(step, optims, 0))
    osd = _dict(
        _dict(rank0.value, rank0.path).get("optimizer_state_dict"), f"{rank0.path}: optimizer_state_dict"
    )
    stage, count = osd.get("zero_stage"), osd.get("partition_count")
    counts = count if isinstance(count, list) and count else [count]
    world = max(counts) if all(type(c) is int for c in counts) else None
    if type(stage) is not int or stage not in (1, 2, 3) or type(world) is not int or world < 1:
        raise _fail(
            path / rank0.rel,
            f"zero_stage {_show(stage)} with partition_count {_show(count)} "
            "is not ZeRO-1/2/3; the file is corrupt or not DeepSpeed's, re-copy the checkpoint",
        )
    if len(optims) != world:
        raise _fail(
            step,
            f"{len(optims)} *_optim_states.pt files for a partition count of {world}; "
            "a rank's file is missing or left from another run, re-copy the checkpoint",
        )
    optim_files = [rank0] + [
        read_pickled(path, prefix + _optim_file(step, optims, r)) for r in range(1, world)
    ]
    stamps.update({f.rel: f.stamp for f in optim_files})
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    groups = [_groups(f, key) for f in optim_files]
    shapes = [
        [(str(k), _shape(v, model.path)) for k, v in _dict(g, model.path).items()]
        for g in _list(state.get("param_shapes"), f"{model.path}: param_shapes")
    ]
    pieces: dict[str, list[Piece]] = {}
    if stage <= 2:
        paddings = osd.get("param_alignment_paddings")
        if len(shapes) != len(groups[0]):
            raise _fail(path / model.rel, f"{len(shapes)} param groups, {len(groups[0])} fp32 partitions")
        for g, group_shapes in enumerate(shapes):
            pad = _paddings(path / rank0.rel, paddings, g, len(group_shapes))
            got, problem = zero2_pieces(group_shapes, [r[g] for r in groups], world, pad)
            if problem:
                raise _fail(
                    path / prefix,
                    f"param group {g}: {problem}; the checkpoint is not one ZeRO "
                    f"layout ckptconv puts back together, convert it with DeepSpeed's {_UNIVERSAL}",
                )
            pieces.update(got)
    else:
        got, problem = zero3_pieces([s for g in shapes for s in g], groups)
        if problem:
            raise _fail(path / prefix, f"{problem}; convert it with DeepSpeed's {_UNIVERSAL}")
        pieces.update(got)
    flat = {name: shape for g in shapes for name, shape in g}
    tensors = {
        name: TensorSpec(name, "float32", flat[name], chunks(flat[name], 4, p)) for name, p in pieces.items()
    }
    frozen_files = [model]
    if stage == 3 and state.get("frozen_param_shapes"):
        frozen_files += [read_pickled(path, prefix + _zero3_model(r)) for r in range(1, world)]
        stamps.update({f.rel: f.stamp for f in frozen_files})
    tensors.update(_frozen(path, stage, state, frozen_files))
    return _finish(path, model, module, state, tensors, stamps)


def _finish(
    path: Path,
    model: PickledFile,
    module: dict[str, Any],
    state: dict[str, Any],
    tensors: dict[str, TensorSpec],
    stamps: dict[str, Any],
) -> DcpCheckpoint:
    """Buffers from `module`, shared parameters under both names, parameters DeepSpeed keeps only in `module`
    (a ZeRO-1 checkpoint's frozen ones), in `module`'s order."""
    shared = {str(k): str(v) for k, v in _dict(state.get("shared_params") or {}, model.path).items()}
    out: dict[str, TensorSpec] = {}
    for name, value in module.items():
        if name in tensors:
            out[name] = tensors.pop(name)
        elif name in shared and shared[name] in (tensors | out):
            continue  # after its source, below
        elif isinstance(value, TensorRecord) and math.prod(value.size) > 0:
            out[name] = _whole(model, name, value)
    out.update(tensors)
    for alias, source in shared.items():
        if source in out:
            out[alias] = TensorSpec(alias, out[source].dtype_name, out[source].shape, out[source].chunks)
    if not out:
        raise _fail(path / model.rel, "lists no parameters")
    return DcpCheckpoint(path, out, {}, {k: (k,) for k in out}, stamps, kind="deepspeed")


def _module_tensors(
    path: Path, model: PickledFile, module: dict[str, Any], state: dict[str, Any]
) -> dict[str, TensorSpec]:
    shapes = {
        k: _shape(v, model.path)
        for g in state.get("param_shapes") or []
        for k, v in _dict(g, model.path).items()
    }
    out = {}
    for name, value in module.items():
        if not isinstance(value, TensorRecord):
            continue
        if name in shapes and value.size != shapes[name]:
            raise _fail(
                path / model.rel,
                f"--deepspeed-weights module: {name!r} is stored as "
                f"{list(value.size)}, not {list(shapes[name])} (ZeRO-3 keeps no whole 16-bit weights "
                "there); leave out --deepspeed-weights for the fp32 master weights",
            )
        out[name] = _whole(model, name, value)
    if not out:
        raise _fail(path / model.rel, "its module holds no tensors")
    return out


def _whole(file: PickledFile, name: str, record: TensorRecord) -> TensorSpec:
    """A tensor stored whole in `file`."""
    itemsize = record.dtype.itemsize
    dtype = str(record.dtype).removeprefix("torch.")
    piece = Piece(0, math.prod(record.size), file.rel, file.where(record))
    return TensorSpec(name, dtype, record.size, chunks(record.size, itemsize, [piece]))


def _frozen(path: Path, stage: int, state: dict[str, Any], files: list[PickledFile]) -> dict[str, TensorSpec]:
    """Frozen parameters: ZeRO-2 keeps each whole in rank 0's `frozen_param_fragments`; ZeRO-3 a
    ceil(numel / world) fragment of each per rank, in each rank's model states file."""
    shapes = state.get("frozen_param_shapes") or {}
    out = {}
    for name, shape_value in _dict(shapes, files[0].path).items():
        shape = _shape(shape_value, files[0].path)
        frags = []
        for f in files:
            frag = _dict(_dict(f.value, f.path).get("frozen_param_fragments"), f.path).get(name)
            if not isinstance(frag, TensorRecord):
                raise _fail(path / f.rel, f"frozen parameter {name!r} has no fragment")
            frags.append(frag)
        numel, itemsize = math.prod(shape), frags[0].dtype.itemsize
        dtype = str(frags[0].dtype).removeprefix("torch.")
        if stage <= 2:
            if frags[0].size != shape:
                raise _fail(
                    path / files[0].rel, f"frozen {name!r} is {list(frags[0].size)}, not {list(shape)}"
                )
            out[name] = _whole(files[0], name, frags[0])
            continue
        part = math.ceil(numel / len(files))
        pieces = []
        for r, (f, frag) in enumerate(zip(files, frags, strict=True)):
            if math.prod(frag.size) != part or frag.dtype != frags[0].dtype:
                raise _fail(path / f.rel, f"frozen {name!r}: a fragment of {list(frag.size)}, not [{part}]")
            lo, hi = r * part, min((r + 1) * part, numel)
            if lo < hi:
                pieces.append(Piece(lo, hi, f.rel, f.where(frag)))
        out[name] = TensorSpec(name, dtype, shape, chunks(shape, itemsize, pieces))
    return out


def _zero3_model(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _optim_file(step: Path, optims: dict[str, Any], rank: int) -> str:
    for name, m in optims.items():
        if int(m.group(1)) == rank:
            return name
    raise _fail(
        step / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        "missing: the checkpoint is incomplete, re-copy it",
    )


def _groups(file: PickledFile, key: str) -> list[Span]:
    osd = _dict(_dict(file.value, file.path).get("optimizer_state_dict"), file.path)
    spans = []
    for record in _list(osd.get(key), f"{file.path}: {key}"):
        if (
            not isinstance(record, TensorRecord)
            or len(record.size) != 1
            or str(record.dtype) != "torch.float32"
        ):
            raise _fail(file.path, f"{key} holds something else than flat fp32 tensors")
        spans.append(Span(file.rel, file.where(record), record.size[0]))
    return spans


def _paddings(where: Path, paddings: Any, group: int, count: int) -> list[int] | None:
    """Param group `group`'s `param_alignment_paddings`: a non-negative int per parameter (None when the
    checkpoint records none); anything else would misplace every parameter after it."""
    if paddings is None:
        return None
    pad = paddings[group] if isinstance(paddings, list) and group < len(paddings) else None
    if not isinstance(pad, list) or len(pad) != count or not all(type(n) is int and n >= 0 for n in pad):
        raise _fail(
            where,
            f"param_alignment_paddings of param group {group} is not {count} non-negative ints (one per "
            "parameter); the file is corrupt or not DeepSpeed's, re-copy the checkpoint",
        )
    return pad


def _refuse_unsupported(where: Path, state: dict[str, Any]) -> None:
    for key in ("ds_autoep_layers", "autoep_layers"):
        layers = state.get(key)
        if isinstance(layers, list) and any(
            isinstance(e, dict) and e.get("checkpoint_format") == "zero3_partitioned" for e in layers
        ):
            raise _fail(
                where,
                f"an AutoEP ZeRO-3 partition-native checkpoint (experts partitioned over "
                f"expert replica groups); convert it with DeepSpeed's {_UNIVERSAL} first",
            )
    dims = state.get("checkpoint_parallel_dimensions")
    sizes = {k: dims.get(k) for k in ("pp_degree", "tp_degree")} if isinstance(dims, dict) else {}
    mp = state.get("mp_world_size", 1)
    if mp is not None and (type(mp) is not int or mp < 1):
        raise _fail(
            where,
            f"mp_world_size {_show(mp)} is not a model-parallel world size; the file is corrupt or "
            "not DeepSpeed's, re-copy the checkpoint",
        )
    if any(type(v) is int and v > 1 for v in sizes.values()) or mp not in (1, None):
        raise _fail(
            where,
            f"saved with pipeline or tensor parallelism (mp_world_size {mp}, {sizes}); ckptconv puts back "
            f"data-parallel ZeRO partitions only, convert it with DeepSpeed's {_UNIVERSAL} first",
        )


def _show(value: Any) -> str:
    """A value read from a pickle, short enough for a message (a list by its first few items)."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(short(v, 30) for v in value[:4]) + (", ...]" if len(value) > 4 else "]")
    return short(value, 80)


def _dict(value: Any, where: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected a dict, found {type(value).__name__}; not a DeepSpeed checkpoint file")
    return value


def _list(value: Any, where: object) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise _fail(where, f"expected a list, found {type(value).__name__}; not a DeepSpeed checkpoint file")
    return list(value)


def _shape(value: Any, where: object) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(type(n) is int and n >= 0 for n in value):
        raise _fail(where, f"a parameter shape {type(value).__name__} is not a list of sizes")
    if len(value) > MAX_DIMS:
        raise _fail(
            where, f"a parameter shape of {len(value)} dimensions (at most {MAX_DIMS}); the file is corrupt"
        )
    return tuple(value)
