"""Which layout variant a checkpoint holds (HF experts stored per expert or fused, ...), read off its keys and
shapes, or off what a mapping makes of them. Pure: names and shapes only, never a tensor.

Each aspect of a layout has a detector, `Seen -> Variant | None`, listed in `DETECTORS`; `detect` runs them
all. A new aspect (a runtime-side one: how a trainer stacks or interleaves its experts) is one more detector
reading `Seen.runtime` or the mapping's rules, added to `DETECTORS` with its words in `_WORDS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptconv.mapping.types import Direction, KeyMapping, Target

Shapes = Mapping[str, tuple[int, ...]]
HF_EXPERTS = ("per_expert", "fused")  # the `when` values of a mapping's HF expert rules (mapping/parse.py)

# transformers' per-expert names (`mlp.experts.3.gate_proj.weight`; Mixtral's `experts.3.w1.weight`), and its
# fused ones (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]; gpt-oss alike): 3-D,
# not `.weight`. `(^|\.)` keeps DeepSeek's `shared_experts.` out.
_PER_EXPERT = re.compile(r"(?:^|\.)experts\.[0-9]+\.(?:[^.]+_proj|w[123])\.weight$")
_FUSED = re.compile(r"(?:^|\.)experts\.[^.]+_proj$")


@dataclass(frozen=True)
class Seen:
    """What the detectors read about one checkpoint."""

    hf: Shapes
    """The HF-side keys and shapes: an HF checkpoint's own; a DCP's as dcp-to-hf takes them, or with a mapping
    the keys that mapping writes."""
    runtime: Shapes = field(default_factory=dict)
    """The runtime-side keys and shapes, where a mapping tells the sides apart (a DCP's own, an HF
    checkpoint's mapped keys); empty otherwise."""
    mapping: KeyMapping | None = None
    """The mapping given (`--mapping`), or None."""
    targets: Sequence[Target] = ()
    """What the mapping made of the checkpoint's keys (`map_keys(...).targets`)."""
    direction: Direction | None = None
    """Which way the mapping was read: to_hf for a DCP (the HF keys are the mapping's), to_runtime for an HF
    checkpoint (the HF keys are its own); None without a mapping."""


@dataclass(frozen=True)
class Variant:
    """The variant one aspect of the layout is in."""

    aspect: str
    """What it is a variant of: `hf_experts` (how the HF files store routed experts)."""
    variant: str
    """hf_experts: per_expert, fused, or mixed (both at once)."""
    basis: str
    """keys: the checkpoint's own keys are in it; mapping: the mapping writes it (a DCP read to HF)."""
    key: str
    """The first key that shows it."""

    def to_json(self) -> dict[str, str]:
        """The --json report's entry, under `layout[aspect]`."""
        return {"variant": self.variant, "basis": self.basis, "key": self.key}


def hf_experts(seen: Seen) -> Variant | None:
    """How routed experts are stored on the HF side: `per_expert` (`experts.{e}.*_proj.weight`, what
    transformers' save_pretrained writes), `fused` (`experts.gate_up_proj` / `experts.down_proj`, 3-D: the
    modules' own parameters), `mixed`; None when there are no routed experts. With a mapping whose rules hold
    both variants (`when = ...`), the variant of the rules that matched, as the mapping itself chose.

    >>> per = {"m.layers.0.mlp.experts.0.gate_proj.weight": (8, 16), "m.layers.0.mlp.gate.weight": (4, 16)}
    >>> found = hf_experts(Seen(per))
    >>> found.variant, found.basis, found.key
    ('per_expert', 'keys', 'm.layers.0.mlp.experts.0.gate_proj.weight')
    >>> hf_experts(Seen({"m.layers.0.mlp.experts.gate_up_proj": (4, 16, 16)})).variant
    'fused'
    >>> hf_experts(Seen({"m.layers.0.mlp.shared_experts.gate_proj.weight": (8, 16)})) is None
    True
    """
    by_rules = _by_rules(seen)
    if by_rules is not None:
        return by_rules
    per = [k for k in seen.hf if _PER_EXPERT.search(k)]
    fused = [k for k, shape in seen.hf.items() if _FUSED.search(k) and len(shape) == 3]
    if not per and not fused:
        return None
    variant = "mixed" if per and fused else "per_expert" if per else "fused"
    return Variant("hf_experts", variant, "keys", (per or fused)[0])


def _by_rules(seen: Seen) -> Variant | None:
    """The variant of the mapping's `when` rules that made targets (None: the mapping has none, or none
    matched): a DCP's are the form the mapping writes, an HF checkpoint's the form its keys are in."""
    if seen.mapping is None or not seen.mapping.variants:
        return None
    # only the HF expert forms: a mapping's `when` may come to name runtime-side variants too
    when = {r.number: r.when for r in seen.mapping.rules if r.when in HF_EXPERTS}
    made = [t for t in seen.targets if t.rule in when]
    if not made:
        return None
    variants = list(dict.fromkeys(when[t.rule] for t in made if t.rule is not None))
    variant = variants[0] if len(variants) == 1 else "mixed"
    if seen.direction == "to_hf":
        return Variant("hf_experts", variant, "mapping", made[0].key)
    return Variant("hf_experts", variant, "keys", made[0].sources[0])


def runtime_layouts(seen: Seen) -> list[Variant]:
    """The mapping's runtime layouts (`[[mapping.layouts]]`: torchtitan's separate w1 / w3, interleaved or
    stacked w13, experts [E, F, D] or [E, 2, F, D]) a checkpoint is in, one aspect per layout group
    (`runtime:GROUP`): a DCP's as the mapping detected them off its keys and shapes (basis `keys`), an HF
    checkpoint's as the mapping writes them to runtime (basis `mapping`). Read off the rules that made
    targets, so only groups the checkpoint holds are told.

    >>> from ckptconv.mapping import load_mapping
    >>> from ckptconv.mapping.rules import map_keys
    >>> titan = load_mapping("torchtitan-llama3")
    >>> dcp = {"layers.0.feed_forward.w13.weight": (16, 8), "layers.0.feed_forward.w2.weight": (8, 8)}
    >>> made = map_keys(titan, "to_hf", dcp, {"num_attention_heads": 1}).targets
    >>> [(v.aspect, v.variant) for v in runtime_layouts(Seen({}, dcp, titan, made, "to_hf"))]
    [('runtime:feed-forward', 'w13-interleaved')]
    """
    if seen.mapping is None or not seen.mapping.layouts:
        return []
    group = {layout.name: layout.group for layout in seen.mapping.layouts}
    tagged = {r.number: r.layout for r in seen.mapping.rules if r.layout is not None}
    found: dict[str, Variant] = {}
    for target in seen.targets:
        for layout in tagged.get(target.rule, ()) if target.rule is not None else ():
            if group[layout] in found:
                continue
            aspect = "runtime:" + group[layout]
            if seen.direction == "to_hf":  # a DCP: its own runtime keys are in the layout
                found[group[layout]] = Variant(aspect, layout, "keys", target.sources[0])
            else:  # an HF checkpoint: the runtime keys the mapping writes are
                found[group[layout]] = Variant(aspect, layout, "mapping", target.key)
    return list(found.values())


Detector = Callable[[Seen], "Variant | list[Variant] | None"]
DETECTORS: tuple[Detector, ...] = (hf_experts, runtime_layouts)


def detect(seen: Seen) -> list[Variant]:
    """Every aspect's variant that the checkpoint shows, in `DETECTORS` order.

    >>> [v.variant for v in detect(Seen({"model.layers.1.mlp.experts.down_proj": (4, 16, 8)}))]
    ['fused']
    >>> detect(Seen({"model.embed_tokens.weight": (64, 16)}))
    []
    """
    found: list[Variant] = []
    for detector in DETECTORS:
        shown = detector(seen)
        found.extend([] if shown is None else [shown] if isinstance(shown, Variant) else shown)
    return found


# aspect -> (what it is, {variant: words})
_WORDS: dict[str, tuple[str, dict[str, str]]] = {
    "hf_experts": (
        "routed experts",
        {"per_expert": "per expert", "fused": "fused", "mixed": "both per expert and fused"},
    ),
}


def line(aspect: str, entry: Mapping[str, Any], label: str = "layout") -> str:
    """One human line for a `layout` entry of the --json report, starting with `label`.

    >>> line("hf_experts", {"variant": "fused", "basis": "keys", "key": "m.experts.gate_up_proj"})
    'layout: routed experts stored fused (m.experts.gate_up_proj)'
    >>> line("hf_experts", {"variant": "per_expert", "basis": "mapping", "key": "m.experts.0.up_proj.weight"})
    'layout: routed experts written per expert by the mapping (m.experts.0.up_proj.weight)'
    """
    what, words = _WORDS.get(aspect, (aspect, {}))
    if aspect.startswith("runtime:"):  # a mapping's layout group: its own name, the layout's as declared
        what = aspect.removeprefix("runtime:") + " (runtime)"
    variant = words.get(entry["variant"], entry["variant"])
    how = "stored" if entry["basis"] == "keys" else "written"
    by = " by the mapping" if entry["basis"] == "mapping" else ""
    return f"{label}: {what} {how} {variant}{by} ({entry['key']})"
