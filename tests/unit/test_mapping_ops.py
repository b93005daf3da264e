"""Mapping v2 operations, pure: each rule maps keys both ways, and its parts, executed by `blocks.place` on
data cut into arbitrary chunks (as DCP stores it) or read by target row windows (as hf-to-dcp writes it),
give exactly the tensors an explicit torch expression gives."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from ckptconv.errors import CkptconvError
from ckptconv.mapping import load_mapping
from ckptconv.mapping.parts import src_rows
from ckptconv.mapping.rules import Target, map_keys
from ckptconv.stream.blocks import place


def mapping(tmp_path: Path, rules: str, head: str = "") -> object:
    path = tmp_path / "m.toml"
    path.write_text(f'[mapping]\nname = "t"\n{head}\n{rules}')
    return load_mapping(str(path))


def chunks(shape: tuple[int, ...], rng: random.Random) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A random grid of blocks covering `shape` (as FSDP / TP shards would)."""
    cuts = []
    for n in shape:
        inner = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 2)))) if n > 1 else []
        cuts.append([0, *inner, n])
    boxes = []
    for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts]):
        boxes.append((tuple(a for a, _ in cell), tuple(b - a for a, b in cell)))
    return boxes


def execute(
    targets: list[Target], source: dict[str, torch.Tensor], rng: random.Random
) -> dict[str, torch.Tensor]:
    """Every target, each part fed the source chunk by chunk (dcp-to-hf's way)."""
    out = {}
    for t in targets:
        tensor = (torch.zeros if t.padded else torch.empty)(t.shape, dtype=torch.float64)
        view = tensor.view(t.layout) if t.layout else tensor
        for part in t.parts:
            data = source[part.src]
            for offsets, sizes in chunks(tuple(data.shape), rng):
                block = data
                for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
                    block = block.narrow(d, o, n)
                place(view, part, (offsets, sizes), block)
        out[t.key] = tensor
    return out


def by_windows(
    targets: list[Target], source: dict[str, torch.Tensor], rng: random.Random
) -> dict[str, torch.Tensor]:
    """Every target, row window by row window, each reading only the source rows `src_rows` names
    (hf-to-dcp's way)."""
    out = {}
    for t in targets:
        rows = t.shape[0] if t.shape else 1
        pieces = []
        cuts = [0, *sorted(rng.sample(range(1, rows), min(rows - 1, 2))), rows] if rows > 1 else [0, rows]
        for lo, hi in itertools.pairwise(cuts):
            window = (torch.zeros if t.padded else torch.empty)((hi - lo, *t.shape[1:]), dtype=torch.float64)
            view = window.view(hi - lo, *t.layout[1:]) if t.layout else window
            for part in t.parts:
                need = src_rows(part, lo, hi)
                if need is None:
                    continue
                data = source[part.src]
                a, b = need
                box = ((a, *[0] * (data.dim() - 1)), (b - a, *data.shape[1:]))
                place(view, part, box, data.narrow(0, a, b - a), window=lo)
            pieces.append(window)
        out[t.key] = torch.cat(pieces)
    return out


def round_trip(
    m, runtime: dict[str, torch.Tensor], config: dict, expected_hf: dict[str, torch.Tensor]
) -> None:
    rng = random.Random(0)
    shapes = {k: tuple(v.shape) for k, v in runtime.items()}
    to_hf = map_keys(m, "to_hf", shapes, config)
    for run in (execute, by_windows):
        hf = run(to_hf.targets, runtime, rng)
        assert hf.keys() == expected_hf.keys()
        for key, value in expected_hf.items():
            assert torch.equal(hf[key], value), (run.__name__, key)
    back = map_keys(m, "to_runtime", {k: tuple(v.shape) for k, v in expected_hf.items()}, config)
    for run in (execute, by_windows):
        got = run(back.targets, expected_hf, rng)
        assert got.keys() == runtime.keys()
        for key, value in runtime.items():
            assert torch.equal(got[key], value), (run.__name__, key)


