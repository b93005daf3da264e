"""LoRA planning without a checkpoint (issue #21): keys, nested wrappers, scaling, the factors a mapping
gives an adapter, checked by executing the parts (ckptconv.stream.blocks.place) on random tensors in
float64; `--lora-targets` (issue #36) against PEFT's matching of target_modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptconv.errors import CkptconvError
from ckptconv.lora.keys import Factors, find_lora
from ckptconv.lora.mapped import factor_targets
from ckptconv.lora.select import LoraRequest
from ckptconv.lora.settings import LoraSettings, adapter_config, chosen_targets, mapped_config
from ckptconv.mapping import load_mapping
from ckptconv.mapping.rules import map_keys
from ckptconv.mapping.types import Target
from ckptconv.stream.blocks import place

MAPPING = """
[mapping]
name = "lora-test"

[[rule]]  # fused QKV, split by rows: B's rows follow, A is shared
runtime = "l.wqkv.weight"
hf = ["m.q_proj.weight", "m.k_proj.weight", "m.v_proj.weight"]
sizes = [8, 4, 4]

[[rule]]  # gate/up interleaved by rows
runtime = "l.w13.weight"
hf = ["m.gate_proj.weight", "m.up_proj.weight"]
interleave = true

[[rule]]  # a rotary row permutation
runtime = "l.wq.weight"
hf = "m.q2_proj.weight"
permute = "q"

[[rule]]  # split by columns: A's columns follow, B is shared
runtime = "l.wcat.weight"
hf = ["m.a_proj.weight", "m.b_proj.weight"]
dim = 1

[[rule]]  # a fusion: two adapted weights in one HF tensor have no single A
runtime = ["l.w1.weight", "l.w3.weight"]
hf = "m.fused.weight"
"""
SHAPES = {
    "l.wqkv.weight": (16, 6),
    "l.w13.weight": (10, 6),
    "l.wq.weight": (8, 6),
    "l.wcat.weight": (6, 10),
    "l.w1.weight": (4, 6),
    "l.w3.weight": (4, 6),
}
R = 3


def run_targets(targets: list[Target], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for t in targets:
        value = torch.zeros(t.shape, dtype=torch.float64)
        for p in t.parts:
            box = p.src_box()
            data = tensors[p.src][tuple(slice(o, o + n) for o, n in zip(*box, strict=True))]
            place(value, p, box, data)
        out[t.key] = value
    return out


def test_an_adapter_through_a_mapping_merges_to_the_mapped_merge(tmp_path: Path) -> None:
    """For every weight a mapping moves by whole rows or whole columns, B_T @ A_T of the mapped factors is
    exactly the mapped B @ A (float64, so the product's rounding is the same on both sides)."""
    (tmp_path / "m.toml").write_text(MAPPING)
    mapping = load_mapping(str(tmp_path / "m.toml"))
    config = {"num_attention_heads": 2, "num_key_value_heads": 2}
    shapes = {k: s for k, s in SHAPES.items() if k not in ("l.w1.weight", "l.w3.weight")}
    targets = map_keys(mapping, "to_hf", shapes, config).targets
    g = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    factors, factor_shapes = {}, {}
    for key, (rows, cols) in shapes.items():
        stem = key.removesuffix(".weight")
        a, b = f"{stem}.lora_A.default.weight", f"{stem}.lora_B.default.weight"
        tensors[key] = torch.randn(rows, cols, generator=g, dtype=torch.float64)
        tensors[a] = torch.randn(R, cols, generator=g, dtype=torch.float64)
        tensors[b] = torch.randn(rows, R, generator=g, dtype=torch.float64)
        factors[key] = Factors(stem, "linear", a, b)
        factor_shapes |= {a: (R, cols), b: (rows, R)}
    adapter = run_targets(factor_targets(targets, factors, factor_shapes), tensors)
    merged = {k: tensors[k] + tensors[f.b] @ tensors[f.a] for k, f in factors.items()}
    want = run_targets(targets, merged)
    base = run_targets(targets, tensors)
    names = ["a_proj", "b_proj", "gate_proj", "k_proj", "q2_proj", "q_proj", "up_proj", "v_proj"]
    assert sorted(want) == [f"m.{n}.weight" for n in names]
    for key, value in want.items():
        stem = "base_model.model." + key.removesuffix(".weight")
        a, b = adapter[stem + ".lora_A.weight"], adapter[stem + ".lora_B.weight"]
        assert torch.equal(base[key] + b @ a, value), key
    assert adapter["base_model.model.m.q_proj.lora_A.weight"].shape == (R, 6)  # shared A
    assert adapter["base_model.model.m.a_proj.lora_B.weight"].shape == (6, R)  # shared B


def test_a_fusion_of_adapted_weights_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "m.toml").write_text(MAPPING)
    shapes = {k: SHAPES[k] for k in ("l.w1.weight", "l.w3.weight")}
    targets = map_keys(load_mapping(str(tmp_path / "m.toml")), "to_hf", shapes, {}).targets
    factors = {k: Factors(k[:-7], "linear", k + ".A", k + ".B") for k in shapes}
    fshapes = {k + ".A": (R, 6) for k in shapes} | {k + ".B": (4, R) for k in shapes}
    with pytest.raises(CkptconvError, match=r"'m\.fused\.weight' is made of several tensors"):
        factor_targets(targets, factors, fshapes)


