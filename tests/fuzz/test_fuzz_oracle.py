"""The structured fuzzers' oracle (fuzz/fuzz_oracle.py) catches what it is there to catch: a command standing
in for `main` that raises, runs long, takes memory, says two lines, exits 1, or writes beside OUT is
reported; one that writes only OUT (through its staging directory) or fails cleanly is not."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fuzz_oracle
import pytest
from fuzz_oracle import Fuzzer, fuzzing


@pytest.fixture
def fuzzer(
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Fuzzer]:
    monkeypatch.setattr(fuzz_oracle, "FINDINGS", None)  # failures raise, even in a campaign
    monkeypatch.setattr(fuzz_oracle, "WALL_S", 0.5)
    yield from fuzzing(request, capsys, tmp_path, monkeypatch)
    kept = [p for p in request.node.user_properties if not p[0].startswith("fuzz_")]
    request.node.user_properties[:] = kept  # stand-ins: not counted as fuzzing


def command(monkeypatch: pytest.MonkeyPatch, body: Callable[[list[str]], None]) -> None:
    monkeypatch.setattr(fuzz_oracle, "main", body)


def fail(line: str = "ckptconv: error: bad input; fix it", code: int = 2) -> None:
    sys.stderr.write(line + "\n")
    raise SystemExit(code)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (lambda argv: [][1], "traceback: IndexError"),
        (lambda argv: time.sleep(5), "ran past 0.5 s"),
        (lambda argv: bytearray(300 * 2**20), "peak memory grew"),
        (lambda argv: fail("ckptconv: error: one\nckptconv: error: two"), "2 error lines"),
        (lambda argv: fail("warning: x\nckptconv: error: one\ntrailing"), "1 error lines, not one last line"),
        (lambda argv: fail(code=1), "exit 1"),
        (lambda argv: Path("beside").write_text("x"), "changed EX/beside"),
        (lambda argv: (Path("out").mkdir(), fail()), "changed after it failed EX/out"),
        (lambda argv: Path("input.json").write_text("changed"), "changed EX/input.json"),
    ],
    ids=[
        "raises", "runs-long", "takes-memory", "two-lines", "line-not-last", "exit-1", "writes-beside",
        "fails-leaving-out", "changes-an-input",
    ],
)  # fmt: skip
def test_the_oracle_reports(
    fuzzer: Fuzzer, monkeypatch: pytest.MonkeyPatch, body: Callable[[list[str]], None], problem: str
) -> None:
    command(monkeypatch, body)
    with fuzzer.example("a stand-in command") as work:
        (work / "input.json").write_text("{}")
        with pytest.raises(AssertionError, match=problem):
            fuzzer.run("dcp-to-hf", "input.json", str(work / "out"), outs=[work / "out"])


def test_the_oracle_passes_out_its_staging_and_a_clean_failure(
    fuzzer: Fuzzer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def publish(argv: list[str]) -> None:
        staging = Path(".out.ckptconv-partial")
        staging.mkdir()
        (staging / "model.safetensors").write_text("x")
        staging.rename("out")

    def refuse(argv: list[str]) -> None:
        Path(".other.ckptconv-lock").write_text("")  # a failure may leave the lock file
        fail("warning: something\nckptconv: error: bad input; fix it")

    with fuzzer.example("a stand-in command") as work:
        command(monkeypatch, publish)
        assert fuzzer.run("dcp-to-hf", "in", "out", outs=[work / "out"]) == (0, "")
        command(monkeypatch, refuse)
        code, err = fuzzer.run("dcp-to-hf", "in", "other", outs=[work / "other"])
        assert code == 2 and err.endswith("fix it\n")
        command(monkeypatch, lambda argv: fail(code=1))
        assert fuzzer.run("verify", "a", "b", codes=(0, 1, 2))[0] == 1
    assert (fuzzer.inputs, fuzzer.commands, fuzzer.succeeded) == (1, 3, 1)
