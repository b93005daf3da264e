"""A base model is an input whoever made it controls (issue #36: `--reference` / `--copy-from BASE`, a hub
repo id, save_hf's `reference=`): its index's file names, written into OUT by `--file-split reference`, and
its headers, read from the hub, are refused in one line (exit 2, nothing written) when crafted: a name that
is not a plain `*.safetensors` file could land outside OUT or overwrite config.json, the index or the stash;
a header the hub serves is parsed by ckptconv's own bounded reader, not huggingface_hub's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from test_bad_input import assert_one_line, run

from ckptconv.errors import CkptconvError


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint of two tensors and a trainer-state scalar (a stash to write), by torch's dcp.save."""
    path = tmp_path_factory.mktemp("refsrc") / "dcp"
    state = {"model": {"a": torch.arange(12.0).view(3, 4), "b": torch.ones(5)}, "step": 7}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def crafted_base(path: Path, files: dict[str, list[str]]) -> Path:
    """An HF directory whose index puts each key in the file named (written by safetensors' own writer)."""
    path.mkdir()
    tensors = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    for name, keys in files.items():
        save_file({k: tensors[k] for k in keys}, str(path / name))
    weight_map = {k: name for name, keys in files.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


# -- --file-split reference: BASE's file names become OUT's ----------------------------------------------


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        # before: exit 0, OUT/config.json the tensor file or the given config (one overwrote the other)
        ("config.json", ["--config", "CONFIG"]),
        # before: exit 0, the stash overwrote the file the index names for 'a'
        ("ckptconv_state.json", ["--keep-trainer-state"]),
        # before: exit 0, --copy-from's tokenizer.json and the tensor file were one
        ("tokenizer.json", []),
        # before: exit 0, a hidden file in OUT
        (".a.safetensors", []),
    ],
)
@pytest.mark.parametrize("flag", ["--reference", "--copy-from"])
def test_file_split_reference_names_must_be_plain_safetensors(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, extra: list[str], flag: str
) -> None:
    base = crafted_base(tmp_path / "base", {name: ["a"], "model.safetensors": ["b"]})
    config = tmp_path / "my-config.json"
    config.write_text('{"model_type": "llama"}')
    extra = [str(config) if a == "CONFIG" else a for a in extra]
    out = tmp_path / "out"
    args = ["dcp-to-hf", str(src), str(out), flag, str(base), "--file-split", "reference", "--dtype", "keep"]
    code, err = run(capsys, *args, *extra)
    assert_one_line(code, err, f"{flag} {base} puts 'a' in the file {name!r}", "--file-split size")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize(
    "name",
    [
        "..",  # from_headers takes it (`Path(d) / ".."` is named ".."): OUT's parent
        "../x.safetensors",
        "/abs/x.safetensors",
        "sub/x.safetensors",
        "a\\b.safetensors",
        "model.safetensors.index.json",
        "generation_config.json",
        "x.safetensors\n",
        "new\nline.safetensors",
        "\x1b[2Jx.safetensors",
        "x" * 250 + ".safetensors",  # longer than a file name may be
        ".safetensors",
    ],
)
def test_split_as_reference_refuses_names_that_are_not_plain(name: str) -> None:
    """What planning writes is refused whatever read the name (a hub repo's index arrives unchecked by
    `open_hf`'s local rules), with the name quoted so a newline or escape cannot split or paint the line."""
    from ckptconv.plan.base import KEYWORD_WORDS, Base
    from ckptconv.plan.follow import split_as_reference
    from ckptconv.plan.types import OutTensor

    shapes = {"a": ((3, 4), "float32"), "b": ((5,), "float32")}
    base = Base("reference", "org/name", shapes, {"a": name, "b": "model.safetensors"}, words=KEYWORD_WORDS)
    outs = {key: OutTensor.__new__(OutTensor) for key in shapes}  # only the keys are looked at
    with pytest.raises(CkptconvError) as raised:
        split_as_reference(outs, base)
    message = str(raised.value)
    assert message.startswith("save_hf: file_split='reference': reference=org/name puts 'a' in the file ")
    assert repr(name) in message and "\n" not in message and "\x1b" not in message
    # a plain name is taken as it is
    plain = Base("reference", "org/name", shapes, {"a": "x-1.safetensors", "b": "model.safetensors"})
    assert split_as_reference(outs, plain) == {"x-1.safetensors": ["a"], "model.safetensors": ["b"]}


