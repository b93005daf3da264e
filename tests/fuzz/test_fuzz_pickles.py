"""Structured fuzzing of every pickle ckptconv reads: DCP `.metadata` (edited through DCP's own classes, and
written opcode by opcode), Megatron's `common.pt` and non-tensor items (in torch.save's zip container, or a
spoilt one). Each example runs the commands that read it in-process (fuzz/fuzz_oracle.py): exit 0 or 2 (1:
verify's mismatch), one line, bounded time and memory, nothing written but OUT. tests/fuzz/test_fuzz.py flips
bytes of real files; these build inputs that parse, to get past the first check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fuzz_dcp import inject_item, metadata_edits, read_metadata, save, write_metadata
from fuzz_oracle import Fuzzer, Shown, fuzz_settings
from fuzz_pickles import COMMON, PAYLOADS, metadata_pickles, state_pickles
from fuzz_torchsave import CONTAINERS, container
from hypothesis import given
from hypothesis import strategies as st

from ckptconv.cli.app import main


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real one-process DCP checkpoint (tensors of five dtypes, `step` and nested `args` items)."""
    return save(tmp_path_factory.mktemp("fuzzdcp") / "ckpt")


@pytest.fixture(scope="module")
def base_hf(base: Path) -> Path:
    """`base` converted: the reference verify compares against."""
    out = base.parent / "hf"
    try:
        main(["dcp-to-hf", str(base), str(out), "--quiet", "--dtype", "keep"])
    except SystemExit as e:
        assert not e.code
    return out


def shown(raw: bytes) -> Shown[bytes]:
    return Shown(raw, f"{len(raw)} bytes: {raw[:300]!r}")


def _copy(src: Path, work: Path) -> Path:
    return Path(shutil.copytree(src, work / "ckpt"))


@fuzz_settings()
@given(data=st.data())
def test_fuzz_metadata_built_from_dcp_classes(
    fuzzer: Fuzzer, base: Path, base_hf: Path, data: st.DataObject
) -> None:
    """`.metadata` as DCP's classes make it, with sizes, chunks, dtypes, keys and storage entries edited."""
    md = data.draw(metadata_edits(read_metadata(base)))
    with fuzzer.example(md.note) as work:
        ckpt = _copy(base, work)
        write_metadata(ckpt, md.value)
        out = work / "out"
        fuzzer.run("inspect", str(ckpt), "--json")
        fuzzer.run("dcp-to-hf", str(ckpt), str(out), "--dry-run")
        fuzzer.run("dcp-to-hf", str(ckpt), str(out), "--quiet", "--dtype", "keep", outs=[out])
        fuzzer.run("verify", str(ckpt), str(base_hf), codes=(0, 1, 2))


@fuzz_settings()
@given(raw=metadata_pickles().map(shown))
def test_fuzz_metadata_opcodes(fuzzer: Fuzzer, base: Path, base_hf: Path, raw: Shown[bytes]) -> None:
    """`.metadata` written opcode by opcode: DCP's records with odd fields, shared and reused records,
    doubled and nested values, calls of allowlisted constructors with odd arguments, payloads."""
    with fuzzer.example(raw.note) as work:
        ckpt = _copy(base, work)
        (ckpt / ".metadata").write_bytes(raw.value)
        out = work / "out"
        fuzzer.run("inspect", str(ckpt))
        fuzzer.run("dcp-to-hf", str(ckpt), str(out), "--quiet", outs=[out])
        fuzzer.run("verify", str(base_hf), str(ckpt), codes=(0, 1, 2))


@fuzz_settings()
@given(kind=CONTAINERS, pkl=state_pickles([*COMMON, *PAYLOADS], top_dict=True).map(shown))
def test_fuzz_megatron_common_pt(fuzzer: Fuzzer, base: Path, kind: str, pkl: Shown[bytes]) -> None:
    """A Megatron-Core checkpoint's `common.pt`: a torch.save zip (or a spoilt one, a zip bomb) of a dict
    whose values are Namespaces, enums, tensors, shared and nested values, payload calls."""
    with fuzzer.example(f"{kind} container, {pkl.note}") as work:
        ckpt = _copy(base, work)
        (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        (ckpt / "common.pt").write_bytes(container(kind, pkl.value))
        out = work / "out"
        fuzzer.run("inspect", str(ckpt), "--json")
        code, _ = fuzzer.run("dcp-to-hf", str(ckpt), str(out), "--quiet", outs=[out])
        if code == 0:
            back = work / "back"
            fuzzer.run("hf-to-dcp", str(out), str(back), "--quiet", outs=[back])


@fuzz_settings()
@given(kind=CONTAINERS, pkl=state_pickles([*COMMON, *PAYLOADS], top_dict=False).map(shown))
def test_fuzz_non_tensor_items(fuzzer: Fuzzer, base: Path, kind: str, pkl: Shown[bytes]) -> None:
    """A non-tensor item (`step`) whose saved bytes are any pickle in any container: dcp-to-hf stashes it,
    hf-to-dcp writes it back, verify and inspect read both sides."""
    with fuzzer.example(f"{kind} container, {pkl.note}") as work:
        ckpt = _copy(base, work)
        inject_item(ckpt, "step", container(kind, pkl.value))
        hf, back = work / "hf", work / "back"
        fuzzer.run("inspect", str(ckpt))
        code, _ = fuzzer.run("dcp-to-hf", str(ckpt), str(hf), "--quiet", "--dtype", "keep", outs=[hf])
        if code != 0:
            return
        code, _ = fuzzer.run("hf-to-dcp", str(hf), str(back), "--quiet", outs=[back])
        if code == 0:
            fuzzer.run("verify", str(ckpt), str(back), codes=(0, 1, 2))
            fuzzer.run("dcp-to-hf", str(back), str(work / "again"), "--quiet", outs=[work / "again"])
