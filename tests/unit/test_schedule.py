"""The unshard scheduler: shard steps from placements, jobs, rounds under a gathered-bytes budget, and the
foreach all-gather executor run by simulated ranks (threads) over a recording fake collective."""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from ckptconv.errors import CkptconvError
from ckptconv.live.allgather import run_rounds
from ckptconv.plan.schedule import (
    Holding,
    Job,
    Placement,
    ShardStep,
    plan_job,
    plan_rounds,
    shard_steps,
    slabs,
)

S, R = Shard, Replicate


def _ss(dim: int, sf: int) -> _StridedShard:
    return _StridedShard(dim, split_factor=sf)


def _plain(placements: Sequence[Any]) -> list[Placement]:
    out = []
    for p in placements:
        if isinstance(p, _StridedShard):
            out.append(Placement("shard", p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(Placement("shard", p.dim))
        else:
            out.append(Placement("replicate"))
    return out


@pytest.mark.parametrize(
    ("placements", "steps"),
    [
        ([S(0)], [(0, 0)]),
        ([R()], []),
        ([R(), S(1)], [(1, 1)]),
        ([S(0), S(1)], [(1, 1), (0, 0)]),  # FSDP x TP on different dims: TP first, then FSDP
        ([S(0), S(0)], [(1, 0), (0, 0)]),  # nested on one dim: the inner split first
        ([_ss(0, 2), S(0)], [(0, 0), (1, 0)]),  # FSDP2 over TP on the same dim (strided): FSDP first
        ([S(0), _ss(1, 2), S(1)], [(1, 1), (2, 1), (0, 0)]),  # 3-D mesh: EP x strided FSDP x TP
        ([S(1), R(), S(2)], [(2, 2), (0, 1)]),  # a grouped 3-D tensor whose shard dims moved by one
    ],
)
def test_shard_steps_undo_placements_in_order(placements: list[Any], steps: list[tuple[int, int]]) -> None:
    assert shard_steps(_plain(placements)) == tuple(ShardStep(m, d) for m, d in steps)


def test_partial_placements_are_refused() -> None:
    with pytest.raises(CkptconvError, match=r"Partial placement on mesh dim 1.*redistribute"):
        shard_steps([Placement("shard", 0), Placement("partial")])


def holding(
    fqn: str, shape: tuple[int, ...], dtype: torch.dtype, mesh: tuple[int, ...], placements: Any
) -> Holding:
    """What every simulated rank (row-major in `mesh`) would describe for a DTensor with `placements`, using
    torch's own local shape / offset arithmetic (no process group needed)."""
    world = math.prod(mesh)
    coords = [list(_unravel(r, mesh)) for r in range(world)]
    blocks = []
    for c in coords:
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, c, placements)
        blocks.append((tuple(offsets), tuple(sizes)))
    steps = shard_steps(_plain(placements))
    groups = tuple(
        tuple(
            tuple(
                r
                for r in range(world)
                if all(coords[r][d] == c[d] for d in range(len(mesh)) if d != s.mesh_dim)
            )
            for c in coords
        )
        for s in steps
    )
    return Holding(fqn, shape, dtype, steps, tuple(blocks), groups)


def _unravel(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(mesh):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def whole(h: Holding) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (tuple(0 for _ in h.shape), h.shape)


class RecordingCollective:
    """A fake all-gather for simulated ranks in threads: members of a group meet, each gets every member's
    input in group order; every call is recorded as (rank, key, group, elements sent)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Hashable, tuple[int, ...], int]] = []
        self._cv = threading.Condition()
        self._seq: dict[tuple[int, tuple[int, ...]], int] = {}
        self._inputs: dict[tuple[tuple[int, ...], int], dict[int, list[torch.Tensor]]] = {}

    def for_rank(self, rank: int) -> Any:
        outer = self

        class Bound:
            def all_gather(
                self,
                outs: list[torch.Tensor],
                inps: list[torch.Tensor],
                key: Hashable,
                group: tuple[int, ...],
                receivers: list[tuple[int, ...] | None],
            ) -> None:
                outer._gather(rank, outs, inps, key, group, receivers)

        return Bound()

    def _gather(
        self,
        rank: int,
        outs: list[torch.Tensor],
        inps: list[torch.Tensor],
        key: Hashable,
        group: tuple[int, ...],
        receivers: list[tuple[int, ...] | None],
    ) -> None:
        with self._cv:
            self.calls.append((rank, key, group, sum(i.numel() for i in inps)))
            n = self._seq.get((rank, group), 0)
            self._seq[(rank, group)] = n + 1
            slot = self._inputs.setdefault((group, n), {})
            slot[rank] = [i.clone() for i in inps]
            self._cv.notify_all()
            assert self._cv.wait_for(lambda: len(slot) == len(group), timeout=30), "a member never came"
            for k, out in enumerate(outs):
                sizes = {slot[m][k].numel() for m in group}
                assert len(sizes) == 1, f"all-gather with unequal inputs {sizes}"
                who = receivers[k]
                if who is not None and rank not in who:
                    assert out.numel() == 0, "a rank that does not read a job allocated its result"
                    continue
                out.copy_(torch.cat([slot[m][k] for m in group]))


def simulate(
    holdings: dict[str, Holding], jobs: Sequence[Job], budget: int, full: dict[str, torch.Tensor]
) -> tuple[RecordingCollective, list[Any], list[dict[int, Any]]]:
    """Run every simulated rank's executor in a thread; return the recorder, the rounds and each rank's
    results (job index -> block)."""
    world = len(next(iter(holdings.values())).blocks)
    rounds = plan_rounds(jobs, budget)
    recorder = RecordingCollective()
    results: list[dict[int, Any]] = [{} for _ in range(world)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        def local(fqn: str) -> torch.Tensor:
            offsets, sizes = holdings[fqn].blocks[rank]
            t = full[fqn]
            for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
                t = t.narrow(d, o, s)
            return t.clone()

        try:
            for j, value in run_rounds(jobs, rounds, rank, local, recorder.for_rank(rank)):
                results[rank][j] = value
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return recorder, rounds, results


def _full(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randn(shape, generator=g).to(dtype)


def _box(t: torch.Tensor, box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(*box, strict=True)):
        t = t.narrow(d, o, s)
    return t


def test_foreach_all_gather_of_every_layout_is_bit_exact_and_batched() -> None:
    """4 simulated ranks: FSDP2 x TP strided, uneven Shard(1) with an empty shard, Replicate, EP x FSDP
    experts (3-D, shard dims 0 and 1), an empty tensor, a plain tensor, fp8 and bool. Every rank ends with
    every block bit for bit; each round runs one collective per (process group, dtype) it holds."""
    mesh2, mesh4 = (2, 2), (4,)
    layouts = {
        "tp.a": ((10, 6), torch.float32, mesh2, [_ss(0, 2), S(0)]),
        "tp.b": ((12, 3), torch.float32, mesh2, [_ss(0, 2), S(0)]),  # same group and dtype as tp.a
        "uneven": ((7, 5), torch.bfloat16, mesh4, [S(1)]),  # 2, 2, 1, 0 columns
        "norm": ((6,), torch.float32, mesh4, [R()]),
        "experts": ((8, 4, 6), torch.bfloat16, mesh2, [S(0), S(1)]),
        "empty": ((0, 4), torch.float32, mesh4, [S(0)]),
        "fp8": ((9, 4), torch.float8_e4m3fn, mesh4, [S(0)]),
        "mask": ((5, 3), torch.bool, mesh4, [S(0)]),
    }
    holdings = {k: holding(k, *v) for k, v in layouts.items()}
    full = {k: _full(h.shape, h.dtype, i) for i, (k, h) in enumerate(holdings.items())}
    jobs = [plan_job(h, whole(h)) for h in holdings.values()]
    recorder, rounds, results = simulate(holdings, jobs, 2**30, full)
    for rank, got in enumerate(results):
        assert sorted(got) == list(range(len(jobs)))
        for j, job in enumerate(jobs):
            want = _box(full[job.fqn], job.box)
            assert got[j].dtype == want.dtype and got[j].shape == want.shape
            assert torch.equal(got[j].view(torch.uint8), want.contiguous().view(torch.uint8)), (rank, job.fqn)
    # strided FSDP2 x TP needs two chained all-gathers: the second in the next round
    assert len(rounds) == 2
    first = {b.key: [jobs[j].fqn for j, _ in b.items] for b in rounds[0].batches}
    assert ["tp.a", "tp.b"] in first.values()  # one foreach all-gather carries both
    assert all(len({jobs[j].dtype for j, _ in b.items}) == 1 for r in rounds for b in r.batches)
    for rank in range(4):
        mine = [c for c in recorder.calls if c[0] == rank]
        assert len(mine) == sum(len(r.batches) for r in rounds)  # one collective per batch, no more
    assert not any(jobs[j].fqn in ("norm", "empty") for r in rounds for b in r.batches for j, _ in b.items)


def test_budget_counts_gathered_bytes_not_local_shards() -> None:
    """8 tensors sharded over 4 ranks: 4 KiB local, 16 KiB gathered each. A 32 KiB budget runs 2 a round (a
    budget on local bytes would have run all 8 at once and held 128 KiB per rank: xtuner's 71 GiB bug)."""
    holdings = {f"w{i}": holding(f"w{i}", (64, 64), torch.float32, (4,), [S(0)]) for i in range(8)}
    jobs = [plan_job(h, whole(h)) for h in holdings.values()]
    budget = 32 * 2**10
    rounds = plan_rounds(jobs, budget)
    assert [len(r.started) for r in rounds] == [2, 2, 2, 2]
    assert all(sum(r.nbytes.values()) <= budget for r in rounds)
    assert [len(r.batches) for r in rounds] == [1, 1, 1, 1]  # same group and dtype: one all-gather each
    full = {k: _full(h.shape, h.dtype, i) for i, (k, h) in enumerate(holdings.items())}
    recorder, _, results = simulate(holdings, jobs, budget, full)
    assert all(torch.equal(results[3][j], full[f"w{j}"]) for j in range(8))
    # with readers (the ranks writing the files that read a tensor), only they receive it
    jobs = [replace(job, readers=(j % 4,)) for j, job in enumerate(jobs)]
    _, _, results = simulate(holdings, jobs, budget, full)
    for rank in range(4):
        for j in range(8):
            assert (results[rank][j] is None) != (rank == j % 4)
            assert rank != j % 4 or torch.equal(results[rank][j], full[f"w{j}"])
    assert {n for _, _, _, n in recorder.calls} == {2 * 16 * 64}  # two 16-row shards per call


def test_a_job_larger_than_the_budget_runs_alone_and_chains_continue_first() -> None:
    big = holding("big", (64, 64), torch.float32, (2, 2), [_ss(0, 2), S(0)])  # 2 steps, 16 KiB
    small = [holding(f"s{i}", (16, 16), torch.float32, (4,), [S(0)]) for i in range(3)]  # 1 KiB each
    jobs = [plan_job(h, whole(h)) for h in [big, *small]]
    rounds = plan_rounds(jobs, 2 * 2**10)
    assert rounds[0].started == (0,)  # alone: over budget
    assert rounds[1].started == () and [b.items for b in rounds[1].batches] == [((0, 1),)]  # its 2nd step
    assert rounds[2].started == (1, 2) and rounds[3].started == (3,)


def test_fused_moe_tensors_are_gathered_bucket_by_bucket() -> None:
    """A stacked [8 experts, 4, 6] tensor read one expert per HF key, with a budget of two experts' bytes:
    four slab jobs of two whole experts, every round within the budget, values bit for bit."""
    h = holding("experts", (8, 4, 6), torch.float32, (2, 2), [S(0), S(1)])
    expert = 4 * 6 * 4
    boxes = slabs(h.shape, 4, [(e, e + 1) for e in range(8)], 2 * expert)
    assert [b[0][0] for b in boxes] == [0, 2, 4, 6] and all(b[1] == (2, 4, 6) for b in boxes)
    jobs = [plan_job(h, b) for b in boxes]
    rounds = plan_rounds(jobs, 2 * expert)
    # EP x FSDP: two chained all-gathers a slab, and a slab fills the budget: one slab at a time
    assert len(rounds) == 8 and all(sum(r.nbytes.values()) == 2 * expert for r in rounds)
    assert [r.started for r in rounds[::2]] == [(0,), (1,), (2,), (3,)]
    full = {"experts": _full(h.shape, h.dtype, 5)}
    _, _, results = simulate({"experts": h}, jobs, 2 * expert, full)
    for rank in range(4):
        assert torch.equal(torch.cat([results[rank][j] for j in range(4)]), full["experts"])
    # cut only where a reader's rows start or end; small tensors stay whole
    assert slabs((8, 4), 4, [(0, 3), (3, 8)], 40) == [((0, 0), (3, 4)), ((3, 0), (5, 4))]
    assert slabs((8, 4), 4, [(0, 8)], 64) == [((0, 0), (8, 4))]
    assert slabs((), 4, [], 0) == [((), ())]


def test_layouts_that_do_not_tile_in_step_order_are_refused() -> None:
    h = holding("tp", (10, 6), torch.float32, (2, 2), [_ss(0, 2), S(0)])
    wrong = Holding(h.fqn, h.shape, h.dtype, tuple(reversed(h.steps)), h.blocks, tuple(reversed(h.groups)))
    with pytest.raises(CkptconvError, match="'tp': the shards gathered on dim 0 are not adjacent"):
        plan_job(wrong, whole(h))


def test_ranks_that_disagree_about_a_state_dict_are_refused() -> None:
    from ckptconv.live.allgather import Described, holdings

    def d(fqn: str, groups: tuple[tuple[int, ...], ...] = ((0, 1),)) -> Described:
        return Described(fqn, (4, 2), torch.float32, ((0, 0), (2, 2)), (ShardStep(0, 0),), groups)

    with pytest.raises(CkptconvError, match="rank 1 holds other tensor keys than rank 0"):
        holdings([[d("a"), d("b")], [d("a")]])
    with pytest.raises(CkptconvError, match=r"process groups of 'a'.*do not agree"):
        holdings([[d("a", ((0, 1),))], [d("a", ((1,),))]])