def test_keys_nested_wrappers_and_refusals() -> None:
    p = "base_model.model."
    found = find_lora(
        [
            p + "m.experts.base_layer.base_layer.w1",
            p + "m.experts.base_layer.base_layer.w2",
            p + "m.experts.base_layer.lora_A.x.weight",
            p + "m.experts.base_layer.lora_B.x.weight",
            p + "m.experts.lora_A.x.weight",
            p + "m.experts.lora_B.x.weight",
            p + "m.q.base_layer.weight",
            p + "m.q.lora_A.x.weight",
            p + "m.q.lora_B.x.weight",
        ]
    )
    assert found is not None
    assert dict(found.base) == {
        "m.experts.w1": p + "m.experts.base_layer.base_layer.w1",
        "m.experts.w2": p + "m.experts.base_layer.base_layer.w2",
        "m.q.weight": p + "m.q.base_layer.weight",
    }
    factors = found.adapters["x"]
    assert {w: (f.kind, f.depth) for w, f in factors.items()} == {
        "m.experts.base_layer": ("param", 1),
        "m.experts": ("param", 0),
        "m.q": ("linear", 0),
    }
    assert found.wrapped == {"m.experts": ("w1", "w2")}
    assert find_lora(["a.weight", "b.weight"]) is None
    with pytest.raises(CkptconvError, match="LoKr"):
        find_lora([p + "m.q.lokr_w1.default"])
    with pytest.raises(CkptconvError, match="its LoRA B factor is missing"):
        find_lora([p + "m.q.base_layer.weight", p + "m.q.lora_A.x.weight"])


def test_scaling_as_peft_computes_it() -> None:
    s = LoraSettings(r=8, alpha=16, rank_pattern={"mlp.down_proj": 4}, alpha_pattern={"q_proj": 2})
    assert s.scaling("model.layers.0.self_attn.k_proj") == 2.0
    assert s.scaling("model.layers.0.mlp.down_proj") == 4.0
    assert s.scaling("model.layers.0.self_attn.q_proj") == 0.25
    assert LoraSettings(r=16, alpha=8, rslora=True).scaling("x") == 2.0


@pytest.mark.parametrize("kind", ["linear", "embedding", "experts_out_in", "experts_in_out"])
def test_the_update_of_any_block_is_that_block_of_the_whole_update(kind: str) -> None:
    """`delta_box` (a chunk's block of W, as a mapping reads it) against scaling * B @ A computed whole."""
    from ckptconv.core.specs import TensorSpec
    from ckptconv.lora.merge import LoraParts, delta_box

    g = torch.Generator().manual_seed(1)
    experts, r, out_dim, in_dim = 3, 2, 7, 5
    if kind == "linear":
        a, b = torch.randn(r, in_dim, generator=g), torch.randn(out_dim, r, generator=g)
        whole = (b @ a) * 0.5
    elif kind == "embedding":  # A [r, vocab], B [dim, r]; W [vocab, dim]
        a, b = torch.randn(r, out_dim, generator=g), torch.randn(in_dim, r, generator=g)
        whole = (b @ a).T * 0.5
    else:
        a, b = torch.randn(experts * r, in_dim, generator=g), torch.randn(out_dim, r * experts, generator=g)
        spec = "o r e, e r i -> e o i" if kind == "experts_out_in" else "o r e, e r i -> e i o"
        whole = torch.einsum(spec, b.reshape(out_dim, r, experts), a.reshape(experts, r, in_dim)) * 0.5
    tensors = {"a": a, "b": b}

    def read(s: TensorSpec, span: tuple[int, int] | None) -> torch.Tensor:
        t = tensors[s.fqn]
        return t if span is None else t[span[0] : span[1]]

    lora = LoraParts(
        TensorSpec("a", "float32", tuple(a.shape), ()), TensorSpec("b", "float32", tuple(b.shape), ()),
        kind, 0.5, None, experts,  # type: ignore[arg-type]
    )  # fmt: skip
    for offsets in [(0,) * whole.dim(), (1,) * whole.dim()]:
        sizes = tuple(
            n - o - (1 if d else 0) for d, (n, o) in enumerate(zip(whole.shape, offsets, strict=True))
        )
        box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        assert torch.equal(delta_box(lora, offsets, sizes, read), whole[box]), (kind, offsets)


