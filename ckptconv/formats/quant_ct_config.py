"""compressed-tensors' quantization_config read as ckptconv dequantizes it: its config_groups (targets, weight
args, format), its `ignore`, and which group quantized a module. No torch.

A module's group is chosen as compressed-tensors' `apply_quantization_config` chose it when the release was
made (`utils.match.match_targets`): an exact name target first, then a "re:" regex (Python `re.match`, as
`match_name`), then the class target "Linear" (any module: the names of a checkpoint show no classes); a
target named by two groups belongs to the later one. `ignore` entries match names the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from ckptconv.errors import CkptconvError

FORMATS = {  # compressed-tensors CompressionFormat -> ckptconv's scheme
    "float-quantized": "ct-fp8",
    "naive-quantized": "ct-fp8",  # FloatQuantizationCompressor is NaiveQuantizationCompressor
    "pack-quantized": "ct-int",
    "nvfp4-pack-quantized": "ct-nvfp4",
    "mxfp4-pack-quantized": "ct-mxfp4",
}
STRATEGIES = {  # scheme -> the weight strategies its compressor dequantizes and ckptconv reads
    "ct-fp8": ("tensor", "channel", "block", "group"),
    "ct-int": ("tensor", "channel", "group"),
    "ct-nvfp4": ("tensor_group",),
    "ct-mxfp4": ("group",),
}
CLASS_TARGET = "Linear"  # the only class a name-only match can honour: every quantized module is one


class Group(NamedTuple):
    """One config_groups entry with weights, checked: what ckptconv needs to read its modules."""

    name: str
    """Its key in config_groups."""
    scheme: str
    """ckptconv's scheme (`FORMATS`)."""
    format: str
    """compressed-tensors' format it is stored in."""
    strategy: str
    """The weights' strategy (tensor, channel, group, block, tensor_group)."""
    bits: int
    """The weights' num_bits."""
    group_size: int
    """Values per scale along a row (group strategies), else 0."""
    block: tuple[int, int]
    """block_structure (block strategy), else (0, 0)."""
    symmetric: bool
    """No zero points when true."""


class CtConfig(NamedTuple):
    """A compressed-tensors quantization_config: groups by target, and the ignore list."""

    targets: dict[str, Group]
    """Each target of every group with weights (a later group's wins, as in apply_quantization_config)."""
    ignore: tuple[str, ...]
    """Module names / "re:" patterns left unquantized."""


def parse(qc: Mapping[str, Any], where: str) -> CtConfig:
    """The groups of `qc` (config.json's quantization_config); `where` ("FILE: 'KEY'", a tensor it stores)
    starts the one line that refuses what ckptconv cannot dequantize."""
    for extra in ("sparsity_config", "transform_config"):
        value = qc.get(extra)
        if value and not (isinstance(value, dict) and value.get("format") in (None, "dense")):
            raise CkptconvError(
                f"{where} is compressed-tensors with a {extra} (quantization_config), which ckptconv "
                "does not dequantize; dequantize it with compressed-tensors first"
            )
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CkptconvError(
            f'{where}: quantization_config\'s quantization_status is {_shown(status)}, not "compressed": '
            "ckptconv reads compressed-tensors releases as compressed-tensors saves them compressed"
        )
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CkptconvError(f"{where}: quantization_config of compressed-tensors has no config_groups")
    default = qc.get("format")
    targets: dict[str, Group] = {}
    for name, raw in groups.items():
        group = _group(str(name), raw, default, where)
        if group is None:
            continue
        targets_of = raw.get("targets")
        if not isinstance(targets_of, list) or not all(isinstance(t, str) for t in targets_of):
            raise CkptconvError(f"{where}: config_groups {name!r} has targets that are not a list of names")
        for target in targets_of:
            if target.startswith("re:"):
                _regex(target, where)
            targets[target] = group
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise CkptconvError(f"{where}: quantization_config's ignore is not a list of names")
    for entry in ignore:
        if entry.startswith("re:"):
            _regex(entry, where)
    return CtConfig(targets, tuple(ignore))


def group_of(config: CtConfig, module: str) -> Group | None:
    """The group that quantized `module` (None when no target matches it)."""
    names = sorted(t for t in config.targets if t == module)
    regexes = sorted(t for t in config.targets if t.startswith("re:") and _regex(t, "").match(module))
    classes = [CLASS_TARGET] if CLASS_TARGET in config.targets else []
    found = [*names, *regexes, *classes]
    return config.targets[found[0]] if found else None