def values(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)


def test_transpose_of_grouped_experts(tmp_path: Path) -> None:
    """gpt-oss: runtime mlp1 [E, 2F, D] is HF gate_up_proj [E, D, 2F]."""
    m = mapping(
        tmp_path, '[[rule]]\nruntime = "l.{layer}.mlp1"\nhf = "m.{layer}.gate_up"\ntranspose = [1, 2]\n'
    )
    w = values(3, 8, 5)
    round_trip(m, {"l.0.mlp1": w}, {}, {"m.0.gate_up": w.transpose(1, 2)})


def test_interleaved_split_and_concat(tmp_path: Path) -> None:
    """gate and up interleaved row by row in the runtime tensor; separate in HF."""
    m = mapping(tmp_path, '[[rule]]\nruntime = "fc1"\nhf = ["gate", "up"]\ninterleave = true\ndim = 1\n')
    w = values(2, 6, 3)
    round_trip(m, {"fc1": w}, {}, {"gate": w[:, 0::2], "up": w[:, 1::2]})
    # the other way round, with a transpose: HF fused [E, D, 2F] interleaved on its last dim
    m = mapping(
        tmp_path,
        '[[rule]]\nruntime = ["w1", "w3"]\nhf = "gate_up"\ninterleave = true\ndim = 1\ntranspose = [1, 2]\n',
    )
    fused = values(2, 3, 8)
    round_trip(
        m,
        {
            "w1": fused[..., 0::2].transpose(1, 2).contiguous(),
            "w3": fused[..., 1::2].transpose(1, 2).contiguous(),
        },
        {},
        {"gate_up": fused},
    )


@pytest.mark.parametrize("stacked", [False, True])
def test_grouped_qkv_split(tmp_path: Path, stacked: bool) -> None:
    """Megatron / fused wqkv: [groups, q_per_group + 2, head_dim, dim] rows; stacked over layers too."""
    G, qpg, hd, D, L = 2, 3, 2, 4, 2
    config = {"num_attention_heads": G * qpg, "num_key_value_heads": G, "head_dim": hd}
    rule = (
        '[[rule]]\nruntime = "{r}"\nhf = ["{h}.q", "{h}.k", "{h}.v"]\ngroups = "num_key_value_heads"\n'
        'sizes = ["num_attention_heads / num_key_value_heads * head_dim", "head_dim", "head_dim"]\n'
    )
    if stacked:
        rule = rule.format(r="layers.qkv", h="m.layers.{layer}") + 'stack = "layer"\ndim = 1\n'
        w = values(L, G * (qpg + 2) * hd, D)
        grouped = w.view(L, G, qpg + 2, hd, D)
        expected = {}
        for layer in range(L):
            expected[f"m.layers.{layer}.q"] = grouped[layer, :, :qpg].reshape(-1, D)
            expected[f"m.layers.{layer}.k"] = grouped[layer, :, qpg].reshape(-1, D)
            expected[f"m.layers.{layer}.v"] = grouped[layer, :, qpg + 1].reshape(-1, D)
        round_trip(mapping(tmp_path, rule), {"layers.qkv": w}, config, expected)
        return
    w = values(G * (qpg + 2) * hd, D)
    grouped = w.view(G, qpg + 2, hd, D)
    expected = {
        "a.q": grouped[:, :qpg].reshape(-1, D),
        "a.k": grouped[:, qpg].reshape(-1, D),
        "a.v": grouped[:, qpg + 1].reshape(-1, D),
    }
    round_trip(mapping(tmp_path, rule.format(r="qkv", h="a")), {"qkv": w}, config, expected)


