"""Where a command's outcome becomes an exit code: usage errors, ckptconv's errors, interrupts.

Exit codes: 0 success, 1 verify mismatch, 2 bad input or usage (one line on stderr, no traceback; set
CKPTCONV_DEBUG=1 for one), 128 + the signal when interrupted (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP). A closed
stdout or stderr (`| head`) changes none of them: what no reader is left to read is dropped (`pipes`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import typer

from ckptconv.cli.pipes import closed_pipes_dropped
from ckptconv.job.env import debug, rank

if TYPE_CHECKING:
    from ckptconv.errors import CkptconvError

# how the command `call` runs says an error (set while it runs; None in library use)
_say: Callable[[CkptconvError], None] | None = None


def _typer_errors() -> tuple[type[Exception], type[Exception]]:
    """typer's usage-error class and the base of the errors it shows to users, found from its public
    `typer.BadParameter`: typer < 0.29 re-exports click's classes, typer 0.29 vendors its own copy of click,
    so neither `click.UsageError` nor a typer-internal module path can be relied on."""
    ancestors = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
    usage = ancestors.get("UsageError", typer.BadParameter)
    shown = ancestors.get("ClickException", usage)
    return usage, shown


def _usage_line(app: typer.Typer, error: Exception, argv: list[str]) -> str:
    """One line: typer's message and where to look (`see 'ckptconv dcp-to-hf --help'`)."""
    ctx = getattr(error, "ctx", None)
    path = getattr(ctx, "command_path", None) or "ckptconv"
    if path == "ckptconv":  # raised while parsing a command's options, before its context existed
        command = next((a for a in argv if not a.startswith("-")), None)
        if command in typer.main.get_command(app).commands:  # type: ignore[attr-defined]
            path = f"ckptconv {command}"
    message = error.format_message() if hasattr(error, "format_message") else str(error)
    return f"ckptconv: error: {' '.join(message.split()).rstrip('.')}; see '{path} --help'"


def call(app: typer.Typer, argv: list[str] | None = None) -> None:
    """Run `app` on `argv` (the process's arguments by default) and exit with the outcome's code."""
    args = (sys.argv[1:] if argv is None else argv) or ["--help"]  # bare `ckptconv`: the help, exit 0
    global _say
    _say = lambda e: _say_error(e, app, args)  # noqa: E731
    try:
        with closed_pipes_dropped():
            _run(app, args)
    finally:
        _say = None


def _run(app: typer.Typer, args: list[str]) -> None:
    from ckptconv.errors import CkptconvError
    from ckptconv.job.signals import as_interrupts

    usage_error, shown_error = _typer_errors()
    try:
        with as_interrupts():
            code = app(args=args, prog_name="ckptconv", standalone_mode=False)
        if isinstance(code, int) and code:  # some typer versions turn Ctrl-C into 130 and return it
            if code == 130:
                _exit_interrupted()
            sys.exit(code)
    except typer.Exit as e:
        if e.exit_code == 130:
            _exit_interrupted()
        sys.exit(e.exit_code)
    except usage_error as e:
        _fail(_usage_line(app, e, args), app, args)
    except (KeyboardInterrupt, typer.Abort):
        _exit_interrupted()
    except CkptconvError as e:
        if debug():
            raise
        _say_error(e, app, args)
        sys.exit(e.exit_code)
    except OSError as e:  # an environment problem no check named more precisely (EACCES on a parent, ...)
        if debug():
            raise
        where = f"{os.fsdecode(e.filename)}: " if e.filename is not None else ""
        cause = e.strerror or type(e).__name__
        _fail(f"ckptconv: error: {where}{cause}; check the path, its permissions and storage", app, args)
    except shown_error as e:  # any other error typer shows to users (a file it cannot open, ...)
        _fail(_usage_line(app, e, args), app, args)


def say_agreed(error: CkptconvError) -> None:
    """Say now (rank 0, flushed) an error every rank raised together, so that the ranks can wait for it
    before any of them ends: torchrun stops a job's other processes (SIGTERM) as soon as one ends with an
    error, which could kill rank 0 before its report is out. Nothing in library use or with CKPTCONV_DEBUG
    (the traceback comes later)."""
    if _say is not None and not debug():
        _say(error)


def _say_error(e: CkptconvError, app: typer.Typer, args: list[str]) -> None:
    """`e` as one line on stderr (on rank 0 alone when every rank raised it) and, exit 2 with `--json`, as
    an error report on stdout; once."""
    if e.said:
        return
    e.said = True
    line = f"ckptconv: error: {' '.join(str(e).split())}"
    quiet = e.agreed and rank() != 0
    if e.exit_code != 2:  # a verify mismatch (exit 1): its --json report is out already
        if not quiet:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        return
    _report(line, app, args, quiet)


def _fail(line: str, app: typer.Typer, args: list[str]) -> NoReturn:
    _report(line, app, args)
    sys.exit(2)


def _report(line: str, app: typer.Typer, args: list[str], quiet: bool = False) -> None:
    """`line` on stderr (unless `quiet`: another rank says it) and, with `--json`, on rank 0 the report of
    an error on stdout: {"schema_version", "command", "error": {"message", "exit_code"}}; flushed."""
    if not quiet:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    if "--json" in args and rank() == 0 and not quiet:
        import json

        from ckptconv.cli.schema import versioned

        commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
        command = next((a for a in args if a in commands), None)
        error = {"command": command, "error": {"message": line, "exit_code": 2}}
        sys.stdout.write(json.dumps(versioned(error), indent=2) + "\n")
        sys.stdout.flush()


def _exit_interrupted() -> NoReturn:
    """Exit 128 + the signal that stopped the run, with one line for the whole job: under torchrun every rank
    is signalled, rank 0 says so."""
    from ckptconv.job.signals import exit_code

    if rank() == 0:
        sys.stderr.write("ckptconv: interrupted\n")
    sys.exit(exit_code())
