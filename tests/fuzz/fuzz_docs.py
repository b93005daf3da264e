"""Hypothesis strategies for the JSON and TOML files ckptconv reads: a real document (a model's config.json,
PEFT's adapter_config.json, ckptconv's stash, a mapping preset, torch's DCP_SHARDING_INFO and NeMo's
fqn_to_file_index_mapping.json) with fields set to values that trip readers (zero, negative, huge, floats
and strings for sizes, NaN, regexes that backtrack, deep nesting, duplicate keys), then its text spoilt or
not (duplicate keys, NaN literals, 100k-deep arrays, a 5000-digit number, a BOM, trailing bytes, bad UTF-8).
`toml()` writes a mapping document back as TOML text (inline tables and arrays for nested values).
"""

from __future__ import annotations

import json
import math
from typing import Any

from fuzz_oracle import Shown, mostly
from hypothesis import strategies as st

SIZES = [0, 1, 2, 3, 4, 8, 16, 32, 64, 2**31, 2**40, 2**62, 2**63, 10**30, 10**9, -1, -8]
NUMBERS = [*SIZES, 0.5, 4.0, 1e9, 1e308, -0.0, math.nan, math.inf, -math.inf]
ODD = ["", "4", "x", "bfloat16", "é", "(a+)+$", "[", None, True, False, [], {}, [4], {"a": 1}]
REGEXES = [
    "q_proj", "v_proj", ".*", "(a+)+$", "(.*)*x", "(.*a){25}", "([a-z.0-9_]+)*z", "[", "(?P<x", "\\",
    "model\\.layers\\.0\\.self_attn\\.q_proj", "layers.0.self_attn.q_proj", "a" * 5000, "(?i)Q_PROJ",
]  # fmt: skip
VALUES = st.sampled_from(NUMBERS + ODD)


def json_values(depth: int = 2) -> st.SearchStrategy[Any]:
    """Any JSON value: the odd leaves above, in lists and objects."""
    return st.recursive(
        VALUES | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=4 * depth,
    )


SPOILS = ["dup", "nan", "deep", "digits", "bom", "trailing", "latin1", "cut", "empty", "list"]


def dumps(doc: Any, spoil: str) -> bytes:
    """`doc` as JSON text (NaN and Infinity as Python writes them), spoilt as `spoil` says."""
    text = json.dumps(doc, ensure_ascii=False)
    obj = text.startswith("{") and text != "{}"
    if spoil == "dup" and obj:
        first = next(iter(doc))
        text = text[:-1] + f", {json.dumps(first)}: {json.dumps(doc[first])}}}"
    elif spoil == "nan" and obj:
        text = text[:-1] + ', "z": NaN}'
    elif spoil == "deep" and obj:
        text = text[:-1] + ', "z": ' + "[" * 100_000 + "]" * 100_000 + "}"
    elif spoil == "digits" and obj:
        text = text[:-1] + ', "z": ' + "9" * 5000 + "}"
    elif spoil == "empty":
        text = ""
    elif spoil == "list":
        text = f"[{text}]"
    raw = text.encode("utf-8", "surrogatepass")
    if spoil == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif spoil == "trailing":
        raw += b" }x"
    elif spoil == "latin1":
        raw += b"\xff"
    elif spoil == "cut":
        raw = raw[: len(raw) // 2]
    return raw


@st.composite
def edited(draw: st.DrawFn, base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]) -> Shown[Any]:
    """`base` (copied) with 1-4 of `fields` set (or removed), sometimes an unknown field added; the note
    says which."""
    doc = json.loads(json.dumps(base))
    said = []
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4)):
        if draw(st.sampled_from([False] * 5 + [True])):
            doc.pop(name, None)
            said.append(f"-{name}")
        else:
            doc[name] = draw(fields[name])
            said.append(f"{name}={_short(doc[name])}")
    if draw(st.sampled_from([False] * 5 + [True])):
        name = draw(st.sampled_from(["", "zzz", "__proto__"]))
        doc[name] = draw(json_values())
        said.append(f"{name}={_short(doc[name])}")
    return Shown(doc, "; ".join(said))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


@st.composite
def json_files(draw: st.DrawFn, docs: st.SearchStrategy[Any]) -> Shown[bytes]:
    """A file's bytes: a document, spoilt or not."""
    doc = draw(docs)
    what = ""
    if isinstance(doc, Shown):  # an edited document: its note says what was edited
        doc, what = doc.value, doc.note
    spoil = draw(mostly("", SPOILS))
    raw = dumps(doc, spoil)
    return Shown(raw, f"{spoil or 'clean'}: {what or repr(raw[:400])}")


# -- config.json -------------------------------------------------------------------------------------------