def test_narrow_and_pad_vocabulary(tmp_path: Path) -> None:
    m = mapping(tmp_path, '[[rule]]\nruntime = "emb"\nhf = "embed"\nnarrow = "vocab_size"\nmultiple = 8\n')
    w = values(16, 3)
    w[13:] = 0  # padding rows: zeros, which is what reading back writes
    round_trip(m, {"emb": w}, {"vocab_size": 13}, {"embed": w[:13]})
    back = map_keys(m, "to_runtime", {"embed": (13, 3)}, {"vocab_size": 13})
    assert back.targets[0].op == "pad" and back.targets[0].padded and back.targets[0].shape == (16, 3)


def test_reshape_linear_patch_embedding_to_a_convolution(tmp_path: Path) -> None:
    m = mapping(
        tmp_path,
        '[[rule]]\nruntime = "patch"\nhf = "conv"\nhf_shape = [-1, "c", "p", "p"]\n',
    )
    w = values(4, 2 * 3 * 3)
    round_trip(m, {"patch": w}, {"c": 2, "p": 3}, {"conv": w.reshape(4, 2, 3, 3)})


def test_stack_with_transpose_per_expert(tmp_path: Path) -> None:
    m = mapping(
        tmp_path,
        '[[rule]]\nruntime = "w"\nhf = "e.{expert}.w"\nstack = "expert"\ntranspose = [1, 2]\n',
    )
    w = values(3, 4, 5)
    round_trip(m, {"w": w}, {}, {f"e.{e}.w": w[e].T for e in range(3)})


def test_placeholder_arithmetic_ranges_and_duplicates(tmp_path: Path) -> None:
    head = '[mapping.ranges]\nlayer = "n"\nmtp = { below = "m", default = 0 }\n'
    rules = (
        '[[rule]]\nruntime = "emb"\nhf = ["embed", "layers.{mtp + n}.embed"]\nduplicate = true\n'
        '[[rule]]\nruntime = "layers.{layer}.w"\nhf = "layers.{layer}.w"\n'
        '[[rule]]\nruntime = "mtp.{mtp}.w"\nhf = "layers.{mtp + n}.w"\n'
    )
    m = mapping(tmp_path, rules, head)
    config = {"n": 2, "m": 1}
    emb, w0, w1, w2 = values(5, 2), values(3), values(3) + 1, values(3) + 2
    runtime = {"emb": emb, "layers.0.w": w0, "layers.1.w": w1, "mtp.0.w": w2}
    hf = {"embed": emb, "layers.2.embed": emb, "layers.0.w": w0, "layers.1.w": w1, "layers.2.w": w2}
    round_trip(m, runtime, config, hf)
    back = map_keys(m, "to_runtime", {k: tuple(v.shape) for k, v in hf.items()}, config)
    assert back.same == [("layers.2.embed", "embed")]
    # an MTP layer is never a main layer: without the MTP rule it is unmapped, with or without passing it
    plain = mapping(tmp_path, rules.split('[[rule]]\nruntime = "mtp')[0], head)
    with pytest.raises(CkptconvError, match=r"no rule maps 'layers\.2\.w'"):
        map_keys(plain, "to_runtime", {k: tuple(v.shape) for k, v in hf.items()}, config)
    passed = map_keys(
        plain, "to_runtime", {"layers.2.w": (3,), "layers.0.w": (3,)}, config, allow_unmapped=True
    )
    assert passed.unmapped == ["layers.2.w"]
    assert [t.key for t in passed.targets if t.op != "passthrough"] == ["layers.0.w"]
    # no MTP layer in the checkpoint: no copies are written, whatever config.json says
    none = map_keys(m, "to_hf", {"emb": (5, 2), "layers.0.w": (3,)}, config)
    assert sorted(t.key for t in none.targets) == ["embed", "layers.0.w"]
    # a range that needs a key config.json lacks says so
    with pytest.raises(CkptconvError, match=r"needs 'n' from config\.json; pass --config"):
        map_keys(m, "to_hf", {"layers.0.w": (3,)}, {})


