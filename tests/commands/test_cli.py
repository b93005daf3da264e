"""The command line itself: usage errors, --version, help, CKPTCONV_* variables, signals, collective failures.

Every usage error is exit 2 with one line and a hint, whichever typer (and whichever click inside it) is
installed; SIGTERM and SIGHUP unwind like Ctrl-C, on one process and under torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import _env, ckptconv, start
from test_bad_input import assert_one_line

import ckptconv as package

USAGE_ERRORS = [
    ((), None),
    (("--bogus",), ("No such option: --bogus", "see 'ckptconv --help'")),
    (("frobnicate",), ("No such command 'frobnicate'", "see 'ckptconv --help'")),
    (("dcp-to-hf",), ("Missing argument 'SRC'", "see 'ckptconv dcp-to-hf --help'")),
    (("dcp-to-hf", "--bogus"), ("No such option: --bogus", "see 'ckptconv dcp-to-hf --help'")),
    (("dcp-to-hf", "a", "b", "--dtype"), ("'--dtype' requires an argument", "ckptconv dcp-to-hf --help")),
    (("hf-to-dcp", "org/name"), ("Missing argument 'OUT'", "see 'ckptconv hf-to-dcp --help'")),
    (("verify", "a"), ("Missing argument 'B'", "see 'ckptconv verify --help'")),
    (("verify", "a", "b", "--atol", "x"), ("--atol", "see 'ckptconv verify --help'")),
    (("inspect",), ("Missing argument 'PATH'", "see 'ckptconv inspect --help'")),
    (("inspect", "x", "--json", "extra"), ("unexpected extra argument", "ckptconv inspect --help")),
]


@pytest.mark.parametrize(("args", "needles"), USAGE_ERRORS, ids=lambda v: " ".join(v) if v else "-")
def test_usage_errors_are_one_line_exit_2_with_a_hint(args: tuple[str, ...], needles: tuple | None) -> None:
    proc = ckptconv(*args)
    if needles is None:  # bare: the help, as `ckptconv --help` (whatever typer itself would do)
        assert proc.returncode == 0 and proc.stdout == ckptconv("--help").stdout and proc.stderr == ""
        return
    assert_one_line(proc.returncode, proc.stderr, *needles)
    if "--json" in args:  # the error as a report on stdout (tests/commands/test_json_schema.py)
        assert json.loads(proc.stdout)["error"]["message"] == proc.stderr.strip()
    else:
        assert proc.stdout == ""


def test_version() -> None:
    proc = ckptconv("--version")
    assert proc.returncode == 0 and proc.stdout == f"ckptconv {package.__version__}\n" and proc.stderr == ""


def test_help_lists_each_command_once() -> None:
    proc = ckptconv("--help")
    assert proc.returncode == 0, proc.stderr
    commands = proc.stdout.split("Commands:")[1].split()
    for name in ("dcp-to-hf", "hf-to-dcp", "verify", "inspect"):
        assert commands.count(name) == 1, proc.stdout
    assert "--version" in proc.stdout


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("CKPTCONV_TIMEOUT_S", "ten"),
        ("CKPTCONV_TIMEOUT_S", "0"),
        ("CKPTCONV_WRITE_THREADS", "1.5"),
        ("CKPTCONV_WRITE_THREADS", "-2"),
        ("CKPTCONV_LOG_EVERY_S", "soon"),
        ("CKPTCONV_LOG_EVERY_S", "inf"),
    ],
)
def test_bad_environment_variable_is_one_line_naming_it(
    fsdp2_ckpt: Path, tmp_path: Path, name: str, value: str
) -> None:
    env = {**_env(), name: value}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptconv", "dcp-to-hf", str(fsdp2_ckpt), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert_one_line(proc.returncode, proc.stderr, f"{name}={value!r}", "fix or unset it")
    assert list(tmp_path.iterdir()) == []


def _wait_for_work(parent: Path, proc: subprocess.Popen[str], seconds: float = 120) -> None:
    """Until the run has created something beside OUT (its staging directory): it is writing."""
    deadline = time.monotonic() + seconds
    while not any(parent.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never started writing"
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_unwind_like_ctrl_c(slow_ckpt: Path, tmp_path: Path, sig: int, code: int) -> None:
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "out"
    args = ["dcp-to-hf", str(slow_ckpt), str(out), "--bucket-size", "8MB"]
    # the signal's default action, as a terminal or a scheduler starts a job, even when this test runs under
    # nohup (whose ignored SIGHUP ckptconv keeps ignored, by design)
    restore = lambda: signal.signal(sig, signal.SIG_DFL)  # noqa: E731
    proc = start([sys.executable, "-m", "ckptconv", *args], preexec_fn=restore)
    _wait_for_work(parent, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert [x for x in err.splitlines() if x.startswith("ckptconv:")] == ["ckptconv: interrupted"], err
    assert list(parent.iterdir()) == []  # staging (and any lock) removed, OUT never created


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm-to-torchrun", "ctrl-c-to-the-job"])
def test_a_signal_to_a_torchrun_job_prints_one_line_and_leaves_nothing(
    slow_ckpt: Path, tmp_path: Path, how: str
) -> None:
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    cmd += ["ckptconv", "dcp-to-hf", str(slow_ckpt), str(out), "--bucket-size", "8MB"]
    agent = start(cmd, start_new_session=True)
    _wait_for_work(parent, agent)
    workers = psutil.Process(agent.pid).children()
    assert len(workers) == 2
    if how == "sigterm-to-torchrun":
        agent.send_signal(signal.SIGTERM)
    else:  # a terminal's Ctrl-C: SIGINT to the whole foreground process group
        os.killpg(agent.pid, signal.SIGINT)
    _, err = agent.communicate(timeout=90)
    assert agent.returncode != 0
    ours = [line for line in err.splitlines() if line.startswith("ckptconv:")]
    assert ours == ["ckptconv: interrupted"], err
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == [], alive
    assert list(parent.iterdir()) == []


@pytest.mark.slow
def test_a_stalled_rank_is_one_line_per_rank_naming_the_collective(slow_ckpt: Path, tmp_path: Path) -> None:
    """A rank that stops answering (SIGSTOP, as a hung node would) fails its peer's next collective after
    CKPTCONV_TIMEOUT_S: one line, not gloo's RuntimeError traceback."""
    parent = tmp_path / "outs"
    parent.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    cmd += ["ckptconv", "dcp-to-hf", str(slow_ckpt), str(parent / "out"), "--bucket-size", "8MB"]
    agent = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_env(), "CKPTCONV_TIMEOUT_S": "5"},
        stdin=subprocess.DEVNULL,
    )
    _wait_for_work(parent, agent)
    workers = sorted(psutil.Process(agent.pid).children(), key=lambda p: p.pid)
    stalled = next(w for w in workers if w.environ().get("RANK") == "1")
    waiting = next(w for w in workers if w is not stalled)
    stalled.suspend()
    try:
        waiting.wait(timeout=120)  # rank 0 gives up after CKPTCONV_TIMEOUT_S
    finally:
        stalled.resume()  # so that torchrun's SIGTERM ends it at once rather than after its grace period
    _, err = agent.communicate(timeout=120)
    assert agent.returncode != 0
    ours = [line for line in err.splitlines() if line.startswith("ckptconv:")]
    assert len(ours) == 1, err
    assert ours[0].startswith("ckptconv: error: rank 0: a collective with the other ranks failed"), err
    assert "CKPTCONV_TIMEOUT_S=5s" in ours[0]
    assert "RuntimeError" not in err
    assert not (parent / "out").exists()