def _sizes() -> st.SearchStrategy[Any]:
    return st.sampled_from(SIZES) | VALUES


def _block() -> st.SearchStrategy[Any]:
    square = st.sampled_from([1, 3, 16, 128, 10**9, 2**40, 0, -1]).map(lambda n: [n, n])
    return square | st.sampled_from([[128, 64], [128], [128.0, 128.0], "128", None, [[128, 128]]])


QUANT = st.fixed_dictionaries(
    {"quant_method": st.sampled_from(["fp8", "mxfp4", "bitsandbytes", "", 8, None])},
    optional={
        "weight_block_size": _block(),
        "fmt": st.sampled_from(["e4m3", "e5m2", 1]),
        "activation_scheme": st.sampled_from(["dynamic", "static", None]),
        "modules_to_not_convert": st.sampled_from([None, [], ["lm_head"], "lm_head", [1]]),
    },
)
CONFIG_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **{
        name: _sizes()
        for name in (
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size",
            "num_hidden_layers", "intermediate_size", "max_position_embeddings",
        )
    },
    "tie_word_embeddings": st.sampled_from([True, False, None, 1, "true", 0.0]),
    "dtype": st.sampled_from(["bfloat16", "float32", "float8_e4m3fn", "int64", "nope", None, 16]),
    "torch_dtype": st.sampled_from(["bfloat16", "float16", "", None]),
    "quantization_config": QUANT | VALUES,
    "text_config": st.fixed_dictionaries({"num_attention_heads": _sizes(), "head_dim": _sizes()}) | VALUES,
    "model_type": st.sampled_from(["llama", "qwen3", "", None, ["llama"]]),
}  # fmt: skip


# -- adapter_config.json (PEFT LoRA) ------------------------------------------------------------------------


def _patterns(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.dictionaries(st.sampled_from(REGEXES), values, max_size=3) | VALUES


ADAPTER_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "r": st.sampled_from([4, 8, 0, 1, -4, 2**63, 4.0, 4.5, "4", True, None]),
    "lora_alpha": st.sampled_from([*NUMBERS, "8", True, None]),
    "use_rslora": st.sampled_from([True, False, None, 1, "yes"]),
    "use_dora": st.sampled_from([True, False, None, "no"]),
    "rank_pattern": _patterns(st.sampled_from([4, 8, 0, -1, 2**40, 4.0, "4", None])),
    "alpha_pattern": _patterns(st.sampled_from(NUMBERS)),
    "target_modules": st.sampled_from([["q_proj", "v_proj"], "q_proj", ".*", "(a+)+$", [], None, [1], "["]),
    "peft_type": st.sampled_from(["LORA", "lora", "IA3", None, 1]),
    "fan_in_fan_out": st.sampled_from([True, False, "x"]),
    "modules_to_save": st.sampled_from([None, ["lm_head"], "lm_head", [None]]),
    "target_parameters": st.sampled_from([None, [], ["mlp.experts.gate_up_proj"], "x"]),
    "layers_to_transform": st.sampled_from([None, [0], 0, [-1], [10**9]]),
}


# -- ckptconv_state.json (the stash) ------------------------------------------------------------------------

STASH_KEYS = ["step", "args", "", "step", "model.embed.weight", "a" * 300, "é", "x.y"]
STASH_PATHS = [["step"], [], ["a", 0], [0], ["model", "embed.weight"], [["x"]], [1.5], [None], ["a"] * 300]
TENSOR_DTYPES = [
    None,
    "int32",
    "int64",
    "float32",
    "bool",
    "bfloat16",
    "float8_e4m3fn",
    "complex64",
    "nope",
    5,
]


@st.composite
def stash_items(draw: st.DrawFn, b64: st.SearchStrategy[str]) -> Any:
    """One stash entry: a JSON value (maybe a 0-d tensor's number), or bytes kept as base64, or junk."""
    kind = draw(st.sampled_from(["value", "value", "bytes", "junk"]))
    key = draw(st.sampled_from(STASH_KEYS))
    path = draw(st.sampled_from([[key], *STASH_PATHS]))
    if kind == "value":
        item = {"key": key, "path": path, "value": draw(json_values())}
        tensor = draw(st.sampled_from(TENSOR_DTYPES))
        if tensor is not None:
            item["tensor"] = tensor
        return item
    if kind == "bytes":
        return {"key": key, "path": path, "not_loaded": "holds x", "torch_save_b64": draw(b64)}
    return draw(st.sampled_from([{}, {"key": key}, {"key": 5, "path": "step"}, [], None, {"path": path}]))


