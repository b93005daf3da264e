"""Pure: the unshard scheduler. Which blocks are gathered, in which rounds, batched into which collectives.

A *job* brings one block of a global tensor (the whole tensor, or a slab of rows of a stacked / fused one) to
the ranks that need it, by a chain of *steps*. On the live path (`allgather`) a step is one all-gather over
one mesh dimension's process group that undoes that dimension's sharding; its pieces are concatenated on a
tensor dim. On the stored-chunk path (`gather.gather_tensors`) a job is one output tensor whose single step
is a batch of point-to-point transfers to its writer.

`plan_rounds` is the scheduler both paths share: each round takes the ready step of every started job, admits
new jobs in order while the round's *gathered* (global) bytes stay within the budget of their account, and
groups the round's steps by (process group, dtype) into one batch each, i.e. one foreach all-gather. The
budget counts a job's whole gathered block, never its local shard: with 64 ranks a 1 GiB budget admits 1 GiB
of gathered tensors, not 64 GiB. A job larger than the budget runs alone in its rounds.

Everything here is computed identically on every rank from the same inputs: that is what lets every rank
issue the same collectives in the same order without talking.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ckptconv.core.layout import Box, intersect
from ckptconv.errors import CkptconvError

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class ShardStep:
    """Undo the sharding of mesh dim `mesh_dim`: all-gather over its process group, concatenate on `dim`."""

    mesh_dim: int
    dim: int


@dataclass(frozen=True)
class Placement:
    """A DTensor placement as plain data: kind "shard" (with `split_factor` > 1 for `_StridedShard`),
    "replicate" or "partial"."""

    kind: str
    dim: int = 0
    split_factor: int = 1


def shard_steps(placements: Sequence[Placement]) -> tuple[ShardStep, ...]:
    """The all-gathers that undo `placements` (one per mesh dim), in the order they must run.

    Sharding applies mesh dims in order, each splitting the blocks of the ones before, except that a
    `_StridedShard` on mesh dim i (FSDP2 over a tensor TP already split on the same dim) was applied after
    the later mesh dims sharding that tensor dim. Unsharding runs that order backwards: plain FSDP2 x TP
    gathers TP first; strided FSDP2 x TP gathers FSDP first, so that every intermediate block is contiguous.
    """
    order: list[int] = []
    for i, p in enumerate(placements):
        if p.kind == "partial":
            raise CkptconvError(
                f"a DTensor with a Partial placement on mesh dim {i} holds unreduced values; "
                "call .redistribute() to Replicate or Shard it before saving"
            )
        if p.kind == "shard":
            order.append(i)
    for i in [i for i in order if placements[i].split_factor > 1]:
        later = [j for j in order if j > i and placements[j].dim == placements[i].dim]
        if later:
            order.remove(i)
            order.insert(order.index(later[-1]) + 1, i)
    return tuple(ShardStep(i, placements[i].dim) for i in reversed(order))


@dataclass(frozen=True)
class Holding:
    """Where every rank's local data of one tensor sits, and the process groups of its shard steps.

    `blocks[r]`: rank r's local block (global coordinates); `groups[k][r]`: the ranks of rank r's process
    group for step k (a rank's own mesh coordinates pick which group; submeshes differ between ranks).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    steps: tuple[ShardStep, ...]
    blocks: tuple[Box, ...]
    groups: tuple[tuple[Ranks, ...], ...]


@dataclass(frozen=True)
class JobStep:
    """One all-gather of a job: `pieces[r]` is what rank r contributes (None: nothing), `result[r]` what it
    holds afterwards; `partition` (every group, sorted) names the process group identically on every rank."""

    dim: int
    partition: tuple[Ranks, ...]
    group_of: tuple[Ranks, ...]  # indexed by rank
    pieces: tuple[Box | None, ...]
    result: tuple[Box | None, ...]

    def padded_numel(self, rank: int) -> int:
        """Elements each member of `rank`'s group sends (all-gather needs equal sizes: pad to the largest)."""
        return max(_numel(self.pieces[m]) for m in self.group_of[rank])


@dataclass(frozen=True)
class Job:
    """Bring `box` of tensor `fqn` to every rank, by `steps` (none: every rank already holds it)."""

    fqn: str
    dtype: torch.dtype
    box: Box
    origin: tuple[tuple[int, ...], ...]  # each rank's local block's offsets
    start: tuple[Box | None, ...]  # each rank's part of `box` before the first step
    steps: tuple[JobStep, ...]
    account: Hashable = "all"  # whose memory the gathered block lands in (a budget per account)
    readers: tuple[int, ...] | None = None  # the ranks that need the result (None: every rank)

    def receives(self, rank: int) -> bool:
        return self.readers is None or rank in self.readers

    @property
    def nbytes(self) -> int:
        return math.prod(self.box[1]) * self.dtype.itemsize

    @property
    def keys(self) -> tuple[Hashable, ...]:
        return tuple((s.partition, self.dtype) for s in self.steps)


def _numel(box: Box | None) -> int:
    return 0 if box is None else math.prod(box[1])


def plan_job(holding: Holding, box: Box) -> Job:
    """The steps that bring `box` of `holding`'s tensor to every rank; refuses layouts whose intermediate
    blocks are not contiguous (the placements do not describe a tiling this order can undo)."""
    world = len(holding.blocks)
    hold: list[Box | None] = [_clip(b, box) for b in holding.blocks]
    start = tuple(hold)
    steps = []
    if _numel(box):
        for k, step in enumerate(holding.steps):
            group_of = holding.groups[k]
            pieces = tuple(hold)
            for group in set(group_of):
                union = _concat([pieces[m] for m in group], step.dim, holding.fqn)
                for m in group:
                    hold[m] = union
            partition = tuple(sorted(set(group_of)))
            steps.append(JobStep(step.dim, partition, group_of, pieces, tuple(hold)))
    for rank in range(world):
        if _numel(box) and hold[rank] != box:
            raise CkptconvError(
                f"{holding.fqn!r}: after gathering its shards rank {rank} holds {hold[rank]}, not {box}; "
                "its placements are not ones ckptconv can undo (a rank's local data must be one block)"
            )
    origin = tuple(b[0] for b in holding.blocks)
    return Job(holding.fqn, holding.dtype, box, origin, start, tuple(steps))


def _clip(block: Box, box: Box) -> Box | None:
    if not math.prod(block[1]):
        return None
    return intersect(block, box)


def _concat(pieces: Sequence[Box | None], dim: int, fqn: str) -> Box | None:
    """The block the non-empty `pieces` make when laid end to end on `dim` in order."""
    present = [p for p in pieces if p is not None]
    if not present:
        return None
    offsets, sizes = list(present[0][0]), list(present[0][1])
    for o, s in present[1:]:
        same = all(o[d] == offsets[d] and s[d] == sizes[d] for d in range(len(o)) if d != dim)
        if not same or o[dim] != offsets[dim] + sizes[dim]:
            raise CkptconvError(
                f"{fqn!r}: the shards gathered on dim {dim} are not adjacent blocks ({list(present)}); "
                "its placements are not ones ckptconv can undo"
            )
        sizes[dim] += s[dim]
    return tuple(offsets), tuple(sizes)


def slabs(shape: Sequence[int], itemsize: int, ranges: Sequence[tuple[int, int]], budget: int) -> list[Box]:
    """Boxes of whole rows (dim 0) that cover `shape`, cut only where a reader's row range starts or ends
    (`ranges`: the rows each consumer needs, e.g. one expert of a stacked tensor) and merged up to `budget`
    bytes: a fused MoE tensor is gathered bucket by bucket, a plain one whole."""
    if not shape or not shape[0] or math.prod(shape) * itemsize <= budget:
        return [(tuple(0 for _ in shape), tuple(shape))]
    row_bytes = math.prod(shape[1:]) * itemsize
    cuts = sorted({0, shape[0], *(r for rng in ranges for r in rng if 0 < r < shape[0])})
    out: list[tuple[int, int]] = []
    for lo, hi in itertools.pairwise(cuts):
        if out and (hi - out[-1][0]) * row_bytes <= budget:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    rest = tuple(0 for _ in shape[1:])
    return [((lo, *rest), (hi - lo, *shape[1:])) for lo, hi in out]


@dataclass(frozen=True)
class Batch:
    """Steps of several jobs that run as one collective: the same process group and dtype."""

    key: Hashable
    items: tuple[tuple[int, int], ...]  # (job index, step index)


@dataclass(frozen=True)
class Round:
    batches: tuple[Batch, ...]
    started: tuple[int, ...]  # jobs admitted this round
    done: tuple[int, ...]  # jobs whose last step ran this round (or with no step, admitted this round)
    nbytes: dict[Hashable, int]  # gathered bytes per account


class Schedulable(Protocol):
    """What the scheduler needs of a job: whose budget it uses, its gathered bytes, one batch key per step."""

    @property
    def account(self) -> Hashable: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def keys(self) -> tuple[Hashable, ...]: ...


def plan_rounds(jobs: Sequence[Schedulable], budget: int) -> list[Round]:
    """Rounds of `jobs` (admitted in order per account) within `budget` gathered bytes per account."""
    queues: dict[Hashable, deque[int]] = {}
    for j, job in enumerate(jobs):
        queues.setdefault(job.account, deque()).append(j)
    active: list[tuple[int, int]] = []  # (job, next step)
    rounds = []
    while active or any(queues.values()):
        used: dict[Hashable, int] = {}
        steps = list(active)
        for j, _ in active:
            used[jobs[j].account] = used.get(jobs[j].account, 0) + jobs[j].nbytes
        started = []
        for account, queue in queues.items():
            while queue:
                job = jobs[queue[0]]
                total = used.get(account, 0)
                if total and total + job.nbytes > budget:
                    break
                used[account] = total + job.nbytes
                started.append(queue.popleft())
                steps.append((started[-1], 0))
        grouped: dict[Hashable, list[tuple[int, int]]] = {}
        for j, s in sorted(steps):
            if s < len(jobs[j].keys):
                grouped.setdefault(jobs[j].keys[s], []).append((j, s))
        batches = tuple(Batch(key, tuple(items)) for key, items in sorted(grouped.items(), key=_key_order))
        active = [(j, s + 1) for j, s in sorted(steps) if s + 1 < len(jobs[j].keys)]
        done = tuple(j for j, s in sorted(steps) if s + 1 >= len(jobs[j].keys))
        rounds.append(Round(batches, tuple(started), done, used))
    return rounds


def _key_order(item: tuple[Hashable, list[tuple[int, int]]]) -> tuple[str, int]:
    return repr(item[0]), item[1][0][0]