def test_out_of_range_timeout_and_bad_rank_are_one_line(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    for env in ({"CKPTCONV_TIMEOUT_S": str(10**14)}, {"CKPTCONV_WRITE_THREADS": "100000"}):
        proc = subprocess.run(
            [sys.executable, "-m", "ckptconv", "dcp-to-hf", str(fsdp2_ckpt), str(tmp_path / "out")],
            capture_output=True,
            text=True,
            env={**_env(), **env},
            stdin=subprocess.DEVNULL,
        )
        assert_one_line(proc.returncode, proc.stderr, next(iter(env)), "from 1 to")
    proc = subprocess.run(
        [sys.executable, "-m", "ckptconv", "inspect", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        env={**_env(), "RANK": "x"},
        stdin=subprocess.DEVNULL,
    )
    assert_one_line(proc.returncode, proc.stderr, "missing")


def test_the_first_signal_decides_and_later_ones_do_not_interrupt_the_cleanup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C goes through the same handler as SIGTERM: torchrun's SIGTERM (or a second Ctrl-C) arriving
    while the run unwinds is ignored, and the exit code stays 130."""
    from ckptconv.job import signals

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    monkeypatch.setattr(signals, "_received", [])
    cleaned = False
    with pytest.raises(signals.Interrupted) as caught, signals.as_interrupts():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            cleaned = True
    assert cleaned and caught.value.signum == signal.SIGINT and signals.exit_code() == 130
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_inside_a_deferred_block_is_raised_on_leaving_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store call and the record of what it made are not split: SIGTERM inside `deferred()` is raised
    when the outermost block is left, with its own exit code; the same signal again at once (torchrun
    forwarding srun's) stays held; another signal raises at once (a user insisting)."""
    from ckptconv.job import signals

    monkeypatch.setattr(signals, "_received", [])
    done = []
    with pytest.raises(signals.Interrupted) as caught, signals.as_interrupts():
        with signals.deferred():
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # the forwarded copy
                time.sleep(0.2)
                done.append("inner")
            done.append("outer")
        done.append("after")
    assert done == ["inner", "outer"] and caught.value.signum == signal.SIGTERM and signals.exit_code() == 143

    monkeypatch.setattr(signals, "_received", [])
    start = time.monotonic()
    # under nohup SIGHUP is ignored and stays so (as_interrupts keeps it): another signal stands in for it
    first = signal.SIGHUP if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else signal.SIGINT
    with pytest.raises(signals.Interrupted) as caught, signals.as_interrupts(), signals.deferred():
        os.kill(os.getpid(), first)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert time.monotonic() - start < 4  # raised by the second signal, not on leaving the block
    assert caught.value.signum == first and signals.exit_code() == 128 + first
    assert not signals._pending and not signals._deferring


OLD_TYPER = ("typer==0.15.4", "click==8.1.8")


@pytest.mark.slow
def test_usage_errors_with_a_typer_built_on_the_click_package(tmp_path: Path) -> None:
    """typer < 0.29 re-exports the `click` package's exceptions, typer 0.29 vendors its own click: the same
    one-line errors on both (the lock pins the newer one; this runs the older one from PyPI)."""
    target = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *OLD_TYPER],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if pip.returncode != 0:
        pytest.skip(f"cannot install typer 0.15.4 from the package index: {pip.stderr.strip()[-200:]}")
    env = {**_env(), "PYTHONPATH": f"{target}{os.pathsep}{_env()['PYTHONPATH']}"}
    version = subprocess.run(
        [sys.executable, "-c", "import typer, click; print(typer.__version__, click.__version__)"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert version.stdout.split() == ["0.15.4", "8.1.8"], version
    for args, needles in USAGE_ERRORS[1:]:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptconv", *args],
            capture_output=True,
            text=True,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
        line = proc.stderr.strip()
        assert "\n" not in line and line.startswith("ckptconv: error: "), (args, proc.stderr)
        assert needles[-1].removeprefix("see ").strip("'") in line, (args, line)  # the right --help
    bare = subprocess.run([sys.executable, "-m", "ckptconv"], capture_output=True, text=True, env=env)
    assert bare.returncode == 0 and bare.stdout.startswith("Usage: ckptconv")


def test_no_numpy_no_warning(fsdp2_ckpt: Path, tmp_path: Path) -> None:
    """A plain install has no numpy (nothing ckptconv uses needs it): torch's import would warn about it,
    and a run prints only ckptconv's own lines."""
    run = (
        "import sys; sys.modules['numpy'] = None; "
        f"sys.argv = ['ckptconv', 'dcp-to-hf', {str(fsdp2_ckpt)!r}, {str(tmp_path / 'out')!r}]; "
        "from ckptconv.cli.app import run; run()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", run], capture_output=True, text=True, env=_env(), stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
