"""What makes a DCP checkpoint a Megatron-Core `torch_dist` checkpoint (hf-to-dcp with a mapping whose
`[mapping]` says `checkpoint = "megatron"`, e.g. the megatron-gpt preset).

megatron-core's `dist_checkpointing.load(sharded_state_dict, DIR)` reads two files besides torch's `.metadata`
and `.distcp` files (docs/notes/megatron-torch-dist.md):

- `metadata.json`: which backends wrote the directory; megatron picks its load strategy by it and refuses a
  directory without it ("not a distributed checkpoint");
- `common.pt`: `torch.load`ed (weights_only, as torch 2.6 and later load by default) and merged under the
  loaded tensors: the values that are not sharded.

What Megatron-LM's `load_checkpoint` reads from `common.pt`, and what this writes:

- `checkpoint_version`: 3.0. A checkpoint without it counts as version 0, and below 2.0 Megatron-LM reorders
  the rows of every `linear_qkv` (`fix_query_key_value_ordering`) after loading: wrong for these tensors;
- `iteration`: the training step (0 when unknown). Megatron-LM exits without it unless `--finetune` or the
  checkpoint is a `release`;
- no `args`: that would pickle an `argparse.Namespace`. Megatron-LM then takes the checkpoint's TP and PP as
  1 and says so, and `check_checkpoint_args` is skipped;
- no `content_metadata`: megatron's `sharded_state_dict(metadata)` defaults (`singleton_local_shards`
  False: the stacked layer layout the presets write) apply.

megatron also asks for one ShardedObject `_extra_state` per linear layer (TransformerEngine's FP8 state; None
with the local spec and for a model never trained in FP8), and its default strictness refuses a checkpoint
without them. `extra_state_objects` names them for the weights written, with the value megatron saves.

The checkpoint holds model weights only (no optimizer state, no `rng_state`): load it in Megatron-LM with
`--finetune`, or `--no-load-optim --no-load-rng`, or as `release/` beside a
`latest_checkpointed_iteration.txt` reading `release`.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ckptconv.core.specs import StashedItem

if TYPE_CHECKING:
    from ckptconv.plan.types import DcpSavePlan

# a parallel linear layer's weight in a decoder or MTP layer (megatron names them `linear_*`, MLA's
# linear_q_down_proj etc. included, or `*_proj` as MTP's eh_proj): its module, then (with
# singleton_local_shards) the SwiGLU half. Not the output layer (GPTModel drops its `_extra_state`), the
# router, the embedding or the norms, which have none.
_LINEAR = re.compile(r"((?:[^.]+\.)*layers\..*\.(?:linear_\w+|\w+_proj))\.weight(?:_w|_v)?")
# experts stacked along a prepended axis: the experts' linear layer right under `experts.experts.`
_STACKED_EXPERTS = re.compile(r".*\.experts\.experts\.linear_\w+")


def extra_state_objects(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, list[None]]:
    """The `_extra_state` ShardedObjects of the linear layers whose weights `shapes` holds (runtime keys and
    global shapes), as `dist_checkpointing.save` names them, each with what megatron stores for it: the list
    of the objects of that key on a rank, `[None]` (torch.save of it is the item's bytes).

    The object's offsets are the weight's stacked axes: the layer axis of a key whose layers are stacked
    (`decoder.layers.X.weight` [L, ...]), then the expert axis of stacked experts (`...experts.experts.
    linear_fc1.weight`). `decoder.layers.X.weight` gives `decoder.layers.X._extra_state/shard_{l}_{L}` for
    every layer l; experts [L, E, ...] give `.../shard_{l}.{e}_{L}.{E}`; a per-layer key (MTP layers,
    non-homogeneous models such as a dense then MoE stack) with stacked experts [E, ...] `.../shard_{e}_{E}`;
    a key with no stacked axis (a per-layer linear, singleton_local_shards) `.../shard_0_1`. TP plays no
    part: the object is replicated over it."""
    out: dict[str, list[None]] = {}
    for key, shape in shapes.items():
        m = _LINEAR.fullmatch(key)
        if m is None:
            continue
        module = m.group(1)
        parts = module.split(".")
        stacked = int(not parts[parts.index("layers") + 1].isdigit())  # no layer number: layers stacked
        stacked += int(_STACKED_EXPERTS.fullmatch(module) is not None)
        grid = shape[:stacked] if stacked else (1,)
        for index in itertools.product(*(range(n) for n in grid)):
            name = f"{module}._extra_state/shard_{_dotted(index)}_{_dotted(grid)}"
            out[name] = [None]
    return out


def is_extra_state(key: str) -> bool:
    return "._extra_state/shard_" in key


def with_extra_state(plan: DcpSavePlan) -> DcpSavePlan:
    """`plan` with the `_extra_state` objects megatron's load asks for among its stashed items, instead of any
    the stash brought (named for another layout, such as a singleton_local_shards source)."""
    import torch

    buffer = io.BytesIO()
    torch.save([None], buffer)
    objects = extra_state_objects({t.key: t.shape for t in plan.tensors})
    kept = [item for item in plan.stash if not is_extra_state(item.key)]
    added = [StashedItem(key, (key,), buffer.getvalue(), value, True) for key, value in objects.items()]
    return dataclasses.replace(plan, stash=(*kept, *added))


def iteration_of(stash: Sequence[StashedItem]) -> int | None:
    """The `iteration` a stash carries (a Megatron source's, through dcp-to-hf), None without one."""
    for item in stash:
        if item.key == "iteration" and item.has_value and type(item.value) is int:
            return item.value
    return None


def _dotted(values: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in values)
