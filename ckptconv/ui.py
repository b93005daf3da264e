"""Where messages go: logs, warnings and progress to stderr (rank 0, or any rank for its own warnings)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@dataclass
class Ui:
    rank: int = 0
    quiet: bool = False
    progress: bool | None = None  # None: a bar only when stderr is a terminal
    console: Console = field(default_factory=lambda: Console(stderr=True, highlight=False, soft_wrap=True))
    warnings: list[str] = field(default_factory=list)

    def info(self, message: str) -> None:
        if self.rank == 0 and not self.quiet:
            self.console.print(message, markup=False)

    def warn(self, message: str, *, every_rank: bool = False) -> None:
        """A warning; computed identically on every rank unless `every_rank`, so printed by rank 0 only."""
        self.warnings.append(message)
        if self.rank == 0 or every_rank:
            prefix = f"[rank {self.rank}] " if every_rank and self.rank else ""
            self.console.print(f"warning: {prefix}{message}", style="yellow", markup=False)

    @contextmanager
    def bytes_progress(self, label: str, total: int) -> Iterator[ProgressHook]:
        show = self.progress if self.progress is not None else sys.stderr.isatty()
        if self.rank != 0 or self.quiet or not show:
            yield ProgressHook(None, None)
            return
        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        with bar:
            yield ProgressHook(bar, bar.add_task(label, total=total))


@dataclass
class ProgressHook:
    bar: Progress | None
    task: object

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, nbytes)  # type: ignore[arg-type]
