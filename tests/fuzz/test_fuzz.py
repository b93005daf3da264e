"""Fuzzing: mutated real `.metadata`, `.distcp` and safetensors bytes: success or exit 2, never a traceback.

A bounded number of examples runs in CI (in-process through `main`, so each costs milliseconds); set
CKPTCONV_FUZZ_EXAMPLES for a longer run. Oracle: every command either succeeds or exits 2 with exactly one
`ckptconv: error:` line; a success of dcp-to-hf on a mutated `.metadata` must still produce tensors of the
same values (the mutation hit bytes that do not matter, such as padding or a key name); a success on a mutated
`.distcp` must give the same values too (a flipped data byte fails the record's CRC-32 check).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from test_bad_input import assert_one_line, run

EXAMPLES = int(os.environ.get("CKPTCONV_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples on every CI run; CKPTCONV_FUZZ_EXAMPLES widens the search
)


@st.composite
def mutations(draw: st.DrawFn, size: int) -> tuple[str, int, bytes]:
    kind = draw(st.sampled_from(["flip", "truncate", "overwrite", "insert"]))
    at = draw(st.integers(0, max(0, size - 1)))
    data = draw(st.binary(min_size=1, max_size=16))
    return kind, at, data


def mutate(raw: bytes, mutation: tuple[str, int, bytes]) -> bytes:
    kind, at, data = mutation
    if kind == "flip":
        return raw[:at] + bytes([raw[at] ^ (data[0] or 1)]) + raw[at + 1 :]
    if kind == "truncate":
        return raw[:at]
    if kind == "overwrite":
        return raw[:at] + data + raw[at + len(data) :]
    return raw[:at] + data + raw[at:]


def check(code: int, err: str) -> None:
    assert "Traceback" not in err, err
    if code != 0:
        assert_one_line(code, err)


def _values(hf: Path) -> list[tuple[str, tuple[int, ...], bytes]]:
    """Every tensor's dtype, shape and bytes, sorted: what a conversion produced, whatever the key names."""
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        tensors = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118 (safe_open is no dict)
    return sorted(
        (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for t in tensors
    )


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def hf_small(fsdp2_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import ckptconv

    out = tmp_path_factory.mktemp("fuzzhf") / "hf"
    assert ckptconv("dcp-to-hf", str(fsdp2_ckpt), str(out)).returncode == 0
    return out


@FUZZ
@given(data=st.data())
def test_fuzz_dcp_metadata(
    fsdp2_ckpt: Path, hf_small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], data: st.DataObject
) -> None:
    reference = hf_small
    ckpt = _copy(fsdp2_ckpt, tmp_path / "ckpt")
    raw = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(mutate(raw, data.draw(mutations(len(raw)))))
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out), "--quiet")
    check(code, err)
    if code == 0:  # the stored bytes did not change, so neither may the values (key names may)
        assert _values(out) == _values(reference)
    code, err = run(capsys, "inspect", str(ckpt), "--json")
    check(code, err)


@FUZZ
@given(data=st.data())
def test_fuzz_distcp_bytes(
    fsdp2_ckpt: Path, hf_small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], data: st.DataObject
) -> None:
    ckpt = _copy(fsdp2_ckpt, tmp_path / "ckpt")
    target = sorted(ckpt.glob("*.distcp"))[data.draw(st.integers(0, 1))]
    raw = target.read_bytes()
    target.write_bytes(mutate(raw, data.draw(mutations(len(raw)))))
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    for read in ("direct", "gather"):
        code, err = run(capsys, "dcp-to-hf", str(ckpt), str(out), "--quiet", "--read", read, "--overwrite")
        check(code, err)
        if code == 0:  # a mutation that changes stored values is caught by the records' CRC-32
            assert _values(out) == _values(hf_small)


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors(
    hf_small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], data: st.DataObject
) -> None:
    hf = _copy(hf_small, tmp_path / "hf")
    target = hf / "model.safetensors"
    raw = target.read_bytes()
    header = int.from_bytes(raw[:8], "little") + 8
    # mostly the header (where the structure is), sometimes anywhere
    at_most = data.draw(st.sampled_from([header, len(raw)]))
    target.write_bytes(mutate(raw, data.draw(mutations(at_most))))
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    code, err = run(capsys, "hf-to-dcp", str(hf), str(out), "--quiet")
    check(code, err)
    code, err = run(capsys, "inspect", str(target), "--json")
    check(code, err)
    code, err = run(capsys, "verify", str(hf_small), str(hf))
    assert "Traceback" not in err
    assert code in (0, 1, 2)
    if code == 2:
        assert_one_line(code, err)


def _lying_file(path: Path, header: dict, data: bytes = b"\0" * 64, length: int | None = None) -> Path:
    import json
    import struct

    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "length", "needle"),
    [
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            None,
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [40], "data_offsets": [0, 160]}}, None, "past the end"),
        ({"a": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 16]}}, None, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, None, "does not match its 16 bytes"),
        ({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, None, "not a list of dimensions"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 2**62, "header length"),
        ({"a": {"dtype": "F32", "shape": [4]}}, None, "malformed header entry"),
    ],
)
def test_safetensors_headers_that_lie(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], header: dict, length: int | None, needle: str
) -> None:
    lying = _lying_file(tmp_path / "lie.safetensors", header, length=length)
    for command in (["hf-to-dcp", str(lying), str(tmp_path / "out")], ["inspect", str(lying)]):
        code, err = run(capsys, *command)
        assert_one_line(code, err, "lie.safetensors", needle)
    assert not (tmp_path / "out").exists()