# --- --lora-targets ----------------------------------------------------------------------------------------

LAYERS = [f"model.layers.{i}" for i in range(2)]
ADAPTED = {f"{layer}.self_attn.{p}" for layer in LAYERS for p in ("q_proj", "v_proj")} | {
    "model.layers.0.mlp.down_proj"  # layer 1's down_proj has no factors
}
MODULES = ADAPTED | {f"{layer}.{p}" for layer in LAYERS for p in ("self_attn.k_proj", "mlp.down_proj")}


@pytest.mark.parametrize(
    ("targets", "written"),
    [
        (("q_proj", "v_proj", "layers.0.mlp.down_proj"), ["q_proj", "v_proj", "layers.0.mlp.down_proj"]),
        (("self_attn.v_proj", "q_proj", "q_proj", "model.layers.0.mlp.down_proj"), None),  # once each
    ],
)
def test_lora_targets_naming_exactly_the_adapted_modules_are_written_as_given(
    targets: tuple[str, ...], written: list[str] | None
) -> None:
    """Each adapted module matched as PEFT matches a target_modules list (its name, or its end after a dot),
    and no other: the names as given, in their order."""
    want = written or list(dict.fromkeys(targets))
    assert chosen_targets(targets, ADAPTED, MODULES) == want
    factors = {m: Factors(m, "linear", m + ".A", m + ".B") for m in ADAPTED}
    s = LoraSettings(r=4, alpha=8)
    config = adapter_config(s, factors, MODULES, None, targets)
    assert config["target_modules"] == want
    derived = adapter_config(s, factors, MODULES, None)
    assert isinstance(derived["target_modules"], str)  # a regex: down_proj alone would match layer 1's too
    assert {k: v for k, v in config.items() if k != "target_modules"} == {
        k: v for k, v in derived.items() if k != "target_modules"
    }
    # through a mapping, the names are the mapped model's
    assert mapped_config(derived, {m: 4 for m in ADAPTED}, MODULES, targets)["target_modules"] == want


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (("q_proj",), r"no name matches 'model\.layers\.0\.mlp\.down_proj', .* add 'down_proj' or its full"),
        (("q_proj", "v_proj", "layers.0.mlp.down_proj", "o_proj"), r"'o_proj' matches no module with LoRA"),
        (("q_proj", "v_proj", "layers.0.mlp.down_proj", "v"), r"'v' matches no module"),  # not a suffix
        (("q_proj", "v_proj", "down_proj"), r"'down_proj' also matches 'model\.layers\.1\.mlp\.down_proj'"),
        (("q_proj", "v_proj", "layers.0.mlp.down_proj", "self_attn"), r"'self_attn' matches no module"),
    ],
)
def test_lora_targets_that_peft_would_not_load_exactly_are_refused(
    targets: tuple[str, ...], message: str
) -> None:
    with pytest.raises(CkptconvError, match="^--lora-targets: " + message):
        chosen_targets(targets, ADAPTED, MODULES)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (dict(targets=("q_proj",)), "--lora-targets applies with --lora adapter"),
        (dict(mode="merge", targets=("q_proj",)), "--lora-targets applies with --lora adapter"),
        (dict(mode="drop", targets=("q_proj",)), "--lora-targets applies with --lora adapter"),
        (dict(mode="adapter", config=Path("a.json"), targets=("q_proj",)), "a.json already says target_mod"),
        (dict(mode="adapter", targets=("q_proj", "")), "--lora-targets: an empty module name"),
    ],
)
def test_lora_targets_flag_refusals(request_: dict[str, object], message: str) -> None:
    with pytest.raises(CkptconvError, match=message):
        LoraRequest(**request_).check()  # type: ignore[arg-type]
    LoraRequest("adapter", targets=("q_proj",)).check()
