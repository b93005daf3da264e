"""Property-based round trips through random mappings: stack/unstack, split/concat on either dim, fused
runtime lists, renames; random sizes (including empty parts) and dtypes (including fp8, int and bool).

A random runtime state is saved by dcp.save, converted to HF with a random mapping file, and back; the HF
tensors must be the exact slices the rules name, and the round trip must give the saved bytes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import run
from test_dcp_to_hf import load_dir, same_bits
from test_hf_to_dcp import load_plain

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int64,
    torch.int8,
    torch.bool,
]


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).view(torch.bool).reshape(shape)
    if dtype.is_floating_point:  # finite values only: NaN payloads would still round trip, but keep it plain
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return raw.view(dtype).reshape(shape)


@st.composite
def cases(draw: st.DrawFn) -> dict:
    return {
        "layers": draw(st.integers(1, 2)),
        "experts": draw(st.integers(1, 4)),
        "f": draw(st.integers(1, 5)),
        "d": draw(st.integers(1, 4)),
        "qkv": draw(st.lists(st.integers(0, 4), min_size=3, max_size=3).filter(lambda s: sum(s) > 0)),
        "qkv_dim": draw(st.integers(0, 1)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "seed": draw(st.integers(0, 2**16)),
    }


MAPPING = """[mapping]
name = "random"

[[rule]]
runtime = "layers.{{layer}}.moe.w1"
hf = "model.layers.{{layer}}.experts.{{expert}}.w1"
stack = "expert"

[[rule]]
runtime = "layers.{{layer}}.attn.wqkv"
hf = ["model.layers.{{layer}}.q", "model.layers.{{layer}}.k", "model.layers.{{layer}}.v"]
dim = {qkv_dim}
sizes = [{sizes}]

[[rule]]
runtime = ["layers.{{layer}}.moe.gate", "layers.{{layer}}.moe.up"]
hf = "model.layers.{{layer}}.experts.gate_up"
dim = 1
sizes = [{f}, {f1}]

[[rule]]
runtime = "layers.{{layer}}.norm"
hf = "model.layers.{{layer}}.norm"
"""


EXAMPLES = settings(  # each example converts both ways in process: CKPTCONV_MAPPING_EXAMPLES trades time
    max_examples=int(os.environ.get("CKPTCONV_MAPPING_EXAMPLES", "12")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def fresh(tmp_path: Path, case: dict) -> Path:
    """A clean directory for one example (hypothesis reuses the test's tmp_path across examples)."""
    root = tmp_path / f"case{case['seed']}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    return root


@EXAMPLES
@given(case=cases())
def test_random_mapping_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: dict) -> None:
    root = fresh(tmp_path, case)
    dtype, E, F, D = case["dtype"], case["experts"], case["f"], case["d"]
    q, k, v = case["qkv"]
    qkv_shape = (q + k + v, D) if case["qkv_dim"] == 0 else (D, q + k + v)
    runtime: dict[str, torch.Tensor] = {}
    for layer in range(case["layers"]):
        shapes = {
            "moe.w1": (E, F, D),
            "attn.wqkv": qkv_shape,
            "moe.gate": (E, F, D),
            "moe.up": (E, F + 1, D),
            "norm": (D,),
        }
        for i, (name, shape) in enumerate(shapes.items()):
            runtime[f"layers.{layer}.{name}"] = _values(shape, dtype, case["seed"] * 31 + layer * 7 + i)
    (root / "m.toml").write_text(
        MAPPING.format(qkv_dim=case["qkv_dim"], sizes=f"{q}, {k}, {v}", f=F, f1=F + 1)
    )
    dcp.save({"model": runtime}, checkpoint_id=str(root / "ckpt"), no_dist=True)
    mapping = str(root / "m.toml")
    code, err = run(
        capsys,
        "dcp-to-hf",
        str(root / "ckpt"),
        str(root / "hf"),
        "--mapping",
        mapping,
        "--dtype",
        "keep",
        "--quiet",
    )
    assert code == 0, err
    hf = load_dir(root / "hf")
    for layer in range(case["layers"]):
        rt, h = f"layers.{layer}.", f"model.layers.{layer}."
        for e in range(E):
            assert same_bits(hf[f"{h}experts.{e}.w1"], runtime[rt + "moe.w1"][e])
        parts = runtime[rt + "attn.wqkv"].split([q, k, v], dim=case["qkv_dim"])
        for name, part in zip("qkv", parts, strict=True):
            assert same_bits(hf[h + name], part.contiguous())
        fused = torch.cat([runtime[rt + "moe.gate"], runtime[rt + "moe.up"]], dim=1)
        assert same_bits(hf[h + "experts.gate_up"], fused)
    code, err = run(
        capsys,
        "hf-to-dcp",
        str(root / "hf"),
        str(root / "back"),
        "--mapping",
        mapping,
        "--prefix",
        "model.",
        "--quiet",
    )
    assert code == 0, err
    state = load_plain(root / "back")
    assert set(state) == {f"model.{key}" for key in runtime}
    for key, value in runtime.items():
        assert same_bits(state[f"model.{key}"], value), key  # type: ignore[arg-type]
    code, err = run(capsys, "verify", str(root / "back"), str(root / "hf"), "--mapping", mapping)
    assert code == 0, err
