"""The steps both conversions take: memory returned to the system, the model's config.json found, the
staged output checked against its source (`--verify`)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

from ckptconv.formats.files import exists
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone
from ckptconv.mapping import CONFIG_FILE
from ckptconv.run import sides
from ckptconv.run import verify as verify_mod

ConfigFile = tuple[Path | None, Path | None]  # config.json, the root it must resolve inside (None: a flag's)


def return_freed_memory() -> None:
    """Serve buffers of 1 MiB and more with mmap, so freeing a chunk gives its memory back to the system.

    glibc otherwise raises its mmap threshold up to 32 MiB after the first large free, and chunks of a few MiB
    then pile up in its heap: measured, peak RSS of a 1 GB hf-to-dcp went from 0.8 to 0.4 GiB with this.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 2**20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def config_file(config: Path | None, *places: tuple[Path, Path] | None) -> ConfigFile:
    """`--config`, else the config.json of the first of `places` (a directory, and the root its files must
    resolve inside) that has one: --copy-from's (or .hf_metadata), then the checkpoint's own."""
    if config is not None:
        return config, None
    for place in places:
        if place is not None and exists(place[0] / CONFIG_FILE):
            return place[0] / CONFIG_FILE, place[1]
    return None, None


def check_output(
    world: World,
    ui: Ui,
    source: Callable[[], sides.Side],
    output: Callable[[sides.Side], sides.Side],
) -> None:
    """Collective (`--verify`): the staged output against its source, before it is published."""
    a = everyone(world, source)
    b = everyone(world, output, a)
    verify_mod.check_output(a, b, world, ui)
