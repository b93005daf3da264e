"""Under torchrun: `open_dcp_shared` on every rank, with `.metadata` readable by rank 0 alone.

On every other rank `open_dcp` and the file reads of `ckptconv.formats.dcp` raise, so a rank that read the
metadata itself would fail. Prints one JSON line from rank 0: {"same": [bool per rank]}, each rank's result
(packed) compared with what `open_dcp` gives rank 0 afterwards.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from _finish import finish

import ckptconv.formats.dcp as dcp
from ckptconv.job.world import everyone, world_from_env
from ckptconv.source import share as dcp_share


def refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a rank other than 0 read the checkpoint's metadata")


def main() -> None:
    path = Path(sys.argv[1])
    with world_from_env() as world:
        if not world.is_main:
            dcp_share.open_dcp = refuse  # type: ignore[assignment]
            dcp.read_regular = refuse  # type: ignore[assignment]
        ckpt = everyone(world, dcp_share.open_dcp_shared, world, path)
        mine = dcp_share.pack(ckpt)
        reports = world.all_gather_object(mine)
        if world.is_main:
            expected = dcp.open_dcp(path)
            print(json.dumps({"same": [dcp_share.unpack(r) == expected for r in reports]}))
    finish()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main()
