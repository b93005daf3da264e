"""Structured fuzzing of the files beside the tensors: safetensors headers (dtypes, shapes, offsets,
__metadata__, the header length field) read by hf-to-dcp and verify, the index's weight_map, ckptconv's own
stash (`ckptconv_state.json`, items as JSON values, 0-d tensors and base64 pickles), and torch's distributed
HF shards (DCP_SHARDING_INFO, the shard file names, `.hf_metadata/`). Each example runs the commands that
read it in-process (tests/fuzz/fuzz_oracle.py): exit 0 or 2 (1: verify's mismatch), one line, bounded time and
memory, nothing written but OUT. tests/fuzz/test_fuzz.py holds safetensors headers against the library itself.
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzz_dcp import save
from fuzz_docs import CONFIG_FIELDS, SIZES, VALUES, edited, file_splits, json_files, sharding_infos, stashes
from fuzz_oracle import Fuzzer, Shown, fuzz_settings
from fuzz_pickles import COMMON, state_pickles
from fuzz_torchsave import SPOILT, container
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from test_fuzz import st_headers

from ckptconv.cli.app import main


def cli(*argv: object) -> None:
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        assert not e.code, argv


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed_tokens.weight": torch.randn(7, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "counts": torch.arange(5),
        "flags": torch.tensor([True, False]),
    }


SPLIT = {"model.embed_tokens.weight": 1, "model.norm.weight": 1, "counts": 2, "flags": 2}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An HF model in one file and in two files with an index (safetensors' own writer); a DCP checkpoint
    and its dcp-to-hf release (with the stash); torch's distributed HF shards (HuggingFaceStorageWriter,
    save_distributed, the keys in two files) with the `.hf_metadata/` NeMo Automodel leaves, and their
    release."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    root = tmp_path_factory.mktemp("fuzzfiles")
    state = tensors()
    single = root / "single"
    single.mkdir()
    save_file(state, str(single / "model.safetensors"), metadata={"format": "pt"})
    sharded = root / "sharded"
    sharded.mkdir()
    weight_map = {}
    for number, keys in ((1, ["model.embed_tokens.weight", "model.norm.weight"]), (2, ["counts", "flags"])):
        name = f"model-0000{number}-of-00002.safetensors"
        save_file({k: state[k] for k in keys}, str(sharded / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": 84}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = save(root / "dcp")
    cli("dcp-to-hf", ckpt, root / "stashed", "--dtype", "keep", "-q")
    shards = root / "shards"
    writer = HuggingFaceStorageWriter(str(shards), save_distributed=True, fqn_to_index_mapping=SPLIT)
    dcp.save(state, storage_writer=writer, no_dist=True)
    (shards / ".hf_metadata").mkdir()
    (shards / ".hf_metadata" / "fqn_to_file_index_mapping.json").write_text(json.dumps(SPLIT))
    config = {"model_type": "llama", "vocab_size": 7, "hidden_size": 4, "tie_word_embeddings": False}
    (shards / ".hf_metadata" / "config.json").write_text(json.dumps(config))
    cli("dcp-to-hf", shards, root / "shards_hf", "--dtype", "keep", "-q")
    return {
        "single": single,
        "sharded": sharded,
        "dcp": ckpt,
        "stashed": root / "stashed",
        "shards": shards,
        "shards_hf": root / "shards_hf",
    }


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


# -- safetensors headers ------------------------------------------------------------------------------------

ST_DTYPES = [
    "F32",
    "BF16",
    "F16",
    "I64",
    "BOOL",
    "U8",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "F4",
    "C64",
    "I4",
    "Q7",
]
DIM_VALUES = st.sampled_from([*SIZES, 2**64, 1.0, "4", None, True])


@st.composite
def real_headers(draw: st.DrawFn, raw: bytes) -> Shown[bytes]:
    """A real safetensors file with its header's entries edited (dtype, shape, offsets, extra fields),
    __metadata__ values set (non-strings, a DCP_SHARDING_INFO of junk), the length field off."""
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    data = raw[8 + length :]
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(header)))
        what = draw(st.sampled_from(["dtype", "shape", "offsets", "field", "metadata", "length", "drop"]))
        entry = header[key]
        if what == "metadata" or key == "__metadata__":
            meta = (
                header.setdefault("__metadata__", {}) if isinstance(header.get("__metadata__"), dict) else {}
            )
            name = draw(st.sampled_from(["format", "DCP_SHARDING_INFO", "x", ""]))
            meta[name] = draw(VALUES | st.sampled_from(["pt", "mlx", "{", '{"a": {"saved_offsets": [0]}}']))
            header["__metadata__"] = meta
        elif what == "dtype":
            entry["dtype"] = draw(st.sampled_from(ST_DTYPES) | VALUES)
        elif what == "shape":
            entry["shape"] = draw(st.lists(DIM_VALUES, max_size=4) | VALUES)
        elif what == "offsets":
            entry["data_offsets"] = draw(st.lists(DIM_VALUES, max_size=3) | VALUES)
        elif what == "field":
            entry[draw(st.sampled_from(["x", "dtype ", ""]))] = draw(VALUES)
        elif what == "drop":
            del header[key]
        if what != "length":
            edits.append(f"{what} {key!r}")
    text = json.dumps(header).encode()
    field = len(text)
    if draw(st.integers(0, 3)) == 0:
        field = draw(
            st.sampled_from([0, 1, 7, field - 1, field + 1, field + len(data), 2**31, 2**63, 2**64 - 1])
        )
        edits.append(f"length {field}")
    blob = struct.pack("<Q", field) + text + data
    return Shown(blob, f"{'; '.join(edits)}: {blob[:600]!r}")


@fuzz_settings()
@given(data=st.data())
def test_fuzz_safetensors_headers(fuzzer: Fuzzer, files: dict[str, Path], data: st.DataObject) -> None:
    """A safetensors file whose header is a real one edited, or built whole (tests/fuzz/test_fuzz.st_headers):
    hf-to-dcp converts it (as a file and as a directory's model.safetensors), verify compares it."""
    if data.draw(st.booleans()):
        drawn = data.draw(real_headers((files["single"] / "model.safetensors").read_bytes()))
    else:
        drawn = data.draw(st_headers().map(lambda case: Shown(case[0], f"built: {case[0][:600]!r}")))
    blob = drawn.value
    with fuzzer.example(drawn.note) as work:
        hf = work / "hf"
        hf.mkdir()
        target = hf / "model.safetensors"
        target.write_bytes(blob)
        a, b = work / "a", work / "b"
        fuzzer.run("hf-to-dcp", str(target), str(a), "-q", outs=[a])
        fuzzer.run("hf-to-dcp", str(hf), str(b), "-q", "--dtype", "bf16", outs=[b])
        fuzzer.run("verify", str(files["single"]), str(hf), codes=(0, 1, 2))


# -- the index ----------------------------------------------------------------------------------------------

FILE_NAMES = [
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    "model-00003-of-00002.safetensors", "../single/model.safetensors", "/etc/hostname", "", ".",
    "model.safetensors.index.json", "a/../model-00001-of-00002.safetensors",
]  # fmt: skip
KEY_NAMES = ["model.embed_tokens.weight", "model.norm.weight", "counts", "flags", "", "other", "model."]


def indexes(base: dict[str, Any]) -> st.SearchStrategy[Any]:
    weight_maps = st.dictionaries(
        st.sampled_from(KEY_NAMES), st.sampled_from(FILE_NAMES) | VALUES, max_size=6
    )
    moved = st.builds(
        lambda key, name: {**base["weight_map"], key: name},
        st.sampled_from(KEY_NAMES),
        st.sampled_from(FILE_NAMES),
    )
    fields = {
        "weight_map": st.one_of(moved, st.one_of(weight_maps, VALUES)),
        "metadata": st.fixed_dictionaries({"total_size": VALUES}) | VALUES,
    }
    return edited(base, fields)


@fuzz_settings()
@given(data=st.data())
def test_fuzz_index(fuzzer: Fuzzer, files: dict[str, Path], data: st.DataObject) -> None:
    """model.safetensors.index.json with its weight_map pointing keys at other, missing, outside or no files,
    its metadata odd: inspect, hf-to-dcp and verify read it."""
    base = json.loads((files["sharded"] / "model.safetensors.index.json").read_text())
    raw = data.draw(json_files(indexes(base)))
    with fuzzer.example(raw.note) as work:
        hf = _copy(files["sharded"], work / "hf")
        (hf / "model.safetensors.index.json").write_bytes(raw.value)
        shutil.copytree(files["single"], work / "single")  # what "../single/..." names
        out = work / "out"
        fuzzer.run("inspect", str(hf), "--json")
        fuzzer.run("hf-to-dcp", str(hf), str(out), "-q", outs=[out])
        fuzzer.run("verify", str(hf), str(files["single"]), codes=(0, 1, 2))


# -- the stash ----------------------------------------------------------------------------------------------

B64 = st.one_of(
    st.builds(
        lambda kind, pkl: base64.b64encode(container(kind, pkl)).decode(),
        st.one_of(st.just("zip"), st.sampled_from([c for c in SPOILT if c != "bomb"])),
        state_pickles(COMMON, top_dict=False),
    ),
    st.sampled_from(["", "!!!", "AAAA", "A", "=" * 8, "QUJD\nREVG", "8J+Ygg=="]),
)


@fuzz_settings()
@given(data=st.data())
def test_fuzz_stash(fuzzer: Fuzzer, files: dict[str, Path], data: st.DataObject) -> None:
    """ckptconv_state.json with items added, replaced and dropped: JSON values of every kind, 0-d tensors of
    any dtype (a number that does not fit it), bytes as base64 pickles in any container or not base64 at
    all, empty and duplicate keys, odd paths; its format and version fields set. hf-to-dcp reads it into a
    DCP checkpoint; inspect, verify and dcp-to-hf read that."""
    base = json.loads((files["stashed"] / "ckptconv_state.json").read_text())
    raw = data.draw(json_files(stashes(base, B64)))
    with fuzzer.example(raw.note) as work:
        hf = _copy(files["stashed"], work / "hf")
        (hf / "ckptconv_state.json").write_bytes(raw.value)
        out, again = work / "out", work / "again"
        code, _ = fuzzer.run("hf-to-dcp", str(hf), str(out), "-q", outs=[out])
        if code == 0:
            fuzzer.run("inspect", str(out), "--json")
            fuzzer.run("verify", str(hf), str(out), codes=(0, 1, 2))
            fuzzer.run("dcp-to-hf", str(out), str(again), "-q", "--dtype", "keep", outs=[again])


# -- torch's distributed HF shards and .hf_metadata ----------------------------------------------------------

NUMBERS = ["00001", "00002", "00000", "00003", "99999", "99999999999", "1", "-0001"]


@fuzz_settings()
@given(data=st.data())
def test_fuzz_hf_distributed_shards(fuzzer: Fuzzer, files: dict[str, Path], data: st.DataObject) -> None:
    """torch's distributed HF shards with DCP_SHARDING_INFO rewritten (offsets negative, huge, of the wrong
    rank, for other keys), shard files renamed (a rank or file number of eleven digits, a gap, N < I),
    `.hf_metadata/fqn_to_file_index_mapping.json` and `.hf_metadata/config.json` set to odd documents:
    inspect, dcp-to-hf (sized and --keep-file-split) and verify read them."""
    state = tensors()
    config = json.loads((files["shards"] / ".hf_metadata" / "config.json").read_text())
    edits = data.draw(
        st.lists(st.sampled_from(["sharding", "rename", "split", "config"]), min_size=1, max_size=3)
    )
    with fuzzer.example(", ".join(edits)) as work:
        shards = _copy(files["shards"], work / "shards")
        notes = []
        for edit in edits:
            names = sorted(p.name for p in shards.glob("*.safetensors"))
            if edit == "sharding" and names:
                name = data.draw(st.sampled_from(names))
                with safe_open(str(shards / name), "pt") as f:
                    stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
                    meta = dict(f.metadata())
                doc = data.draw(sharding_infos(sorted(stored), {k: state[k].dim() for k in stored}))
                raw = data.draw(json_files(st.just(doc)))
                meta["DCP_SHARDING_INFO"] = raw.value.decode("utf-8", "replace")
                save_file(stored, str(shards / name), metadata=meta)
                notes.append(f"{name}: {raw.note}")
            elif edit == "rename" and names:
                old = data.draw(st.sampled_from(names))
                rank, number, total = (data.draw(st.sampled_from(NUMBERS)) for _ in range(3))
                new = f"shard-{rank}-model-{number}-of-{total}.safetensors"
                (shards / old).rename(shards / new)
                notes.append(f"{old} -> {new}")
            elif edit == "split":
                raw = data.draw(json_files(file_splits(sorted(state))))
                (shards / ".hf_metadata" / "fqn_to_file_index_mapping.json").write_bytes(raw.value)
                notes.append(f"split {raw.note}")
            elif edit == "config":
                raw = data.draw(json_files(edited(config, CONFIG_FIELDS)))
                (shards / ".hf_metadata" / "config.json").write_bytes(raw.value)
                notes.append(f"config {raw.note}")
        fuzzer.note = "; ".join(notes)[:2000]
        out, kept = work / "out", work / "kept"
        fuzzer.run("inspect", str(shards), "--json")
        fuzzer.run("dcp-to-hf", str(shards), str(out), "-q", "--dtype", "keep", outs=[out])
        fuzzer.run("dcp-to-hf", str(shards), str(kept), "-q", "--keep-file-split", outs=[kept])
        fuzzer.run("verify", str(shards), str(files["shards_hf"]), codes=(0, 1, 2))
