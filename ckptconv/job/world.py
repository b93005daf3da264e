"""Who we are in a torchrun job, and how ranks agree on errors so that none of them hangs.

A single process (no torchrun) is a world of size 1 and never touches torch.distributed. Under torchrun the
process group uses gloo for CPU tensors (and nccl for CUDA tensors when CUDA is present), with a finite
timeout so that a dead peer turns into an error rather than a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

from ckptconv.errors import CkptconvError
from ckptconv.job.env import env_int

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a plain list of one item outside torchrun)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the others pass anything, None by convention)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_bytes(self, data: bytearray | None) -> bytearray:
        """Rank 0's `data` on every rank, sent as it lies in memory (a uint8 tensor over its buffer): not
        pickled, not copied on rank 0, received straight into the others' buffer."""
        if not self.distributed:
            assert data is not None
            return data
        import torch
        import torch.distributed as dist

        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0)
        box = data if self.is_main and data is not None else bytearray(int(size.item()))
        if box:
            dist.broadcast(torch.frombuffer(box, dtype=torch.uint8), src=0)
        return box

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def agree(self, error: BaseException | None = None) -> None:
        """Collective: raise on every rank if any rank failed, with the lowest failing rank's message.

        Call it at the same point on every rank: a rank that failed passes its exception, the others None.
        """
        mine = None if error is None else (_one_line(error), getattr(error, "exit_code", 1))
        reports = self.all_gather_object(mine)
        for rank, report in enumerate(reports):
            if report is None:
                continue
            if error is not None and rank == self.rank and not isinstance(error, CkptconvError):
                raise error  # a bug: keep its traceback on the rank where it happened
            message, code = report
            prefix = f"rank {rank}: " if self.distributed and rank != self.rank else ""
            raise CkptconvError(prefix + message, exit_code=code, agreed=self.distributed) from error


def everyone(world: World, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run `fn` on every rank and agree on the outcome: all ranks get the result or all raise."""
    try:
        result, error = fn(*args, **kwargs), None
    except Exception as e:
        result, error = None, e
    world.agree(error)
    return cast(T, result)


def on_main(world: World, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
    """Run `fn` on rank 0 only; every rank learns whether it failed."""
    return everyone(world, lambda: fn(*args, **kwargs) if world.is_main else None)


def from_main(
    world: World,
    fn: Callable[[], T],
    encode: Callable[[T], Any] = lambda x: x,
    decode: Callable[[Any], T] = lambda x: x,
    raw: bool = False,
) -> T:
    """`fn()` run on rank 0 alone, its result on every rank (sent as `encode(result)`, rebuilt by `decode`),
    or its error raised on every rank. Collective; call it inside `everyone`, whose agreement then names
    rank 0 as where an error came from. What one rank reads for all (a `.metadata`, 2,000 file headers) is
    read once instead of once per rank. `raw`: `encode` gives a bytearray, sent as it is (`broadcast_bytes`:
    tens of MB are then neither pickled nor copied)."""
    if not world.distributed:
        return fn()
    if world.is_main:
        try:
            result = fn()
            sent = encode(result)
        except Exception as e:  # the others are waiting in the broadcast: they get the error instead
            world.broadcast_object(("error", str(e), e.exit_code if isinstance(e, CkptconvError) else 1))
            raise
        world.broadcast_object(("ok", None if raw else sent))
        if raw:
            world.broadcast_bytes(sent)
        return result
    message = world.broadcast_object(None)
    if message[0] == "error":
        raise CkptconvError(message[1], exit_code=message[2])
    return decode(world.broadcast_bytes(None) if raw else message[1])


def _one_line(error: BaseException) -> str:
    text = str(error) if isinstance(error, CkptconvError) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())


COLLECTIVE_FAILURE = re.compile(r"gloo|nccl|[Tt]imed out|timeout|closed by peer|Connection reset|Broken pipe")


def collective_failure(error: BaseException, rank: int, timeout_s: int) -> CkptconvError | None:
    """The one-line error for a collective that failed because a peer died or stalled (torch raises a plain
    RuntimeError from gloo, a DistError from its newer backends), or None for any other exception."""
    import torch.distributed as dist

    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    if not (isinstance(error, dist.DistError) or COLLECTIVE_FAILURE.search(text)):
        return None
    cause = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    cause = re.sub(r"^\[[^\]]*\]\s*", "", cause)[:200]  # drop gloo's "[/path/pair.cc:553]" prefix
    return CkptconvError(
        f"rank {rank}: a collective with the other ranks failed ({cause}); another rank died or waited "
        f"longer than CKPTCONV_TIMEOUT_S={timeout_s}s: see the other ranks' errors above"
    )


def _say_before_parting(error: CkptconvError, say: Callable[[CkptconvError], None]) -> None:
    """Rank 0 says (`say`) an error every rank raised together, then the ranks wait for each other: torchrun
    stops the others (SIGTERM) as soon as one rank ends with an error, and a rank that ended first would
    otherwise kill rank 0 before its message and `--json` report are out."""
    import torch.distributed as dist

    say(error)
    with contextlib.suppress(RuntimeError):  # a peer died meanwhile: each rank still ends with the error
        dist.barrier()


@contextmanager
def world_from_env(
    timeout_s: int | None = None, say_agreed: Callable[[CkptconvError], None] = lambda e: None
) -> Iterator[World]:
    """The world torchrun describes in the environment; a process group only when WORLD_SIZE > 1.

    `say_agreed` reports an error every rank raised together before the ranks part (the CLI's exit path,
    `cli.exits.say_agreed`; nothing by default, as in library use).
    `timeout_s` (default CKPTCONV_TIMEOUT_S, 600) bounds every collective; a collective that fails because a
    peer died or stalled becomes one line naming this rank (`collective_failure`)."""
    size = env_int("WORLD_SIZE", 1)
    if size <= 1:
        yield World(0, 1)
        return
    import torch
    import torch.distributed as dist

    timeout = timeout_s if timeout_s is not None else env_int("CKPTCONV_TIMEOUT_S", 600, maximum=10**7)
    owned = not dist.is_initialized()
    if owned:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    try:
        yield World(rank, dist.get_world_size())
        if owned:
            dist.barrier()  # no rank tears down its process group while a peer is still in a collective
    except RuntimeError as e:
        failure = collective_failure(e, rank, timeout)
        if failure is None:
            raise
        raise failure from None
    except CkptconvError as e:
        if owned and e.agreed:
            _say_before_parting(e, say_agreed)
        raise
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
