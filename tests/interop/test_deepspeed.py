"""DeepSpeed ZeRO-1/2/3 checkpoints against DeepSpeed 0.19.8's own code (issue #39, item 2).

DeepSpeed itself (support/deepspeed.py, support/workers/deepspeed_train.py; CPU, gloo, 2 ranks, bf16) trains
a tiny transformers Llama one step under ZeRO-1 (untied), ZeRO-2 and ZeRO-3 (tied embedding and LM head, one
frozen layernorm) and saves it with `engine.save_checkpoint`; its own
`zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` gives the expected weights. Checked here:

- dcp-to-hf's fp32 release equals zero_to_fp32's weights bit for bit (the `latest` tag followed, or the
  `global_step1/` directory given), `--dtype bf16` their cast; the tied head is the embedding, the frozen
  layernorm DeepSpeed's own fragment(s); so does the universal checkpoint DeepSpeed's own ds_to_universal.py
  makes of the ZeRO-2 and ZeRO-3 ones;
- `--deepspeed-weights module` equals the engine's 16-bit module weights (ZeRO-1/2); ZeRO-3, which keeps none
  there, is refused with exit 2;
- the Adam moments are never read: their bytes overwritten with garbage change nothing, and the bytes read
  are the weights' bytes;
- a rank file whose pickle calls os.system is refused (exit 2) without running it; a missing rank file is
  named;
- (slow) 1 and 2 ranks write byte-identical releases.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import ckptconv
from deepspeed import trained
from test_dcp_to_hf import load_dir, same_bits

from ckptconv.formats.deepspeed_pickle import read_pickled

SPECS = ("1", "2_tied_frozen_universal", "3_tied_frozen_universal")
STEP = "global_step1"


@pytest.fixture(scope="module")
def runs() -> Path:
    return trained(*SPECS)


def convert(src: Path, out: Path, *flags: str, nproc: int = 0) -> dict[str, torch.Tensor]:
    """dcp-to-hf of `src` (RUN/ckpt or RUN/ckpt/global_step1) with RUN/config copied."""
    config = next(p / "config" for p in src.parents if (p / "config").is_dir())
    proc = ckptconv("dcp-to-hf", str(src), str(out), "--copy-from", str(config), *flags, nproc=nproc)
    assert proc.returncode == 0, proc.stderr
    return load_dir(out)


def expected(run: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(run / name, weights_only=True)


def check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, bad


@pytest.mark.parametrize("spec", SPECS)
def test_fp32_equals_zero_to_fp32(runs: Path, tmp_path: Path, spec: str) -> None:
    run = runs / spec
    want = expected(run, "fp32.pt")
    got = convert(run / "ckpt", tmp_path / "out", "--dtype", "keep")
    check_equal(got, want)
    if spec == "1":
        return
    assert same_bits(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert got["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16  # DeepSpeed's fragment
    if spec.startswith("3"):  # the tag directory given directly, and bf16 the cast of the fp32 weights
        got = convert(run / "ckpt" / STEP, tmp_path / "bf16", "--dtype", "bf16")
        check_equal(got, {k: v.to(torch.bfloat16) for k, v in want.items()})


@pytest.mark.parametrize("spec", SPECS[1:])
def test_universal_equals_zero_to_fp32(runs: Path, tmp_path: Path, spec: str) -> None:
    run = runs / spec
    got = convert(run / "universal", tmp_path / "out", "--dtype", "keep")
    check_equal(got, expected(run, "fp32.pt"))


@pytest.mark.parametrize("spec", SPECS[:2])
def test_module_weights(runs: Path, tmp_path: Path, spec: str) -> None:
    run = runs / spec
    got = convert(run / "ckpt", tmp_path / "out", "--deepspeed-weights", "module", "--dtype", "bf16")
    check_equal(got, expected(run, "module.pt"))


def test_zero3_module_refused(runs: Path, tmp_path: Path) -> None:
    run = runs / SPECS[2]
    proc = ckptconv("dcp-to-hf", str(run / "ckpt"), str(tmp_path / "out"), "--deepspeed-weights", "module")
    assert proc.returncode == 2, proc.stderr
    assert "--deepspeed-weights module" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def _moments(file: Path, root: Path) -> list[tuple[int, int]]:
    """(offset, length) of every Adam moment's storage in a rank's optimizer states file."""
    pickled = read_pickled(root, str(file.relative_to(root)))
    state = pickled.value["optimizer_state_dict"]
    base = state.get("base_optimizer_state") or state.get("optimizer_state_dict")
    places = []
    for per_param in base["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            places.append(pickled.storages[per_param[name].storage_key])
    return places


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2]])
def test_moments_never_read(runs: Path, tmp_path: Path, spec: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs / spec, run)
    moments = 0
    for file in sorted((run / "ckpt" / STEP).glob("*optim_states.pt")):
        places = _moments(file, run / "ckpt")
        assert places
        with open(file, "r+b") as f:
            for offset, length in places:
                f.seek(offset)
                f.write(b"\xff" * length)  # NaNs where the moments were
                moments += length
    proc = ckptconv(
        "dcp-to-hf",
        str(run / "ckpt"),
        str(tmp_path / "out"),
        "--dtype",
        "keep",
        "--json",
        "--copy-from",
        str(run / "config"),
    )
    assert proc.returncode == 0, proc.stderr
    check_equal(load_dir(tmp_path / "out"), expected(run, "fp32.pt"))
    read = sum(r["bytes_read"] for r in json.loads(proc.stdout)["ranks"])
    # every key's weights once (a tied head: the embedding's bytes, read again for it), nothing else
    weights = sum(v.numel() * v.element_size() for v in expected(run, "fp32.pt").values())
    assert read == weights and moments > read  # the moments: more bytes than all that was read


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_crafted_pickle_refused(runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs / SPECS[1], run)
    marker = tmp_path / "ran"
    rank1 = run / "ckpt" / STEP / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    buf = io.BytesIO()
    torch.save({"optimizer_state_dict": _Boom(marker)}, buf)
    rank1.write_bytes(buf.getvalue())
    proc = ckptconv("dcp-to-hf", str(run / "ckpt"), str(tmp_path / "out"))
    assert proc.returncode == 2 and not marker.exists(), proc.stderr
    assert str(rank1) in proc.stderr and "system" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    assert zipfile.is_zipfile(rank1)  # a real torch.save file, refused for its pickle alone


def test_missing_rank_named(runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs / SPECS[0], run)
    (run / "ckpt" / STEP / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    proc = ckptconv("dcp-to-hf", str(run / "ckpt"), str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "optim_states.pt" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_two_ranks_byte_identical(runs: Path, tmp_path: Path) -> None:
    for spec in (SPECS[1], SPECS[2]):
        src = runs / spec / "ckpt"
        convert(src, tmp_path / spec / "one", "--dtype", "keep")
        convert(src, tmp_path / spec / "two", "--dtype", "keep", nproc=2)
        names = sorted(p.name for p in (tmp_path / spec / "one").iterdir())
        assert names == sorted(p.name for p in (tmp_path / spec / "two").iterdir())
        for name in names:
            assert (tmp_path / spec / "one" / name).read_bytes() == (
                tmp_path / spec / "two" / name
            ).read_bytes()
