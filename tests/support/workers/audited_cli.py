"""`python -m ckptconv ARGS`, noting in the file $AUDIT_LOG each open of a `.metadata`: one line per open,
"RANK TORCH" (TORCH: 1 if torch was imported by then). An audit hook sees every open, `os.open` included."""

import os
import sys

LOG = os.environ["AUDIT_LOG"]


def hook(event: str, args: tuple) -> None:
    path = args[0] if event == "open" else None
    if isinstance(path, str | bytes | os.PathLike) and os.fsdecode(path).endswith(".metadata"):
        with open(LOG, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {int('torch' in sys.modules)}\n")


sys.addaudithook(hook)
from ckptconv.cli.app import run  # noqa: E402

sys.argv[0] = "ckptconv"
run()
