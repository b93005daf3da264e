"""hf-to-dcp / load_hf `--lora-adapter`: the base checkpoint with a PEFT adapter's tensors (`wrap`), read from
a directory, a hub repo id or a URL."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ckptconv.core.specs import HfCheckpoint
from ckptconv.formats.hf import open_hf
from ckptconv.lora.wrap import wrap


def with_adapter(hf: HfCheckpoint, adapter: str | Path | None, name: str) -> HfCheckpoint:
    """`hf` with the adapter's tensors under PEFT-wrapped names (`hf` itself without an adapter)."""
    if adapter is None:
        return hf
    from ckptconv.source.locate import hf_source

    located = hf_source(str(adapter), None)
    tensors = wrap(hf.tensors, open_hf(located).tensors, name, f"--lora-adapter {adapter}")
    return dataclasses.replace(hf, tensors=tensors)
