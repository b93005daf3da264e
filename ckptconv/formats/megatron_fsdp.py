"""Megatron-FSDP `fsdp_dtensor` checkpoints: what tells one apart, and its `args` read without running it.

Megatron-LM's `--ckpt-format fsdp_dtensor` saves a plain torch DCP directory (no `metadata.json`, no
`common.pt`) of the dict `{"model": {"module.<fqn>": DTensor}, "optimizer": ..., "rng_state": ...,
"opt_param_scheduler": ..., "rerun_state_machine": ..., "args": Namespace, "iteration": int,
"checkpoint_version": float}`; with virtual pipeline stages the model is `model0`, `model1`, ... So its
tensors sit under `model.module.` (or `model<N>.module.`) and `args`, `iteration` and `checkpoint_version`
are top-level bytes items. A checkpoint Megatron-Bridge converted has no such items (Megatron-LM PR #4753
teaches its loader to do without them): its Megatron module names under the prefix (`decoder.layers.`,
`embedding.`) make it one then. A prefix alone does not.

Those three items are read as `common.pt` is (formats/megatron.common_of): every global of their pickles a
stand-in, within one read's limits. Nothing from them is imported or called.
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.specs import Common, DcpCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.megatron import FSDP_PREFIX as PREFIX
from ckptconv.formats.megatron import item_bytes, readable_item
from ckptconv.remote.files import RemoteFiles

ITEMS = ("args", "iteration", "checkpoint_version")  # the top-level bytes items Megatron-LM saves


MODULES = ("decoder.layers.", "embedding.word_embeddings.")  # GPTModel's, under the prefix


def is_fsdp_dtensor(ckpt: DcpCheckpoint) -> bool:
    """Whether `ckpt` holds tensors under `model.module.` (or `model<N>.module.`) with the top-level bytes
    items `args`, `iteration` and `checkpoint_version` beside them, or (a Megatron-Bridge conversion, no
    items) Megatron GPTModel's module names under that prefix."""
    keys = [key for fqn in ckpt.tensors if (key := model_key(fqn)) is not None]
    if not keys:
        return False
    if all(_top_level(ckpt, name) for name in ITEMS):
        return True
    return any(key.startswith(MODULES) for _, key in keys)


def _top_level(ckpt: DcpCheckpoint, name: str) -> bool:
    item = ckpt.items.get(name)
    return item is not None and len(item.path) == 1


def model_key(fqn: str) -> tuple[str, str] | None:
    """(the chunk's prefix, the key under it) of a model tensor key, None for any other key."""
    m = PREFIX.match(fqn)
    return None if m is None or not fqn[m.end() :] else (m.group(0), fqn[m.end() :])


def read_items(ckpt: DcpCheckpoint, remote: RemoteFiles | None = None) -> Common | None:
    """`args`, `iteration` and `checkpoint_version` (those it has: None for none) read without running them,
    as one `Common` (what `read_common` makes of torch_dist's common.pt): each item's readable value, and
    what of it was left out. Some part of `args` left out (megatron's enums), its raw bytes are kept under
    `args.pt`."""
    values: dict[str, Any] = {}
    unreadable: dict[str, tuple[str, ...]] = {}
    kept = b""
    present = tuple(name for name in ITEMS if _top_level(ckpt, name))
    if not present:
        return None
    for name in present:
        item = ckpt.items[name]
        raw = item_bytes(ckpt.path, item, remote, ckpt.transforms)
        values[name], unreadable[name] = readable_item(raw, f"{ckpt.path / item.file}: {name!r}", name)
        if unreadable[name] and name != "args":  # Megatron-LM saves plain numbers there
            raise CkptconvError(
                f"{ckpt.path / item.file}: the item {name!r} holds {', '.join(unreadable[name])}, not a "
                "number; not a Megatron-FSDP checkpoint ckptconv can read (re-save it)"
            )
        if name == "args":
            kept = raw
    return Common(values, unreadable, kept, source="args", raw_key="args.pt", items=present)