def test_metadata_shape_larger_than_the_stored_bytes_is_refused_before_allocating(
    fsdp2_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .metadata claiming a 2**40-element tensor in a few stored bytes: exit 2 from the metadata alone."""
    import pickle

    import torch.distributed.checkpoint as dcp  # noqa: F401 (the real classes, to edit the metadata)

    ckpt = _copy(fsdp2_ckpt, tmp_path / "ckpt")
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    entry = metadata.state_dict_metadata["model.embed.weight"]
    entry.size = torch.Size([2**40, 6])
    first = entry.chunks[0]
    entry.chunks[0] = type(first)(offsets=first.offsets, sizes=torch.Size([2**40, 6]))
    entry.chunks[1:] = []
    index = next(i for i in metadata.storage_data if i.fqn == "model.embed.weight" and i.offset is not None)
    info = metadata.storage_data[index]
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != "model.embed.weight"}
    metadata.storage_data[type(index)(fqn="model.embed.weight", offset=torch.Size([0, 0]), index=0)] = info
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    for command in (["dcp-to-hf", str(ckpt), str(tmp_path / "out")], ["inspect", str(ckpt)]):
        code, err = run(capsys, *command)
        assert_one_line(code, err, "'model.embed.weight'", "needs 26388279066624 bytes")


# -- safetensors headers built from the shapes that trip parsers, judged against the safetensors library ----

_DIMS = st.one_of(
    st.integers(0, 5),
    st.sampled_from([2**31, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1]),
    st.sampled_from([4.0, "4", True, None, [2]]),
)
_DTYPES = st.sampled_from(["F32", "BF16", "I64", "BOOL", "U8", "f32", "Q7", "", 4])
_ITEMSIZE = {"F32": 4, "BF16": 2, "I64": 8, "BOOL": 1, "U8": 1}


@st.composite
def st_headers(draw: st.DrawFn) -> tuple[bytes, bool]:
    """(a safetensors file's bytes, whether ckptconv must refuse it even if the library accepts it).

    Entries get offsets that tile the data unless a mutation moves one; then the JSON text may be spoiled:
    a duplicate key, deep nesting, NaN / Infinity, a lone surrogate, odd whitespace or trailing bytes."""
    import json
    import math
    import struct

    header: dict[str, object] = {}
    metadata = draw(st.sampled_from([None, {"format": "pt"}, {"a": 1}, [], "x", "absent"]))
    if metadata != "absent":
        header["__metadata__"] = metadata
    end = 0
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(_DTYPES)
        shape = draw(st.lists(_DIMS, max_size=3))
        ints = all(type(d) is int for d in shape)
        nbytes = math.prod(shape) * _ITEMSIZE.get(str(dtype), 4) if ints else 4  # type: ignore[arg-type]
        nbytes = nbytes if 0 <= nbytes <= 4096 else 4
        offsets: object = [end, end + nbytes]
        end += nbytes
        offsets = draw(
            st.sampled_from(
                [offsets, offsets, offsets, [end, end + 1], [0, 4], [0, 4.0], [0, 4, 4], [4, 0], "0,4"]
            )
        )
        entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        entry.update(draw(st.sampled_from([{}, {}, {"x": [1, {"y": None}]}, {"x": -1.5}])))
        for field in draw(st.lists(st.sampled_from(["dtype", "shape", "data_offsets"]), max_size=1)):
            del entry[field]
        header[draw(st.sampled_from([f"t{i}", f"t{i}", "", "é", "__metadata__x"])) + str(i)] = entry
    text = json.dumps(header, ensure_ascii=False)
    spoil = draw(
        st.sampled_from(["", "", "", "dup", "deep", "deeper", "nan", "inf", "surrogate", "space", "nul"])
    )
    duplicated = spoil == "dup" and len(header) > 0
    if duplicated:
        first = next(iter(header))
        text = text[:-1] + f", {json.dumps(first)}: {json.dumps(header[first])}}}"
    elif spoil in ("deep", "deeper") and text != "{}":
        depth = 125 if spoil == "deep" else 126
        text = text[:-1] + ', "z": ' + "[" * depth + "]" * depth + "}"
    elif spoil in ("nan", "inf") and text != "{}":
        text = text[:-1] + (', "z": NaN}' if spoil == "nan" else ', "z": -Infinity}')
    elif spoil == "surrogate":
        text = text[:-1] + ('"\\udc00": 1}' if text == "{}" else ', "\\udc00": 1}')
    elif spoil == "space":
        text = " \n" + text + "\t "
    raw = text.encode() + (b"\0" if spoil == "nul" else b"")
    data = b"\1" * max(0, end + draw(st.sampled_from([0, 0, 0, -1, 1, 8])))
    return struct.pack("<Q", len(raw)) + raw + data, duplicated


@FUZZ
@given(case=st_headers())
def test_fuzz_headers_against_the_safetensors_library(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: tuple[bytes, bool]
) -> None:
    """ckptconv accepts exactly the files `safetensors.torch.load` accepts (duplicate keys aside: refused)."""
    from safetensors.torch import load

    blob, duplicated = case
    try:
        load(blob)
        accepted = not duplicated
    except Exception:
        accepted = False
    path = tmp_path / "fuzzed.safetensors"
    path.write_bytes(blob)
    code, err = run(capsys, "inspect", str(path), "--json")
    check(code, err)
    assert (code == 0) == accepted, (blob[:300], err)