def test_split_as_reference_refuses_names_one_where_case_is_ignored() -> None:
    """Before: `Model.safetensors` and `model.safetensors` were two files of the plan, one file on macOS or
    Windows (the last written kept, the index naming both); the extra keys' file likewise."""
    from ckptconv.plan.base import Base
    from ckptconv.plan.follow import split_as_reference
    from ckptconv.plan.types import OutTensor

    shapes = {"a": ((3, 4), "float32"), "b": ((5,), "float32")}
    outs = {key: OutTensor.__new__(OutTensor) for key in shapes}
    base = Base("--reference", "b/", shapes, {"a": "Model.safetensors", "b": "model.safetensors"})
    with pytest.raises(
        CkptconvError, match=r"files 'Model\.safetensors' and 'model\.safetensors', one file where"
    ):
        split_as_reference(outs, base)
    lacking = Base("--reference", "b/", {"a": shapes["a"]}, {"a": "Model-Not-In-Reference.safetensors"})
    with pytest.raises(CkptconvError, match=r"has a file named model-not-in-reference\.safetensors"):
        split_as_reference(outs, lacking)


def test_a_hub_index_naming_the_parent_is_refused_before_a_byte(tmp_path: Path) -> None:
    """A hub repo's headers and index (as huggingface_hub hands them over) naming `..`: from_headers takes
    the name; --file-split reference refuses it (before: planned as OUT's file `..`, which names OUT's
    parent)."""
    from ckptconv.formats.hf import from_headers
    from ckptconv.plan.base import Following
    from ckptconv.source.hub_reference import HubBase
    from ckptconv.source.reference import _read

    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    snap = tmp_path / "models--org--name" / "snapshots" / "c0ffee"
    snap.mkdir(parents=True)
    hub = HubBase("org/name", snap, from_headers(snap, {"..": header}, {"a": ".."}))
    base = _read("--reference", Path("org/name"), Following().words, hub)
    assert base.files == {"a": ".."}
    from ckptconv.plan.follow import split_as_reference
    from ckptconv.plan.types import OutTensor

    with pytest.raises(CkptconvError, match=r"puts 'a' in the file '\.\.', which is not a plain"):
        split_as_reference({"a": OutTensor.__new__(OutTensor)}, base)


# -- a hub repo's headers and index, read online ----------------------------------------------------------


def st_bytes(header: bytes, data: bytes = b"") -> bytes:
    """A safetensors file of these header bytes (as given: crafted) and data."""
    return len(header).to_bytes(8, "little") + header + data


GOOD = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """serve(files, index=None) -> the snapshot folder of org/name whose cached index is `index` (a JSON
    object, or bytes as given) and whose files the Hub serves (`hubcache.hub_client`) are `files`."""
    from hubcache import COMMIT, hub_cache, hub_client
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    seen: list[tuple[str, str]] = []
    homes = iter(range(1000))

    def serve(files: dict[str, bytes], index: Any = None) -> Path:
        cached = {} if index is None else {"model.safetensors.index.json": _json(index)}
        snap = hub_cache(tmp_path / f"home{next(homes)}", "org/name", cached)
        monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", hub_client(files, seen))
        monkeypatch.setattr(_http, "_GLOBAL_CLIENT", None)
        assert snap.name == COMMIT
        return snap

    return serve


def _json(value: Any) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value).encode()


