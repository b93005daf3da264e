"""Megatron-FSDP's uneven row blocks, made by megatron-core 0.16.1's own code, for the fsdp_dtensor workers.

Megatron-FSDP shards each parameter by the slice of its flat buffer a rank owns, so a rank's rows are not
torch's `chunk` of them: any split, a rank may hold none. Before `dcp.save` Megatron-LM runs
`preprocess_state_dict_for_uneven_dtensor` (megatron/core/distributed/fsdp/src/megatron_fsdp/
uneven_dtensor.py, called by `preprocess_fsdp_dtensor_state_dict`), which all-gathers every rank's local shape
and sets each DTensor's chunk list and write items to the rank's own rows. `megatron_fsdp_state` does the same
to DTensors made here with a split torch would not make (rank 0 a third of the rows, rounded down: none of a
one- or two-row tensor), so the `.metadata` holds the chunks Megatron-FSDP's saves hold.

megatron-core comes from the pinned --target directory the tests install (tests/support/megatron.py); the
worker is given it on its command line or finds it under the repository's .cache.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

MEGATRON_DIR = Path(__file__).resolve().parents[3] / ".cache" / "megatron-core-0.16.1"


def _rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [start, stop) rank `rank` holds of `n`: rank 0 a third, rounded down; the others the rest,
    split evenly."""
    first = n // 3
    if rank == 0:
        return 0, first
    rest, others = n - first, world - 1
    per = -(-rest // others) if others else 0
    start = min(n, first + (rank - 1) * per)
    return start, min(n, start + per)


def megatron_fsdp_dtensor(full: torch.Tensor, mesh: Any) -> Any:
    """`full` as a DTensor over `mesh` (1-D) sharded by rows in Megatron-FSDP's uneven way; a 0-d tensor is
    replicated. Its chunk metadata is set afterwards by `megatron_fsdp_state`."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if full.dim() == 0:
        return DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
    start, stop = _rows(full.shape[0], dist.get_rank(), dist.get_world_size())
    local = full[start:stop].clone()
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )


def megatron_fsdp_state(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (nested, its DTensors from `megatron_fsdp_dtensor`) through megatron-core's own
    `preprocess_state_dict_for_uneven_dtensor`, as Megatron-LM's fsdp_dtensor save does."""
    if str(MEGATRON_DIR) not in sys.path:
        sys.path.insert(0, str(MEGATRON_DIR))
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    return preprocess_state_dict_for_uneven_dtensor(state)
