"""The JSON Schema of the `--json` reports (report.schema.json, shipped in the package).

Every report carries `schema_version`; it changes only when a field is removed or changes meaning (new
fields may appear at any version), so a CI job can check `schema_version == 1` and rely on the fields the
schema requires. `load()` gives the schema, e.g. for `jsonschema.validate(report, load())`.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

SCHEMA_VERSION = 1
SCHEMA_FILE = "report.schema.json"


def load() -> dict[str, Any]:
    """The report schema (JSON Schema draft 2020-12)."""
    doc: dict[str, Any] = json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text())
    return doc


def versioned(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with `schema_version` first."""
    return {"schema_version": SCHEMA_VERSION, **doc}
