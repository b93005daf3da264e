"""What the CLI prints besides its messages: JSON documents (rank 0 only) and the --trust-pickle notice."""

from __future__ import annotations

import json
import re
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def rank() -> int:
    from ckptconv.job.env import rank

    return rank()


@contextmanager
def trust(enabled: bool) -> Iterator[None]:
    """--trust-pickle for the command run inside; says afterwards what was loaded that way."""
    if not enabled:
        yield
        return
    from ckptconv.formats.safe_pickle import trusting

    with trusting() as loaded:
        yield
    if loaded and rank() == 0:
        sys.stderr.write(
            f"warning: --trust-pickle loaded with a full unpickler: {', '.join(dict.fromkeys(loaded))}\n"
        )


def print_json(doc: dict[str, Any]) -> None:
    """Rank 0: `doc` as the one JSON document on stdout, with its `schema_version` (ckptconv.cli.schema)."""
    from ckptconv.cli.schema import versioned

    if rank() == 0:
        sys.stdout.write(dumps(versioned(doc)) + "\n")


_LONG = 64  # a list of more records than this is written a record per line
_ONE_LINE = json.JSONEncoder(separators=(", ", ": ")).encode


def dumps(doc: dict[str, Any]) -> str:
    """`json.dumps(doc, indent=2)`, except that a long list of records (an inspect's chunks: a million at
    1 TB) has one compact record per line: Python's indenting encoder takes 11 s for a million records,
    the C one, a record at a time, 4 s, and the output is 40% smaller."""
    lists: list[list[Any]] = []
    nonce = secrets.token_hex(8)  # no string of the document can hold a marker by chance or on purpose

    def swap(value: Any) -> Any:
        if type(value) is dict:
            return {k: swap(v) for k, v in value.items()}
        if type(value) is list:
            if len(value) > _LONG and type(value[0]) is dict:
                lists.append(value)
                return f"{nonce}:{len(lists) - 1}"
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(doc), indent=2)

    def records(match: re.Match[str]) -> str:
        line = text[text.rfind("\n", 0, match.start()) + 1 : match.start()]
        indent = " " * (len(line) - len(line.lstrip(" ")))
        rows = f",\n{indent}  ".join(map(_ONE_LINE, lists[int(match.group(1))]))
        return f"[\n{indent}  {rows}\n{indent}]"

    return re.sub(f'"{nonce}:([0-9]+)"', records, text)


def show_dcp_to_hf(
    result: Any, src: Any, out: Any, world: Any, ui: Any, *, dry_run: bool, verify: bool, json_out: bool
) -> None:
    """dcp-to-hf's report: the --json document, the plan of a --dry-run, or the lines saying what was done."""
    from ckptconv.remote.urls import url_path
    from ckptconv.run.report import human_bytes, plan_summary, render_plan

    summary = plan_summary(result.plan)
    out = url_path(out) or out
    doc = {
        "command": "dcp-to-hf",
        "src": str(url_path(src) or src),
        "out": str(out),
        "dry_run": dry_run,
        "seconds": round(result.seconds, 3),
        "verified": verify and result.written,
        "copied": result.copied,
        "config_edits": result.config_edits,
        "ranks": [r.to_json() for r in result.ranks],
        **summary,
        "hub": result.hub,
        "reference": result.reference,
        "resumed": result.resumed,
    }
    lines = [
        f"wrote {out}: {len(result.plan.files)} file(s), {summary['num_tensors']} tensors, "
        f"{human_bytes(result.plan.total_size)} in {result.seconds:.1f}s on {world.size} rank(s)",
        *(f"config.json: {edit}" for edit in result.config_edits),
        *([f"pushed to {result.hub['pr_url'] or result.hub['commit_url']}"] if result.hub else []),
    ]
    _show(doc if json_out else None, render_plan if dry_run else None, result.plan, lines, world, ui)


