"""Writes mapping/presets/transformers/: a preset per model_type from transformers' conversion mapping.

transformers 5 loads a checkpoint into a runtime layout of its own (`get_checkpoint_conversion_mapping`: MoE
experts stacked and gate/up fused, keys renamed) and `save_pretrained` writes the saved layout back. A DCP of
a live transformers-5 model holds the runtime layout; `--mapping transformers` maps it to what
`save_pretrained` writes, and back. For each model_type with a causal-LM or image-text-to-text class:

- no conversion that `save_pretrained` reverts (none, or only a PrefixChange, which it drops for a model built
  from a config): the model_type is listed as `identity` in index.toml (keys and layouts are the same);
- otherwise the model is built on the meta device from its default config (and a variant with the optional
  biases and without q_lora_rank, for the keys only some configs have), every runtime key of
  `model.state_dict()` is reverted alone with transformers' own `revert_weight_conversion` (what
  `save_pretrained` runs), and the transform that took it is translated to a rule: a renaming to a rename,
  `MergeModulelist(0)` to `stack`, `MergeModulelist(0)` + `Concatenate(d)` to `stack` + split along `d`,
  `Transpose(a, b)` to `transpose` (with `check_dims`, `save_pretrained` leaves the runtime tensor as it is: a
  rename). Numbers in keys become placeholders (`layers.{layer}`). A transform with any other operation, or a
  model that cannot be built, leaves the model_type out (`not_covered` in index.toml, with the reason).

Every preset is checked here: ckptconv's own planner maps the meta model's keys and shapes to exactly the
saved ones, and back. `python scripts/gen_transformers_mappings.py` rewrites the folder; `--check` exits 1
when it differs (tests/interop/test_transformers_layouts.py runs that with the installed transformers).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "ckptconv" / "mapping" / "presets" / "transformers"
_NAMES = {"layers": "layer", "experts": "expert", "blocks": "block", "h": "layer"}
_NUM = re.compile(r"0|[1-9][0-9]*")


def generalize(key: str) -> str:
    """`model.layers.3.mlp.experts.1.w1.weight` -> `model.layers.{layer}.mlp.experts.{expert}.w1.weight`."""
    parts, seen, out = key.split("."), {}, []
    for i, part in enumerate(parts):
        if i and _NUM.fullmatch(part):
            prev = re.sub(r"[^a-z0-9_]", "_", parts[i - 1].lower()) or "n"
            name = _NAMES.get(prev, prev if re.match(r"[a-z_]", prev) else "n" + prev)
            seen[name] = seen.get(name, 0) + 1
            out.append("{" + (name if seen[name] == 1 else f"{name}{seen[name]}") + "}")
        else:
            out.append(part)
    return ".".join(out)


def model_classes(model_type: str) -> str | None:
    from transformers.models.auto import modeling_auto as ma

    # a multimodal model_type's checkpoint is its whole model (image-text-to-text), not the text tower alone
    for names in (ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in names:
            return names[model_type]
    return None


def _variant(config: Any) -> Any:
    """The config with every optional bias on and no q_lora_rank: keys the default config lacks."""
    import copy

    other = copy.deepcopy(config)
    for sub in [
        other,
        *[v for v in vars(other).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")],
    ]:
        for name, value in list(vars(sub).items()):
            if isinstance(value, bool) and "bias" in name:
                setattr(sub, name, True)
        if getattr(sub, "q_lora_rank", 0) is not None and hasattr(sub, "q_lora_rank"):
            sub.q_lora_rank = None
    return other


# few layers and experts (where the config has such a field): the same key patterns, planned in a moment
SMALL: dict[str, Any] = {
    "num_hidden_layers": 2,
    "num_experts": 3,
    "num_local_experts": 3,
    "n_routed_experts": 3,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# default configs that leave a size the model needs unset
FIX: dict[str, dict[str, Any]] = {
    "dots1": {"n_routed_experts": 3, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "hunyuan_v1_moe": {"head_dim": 128, "num_experts": 3},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
}


def small_config(model_type: str) -> Any:
    """The default config of `model_type` with the SMALL sizes it has fields for (its own, if that fails)."""
    import transformers as tf

    default = tf.AutoConfig.for_model(model_type)
    try:
        small = {k: v for k, v in SMALL.items() if hasattr(default, k)}
        kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or []))
        if len(kinds) > 1:  # a hybrid model: one layer of each kind its default config has
            small |= {"layer_types": kinds, "num_hidden_layers": len(kinds)}
        return tf.AutoConfig.for_model(model_type, **(small | FIX.get(model_type, {})))
    except Exception:  # a config that checks its fields against each other: the default one
        return tf.AutoConfig.for_model(model_type, **FIX.get(model_type, {}))


def build(model_type: str, config: Any = None) -> Any:
    """The model_type's class on the meta device, from `config` (default: `small_config`)."""
    import torch
    import transformers as tf

    config = config or small_config(model_type)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(tf, model_classes(model_type) or "")(config)


