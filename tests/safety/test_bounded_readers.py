"""Bounded readers (issue #34, item 3): a `.metadata`, a non-tensor item, a tensor's torch.save record, a
`common.pt`, a config, a stash or a mapping file of a few hundred bytes to a few megabytes that describes
gigabytes (memoized references walked as a tree, a memoized value fed to an allowlisted constructor again and
again, a zip bomb, deep nesting, a long dotted TOML key) is exit 2 with one line naming the file and the
limit, in bounded time and memory: each command runs in a child limited to 512 MiB more address space than
it starts with, and a deadline.

The hostile inputs are crafted as an attacker would: real checkpoints and containers made by torch (dcp.save,
torch.save), with torch's own metadata classes pickled around a crafted object, or a container's `data.pkl`
swapped for crafted opcodes.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import resource
import runpy
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import _env, _forked, _forkserver, on_path

from ckptconv.errors import CkptconvError
from ckptconv.formats.documents import load_json, load_toml
from ckptconv.job.limits import LimitExceeded

HEADROOM = 512 * 2**20  # address space a command may take beyond what it starts with
DEADLINE = 60  # seconds; the old readers took minutes or never finished


# -- running a command within bounds ------------------------------------------------------------------------


def bounded(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m ckptconv ARGS` in a child whose address space is limited to HEADROOM beyond its start
    (this module run as `__main__` sets the limit), failing the test past DEADLINE."""
    environ = {**_env(), "BOUNDED_HEADROOM": str(HEADROOM)}
    try:
        if _forked():
            return _forkserver[0].run(__name__, list(args), environ, DEADLINE)
        environ = on_path(environ)
        cmd = [sys.executable, "-m", __name__, *args]
        return subprocess.run(
            cmd, capture_output=True, text=True, env=environ, timeout=DEADLINE, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"ckptconv {' '.join(args)} ran past {DEADLINE} s")


def refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2, one `ckptconv: error:` line naming `needles`, no traceback."""
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("ckptconv: error: ")]
    assert len(lines) == 1 and proc.stderr.strip().splitlines()[-1] == lines[0], proc.stderr[-3000:]
    assert len(lines[0]) < 1000, lines[0][:2000]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# -- crafting -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real DCP checkpoint saved by torch: a tensor under `model`, non-tensor items `step` and `args.lr`."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("bounded") / "ckpt"
    state = {"model": {"w": torch.arange(16.0).reshape(4, 4)}, "step": 7, "args": {"lr": 0.1}}
    with pytest.warns(UserWarning):  # no process group: dcp.save says it saves in one process
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.fixture
def ckpt(made: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(made, tmp_path / "ckpt"))


def metadata_of(ckpt: Path) -> Any:
    import torch.distributed.checkpoint as dcp  # noqa: F401 (torch's metadata classes, for pickle.loads)

    return pickle.loads((ckpt / ".metadata").read_bytes())


def point_at(ckpt: Path, fqn: str, blob: bytes) -> None:
    """Store `blob` as the record of `fqn` (its only chunk, or the item) in a new file `evil.distcp`."""
    (ckpt / "evil.distcp").write_bytes(blob)
    metadata = metadata_of(ckpt)
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            info.relative_path, info.offset, info.length = "evil.distcp", 0, len(blob)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def container(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def with_data_pkl(real: bytes, data: bytes, declared: int | None = None) -> bytes:
    """The torch.save container `real` with its data.pkl replaced: `data` stored, or (`declared` given)
    `data` as a raw deflate stream that says it inflates to `declared` bytes."""
    entries = []
    with zipfile.ZipFile(io.BytesIO(real)) as z:
        for info in z.infolist():
            if info.filename.endswith("/data.pkl"):
                if declared is None:
                    entries.append((info.filename, 0, data, zlib.crc32(data), len(data)))
                else:  # the CRC-32 is never reached: the size is what is checked (or, before, inflated)
                    entries.append((info.filename, 8, data, 0, declared))
            else:
                raw = z.read(info)
                entries.append((info.filename, 0, raw, zlib.crc32(raw), len(raw)))
    out, central = io.BytesIO(), io.BytesIO()
    for name, method, payload, crc, size in entries:
        offset, encoded = out.tell(), name.encode()
        fields = (0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), size, len(encoded), 0)
        out.write(struct.pack("<IHHHHHIIIHH", *fields) + encoded + payload)
        fields = (
            0x02014B50,
            20,
            20,
            0,
            method,
            0,
            0x21,
            crc,
            len(payload),
            size,
            len(encoded),
            0,
            0,
            0,
            0,
            0,
        )
        central.write(struct.pack("<IHHHHHHIIIHHHHHII", *fields, offset) + encoded)
    start, directory = out.tell(), central.getvalue()
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory), start, 0)
    return out.getvalue() + directory + end


def deflated_zeros(mib: int) -> bytes:
    """A raw deflate stream of `mib` MiB of zeros, about 1 KB a MiB."""
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = co.compress(bytes(2**20)) + co.flush(zlib.Z_FULL_FLUSH)  # the same bytes for every MiB
    return block * mib + co.flush(zlib.Z_FINISH)


BOMB_MIB = 1024  # a data.pkl that says (truly) it inflates to 1 GiB, from 1 MB


class Join:
    """Pickles as `pathlib.PosixPath(prev, prev)`: memoized, each one doubles the last (2^40 bytes at 40)."""

    def __init__(self, prev: Any) -> None:
        self.prev = prev

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return pathlib.PosixPath, (self.prev, self.prev)


def doubling(levels: int) -> Any:
    value: Any = "ab"
    for _ in range(levels):
        value = Join(value)
    return value


def tree(levels: int) -> list[Any]:
    """A list of two references to the list before it, `levels` times: a few hundred bytes pickled (the memo),
    a tree of 2^levels leaves to anything that walks it."""
    value: list[Any] = []
    for _ in range(levels):
        value = [value, value]
    return value


def nested(depth: int) -> bytes:
    """Pickle opcodes of `{"args": a list nested `depth` deep}`: EMPTY_DICT, the key, EMPTY_LIST `depth`
    times, APPEND each into the one before, SETITEM (torch.save would stop at Python's recursion limit)."""
    return b"\x80\x02}X\x04\x00\x00\x00args" + b"]" * depth + b"a" * (depth - 1) + b"s."


# -- .metadata ----------------------------------------------------------------------------------------------


def test_a_path_doubled_by_memo_references_in_metadata(ckpt: Path) -> None:
    """`pathlib.PosixPath(p, p)` of the one before, 40 times, in a few hundred bytes of `.metadata`."""
    metadata = metadata_of(ckpt)
    metadata.storage_meta = doubling(40)
    blob = pickle.dumps(metadata)
    (ckpt / ".metadata").write_bytes(blob)
    refused(bounded("inspect", str(ckpt)), str(ckpt / ".metadata"), "a path of more than 65536 characters")


class _Ordered:
    """Pickles as `collections.OrderedDict(pairs)`: the same memoized list of pairs each time."""

    def __init__(self, pairs: list[tuple[str, int]]) -> None:
        self.pairs = pairs

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import collections

        return collections.OrderedDict, (self.pairs,)


def test_a_memoized_list_fed_to_an_allowlisted_constructor_again_and_again(ckpt: Path) -> None:
    """5,000 `OrderedDict(pairs)` of one memoized list of 5,000 pairs: 100 KB, 25 million items copied."""
    pairs = [(f"k{i}", i) for i in range(5000)]
    metadata = metadata_of(ckpt)
    metadata.storage_meta = [_Ordered(pairs) for _ in range(5000)]
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    refused(bounded("inspect", str(ckpt)), str(ckpt / ".metadata"), "CKPTCONV_READ_OBJECTS")


def test_one_long_offsets_tuple_for_every_chunk(ckpt: Path) -> None:
    """20,000 chunks whose offsets and sizes are one memoized 50,000-long torch.Size: 300 KB of `.metadata`
    that the checks of the chunks would flatten into a billion numbers."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    metadata = metadata_of(ckpt)
    long = torch.Size([1] * 50_000)
    entry = metadata.state_dict_metadata["model.w"]
    entry.chunks = [ChunkStorageMetadata(long, long) for _ in range(20_000)]
    metadata.storage_data = {MetadataIndex("model.w", long): _StorageInfo("__0_0.distcp", 0, 4)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    refused(bounded("inspect", str(ckpt)), str(ckpt / ".metadata"), "more than 64 dimensions")


def test_one_long_planner_path_for_every_key(ckpt: Path) -> None:
    """10,000 non-tensor items whose nesting paths are one memoized list of 100,000 names: copied per key."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = metadata_of(ckpt)
    path = ["x"] * 100_000
    for i in range(10_000):
        metadata.state_dict_metadata[f"i{i}"] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex(f"i{i}")] = _StorageInfo("__0_0.distcp", 0, 1)
        metadata.planner_data[f"i{i}"] = path
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    refused(bounded("inspect", str(ckpt)), str(ckpt / ".metadata"), "planner path of more than 100 parts")


