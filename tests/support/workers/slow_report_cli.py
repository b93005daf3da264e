"""`python -m ckptconv ARGS` whose rank 0 takes SLOW_REPORT_S seconds to make its `--json` error report, as on
a loaded machine: under torchrun a rank that ends first gets the others stopped (SIGTERM), which must not
lose rank 0's report."""

import os
import sys
import time
from typing import Any

from ckptconv.cli import schema

_versioned = schema.versioned


def slow_versioned(doc: dict[str, Any]) -> dict[str, Any]:
    if os.environ.get("RANK", "0") == "0" and "error" in doc:
        time.sleep(float(os.environ["SLOW_REPORT_S"]))
    return _versioned(doc)


schema.versioned = slow_versioned
from ckptconv.cli.app import run  # noqa: E402

sys.argv[0] = "ckptconv"
run()
