"""`inspect`'s view of the LoRA adapters in a checkpoint: per adapter its targets, ranks, DoRA and, where the
trainer's `adapter_config.json` sits beside the checkpoint, alpha and rsLoRA. Pure, apart from reading that
file."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats.files import exists
from ckptconv.formats.hf import checkpoint_root
from ckptconv.lora.checks import check_config
from ckptconv.lora.keys import find_lora
from ckptconv.lora.settings import CONFIG_FILE, read_config


def describe(keys: list[str], shapes: dict[str, tuple[int, ...]], src: Path | None) -> list[dict[str, Any]]:
    """One entry per adapter (empty without LoRA): `name`, `modules` (how many), `targets` (their last
    names), `ranks` ({r: modules}), `dora`, and `alpha` / `rslora` from `src/adapter_config.json` (None when
    there is none: then dcp-to-hf needs --lora-alpha)."""
    found = find_lora(keys)
    if found is None:
        return []
    config: dict[str, Any] | None = None
    if src is not None:
        try:  # a file that is not the checkpoint's own (a FIFO, a link out of it) is not read
            if exists(src / CONFIG_FILE):
                config = read_config(src / CONFIG_FILE, checkpoint_root(src))
                check_config(config, str(src / CONFIG_FILE))
        except CkptconvError:  # a config dcp-to-hf would refuse says nothing here
            config = None
    out = []
    selected = dict(found.base)
    experts = {m: _rows(shapes[selected[f"{m}.{ps[0]}"]]) for m, ps in found.wrapped.items() if ps}
    for name, factors in found.adapters.items():
        ranks = Counter(_rows(shapes[f.a]) // max(1, experts.get(f.module, 1)) for f in factors.values())
        out.append(
            {
                "name": name,
                "modules": len(factors),
                "targets": sorted({f.module.rsplit(".", 1)[-1] for f in factors.values()}),
                "ranks": {str(r): n for r, n in sorted(ranks.items())},
                "dora": any(f.magnitude for f in factors.values()),
                "alpha": config.get("lora_alpha") if config else None,
                "rslora": bool(config.get("use_rslora")) if config else None,
            }
        )
    return out


def _rows(shape: tuple[int, ...]) -> int:
    """A factor's (or a stacked parameter's) first dim; 0 for a 0-d tensor, which dcp-to-hf refuses."""
    return shape[0] if shape else 0


def line(adapter: dict[str, Any]) -> str:
    """`LoRA adapter 'default': 6 modules (q_proj, v_proj), r=4, alpha 8` for the text report."""
    ranks = ", ".join(
        f"r={r}" + (f" x{n}" if len(adapter["ranks"]) > 1 else "") for r, n in adapter["ranks"].items()
    )
    kind = "DoRA" if adapter["dora"] else "rsLoRA" if adapter["rslora"] else "LoRA"
    alpha = f"alpha {adapter['alpha']}" if adapter["alpha"] is not None else "alpha unknown (--lora-alpha)"
    return (
        f"{kind} adapter {adapter['name']!r}: {adapter['modules']} modules "
        f"({', '.join(adapter['targets'])}), "
        f"{ranks}, {alpha}; dcp-to-hf needs --lora adapter, merge or drop"
    )
