"""A base model is an input whoever made it controls (issue #36: `--reference` / `--copy-from BASE`, a hub
repo id, save_hf's `reference=`): its index's file names, written into OUT by `--file-split reference`, and
its headers, read from the hub, are refused in one line (exit 2, nothing written) when crafted: a name that
is not a plain `*.safetensors` file could land outside OUT or overwrite config.json, the index or the stash;
a header the hub serves is parsed by ckptconv's own bounded reader, not huggingface_hub's."""

from __future__ import annotations

import json
from pathlib import Path

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
