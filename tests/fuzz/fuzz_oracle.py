"""The structured fuzzers' oracle: one CLI command run in-process through `main`, bounded and judged.

Every command an example runs must: exit 0 or 2 (1 only where the command may report a mismatch: verify),
never raise (a traceback), say exactly one `ckptconv: error:` line (its last line) when it exits 2, finish in
`WALL_S` seconds (SIGALRM interrupts it; should a loop in C never return to Python, faulthandler ends the
whole run after `HARD_S`, exit 1, its traceback shown with -s), grow the process's peak resident memory by
less than `MEMORY` bytes (the peak is reset before each command through /proc/self/clear_refs; an address
space limit of `GUARD` bytes beyond the process's keeps a bomb from taking the machine), and write nothing but
OUT (with the staging, old and lock names ckptconv keeps beside it): the example's directory, which holds
every input and OUT and is the working directory, is snapshot (paths, kinds, sizes, mtimes, link targets)
before and after. A command that fails leaves OUT as it was.

`CKPTCONV_FUZZ_EXAMPLES` sets the examples per test (derandomized: the same ones every run, more with a
larger number). `CKPTCONV_FUZZ_FINDINGS=FILE` turns failures into JSON lines appended to FILE (the test goes
on with the next example), for a long campaign that lists every distinct failure instead of stopping at the
first; `CKPTCONV_FUZZ_LOG=FILE` appends every command's exit code and error line (how far inputs get).
The inputs and commands each test ran go into its report's user_properties, which the
`pytest_terminal_summary` hook of conftest.py adds up (also across xdist workers).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import resource
import shutil
import signal
import stat
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ckptconv.cli.app import main
from ckptconv.formats.names import OLD_SUFFIX, PARTIAL_SUFFIX
from ckptconv.publish.outlock import LOCK_SUFFIX

EXAMPLES = int(os.environ.get("CKPTCONV_FUZZ_EXAMPLES", "20"))
# per command: each takes ~30 ms, but an input using up the read budget (2M objects walked, limits.py) takes
# seconds of Python, and CI shares 2 cores between two test workers: the bound is for what never ends
WALL_S = float(os.environ.get("CKPTCONV_FUZZ_WALL_S", "30"))
MEMORY = 256 * 2**20  # peak resident growth allowed to one command
GUARD = 2 * 2**30  # address space allowed beyond what the process has: a bomb fails instead of the machine
HARD_S = max(120.0, 6 * WALL_S)  # faulthandler ends the run (exit 1) when SIGALRM cannot interrupt a C loop
FINDINGS = os.environ.get("CKPTCONV_FUZZ_FINDINGS")
LOG = os.environ.get("CKPTCONV_FUZZ_LOG")  # every command's exit code and error line, as JSON lines
T = TypeVar("T")


def fuzz_settings(examples: int = EXAMPLES) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,  # the same examples on every CI run; CKPTCONV_FUZZ_EXAMPLES widens the search
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
        print_blob=False,
    )


def mostly(usual: object, others: list[Any]) -> st.SearchStrategy[Any]:
    """`usual` about half the time, else one of `others` (a plain sampled_from of a list with `usual`
    repeated is drawn lopsidedly by Hypothesis' derandomized small runs)."""
    return st.one_of(st.just(usual), st.sampled_from(others))


class Shown(Generic[T]):
    """A drawn input with a short repr (its `note`): Hypothesis prints every drawn value with a failure, and
    a 100k-deep document or a Metadata of 20000 chunks would flood the log."""

    def __init__(self, value: T, note: str) -> None:
        self.value, self.note = value, note

    def __repr__(self) -> str:
        return self.note[:600]


class Overran(BaseException):
    """Raised by SIGALRM in the command that ran past WALL_S (a BaseException: no `except Exception` in the
    code under test swallows it)."""


@dataclass
class Outcome:
    code: int | None
    err: str
    seconds: float
    grown: int  # peak resident bytes beyond the resident size at the start
    raised: BaseException | None = None
    where: str = ""  # the innermost frame of the exception, `file:line function`


@dataclass
class Fuzzer:
    """One test's fuzzing: fresh example directories, bounded commands, their judgement and the counts."""

    name: str
    capsys: pytest.CaptureFixture[str]
    root: Path
    inputs: int = 0
    commands: int = 0
    succeeded: int = 0  # commands that exited 0 (a fuzzer that never gets past the first check is weak)
    seconds: float = 0.0  # spent in commands
    findings: list[dict[str, object]] = field(default_factory=list)
    note: str = ""  # what the current example is (shown with a failure)
    _dir: Path | None = None

    def __repr__(self) -> str:  # Hypothesis prints the test's arguments with a failure: no findings list
        return f"Fuzzer({self.name!r}, {self.inputs} inputs)"

    @contextmanager
    def example(self, note: str = "") -> Iterator[Path]:
        """A new, empty working directory for one example (removed after it); the example is counted."""
        self.inputs += 1
        self.note = note[:2000]
        work = Path(tempfile.mkdtemp(prefix="ex", dir=self.root))
        cwd = os.getcwd()
        os.chdir(work)
        self._dir = work
        try:
            yield work
        finally:
            os.chdir(cwd)
            self._dir = None
            shutil.rmtree(work, ignore_errors=True)

    def run(
        self,
        *argv: str,
        outs: Sequence[Path] = (),
        codes: tuple[int, ...] = (0, 2),
        watch: Sequence[Path] = (),
    ) -> tuple[int | None, str]:
        """`ckptconv ARGV` in-process, judged (see the module doc); `outs` are the OUTs it may write, `watch`
        further directories it must leave alone (the example's directory is always watched)."""
        assert self._dir is not None, "run() belongs inside example()"
        self.commands += 1
        trees = [self._dir, *watch]
        before = [snapshot(t) for t in trees]
        outcome = bounded(list(argv), lambda: self.capsys.readouterr().err)
        self.succeeded += outcome.code == 0
        self.seconds += outcome.seconds
        if LOG:
            said = outcome.err.strip().splitlines()[-1:] if outcome.code else []
            entry = {
                "test": self.name,
                "command": argv[0],
                "code": outcome.code,
                "said": said,
                "input": self.note[:80],
            }
            with open(LOG, "a") as f:
                f.write(json.dumps({**entry, "seconds": round(outcome.seconds, 3)}) + "\n")
        after = [snapshot(t) for t in trees]
        problems = judge(outcome, codes)
        named = [_out_names(Path(os.path.abspath(out))) for out in outs]
        allowed = [p for names in named for p in names]  # a success may write these
        locks = [names[-1] for names in named]  # a failure may leave the lock file
        for tree, old, new in zip(trees, before, after, strict=True):
            for rel in sorted(set(old) | set(new)):
                if old.get(rel) == new.get(rel):
                    continue
                path = tree / rel
                if outcome.code == 0 and any(path == a or a in path.parents for a in allowed):
                    continue
                if outcome.code != 0 and path in locks:
                    continue
                what = "after it failed " if outcome.code != 0 else ""
                problems.append(f"changed {what}{_shown(path, self._dir)} ({old.get(rel)} -> {new.get(rel)})")
                break
        if problems:
            self._fail(list(argv), problems, outcome)
        return outcome.code, outcome.err

    def expect(self, ok: bool, problem: str, *argv: str) -> None:
        """A check of what a command that succeeded wrote (`argv`: that command), judged like the rest."""
        if not ok:
            self._fail(list(argv), [problem], Outcome(0, "", 0.0, 0))

    def _fail(self, argv: list[str], problems: list[str], outcome: Outcome) -> None:
        assert self._dir is not None
        shown = [_shown(a, self._dir) for a in argv]
        finding = {
            "test": self.name,
            "argv": shown,
            "problems": problems,
            "where": outcome.where,
            "err": outcome.err.strip().splitlines()[-3:],
            "input": self.note,
        }
        self.findings.append(finding)
        if FINDINGS:
            with open(FINDINGS, "a") as f:
                f.write(json.dumps(finding) + "\n")
            return
        raise AssertionError(
            f"ckptconv {' '.join(shown)}: {'; '.join(problems)}\n  at {outcome.where}\n"
            f"  stderr: {outcome.err[-1500:]}\n  input: {self.note}"
        )


def _shown(value: object, work: Path) -> str:
    return str(value).replace(str(work), "EX")


def _out_names(out: Path) -> list[Path]:
    """OUT and what ckptconv keeps beside it (staging, old, lock), in that order."""
    return [out, *(out.parent / f".{out.name}{s}" for s in (PARTIAL_SUFFIX, OLD_SUFFIX, LOCK_SUFFIX))]


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under `root` (not following links): a directory, or a size, mtime and link target."""
    found: dict[str, tuple[object, ...]] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(top, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):  # its entries are compared; its mtime moves with OUT's siblings
                found[os.path.relpath(path, root)] = ("dir",)
            else:
                link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
                found[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, link)
    return found


def judge(o: Outcome, codes: tuple[int, ...]) -> list[str]:
    problems = []
    if isinstance(o.raised, Overran):
        problems.append(f"ran past {WALL_S:g} s")
    elif o.raised is not None:
        lines = str(o.raised).strip().splitlines() or [""]
        said = lines[0][:300] + (
            f" ... {lines[-1][:300]}" if len(lines) > 1 else ""
        )  # a remote traceback's end
        problems.append(f"traceback: {type(o.raised).__name__}: {said}")
    elif o.code not in codes:
        problems.append(f"exit {o.code}")
    if "Traceback" in o.err:
        problems.append("a traceback on stderr")
    if o.code == 2:
        lines = o.err.strip().splitlines()
        said = [line for line in lines if line.startswith("ckptconv: error: ")]
        if len(said) != 1 or lines[-1] != said[0]:
            problems.append(f"{len(said)} error lines, not one last line")
    if o.grown > MEMORY:
        problems.append(f"peak memory grew {o.grown / 2**20:.0f} MiB (bound {MEMORY / 2**20:.0f} MiB)")
    if o.raised is None and o.seconds > WALL_S:
        problems.append(f"took {o.seconds:.1f} s")
    return problems


def bounded(argv: list[str], readerr: Callable[[], str]) -> Outcome:
    """`main(argv)` under the time and memory bounds; what came of it."""
    # the growth of the peak beyond the resident size now (beyond the old peak where it cannot be reset)
    baseline = _status("VmRSS") if _reset_peak() else _status("VmHWM")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _status("VmSize") + GUARD
    if sys.platform == "linux" and (soft == resource.RLIM_INFINITY or soft > limit):
        resource.setrlimit(
            resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard)
        )
    previous = signal.signal(signal.SIGALRM, _overran)
    faulthandler.dump_traceback_later(HARD_S, exit=True, file=sys.__stderr__)  # -s shows it
    code: int | None = None
    raised: BaseException | None = None
    start = time.perf_counter()
    try:
        signal.setitimer(signal.ITIMER_REAL, WALL_S)
        try:
            main(argv)
            code = 0
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # a traceback, a timeout, a MemoryError: all judged
        raised = e
    finally:
        seconds = time.perf_counter() - start
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    grown = max(0, _status("VmHWM") - baseline)
    err = readerr()
    where = _innermost(raised) if raised is not None else ""
    return Outcome(code, err, seconds, grown, raised, where)


def _overran(signum: int, frame: object) -> None:
    raise Overran()


def _innermost(e: BaseException) -> str:
    """The frame the exception came from, skipping the oracle's own signal handler."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.endswith("fuzz_oracle.py")]
    if not frames:
        return ""
    f = frames[-1]
    ours = [g for g in frames if "/ckptconv/" in g.filename]
    shown = f"{_short(f.filename)}:{f.lineno} {f.name}"
    if ours and ours[-1] is not f:
        shown += f" (from {_short(ours[-1].filename)}:{ours[-1].lineno} {ours[-1].name})"
    return shown


def _short(filename: str) -> str:
    for marker in ("/ckptconv/", "/site-packages/", "/lib/python"):
        if marker in filename:
            return filename[filename.index(marker) + 1 :]
    return filename


def _status(field_name: str) -> int:
    """A /proc/self/status field in bytes (ru_maxrss where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.M)
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    """Reset VmHWM to the current resident size (Linux 4.0+: "5" to clear_refs); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def fuzzing(
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Fuzzer]:
    """The body of a test module's `fuzzer` fixture (`yield from fuzzing(...)`): a Fuzzer for the test, its
    counts put into the test's report (user_properties) at teardown."""
    monkeypatch.delenv("CKPTCONV_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    f = Fuzzer(request.node.name, capsys, tmp_path)
    try:
        yield f
    finally:
        request.node.user_properties.append(("fuzz_inputs", f.inputs))
        request.node.user_properties.append(("fuzz_commands", f.commands))
        request.node.user_properties.append(("fuzz_succeeded", f.succeeded))
        request.node.user_properties.append(("fuzz_seconds", round(f.seconds, 1)))
        request.node.user_properties.append(("fuzz_findings", len(f.findings)))
        if f.findings and FINDINGS:
            sys.stderr.write(f"{f.name}: {len(f.findings)} finding(s) written to {FINDINGS}\n")
