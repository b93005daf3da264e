"""End a torchrun test worker the way the ckptconv CLI ends: barrier, destroy, leave without teardown.

torch 2.13's gloo threads occasionally abort a process that already finished its work at interpreter
exit ("terminate called without an active exception"), which made a fixture generator fail in CI after
it had written its checkpoint. `os._exit` skips the C++ static destructors where that happens.
"""

import os
import sys

import torch.distributed as dist


def finish() -> None:
    dist.barrier()  # nobody tears down while a peer is still in a collective
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