@st.composite
def stashes(draw: st.DrawFn, base: dict[str, Any], b64: st.SearchStrategy[str]) -> Shown[Any]:
    doc = json.loads(json.dumps(base))
    items, said = doc["items"], []
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["add", "add", "replace", "drop", "head"]))
        if what == "add" or (what == "replace" and not items):
            items.append(draw(stash_items(b64)))
            said.append(f"add {_short(items[-1])}")
        elif what == "replace":
            i = draw(st.integers(0, len(items) - 1))
            items[i] = draw(stash_items(b64))
            said.append(f"item {i} = {_short(items[i])}")
        elif what == "drop" and items:
            said.append(f"drop {_short(items.pop())}")
        elif what == "head":
            name = draw(st.sampled_from(["format", "version", "items"]))
            doc[name] = draw(VALUES)
            said.append(f"{name}={_short(doc[name])}")
    return Shown(doc, "; ".join(said))


# -- mapping TOML --------------------------------------------------------------------------------------------

PATTERNS = [
    "layers.{layer}.attention.qkv_linear.wq.weight", "model.layers.{layer}.self_attn.q_proj.weight",
    "layers.{layer}.attention.wqkv.weight", "model.layers.{layer}.self_attn.k_proj.weight",
    "layers.{layer}.feed_forward.w1.weight", "model.layers.{layer}.mlp.gate_proj.weight", "lm_head.weight",
    "output.weight", "tok_embeddings.weight", "model.embed_tokens.weight", "norm.weight", "model.norm.weight",
    "{layer}", "{", "}", "{}", "{layer}{layer}", "layers.{layer}.{layer}.w", "{a}.{b}.{c}.{d}", "", "(.*)+",
    "model.layers.{layer + num_hidden_layers}.self_attn.q_proj.weight", "model.layers.{layer * 2}.w",
    "model.layers.{layer - 99999999999999999999}.self_attn.q_proj.weight",
]  # fmt: skip
EXPRESSIONS = [
    "num_attention_heads * head_dim", "num_key_value_heads * head_dim", "head_dim", "hidden_size",
    "intermediate_size", "vocab_size", "vocab_size * 2", "hidden_size / num_attention_heads", 3, 16, 64,
    "hidden_size / 0", "hidden_size / 3", "head_dim - 100", "nope", "(" * 100 + "1" + ")" * 100,
    "hidden_size" + " * 999999999" * 15, "-1", "", "text_config.x", "1e9", "2 ** 64", "__import__('os')",
]  # fmt: skip


