"""The options objects (ckptconv/options.py): their checks and defaults, shared by the CLI and the library."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import _env

from ckptconv.errors import CkptconvError
from ckptconv.lora.select import LoraRequest
from ckptconv.options import (
    SAVE_HF,
    DcpToHfOptions,
    DtypeOptions,
    HfToDcpOptions,
    MappingOptions,
    OutputOptions,
    VerifyOptions,
)


def test_dtype_defaults_live_in_one_place() -> None:
    assert DcpToHfOptions().dtype.dtype == "bf16"
    assert DcpToHfOptions(lora=LoraRequest("adapter")).dtype.dtype == "keep"  # an adapter keeps its dtype
    assert DcpToHfOptions(lora=LoraRequest("merge")).dtype.dtype == "bf16"
    given = DcpToHfOptions(dtype=DtypeOptions(dtype="fp16"), lora=LoraRequest("adapter"))
    assert given.dtype.dtype == "fp16"
    assert HfToDcpOptions().dtype.dtype == "keep"
    assert DtypeOptions(fp32=["a$"]).fp32 == ("a$",)  # any sequence, kept as a tuple


def test_sizes_are_parsed_once() -> None:
    options = DcpToHfOptions(max_shard_size="500MB", bucket_size=1024)
    assert (options.shard_bytes, options.bucket_bytes) == (500 * 10**6, 1024)
    assert DcpToHfOptions().bucket_bytes == 128 * 10**6
    assert HfToDcpOptions().file_bytes == 4 * 10**9
    assert HfToDcpOptions(max_file_size="50KB").file_bytes == 50_000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"read_path": "scatter"}, "--read 'scatter' is not one of direct, gather"),
        ({"quantize_skip": ("x",)}, "--quantize-skip applies with --quantize fp8"),
        ({"quantize": "int3"}, "--quantize 'int3' is not one of fp8"),
        ({"quantize": "fp8", "quantize_skip": ("(",)}, "--quantize-skip"),
        ({"write_granularity": "rows"}, "--write-granularity 'rows' is not one of tensor, file"),
        ({"max_shard_size": "5XB"}, "--max-shard-size '5XB': not a size"),
        ({"bucket_size": 0}, "--bucket-size 0: must be positive"),
        ({"lora": LoraRequest("fold")}, "--lora 'fold' is not one of adapter, merge, drop"),
        ({"lora": LoraRequest(None, alpha=8.0)}, "--lora-alpha applies with"),
        ({"lora": LoraRequest("merge"), "read_path": "gather"}, "--lora merge reads with --read direct"),
    ],
)
def test_dcp_to_hf_values_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(CkptconvError, match=re.escape(message)):
        DcpToHfOptions(**kwargs)  # type: ignore[arg-type]


def test_other_values_refused() -> None:
    with pytest.raises(CkptconvError, match="--dtype 'fp64' is not one of bf16, fp16, fp32, keep"):
        DtypeOptions(dtype="fp64")
    with pytest.raises(CkptconvError, match="--fp32"):
        DtypeOptions(fp32=("(",))
    with pytest.raises(CkptconvError, match="--lora-adapter with --mapping is not supported yet"):
        HfToDcpOptions(lora_adapter="org/adapter", mapping=MappingOptions(mapping="torchtitan-llama3"))
    with pytest.raises(
        CkptconvError, match="save_hf: write_granularity='rows' is not one of 'tensor', 'file'"
    ):
        DcpToHfOptions(write_granularity="rows", wording=SAVE_HF)  # type: ignore[arg-type]
    with pytest.raises(CkptconvError, match=r"^bucket_size '0'"):
        DcpToHfOptions(bucket_size="0", wording=SAVE_HF)
    assert OutputOptions().fsync and not OutputOptions().overwrite
    with pytest.raises(CkptconvError, match=re.escape("--max-file-size '4XB': not a size")):
        HfToDcpOptions(max_file_size="4XB")


def test_verify_values_refused_and_tolerance() -> None:
    """verify's checks live in its options: a negative or NaN tolerance, an unknown --lora mode."""
    for value in (-1.0, float("nan")):
        with pytest.raises(CkptconvError, match=r"^--atol .*: must be a number >= 0"):
            VerifyOptions(atol=value)
        with pytest.raises(CkptconvError, match=r"^--rtol .*: must be a number >= 0"):
            VerifyOptions(rtol=value)
    with pytest.raises(CkptconvError, match="--lora 'fuse' is not one of"):
        VerifyOptions(lora=LoraRequest("fuse"))  # type: ignore[arg-type]
    assert VerifyOptions().bit_for_bit and not VerifyOptions(rtol=0.0).bit_for_bit


def test_options_import_no_torch() -> None:
    """The CLI builds its options before the early `.metadata` read, which must come before torch's import
    (source/early.py)."""
    code = (
        "import sys\n"
        "from ckptconv.cli.build import dcp_to_hf_options, hf_to_dcp_options\n"
        "from ckptconv.options import DcpToHfOptions\n"
        "from ckptconv.lora.select import LoraRequest\n"
        "from ckptconv.publish.hub_push import PushRequest\n"
        "DcpToHfOptions(quantize='fp8', quantize_skip=['x'], lora=LoraRequest('adapter'),\n"
        "               push=PushRequest('o/n'))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stderr


def test_save_hf_lora_adapter_keeps_its_dtype_as_the_cli_does(tmp_path: Path) -> None:
    """`--lora adapter` keeps the trained dtype unless --dtype says otherwise; save_hf(lora="adapter") with no
    dtype writes the same (the default lives in DcpToHfOptions)."""
    from safetensors.torch import load_file

    import ckptconv

    p = "base_model.model."
    g = torch.Generator().manual_seed(0)
    state = {
        p + "m.q.base_layer.weight": torch.randn(4, 6, generator=g),
        p + "m.q.lora_A.default.weight": torch.randn(2, 6, generator=g),
        p + "m.q.lora_B.default.weight": torch.randn(4, 2, generator=g),
    }
    ckptconv.save_hf(state, tmp_path / "kept", lora="adapter", lora_alpha=4.0, fp32=())
    written = load_file(tmp_path / "kept" / "adapter_model.safetensors")
    assert written and {t.dtype for t in written.values()} == {torch.float32}
    assert torch.equal(written[p + "m.q.lora_A.weight"], state[p + "m.q.lora_A.default.weight"])
    ckptconv.save_hf(state, tmp_path / "bf16", lora="adapter", lora_alpha=4.0, dtype="bf16", fp32=())
    written = load_file(tmp_path / "bf16" / "adapter_model.safetensors")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