def ignored(config: CtConfig, module: str) -> bool:
    """Whether `ignore` names `module` (exactly, or a "re:" pattern matching its start)."""
    return any(
        _regex(i, "").match(module) is not None if i.startswith("re:") else i == module for i in config.ignore
    )


def _group(name: str, raw: Any, default: Any, where: str) -> Group | None:
    """One config_groups entry checked (None when it quantizes no weights)."""
    if not isinstance(raw, dict):
        raise CkptconvError(f"{where}: config_groups {name!r} is not an object")
    w = raw.get("weights")
    if w is None:
        return None
    if not isinstance(w, dict):
        raise CkptconvError(f"{where}: config_groups {name!r} has weights that are not an object")
    fmt = raw.get("format") or (default if default != "mixed-precision" else None) or _inferred(w)
    scheme = FORMATS.get(fmt) if isinstance(fmt, str) else None
    label = f"config_groups {name!r}"
    if scheme is None:
        raise CkptconvError(
            f"{where} is stored in compressed-tensors format {_shown(fmt)} ({label}), which ckptconv "
            f"does not dequantize (it reads {', '.join(sorted(FORMATS))}); dequantize it with "
            "compressed-tensors first"
        )
    strategy, kind, bits = w.get("strategy"), w.get("type"), w.get("num_bits")
    wanted = {"ct-fp8": ("float", (8,)), "ct-int": ("int", range(1, 9))}.get(scheme, ("float", (4,)))
    if (
        kind != wanted[0]
        or type(bits) is not int
        or bits not in wanted[1]
        or strategy not in STRATEGIES[scheme]
    ):
        raise CkptconvError(
            f"{where}: {label} stores {_shown(kind)} {_shown(bits)}-bit weights with strategy "
            f"{_shown(strategy)} in format {fmt!r}, which ckptconv does not dequantize (it reads "
            f"{scheme} weights of strategy {', '.join(STRATEGIES[scheme])})"
        )
    if w.get("actorder") not in (None, "weight", False) and scheme == "ct-int":
        raise CkptconvError(
            f"{where}: {label} has actorder {w.get('actorder')!r} (weight_g_idx), which ckptconv does not "
            "dequantize; dequantize it with compressed-tensors first"
        )
    size, block = w.get("group_size"), w.get("block_structure")
    need = {"ct-nvfp4": 16, "ct-mxfp4": 32}.get(scheme)
    if strategy in ("group", "tensor_group") and not (_positive(size) and size == (need or size)):
        raise CkptconvError(f"{where}: {label} has group_size {_shown(size)}, not what {scheme} needs")
    if strategy == "block" and not (
        isinstance(block, list) and len(block) == 2 and all(map(_positive, block))
    ):
        raise CkptconvError(f"{where}: {label} has block_structure {_shown(block)}, not [rows, cols]")
    symmetric = w.get("symmetric", True)
    if scheme in ("ct-nvfp4", "ct-mxfp4") and symmetric is False:
        raise CkptconvError(
            f"{where}: {label} is asymmetric FP4, which compressed-tensors does not decompress"
        )
    if strategy == "tensor" and symmetric is False and scheme == "ct-int":
        raise CkptconvError(
            f"{where}: {label}: asymmetric per-tensor pack-quantized weights are not supported"
        )
    grouped, blocked = strategy in ("group", "tensor_group"), strategy == "block"
    return Group(
        name,
        scheme,
        str(fmt),
        str(strategy),
        int(bits),  # checked above
        int(size) if grouped else 0,  # type: ignore[arg-type]
        (int(block[0]), int(block[1])) if blocked else (0, 0),  # type: ignore[index]
        symmetric is not False,
    )


def _inferred(w: Mapping[str, Any]) -> str | None:
    """The format compressed-tensors infers for weight args alone (compressors.format.infer_module_format,
    for the formats ckptconv reads)."""
    size = w.get("group_size")
    if w.get("type") == "float" and w.get("num_bits") == 4 and size in (16, 32):
        return "nvfp4-pack-quantized" if size == 16 else "mxfp4-pack-quantized"
    if w.get("type") == "int":
        return "pack-quantized"
    if w.get("type") == "float" and w.get("num_bits") == 8:
        return "float-quantized"
    return None


def _positive(value: Any) -> bool:
    return type(value) is int and value > 0


def _regex(target: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(target[3:])
    except re.error:
        raise CkptconvError(f"{where}: quantization_config names {target!r}, not a valid regex") from None


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:50] + " ..."