def show_hf_to_dcp(
    result: Any, src: str, out: Any, world: Any, ui: Any, *, dry_run: bool, verify: bool, json_out: bool
) -> None:
    """hf-to-dcp's report: the --json document, the plan of a --dry-run, or the line saying what was done."""
    from ckptconv.run.report import dcp_plan_summary, human_bytes, render_dcp_plan

    summary = dcp_plan_summary(result.plan)
    doc = None
    if json_out:  # listing OUT's files only for the report that shows them
        doc = {
            "command": "hf-to-dcp",
            "src": src,
            "source_path": str(result.source),
            "out": str(out),
            "dry_run": dry_run,
            "seconds": round(result.seconds, 3),
            "verified": verify and result.written,
            "written_files": _written_files(out) if result.written else [],
            "ranks": [r.to_json() for r in result.ranks],
            **summary,
            "reference": result.reference,
            "resumed": result.resumed,
        }
    line = (
        f"wrote {out}: {summary['num_tensors']} tensors, {human_bytes(result.plan.total_size)}, "
        f"{len(result.plan.stash)} non-tensor items, in {result.seconds:.1f}s on {world.size} rank(s)"
    )
    _show(doc, render_dcp_plan if dry_run else None, result.plan, [line], world, ui)


def _show(doc: dict[str, Any] | None, render: Any, plan: Any, lines: list[str], world: Any, ui: Any) -> None:
    """A conversion's report: `doc` as JSON when given (--json), else the plan `render`ed on rank 0 when
    given (--dry-run), else `lines` as notes."""
    if doc is not None:
        print_json(doc)
    elif render is not None:
        if world.is_main:
            from rich.console import Console

            render(plan, Console(highlight=False, soft_wrap=True))
    else:
        for line in lines:
            ui.info(line)


def _written_files(out: Any) -> list[str]:
    """The names in OUT: a directory's entries, or the objects under a URL (listed afresh)."""
    from ckptconv.remote.urls import UrlPath

    if isinstance(out, UrlPath):
        from ckptconv.publish.remote_run import listing

        return sorted(listing(out))
    return sorted(p.name for p in out.iterdir())


def show_verify(report: Any, a: str, b: str, world: Any, tolerance: Any, json_out: bool) -> None:
    """`verify`'s report (the JSON document, or one line per finding and a verdict) on rank 0; a mismatch is
    VerifyMismatch (exit 1) on every rank."""
    from ckptconv.errors import VerifyMismatch

    if json_out:
        print_json(report.to_json())
    elif world.is_main:
        for finding in report.findings:
            sys.stdout.write(finding.line() + "\n")
        how = "bit for bit" if tolerance is None else f"within atol {tolerance.atol}, rtol {tolerance.rtol}"
        if report.match:
            sys.stdout.write(f"match: {report.compared} tensors equal {how} ({report.seconds:.1f}s)\n")
    if not report.match:
        raise VerifyMismatch(
            f"{len(report.findings)} mismatch(es) between {a} and {b}", agreed=world.distributed
        )


SHOWN = 20  # layout differences printed one a line (--json lists them all)


def show_layout(report: Any, a: str, b: str, world: Any, ui: Any, json_out: bool) -> None:
    """`verify --layout`'s report on rank 0 (the JSON document, or the first `SHOWN` differences one a line,
    its notes and a verdict); a difference is VerifyMismatch (exit 1) on every rank."""
    from ckptconv.errors import VerifyMismatch

    findings = report.findings
    if json_out:
        print_json(report.to_json())
    elif world.is_main:
        for finding in findings[:SHOWN]:
            sys.stdout.write(finding.line() + "\n")
        if len(findings) > SHOWN:
            sys.stdout.write(f"... and {len(findings) - SHOWN} more (--json lists them all)\n")
        for note in report.notes:
            ui.info(note)
        if report.match:
            same = f"match: {report.compared} tensors have the same layout"
            sys.stdout.write(f"{same} ({report.seconds:.1f}s)\n")
    if not report.match:
        raise VerifyMismatch(
            f"{len(findings)} layout difference(s) between {a} and {b}", agreed=world.distributed
        )
