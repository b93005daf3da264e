"""Every `ckptconv` command shown in the README and the docs pages parses with the CLI as it is: each line of
a ```bash block that runs ckptconv (directly, under torchrun or as `python -m ckptconv`) is split as a shell
would and parsed by the command's own click parser, so a renamed or removed option, a bad value or a wrong
number of arguments in an example fails here in a second, without the checkpoints. test_docs_examples.py
then runs every one of them (slow-marked: CI runs it). The benchmark commands the pages show
(`scripts/bench.py NAME ...`) parse with the benchmarks' own parser too."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from ckptconv.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```bash\n(.*?)```", re.S)


RUNS = re.compile(r"(^|\s|/)ckptconv\s+(dcp-to-hf|hf-to-dcp|inspect|verify|--version|--help)\b")
SHELL = ("|", ">", ">>", "||", "&&", ";", "2>&1")


def commands() -> list[tuple[str, str]]:
    """(page, the command line) of every ckptconv command in a bash block, continuations joined."""
    found = []
    for page in PAGES:
        for block in BLOCK.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if RUNS.search(line):
                    found.append((page.name, line))
    return found


def argv(line: str) -> list[str]:
    """The arguments after `ckptconv` (whatever runs it: torchrun, `python -m`, a venv path), up to the
    first shell operator or redirection."""
    words = shlex.split(line)
    start = next(i for i, w in enumerate(words) if w == "ckptconv" or w.endswith("/ckptconv")) + 1
    args = []
    for word in words[start:]:
        if word in SHELL or word.startswith((">", "2>")):
            break
        args.append(word)
    return args


CASES = commands()


def test_the_pages_show_commands() -> None:
    assert len(CASES) > 40 and {"README.md", "lora.md", "object-storage.md"} <= {p for p, _ in CASES}


@pytest.mark.parametrize(("page", "line"), CASES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(CASES)])
def test_each_command_parses(page: str, line: str) -> None:
    args = argv(line)
    if args in (["--version"], ["--help"]):
        return
    root = typer.main.get_command(app)
    name, rest = args[0], args[1:]
    assert name in root.commands, f"{page}: {line}: no command {name!r}"  # type: ignore[attr-defined]
    command = root.commands[name]  # type: ignore[attr-defined]
    try:
        command.make_context(name, rest)
    except Exception as e:  # click's (or typer's vendored click's) UsageError / BadParameter
        raise AssertionError(f"{page}: `{line}` does not parse: {e}") from None


def bench_commands() -> list[tuple[str, str]]:
    """(page, arguments) of every `scripts/bench.py NAME ...` the pages show, in code spans (which may wrap
    a line) and bash blocks; `[--opt X]` (an optional part, as the pages write it) is taken as given."""
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = [
            line.split(" #")[0]
            for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in block.replace("\\\n", " ").splitlines()
        ]
        lines += [span.replace("\n", " ") for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", text)]
        for line in lines:
            for args in re.findall(r"scripts/bench\.py ([a-z0-9-]+(?: [^|>]*)?)", " ".join(line.split())):
                found.append((page.name, args.replace("[", "").replace("]", "").strip()))
    return found


BENCH = bench_commands()


@pytest.mark.parametrize(("page", "args"), BENCH, ids=[f"{p}:{i}" for i, (p, _) in enumerate(BENCH)])
def test_each_benchmark_command_parses(page: str, args: str) -> None:
    """A benchmark's options as the pages show them parse with scripts/bench.py's own parser."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from bench import parser
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    try:
        parser().parse_args(shlex.split(args))
    except SystemExit as e:
        raise AssertionError(f"{page}: `scripts/bench.py {args}` does not parse") from e


def test_the_pages_show_benchmark_commands() -> None:
    assert len(BENCH) > 20 and {"README.md", "benchmarks.md"} <= {p for p, _ in BENCH}