def transforms(model: Any) -> list[Any]:
    """What `revert_weight_conversion` reverts for a model built from a config (PrefixChange dropped)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    return [
        t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)
    ]


class Unsupported(Exception):
    """A transform whose operations have no exact rule."""


def _ops(converter: Any) -> dict[str, Any]:
    """The rule fields of a forward WeightConverter (saved -> runtime), or Unsupported."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    ops = list(converter.operations)
    names = [type(o).__name__ for o in ops]
    n = len(converter.source_patterns)
    if len(converter.target_patterns) != 1:
        raise Unsupported(f"{names} into {len(converter.target_patterns)} targets")
    if type(ops[0]) is MergeModulelist and ops[0].dim == 0:
        if len(ops) == 1 and n == 1:
            return {"stack": True}
        if len(ops) == 2 and type(ops[1]) is Concatenate and n > 1:
            return {"stack": True, "dim": ops[1].dim}
    if len(ops) == 1 and type(ops[0]) is Transpose and n == 1:
        return {} if ops[0].check_dims else {"transpose": [ops[0].dim0, ops[0].dim1]}
    raise Unsupported(f"operations {names}")


def rules_of(model: Any) -> list[dict[str, Any]]:
    """One rule per runtime key of `model` (as save_pretrained reverts it), numbers made placeholders."""
    from transformers.core_model_loading import WeightConverter, apply_converters, revert_weight_conversion

    forward = transforms(model)
    pairs = [(t, t.reverse_transform()) for t in forward[::-1] if isinstance(t, WeightConverter)]
    for t in forward:
        if type(t).__name__ not in ("WeightRenaming", "WeightConverter"):
            raise Unsupported(f"transform {type(t).__name__}")
    tied = getattr(model, "_tied_weights_keys", None) or {}
    rules: list[dict[str, Any]] = []
    used: set[int] = set()
    state = model.state_dict()
    for key, tensor in state.items():
        saved = revert_weight_conversion(model, {key: tensor})
        _, pattern = apply_converters(key, [r for _, r in pairs])
        found = [f for f, r in pairs if pattern is not None and pattern in r.source_patterns]
        fields = _ops(found[0]) if found else {}
        used.update(id(f) for f in found[:1])
        runtime = generalize(key)
        hf = list(dict.fromkeys(generalize(k) for k in saved))
        rule: dict[str, Any] = {"runtime": runtime, "hf": hf[0] if len(hf) == 1 else hf}
        extra = [p for h in hf for p in re.findall(r"\{(\w+)\}", h) if "{" + p + "}" not in runtime]
        if fields.pop("stack", False):
            stacks = list(dict.fromkeys(extra))
            if len(stacks) != 1 or len(hf) != len(found[0].source_patterns):
                raise Unsupported(f"{key}: stacked into {sorted(saved)[:2]}...")
            rule["stack"] = stacks[0]
        elif extra or len(hf) != 1:
            raise Unsupported(f"{key}: saved as {sorted(saved)[:3]}, its numbers not kept")
        rule |= fields
        if key in tied and isinstance(tied, dict):
            rule["tied"] = generalize(
                next(iter(revert_weight_conversion(model, {tied[key]: state[tied[key]]})))
            )
        if rule not in rules:
            rules.append(rule)
    idle = [f for f, _ in pairs if id(f) not in used]
    if idle:  # a layer the small config lacks (all dense): its keys would have no rule
        raise Unsupported(f"no key of the small model is converted by {idle[0].target_patterns}")
    return rules