def test_hub_headers_are_read_by_the_bounded_reader(hub: Any) -> None:
    """Before: huggingface_hub's `get_safetensors_metadata` parsed them: a JSON list was an AttributeError,
    a deep nesting a RecursionError (tracebacks), 40,000 dims of 2**62 about 10 s of big-int products
    (25 MB of them: hours), a duplicate key kept silently. Now each is one line, at once."""
    from ckptconv.source.hub_reference import _headers

    snap = hub({"model.safetensors": st_bytes(GOOD, bytes(8))})
    assert _headers("org/name", snap).tensors["a"].shape == (2,)  # type: ignore[union-attr]
    dims = json.dumps({"a": {"dtype": "F32", "shape": [2**62] * 40_000, "data_offsets": [0, 8]}})
    crafted = {
        b"[1]": "not a JSON object",
        b"[" * 100_000 + b"]" * 100_000: "not valid JSON",
        dims.encode(): "overflows a 64-bit size",
        b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {}}': "not valid JSON",
        b'{"a": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 8]}}': "malformed header entry",
        b'{"a": "F32"}': "malformed header entry",
    }
    for header, needle in crafted.items():
        snap = hub({"model.safetensors": st_bytes(header, bytes(8))})
        with pytest.raises(CkptconvError, match=needle) as raised:
            _headers("org/name", snap)
        assert "\n" not in str(raised.value)
    # a header length past the limit: refused before it is read
    snap = hub({"model.safetensors": (2**40).to_bytes(8, "little")})
    with pytest.raises(CkptconvError, match="header length 1099511627776 is impossible"):
        _headers("org/name", snap)
    assert _headers("org/name", hub({})) is None  # no model.safetensors, no index: not a safetensors repo
    # a header longer than the first read is read whole by a second; one the file cuts short is refused
    long = json.dumps({"__metadata__": {"pad": "x" * 200_000}, **json.loads(GOOD)}).encode()
    assert _headers("org/name", hub({"model.safetensors": st_bytes(long, bytes(8))})) is not None
    cut = st_bytes(long, bytes(8))[:150_000]
    with pytest.raises(CkptconvError, match="the hub sent 149992 of its header's 200"):
        _headers("org/name", hub({"model.safetensors": cut}))


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        # before: huggingface_hub's json.load took each as it came (no size or depth limit), and a list
        # in the weight_map was `set()`'s TypeError (a traceback)
        ({"weight_map": {"a": ["model.safetensors"]}}, "not a valid safetensors index"),
        ({"weight_map": {"a": "model.safetensors"}, "metadata": {"total_size": 8}}, None),
        (b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "more than 100 levels of nesting"),
        (b'{"weight_map": {"a": "model.safetensors", "a": "x.safetensors"}}', "the key 'a' appears twice"),
        # before: the name was put in the URL, `..` resolving to another path of the Hub
        ({"weight_map": {"a": "../../other/model.safetensors"}}, "not a file of the repo's top folder"),
        ({"weight_map": {"a": ".."}}, "not a file of the repo's top folder"),
    ],
)
def test_a_hub_index_is_read_by_the_bounded_reader(hub: Any, index: Any, needle: str | None) -> None:
    from ckptconv.source.hub_reference import _headers

    snap = hub({"model.safetensors": st_bytes(GOOD, bytes(8))}, index)
    if needle is None:
        assert _headers("org/name", snap).tensors["a"].shape == (2,)  # type: ignore[union-attr]
        return
    with pytest.raises(CkptconvError, match=needle) as raised:
        _headers("org/name", snap)
    assert "\n" not in str(raised.value) and "model.safetensors.index.json" in str(raised.value)


def test_a_crafted_hub_header_is_one_line_and_nothing_written(
    src: Path, hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import huggingface_hub

    snap = hub({"model.safetensors": st_bytes(b"[1]", bytes(8))})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: str(snap))
    out = tmp_path / "out"
    code, err = run(capsys, "dcp-to-hf", str(src), str(out), "--reference", "org/name")
    assert_one_line(code, err, "--reference org/name: ", "model.safetensors", "not a JSON object")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


# -- crafted local bases: already refused, kept so -----------------------------------------------------------


