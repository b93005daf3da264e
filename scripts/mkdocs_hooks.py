"""MkDocs hook: pages made from the code when the site is built, so they cannot drift from it.

- `<!-- cli-reference -->` (cli.md): every command of the typer app with its usage, help text, and each
  option's flags, type, default and help, read from the click command typer builds.
- `<!-- report-schema -->` (json.md): ckptconv/report.schema.json as shipped.
"""

from __future__ import annotations

import json
from typing import Any


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "<!-- cli-reference -->" in markdown:
        markdown = markdown.replace("<!-- cli-reference -->", cli_reference())
    if "<!-- report-schema -->" in markdown:
        from ckptconv.schema import load

        markdown = markdown.replace("<!-- report-schema -->", f"```json\n{json.dumps(load(), indent=2)}\n```")
    return markdown


def cli_reference() -> str:
    """From the click command typer builds, through the calls click and typer's own copy of it share
    (typer 0.29 vendors click): `context_class`, `get_usage`, `get_help_record`."""
    import typer

    from ckptconv.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="ckptconv")
    out = []
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        sub = command.context_class(command, info_name=name, parent=ctx)
        usage = command.get_usage(sub).replace("Usage: ", "")
        out += [f"## `ckptconv {name}`", "", (command.help or "").strip(), "", "```text", usage, "```", ""]
        rows = ["| argument / option | help |", "| --- | --- |"]
        for param in command.params:
            record = param.get_help_record(sub)
            if record is None:
                continue
            flags, help_text = record
            cell = " ".join(help_text.split()).replace("|", "\\|")
            rows.append(f"| `{flags}` | {cell} |")
        out += [*rows, ""]
    return "\n".join(out)