def typed(s: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Values of the field's own type mostly (to get past the parser to the rules' engine), else odd ones."""
    return st.one_of(s, s, s, VALUES)


SIZE_VALUES = typed(st.sampled_from(EXPRESSIONS) | st.sampled_from(SIZES))
DIMS = typed(st.sampled_from([0, 1, 2, 3])) | st.sampled_from([-1, 99, 2**63, 1.5, "0", True])
KEYS = st.sampled_from(PATTERNS) | st.lists(st.sampled_from(PATTERNS), min_size=2, max_size=3)
RULE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "runtime": typed(KEYS),
    "hf": typed(KEYS),
    "dim": DIMS,
    "stack_dim": DIMS,
    "sizes": typed(st.lists(SIZE_VALUES, min_size=2, max_size=3)),
    "stack": typed(st.sampled_from(["layer", "expert", ["layer", "layer"], ["a", "b"], ""])),
    "permute": typed(st.sampled_from(["q", "k", "v"])),
    "heads": SIZE_VALUES,
    "groups": SIZE_VALUES,
    "narrow": SIZE_VALUES,
    "padded": SIZE_VALUES,
    "multiple": SIZE_VALUES,
    "hf_shape": typed(st.lists(SIZE_VALUES | DIMS, min_size=1, max_size=5)),
    "runtime_shape": typed(st.lists(SIZE_VALUES | DIMS, min_size=1, max_size=5)),
    "transpose": typed(st.lists(DIMS, min_size=2, max_size=2)) | st.lists(DIMS, max_size=3),
    "interleave": st.sampled_from([True, False, 1]),
    "duplicate": st.sampled_from([True, False, "yes", "reference"]),
    "layout": st.sampled_from(["x", ["x"], ["x", "x"], [], [1], "w1-w3", ["w1-w3", "w13-stacked"]]),
    "drop": st.sampled_from([True, False, 0]),
    "tied": typed(st.sampled_from(PATTERNS)),
    "when": typed(st.sampled_from(["fused", "per_expert", "x"])),
    "hf_groups": SIZE_VALUES,
    "offset": st.sampled_from([1, -0.5, 1e308, float("inf"), float("nan"), True, "1"]),
    "zzz": VALUES,
}
RANGES = st.dictionaries(
    st.sampled_from(["layer", "expert", "mtp", ""]),
    SIZE_VALUES | st.fixed_dictionaries({"below": SIZE_VALUES}, optional={"default": VALUES}),
    max_size=2,
)
HEAD_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "name": typed(st.sampled_from(["x", ""])),
    "hf_experts": typed(st.sampled_from(["fused", "per_expert", "x"])),
    "checkpoint": typed(st.sampled_from(["dcp", "megatron", "x"])),
    "ranges": typed(RANGES),
    "defaults": st.dictionaries(st.sampled_from(["vocab_size", "a.b", "head_dim"]), VALUES, max_size=2)
    | VALUES,
    "zzz": VALUES,
}


@st.composite
def mappings(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """A mapping document: `base` (a preset, parsed) with rules' fields set and unset, rules added and
    removed, and [mapping] fields set."""
    doc = json.loads(json.dumps(base))
    rules = doc["rule"]
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["field", "field", "field", "unset", "add", "drop", "head"]))
        if what == "field" and rules:
            rule = rules[draw(st.integers(0, len(rules) - 1))]
            name = draw(st.sampled_from(sorted(RULE_FIELDS)))
            rule[name] = draw(RULE_FIELDS[name])
        elif what == "unset" and rules:  # with a field set after it: `multiple` for `padded`, say
            rule = rules[draw(st.integers(0, len(rules) - 1))]
            rule.pop(draw(st.sampled_from(sorted(rule))), None)
        elif what == "add":
            fields = draw(st.lists(st.sampled_from(sorted(RULE_FIELDS)), min_size=1, max_size=5, unique=True))
            rules.append({name: draw(RULE_FIELDS[name]) for name in fields})
        elif what == "drop" and rules:
            rules.pop(draw(st.integers(0, len(rules) - 1)))
        elif what == "head":
            name = draw(st.sampled_from(sorted(HEAD_FIELDS)))
            doc["mapping"][name] = draw(HEAD_FIELDS[name])
    return doc


def toml(doc: dict[str, Any]) -> str:
    """A mapping document as TOML: [mapping] (nested tables inline), then one [[rule]] table per rule."""
    lines = ["[mapping]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in doc["mapping"].items() if v is not None]
    for rule in doc["rule"]:
        lines += ["", "[[rule]]"]
        lines += [f"{_key(k)} = {_value(v)}" for k, v in rule.items() if v is not None]
    return "\n".join(lines) + "\n"


def _key(k: str) -> str:
    return json.dumps(k, ensure_ascii=False)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v if x is not None) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items() if x is not None) + " }"
    return '""'


TOML_SPOILS = mostly("", ["deep", "digits", "latin1", "cut", "dup"])


def spoil_toml(text: str, spoil: str) -> bytes:
    if spoil == "deep":
        text = text.replace("[mapping]\n", "[mapping]\nzzz = " + "[" * 50_000 + "]" * 50_000 + "\n", 1)
    elif spoil == "digits":
        text = text.replace("[mapping]\n", "[mapping]\nzzz = " + "9" * 5000 + "\n", 1)
    elif spoil == "dup":
        text = text.replace("[mapping]\n", '[mapping]\nname = "a"\nname = "b"\n', 1)
    raw = text.encode("utf-8", "surrogatepass")
    if spoil == "latin1":
        raw += b"# \xff\n"
    elif spoil == "cut":
        raw = raw[: len(raw) // 2]
    return raw


# -- torch's distributed HF shards: DCP_SHARDING_INFO and .hf_metadata ---------------------------------------

OFFSETS = st.sampled_from([0, 1, 3, 7, -1, 2**31, 2**62, 10**30, 1.0, "0", None])


def sharding_infos(keys: list[str], ndims: dict[str, int]) -> st.SearchStrategy[Any]:
    """A DCP_SHARDING_INFO document: {key: {"saved_offsets": [...]}} over the shard's keys and others."""
    entry = st.builds(
        lambda key, offsets: (key, {"saved_offsets": offsets}),
        st.sampled_from([*keys, "", "other"]),
        st.lists(OFFSETS, max_size=3),
    )
    real = st.sampled_from(keys).flatmap(
        lambda k: st.lists(OFFSETS, min_size=ndims[k], max_size=ndims[k]).map(
            lambda o: (k, {"saved_offsets": o})
        )
    )
    return st.lists(real | entry, max_size=4).map(dict) | VALUES | st.just({k: {} for k in keys})


def file_splits(keys: list[str]) -> st.SearchStrategy[Any]:
    """fqn_to_file_index_mapping.json: {key: file number from 1}, with odd keys and numbers."""
    number = st.sampled_from([1, 2, 3, 0, -1, 2**31, 10**12, "1", 1.0, True, None])
    return st.dictionaries(st.sampled_from([*keys, "", "other"]), number, max_size=len(keys) + 1) | VALUES