def test_crafted_local_bases_are_one_line(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An index naming a file outside BASE (`..`, an absolute path), a weight or the index linked out of
    BASE, an impossible header length: each command that reads BASE refuses it in one line, nothing
    written."""
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"a": torch.zeros(3, 4)}, str(outside / "x.safetensors"))
    (outside / "index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors"}}))
    bases = {}
    for name in ("dotdot", "absolute", "linked", "index-linked", "length"):
        bases[name] = tmp_path / name
        bases[name].mkdir()
    index = "model.safetensors.index.json"
    (bases["dotdot"] / index).write_text(json.dumps({"weight_map": {"a": "../outside/x.safetensors"}}))
    (bases["absolute"] / index).write_text(json.dumps({"weight_map": {"a": str(outside / "x.safetensors")}}))
    (bases["linked"] / "model.safetensors").symlink_to(outside / "x.safetensors")
    save_file({"a": torch.zeros(3, 4)}, str(bases["index-linked"] / "x.safetensors"))
    (bases["index-linked"] / index).symlink_to(outside / "index.json")
    (bases["length"] / "model.safetensors").write_bytes((2**60).to_bytes(8, "little") + b"{}")
    needles = {
        "dotdot": "outside the checkpoint directory",
        "absolute": "outside the checkpoint directory",
        "linked": "outside the checkpoint directory",
        "index-linked": "outside the checkpoint directory",
        "length": "header length 1152921504606846976 is impossible",
    }
    for name, base in bases.items():
        out = tmp_path / f"out-{name}"
        for args in (
            ["dcp-to-hf", str(src), str(out), "--reference", str(base), "--file-split", "reference"],
            ["dcp-to-hf", str(src), str(out), "--copy-from", str(base)],
            ["inspect", str(src), "--reference", str(base)],
            ["verify", str(base), str(src), "--layout"],
        ):
            code, err = run(capsys, *args)
            assert_one_line(code, err, str(base), needles[name])
        assert not out.exists()


def test_hf_to_dcp_reference_metadata_is_never_unpickled(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hf-to-dcp --reference CKPT_DIR`: a `.metadata` carrying a payload is refused by the allowlist
    unpickler (nothing runs), a FIFO is never opened; OUT the reference through a symlink is refused."""
    import os
    import pickle

    from test_bad_input import Payload

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(hf / "model.safetensors"))
    marker = tmp_path / "ran"
    evil, fifo = tmp_path / "evil", tmp_path / "fifo"
    evil.mkdir()
    fifo.mkdir()
    (evil / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    os.mkfifo(fifo / ".metadata")
    out = tmp_path / "out"
    code, err = run(capsys, "hf-to-dcp", str(hf), str(out), "--reference", str(evil))
    assert_one_line(code, err, f"--reference {evil}", "system", "never runs code")
    code, err = run(capsys, "hf-to-dcp", str(hf), str(out), "--reference", str(fifo))
    assert_one_line(code, err, f"--reference {fifo}", "is a FIFO")
    assert not marker.exists() and not out.exists()
    (tmp_path / "alias").symlink_to(src)
    code, err = run(
        capsys, "hf-to-dcp", str(hf), str(tmp_path / "alias"), "--reference", str(src), "--overwrite"
    )
    assert_one_line(code, err, f"is --reference {src} itself")
    code, err = run(capsys, "hf-to-dcp", str(hf), str(tmp_path / "alias" / "x"), "--reference", str(src))
    assert_one_line(code, err, f"is inside --reference {src}")
    assert not (src / "x").exists()


def test_a_hub_reference_fetches_the_top_index_alone() -> None:
    """Before: `*.safetensors.index.json` (fnmatch's `*` spans folders) fetched every index file of the repo,
    a crafted repo's of any size and number, though only the top one is read."""
    from huggingface_hub.utils import filter_repo_objects

    from ckptconv.source.hub_reference import REFERENCE_PATTERNS

    names = ["model.safetensors.index.json", "x/big.safetensors.index.json", "b.safetensors.index.json"]
    names += ["config.json", "x/config.json", "model.safetensors"]
    chosen = list(filter_repo_objects(names, allow_patterns=REFERENCE_PATTERNS))
    assert chosen == ["model.safetensors.index.json", "config.json"]
