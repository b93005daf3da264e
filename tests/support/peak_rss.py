"""`python -m peak_rss ARGS`: ckptconv ARGS, then how far the process's peak RSS rose above its RSS at the
start (bytes, stdout's last line), torch and the CLI imported before that start (as in the fork server)."""

from __future__ import annotations

import sys


def _status(field: str) -> int:
    """A /proc/self/status field, in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


if __name__ == "__main__":
    import torch.distributed.run  # noqa: F401  (what every command imports: not the command's own memory)

    from ckptconv.cli.app import main

    # the peak RSS (VmHWM) starts again from the RSS now (a fork server's child inherits the server's)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    start = _status("VmRSS")
    try:
        main(sys.argv[1:])  # not ckptconv's entry point, which leaves by os._exit
    finally:
        print(max(0, _status("VmHWM") - start), flush=True)