def test_transform_descriptors_that_are_a_tree_of_2_40(ckpt: Path) -> None:
    """A storage entry's transform descriptors (which the error message names) that are `tree(40)`."""
    metadata = metadata_of(ckpt)
    for index, info in metadata.storage_data.items():
        if index.fqn == "model.w":
            info.transform_descriptors = tree(40)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    refused(bounded("inspect", str(ckpt)), str(ckpt / ".metadata"), "malformed transform descriptors")


# -- a non-tensor item --------------------------------------------------------------------------------------


def _convert(ckpt: Path) -> subprocess.CompletedProcess[str]:
    return bounded("dcp-to-hf", str(ckpt), str(ckpt.parent / "out"))


def test_an_item_that_is_a_tree_of_2_40_leaves(ckpt: Path) -> None:
    point_at(ckpt, "step", container(tree(40)))  # torch.save's own pickle: 500 bytes
    refused(_convert(ckpt), "evil.distcp", "'step'", "CKPTCONV_READ_OBJECTS")
    assert not (ckpt.parent / "out").exists()


def test_an_item_nested_100000_deep(ckpt: Path) -> None:
    point_at(ckpt, "step", with_data_pkl(container([]), nested(100_000)))
    refused(_convert(ckpt), "evil.distcp", "CKPTCONV_READ_DEPTH")


def test_an_item_asking_for_a_2_gib_bytearray(ckpt: Path) -> None:
    """`bytearray(2**31)`, which torch's weights_only load allows: 40 bytes of pickle."""
    pkl = b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x80\x00\x85R."
    point_at(ckpt, "step", with_data_pkl(container([]), pkl))
    refused(_convert(ckpt), "evil.distcp", "CKPTCONV_READ_BYTES")


def test_an_item_whose_data_pkl_is_a_zip_bomb(ckpt: Path) -> None:
    point_at(ckpt, "step", with_data_pkl(container([]), deflated_zeros(BOMB_MIB), BOMB_MIB * 2**20))
    refused(_convert(ckpt), "evil.distcp", "CKPTCONV_READ_BYTES")


# -- a tensor's torch.save record ---------------------------------------------------------------------------


def test_a_tensor_record_whose_data_pkl_is_a_zip_bomb(ckpt: Path) -> None:
    real = container(torch.arange(16.0).reshape(4, 4))
    point_at(ckpt, "model.w", with_data_pkl(real, deflated_zeros(BOMB_MIB), BOMB_MIB * 2**20))
    refused(_convert(ckpt), "evil.distcp", "CKPTCONV_READ_BYTES")
    assert not (ckpt.parent / "out").exists()


def test_a_tensor_record_feeding_one_list_to_torch_size_again_and_again(ckpt: Path) -> None:
    """A data.pkl of 0.8 MB: a list of 100,000 ints, then `torch.Size(it)` 100,000 times (a copy each)."""
    items = b"(" + b"K\x01" * 100_000 + b"l\x94"  # MARK, BININT1 ..., LIST, MEMOIZE
    calls = (
        b"ctorch\nSize\n\x94" + b"h\x01h\x00\x85R0" * 100_000
    )  # BINGET Size, BINGET list, TUPLE1, REDUCE, POP
    pkl = b"\x80\x04" + items + calls + b"N."
    point_at(ckpt, "model.w", with_data_pkl(container(torch.arange(16.0).reshape(4, 4)), pkl))
    refused(_convert(ckpt), "evil.distcp", "one plain tensor")


# -- Megatron's common.pt -----------------------------------------------------------------------------------


def megatron_like(ckpt: Path, common: bytes) -> Path:
    """What an attacker would hand over as a Megatron-Core checkpoint: a DCP, the marker that makes
    ckptconv read `common.pt`, and the crafted `common.pt`."""
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (ckpt / "common.pt").write_bytes(common)
    return ckpt