def _toml(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return f'"{value}"' if isinstance(value, str) else str(value)


def render(model_type: str, cls: str, rules: list[dict[str, Any]]) -> str:
    import transformers

    lines = [
        f"# transformers {model_type} ({cls}): the runtime layout of a live transformers-5 model",
        "# (its state_dict) <-> what save_pretrained writes. Written by scripts/gen_transformers_mappings.py",
        f"# from transformers {transformers.__version__}'s conversion mapping; do not edit (regenerate).",
        "",
        "[mapping]",
        f'name = "transformers-{model_type}"',
    ]
    for rule in rules:
        lines += ["", "[[rule]]", *(f"{k} = {_toml(v)}" for k, v in rule.items())]
    return "\n".join(lines) + "\n"


def check(model: Any, text: str, model_type: str) -> None:
    """ckptconv maps the model's runtime keys and shapes to exactly the saved ones, and back."""
    import tomllib

    from transformers.core_model_loading import revert_weight_conversion

    from ckptconv.mapping.parse import parse
    from ckptconv.mapping.rules import map_keys

    state = model.state_dict()
    saved = revert_weight_conversion(model, dict(state))
    mapping = parse(tomllib.loads(text), model_type, None)
    config = {"tie_word_embeddings": False}
    runtime = {k: tuple(v.shape) for k, v in state.items()}
    hf = {k: tuple(v.shape) for k, v in saved.items()}
    got = {t.key: t.shape for t in map_keys(mapping, "to_hf", runtime, config).targets}
    back = {t.key: t.shape for t in map_keys(mapping, "to_runtime", hf, config).targets}
    if got != hf or back != runtime:
        raise Unsupported(f"ckptconv's plan differs from save_pretrained: {sorted(set(got) ^ set(hf))[:3]}")


def one(model_type: str) -> tuple[str, str]:
    """What the folder says of `model_type`: ("preset", its TOML), ("identity", ""), ("skipped", why), or
    ("none", "") for a model_type without a causal-LM or image-text-to-text class."""
    import transformers as tf

    cls = model_classes(model_type)
    if cls is None or not hasattr(tf, cls):
        return "none", ""
    try:
        model = build(model_type)
        if not transforms(model):
            return "identity", ""
        rules = rules_of(model)
        try:
            other = build(model_type, _variant(model.config))
        except Exception:  # the variant does not build: the default's keys only
            other = None
        rules += [r for r in (rules_of(other) if other is not None else []) if r not in rules]
        text = render(model_type, cls, rules)
        check(model, text, model_type)
    except Unsupported as e:
        return "skipped", str(e)
    except Exception as e:  # a model its default config cannot build (needs weights, a sub-package, ...)
        return "skipped", f"cannot build from its default config ({type(e).__name__})"
    return "preset", text


def generate() -> dict[str, str]:
    """File name -> text of every file in the folder (the model_types shared out over the CPUs: forked
    processes, each building models on the meta device)."""
    import multiprocessing

    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    files, identity, skipped = {}, [], {}
    types = sorted(CONFIG_MAPPING_NAMES)
    with multiprocessing.get_context("fork").Pool(min(4, os.cpu_count() or 1)) as pool:
        found = pool.map(one, types, chunksize=1)
    for model_type, (kind, what) in zip(types, found, strict=True):
        if kind == "identity":
            identity.append(model_type)
        elif kind == "skipped":
            skipped[model_type] = what
        elif kind == "preset":
            files[f"{model_type}.toml"] = what
    index = [
        "# The model_types scripts/gen_transformers_mappings.py found (transformers "
        f"{tf.__version__}): a preset each, the same",
        "# layout at runtime and in save_pretrained (identity), or left out with the reason (not_covered).",
        "",
        f"covered = {_toml(sorted(f.removesuffix('.toml') for f in files))}",
        f"identity = {_toml(identity)}",
        "",
        "[not_covered]",
        *(f'{k} = "{v}"' for k, v in sorted(skipped.items())),
    ]
    files["index.toml"] = "\n".join(index) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the folder differs; write nothing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    files = generate()
    have = {p.name: p.read_text() for p in args.out.glob("*.toml")} if args.out.is_dir() else {}
    if args.check:
        differ = sorted(set(files) ^ set(have) | {f for f in files if have.get(f) != files[f]})
        for name in differ:
            print(
                f"{args.out / name}: differs from transformers' conversion mapping; regenerate",
                file=sys.stderr,
            )
        return 1 if differ else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in set(have) - set(files):
        (args.out / name).unlink()
    for name, text in files.items():
        (args.out / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