@pytest.mark.parametrize(
    "rule, message",
    [
        ('runtime = "a"\nhf = "b"\ntranspose = [1, 1]', "two different dims"),
        ('runtime = "a"\nhf = ["b", "c"]\ninterleave = true\nsizes = [1, 2]', "interleave splits equally"),
        ('runtime = "a"\nhf = "b"\ngroups = 2', "groups needs a list"),
        ('runtime = "a"\nhf = ["b", "c"]\nnarrow = 3', "narrow and hf_shape need one runtime key"),
        ('runtime = "a"\nhf = "b"\npadded = 3', "padded and multiple go with narrow"),
        ('runtime = "a"\nhf = "b.{e}"\nstack = "e"\npermute = "q"', "permute applies to a rename only"),
        ('runtime = "a"\nhf = "b{x}{y}"', "two placeholders with nothing between"),
        ('runtime = "a"\nhf = "b.{x + }"', "not a {placeholder}"),
        ('runtime = "a"\nhf = ["b", "c"]\nduplicate = true\nsizes = [1, 1]', "duplicate needs"),
    ],
)
def test_bad_rules_are_named(tmp_path: Path, rule: str, message: str) -> None:
    with pytest.raises(CkptconvError, match=r"rule 1: .*" + message.replace("{", r"\{").replace("}", r"\}")):
        mapping(tmp_path, "[[rule]]\n" + rule + "\n")


def test_size_expressions_never_evaluate_code(tmp_path: Path) -> None:
    m = mapping(
        tmp_path, '[[rule]]\nruntime = "a"\nhf = ["b", "c"]\nsizes = ["__import__(\'os\').getpid()", 1]\n'
    )
    with pytest.raises(CkptconvError, match="may only use integers, config keys"):
        map_keys(m, "to_hf", {"a": (3,)}, {})
    m = mapping(tmp_path, '[[rule]]\nruntime = "a"\nhf = ["b", "c"]\nsizes = ["t.n / 2", "t.n / 2"]\n')
    assert [t.shape for t in map_keys(m, "to_hf", {"a": (4,)}, {"t": {"n": 4}}).targets] == [(2,), (2,)]
    with pytest.raises(CkptconvError, match="not exact"):
        map_keys(m, "to_hf", {"a": (3,)}, {"t": {"n": 3}})


def test_inspect_explain_names_the_rule_operation_and_blocks(tmp_path: Path, capsys) -> None:
    import json

    import torch.distributed.checkpoint as dcp
    from test_bad_input import assert_one_line

    from ckptconv.cli.app import main

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            main(list(argv))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    key = "layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD"
    dcp.save({"model": {key: values(3, 8, 5)}}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    target = "model.layers.0.mlp.experts.gate_up_proj"
    argv = ["inspect", str(tmp_path / "ckpt"), "--mapping", "torchtitan-gpt-oss", "--explain"]
    code, out, err = run(*argv, target, "--json")
    assert code == 0, err
    [made] = json.loads(out)["targets"]
    assert made["shape"] == [3, 5, 8] and made["op"] == "transpose" and made["rule"]["transpose"] == [1, 2]
    part = {"source": key, "from": "[0:3, 0:8, 0:5]", "to": "[0:3, 0:5, 0:8]", "dims": [0, 2, 1]}
    assert made["parts"] == [{**part, "row_permutation": False}]
    code, out, err = run(*argv, key)  # a source key: every key made from it
    assert code == 0, err
    assert f"{target} [3, 5, 8]: transpose" in out and "rule 15 of torchtitan-gpt-oss" in out, out
    assert "transpose = [1, 2]" in out and "dims [0, 2, 1]" in out
    code, _, err = run(*argv, "model.layers.0.mlp.experts.gate_up")
    assert_one_line(code, err, "--explain 'model.layers.0.mlp.experts.gate_up'", "close: " + target)
    code, _, err = run("inspect", str(tmp_path / "ckpt"), "--explain", target)
    assert_one_line(code, err, "--explain", "needs --mapping")