@pytest.mark.parametrize(
    ("common", "needle"),
    [
        (lambda: container({"iteration": 1, "args": tree(40)}), "CKPTCONV_READ_OBJECTS"),
        (lambda: with_data_pkl(container({}), nested(100_000)), "CKPTCONV_READ_DEPTH"),
        (lambda: container({"iteration": 1, "save": doubling(40)}), "a path of more than 65536 characters"),
        (
            lambda: with_data_pkl(container({}), deflated_zeros(BOMB_MIB), BOMB_MIB * 2**20),
            "CKPTCONV_READ_BYTES",
        ),
    ],
    ids=["tree", "nested", "doubling-path", "zip-bomb"],
)
def test_a_hostile_common_pt(ckpt: Path, common: Any, needle: str) -> None:
    megatron_like(ckpt, common())
    refused(bounded("inspect", str(ckpt)), str(ckpt / "common.pt"), needle)


# -- JSON and TOML ------------------------------------------------------------------------------------------


def test_a_config_of_five_million_empty_lists(ckpt: Path) -> None:
    config = ckpt.parent / "config.json"
    config.write_text('{"a": [' + "[]," * 5_000_000 + "[]]}")  # 15 MB (under 16 MiB): 320 MB of lists
    proc = bounded("dcp-to-hf", str(ckpt), str(ckpt.parent / "out"), "--config", str(config))
    refused(proc, str(config), "CKPTCONV_READ_OBJECTS")


def test_a_stash_of_ten_million_empty_lists(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.ones(2, 2)}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    stash = hf / "ckptconv_state.json"
    stash.write_text('{"format": "ckptconv-stash", "version": 1, "items": [' + "[]," * 10_000_000 + "[]]}")
    refused(bounded("hf-to-dcp", str(hf), str(tmp_path / "out")), str(stash), "CKPTCONV_READ_OBJECTS")


def test_a_mapping_with_a_dotted_key_of_20000_parts(ckpt: Path) -> None:
    """tomllib's work is quadratic in the parts of a dotted key: 40 KB took minutes."""
    mapping = ckpt.parent / "m.toml"
    mapping.write_text("[mapping]\nname = 'x'\n" + "a." * 20_000 + "a = 1\n")
    refused(bounded("inspect", str(ckpt), "--mapping", str(mapping)), str(mapping), "CKPTCONV_READ_DEPTH")


def test_documents_within_the_limits_parse_as_json_and_tomllib_do() -> None:
    import importlib.resources
    import tomllib

    from ckptconv.mapping import presets

    for name in presets():
        text = importlib.resources.files("ckptconv.mapping").joinpath("presets", f"{name}.toml").read_text()
        assert load_toml(text, name) == tomllib.loads(text)
    text = "a.'b.c'.d = [1.5, '''x.y.[z''', {e = \"]\"}]  # [[[\n[t.\"u\"]\nv = 1979-05-27T07:32:00.5Z\n"
    assert load_toml(text, "t") == tomllib.loads(text)
    doc = {"k": [[{"x": '[[[{{{\\"', "y": [1, 2.5, None]}]] * 30, "s": "é\u2028"}
    for raw in (json.dumps(doc), json.dumps(doc).encode("utf-16"), json.dumps(doc, indent=1).encode()):
        assert load_json(raw, "j") == doc


def test_the_limits_are_raised_by_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    deep = "[" * 150 + "]" * 150
    with pytest.raises(LimitExceeded, match=r"j: more than 100 levels of nesting.*CKPTCONV_READ_DEPTH"):
        load_json(deep, "j")
    monkeypatch.setenv("CKPTCONV_READ_DEPTH", "200")
    assert load_json(deep, "j") is not None
    monkeypatch.setenv("CKPTCONV_READ_DEPTH", "lots")
    with pytest.raises(CkptconvError, match=r"CKPTCONV_READ_DEPTH='lots': must be a whole number"):
        load_json("[]", "j")


if __name__ == "__main__":  # a bounded command (see `bounded`): `python -m test_bounded_readers ARGS`
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + int(os.environ["BOUNDED_HEADROOM"]), hard))
    runpy.run_module("ckptconv", run_name="__main__", alter_sys=True)
