"""verl's FSDP checkpoints and accelerate's `use_dcp=False` FSDP2 files (per-rank torch.save of DTensor state
dicts) read by dcp-to-hf, verify and inspect without running their pickles.

The inputs are written under torchrun on 2 gloo ranks by support/workers/rank_shards_save.py: verl's
`FSDPCheckpointManager.save_checkpoint` reproduced line for line for FSDP2 and FSDP2 x TP (verl commit
01ee5e04e14f2b3723d2fe34f6f5099661733f51, verl/utils/checkpoint/fsdp_checkpoint_manager.py: verl itself
does not install without its GPU stack), and accelerate 1.15.0's own `save_fsdp_model` /
`save_fsdp_optimizer` with `use_dcp=False` (pinned in support/accelerate-requirements.txt). Each must convert
to the tiny bf16 Llama transformers' `save_pretrained` wrote before sharding, bit for bit.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pickle_edit as pe
import pytest
import torch
from conftest import ROOT, SUPPORT, WORKERS, torchrun, tree_sha256
from pinned import install_pinned
from safetensors.torch import load_file
from test_bad_input import assert_one_line, run

from ckptconv.cli.app import main
from ckptconv.cli.schema import load
from ckptconv.formats import dtensor_pickle as dp
from ckptconv.formats.dtensor_layout import LayoutError, local_blocks

ACCELERATE = SUPPORT / "accelerate-requirements.txt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = install_pinned(ROOT / ".cache" / "accelerate-1.15.0", ACCELERATE)
    out = tmp_path_factory.mktemp("rank_shards")
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, str(WORKERS / "rank_shards_save.py"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _assert_release(out: Path, expected: Path) -> None:
    want, got = load_file(expected / "model.safetensors"), load_file(out / "model.safetensors")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("kind", ["verl", "verl_tp", "accelerate"])
def test_converts_to_the_model_save_pretrained_wrote(saved: Path, tmp_path: Path, capsys, kind: str) -> None:
    code, err = run(capsys, "dcp-to-hf", str(saved / kind), str(tmp_path / "hf"), "--dtype", "keep")
    assert code == 0, err
    _assert_release(tmp_path / "hf", saved / "expected")
    if kind.startswith("verl"):  # huggingface/ taken as --copy-from, and said so
        assert f"copying the model's files from {saved / kind / 'huggingface'}" in err
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / "hf" / name).read_bytes() == (saved / kind / "huggingface" / name).read_bytes()
    code, err = run(capsys, "verify", str(saved / kind), str(saved / "expected"))
    assert code == 0, err  # 0: every tensor equal bit for bit


def test_inspect_json_names_the_writer(saved: Path, capsys) -> None:
    for kind, writer, files in (
        ("verl_tp", "verl-fsdp", {"model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"}),
        (
            "accelerate",
            "accelerate-fsdp2",
            {"pytorch_model_fsdp_0_rank0.bin", "pytorch_model_fsdp_0_rank1.bin"},
        ),
    ):
        main(["inspect", "--json", str(saved / kind)])
        report = json.loads(capsys.readouterr().out)
        jsonschema.Draft202012Validator(load()).validate(report)
        (note,) = (n for n in report["release"]["notes"] if n.startswith("left out, never read: "))
        assert ("optim_world_size_2_rank_1.pt" if kind == "verl_tp" else "optimizer_0_rank1.bin") in note
        assert report["format"] == "dcp" and report["writer"] == writer
        assert report["serialization"] == ["torch_entry"] and report["num_tensors"] == 21
        assert {c["file"] for t in report["tensors"] for c in t["chunks"]} == files  # never optim_*/extra_*
        embed = next(t for t in report["tensors"] if t["key"] == "model.embed_tokens.weight")
        # accelerate: FSDP2's uneven last shard; verl_tp: whole on each rank (a dp mesh of 1), read once
        want = [[50, 64], [49, 64]] if kind == "accelerate" else [[99, 64]]
        assert [c["sizes"] for c in embed["chunks"]] == want
        q = next(t for t in report["tensors"] if t["key"] == "model.layers.0.self_attn.q_proj.weight")
        assert [c["offsets"] for c in q["chunks"]] == [[0, 0], [32, 0]]  # TP's or FSDP2's halves


def _replace_pickle(file: Path, data: bytes) -> None:
    with zipfile.ZipFile(file) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as z:
        for name, raw in entries:
            z.writestr(name, data if name.endswith("/data.pkl") else raw)


def test_a_crafted_pickle_is_refused_without_running(saved: Path, tmp_path: Path, capsys) -> None:
    for kind, name in (
        ("verl", "model_world_size_2_rank_1.pt"),
        ("accelerate", "pytorch_model_fsdp_0_rank1.bin"),
    ):
        ckpt = shutil.copytree(saved / kind, tmp_path / kind)
        marker = tmp_path / f"{kind}.ran"
        _replace_pickle(ckpt / name, b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
        for argv in (("dcp-to-hf", str(ckpt), str(tmp_path / f"{kind}.hf")), ("inspect", str(ckpt))):
            code, err = run(capsys, *argv)
            assert_one_line(code, err, str(ckpt / name), "refusing to load", "os.system")
        assert not marker.exists() and not (tmp_path / f"{kind}.hf").exists()


def test_incomplete_or_inconsistent_rank_files_are_named(saved: Path, tmp_path: Path, capsys) -> None:
    def converted(ckpt: Path) -> tuple[int, str]:
        return run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "hf"))

    verl = shutil.copytree(saved / "verl", tmp_path / "missing")
    (verl / "model_world_size_2_rank_1.pt").unlink()
    assert_one_line(*converted(verl), f"{verl / 'model_world_size_2_rank_1.pt'}: missing")
    verl = shutil.copytree(saved / "verl", tmp_path / "world")
    (verl / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    assert_one_line(*converted(verl), f"{verl / 'fsdp_config.json'}: world_size 4")
    verl = shutil.copytree(saved / "verl", tmp_path / "renamed")
    (verl / "model_world_size_2_rank_1.pt").rename(verl / "model_world_size_2_rank_2.pt")
    assert_one_line(*converted(verl), "model_world_size_2_rank_2.pt: rank 2 of a world size of 2")
    verl = shutil.copytree(saved / "verl", tmp_path / "stale")  # rank 0's file copied over rank 1's
    shutil.copy(verl / "model_world_size_2_rank_0.pt", verl / "model_world_size_2_rank_1.pt")
    assert_one_line(*converted(verl), str(verl / "model_world_size_2_rank_1.pt"), "saved by rank 0")
    acc = shutil.copytree(saved / "accelerate", tmp_path / "last")  # the last rank's file: no gap in names
    (acc / "pytorch_model_fsdp_0_rank1.bin").unlink()
    assert_one_line(*converted(acc), "pytorch_model_fsdp_0_rank0.bin", "a device mesh of 2 ranks, but 1 rank")
    assert not (tmp_path / "hf").exists()


def _ours(placement: object) -> object:
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if isinstance(placement, _StridedShard):
        mine = dp.StridedShard()
        mine.dim, mine.split_factor = placement.dim, placement.split_factor
    elif isinstance(placement, Shard):
        mine = dp.Shard()
        mine.dim = placement.dim
    else:
        mine = dp.Replicate()
    return mine


def test_local_blocks_are_where_torch_puts_each_rank_s_shard() -> None:
    """Every rank's local tensor, as torch's own placements split a global tensor (uneven sizes, Shard on
    two mesh dims, _StridedShard as FSDP2 x TP leaves it), is found at the blocks `local_blocks` gives; each
    element once over all ranks."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    checked = 0
    for shape, mesh in (((7, 4), (2, 2)), ((13, 6), (2, 3)), ((5,), (3,)), ((3, 5), (2, 2))):
        dims = range(len(shape))
        options = [Replicate(), *(Shard(d) for d in dims), *(_StridedShard(d, split_factor=2) for d in dims)]
        for placements in itertools.product(options, repeat=len(mesh)):
            if isinstance(placements[-1], _StridedShard):
                continue
            full = torch.arange(int(torch.tensor(shape).prod())).view(shape)
            seen = torch.zeros(shape, dtype=torch.int)
            for coord in itertools.product(*map(range, mesh)):
                local = full
                for k, c, p in zip(mesh, coord, placements, strict=True):
                    if not isinstance(p, Replicate):
                        local = p._split_tensor(local, k, with_padding=False)[0][c]
                try:
                    blocks = local_blocks(shape, mesh, coord, [_ours(p) for p in placements], local.shape)
                except LayoutError as e:
                    assert "strided in dim" in str(e)
                    break
                for offsets, sizes, row in blocks:
                    where = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                    assert torch.equal(full[where], local[row : row + sizes[0]])
                    seen[where] += 1
                checked += 1
            else:
                assert bool((seen == 1).all()), (shape, mesh, placements)
    assert checked > 150


@pytest.mark.slow
def test_one_and_two_ranks_write_the_same_bytes(saved: Path, tmp_path: Path) -> None:
    for kind in ("verl_tp", "accelerate"):
        outs = []
        for nproc in (1, 2):
            out = tmp_path / f"{kind}{nproc}"
            torchrun(nproc, "-m", "ckptconv", "dcp-to-hf", str(saved / kind), str(out), "--dtype", "keep")
            outs.append(tree_sha256(out))
        assert outs[0] == outs[1]
        _assert_release(tmp_path / f"{kind}2", saved / "expected")


def test_plain_tensors_beside_the_dtensors_are_taken_from_one_rank(tmp_path: Path, capsys) -> None:
    """A state dict's plain tensors (buffers FSDP2 leaves whole; integers untouched) and nested dicts."""
    ckpt = tmp_path / "run"
    ckpt.mkdir()
    state = {"buf": torch.tensor([1, 2, 3]), "nested": {"x": torch.arange(6.0).view(2, 3)[1:]}}
    torch.save(state, ckpt / "pytorch_model_fsdp_0_rank0.bin")  # x: a view at a storage offset
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "hf"), "--dtype", "keep")
    assert code == 0, err
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == {"buf", "nested.x"} and torch.equal(got["buf"], state["buf"])
    assert torch.equal(got["nested.x"], state["nested"]["x"])


R0, R1 = "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"


def _spec(tree: pe.Call, name: str | None = None) -> dict[str, object]:
    """The DTensorSpec state of the first tensor (or of `name`) of a rank file's tree."""
    dtensor = next(v for k, v in tree.items if name in (None, k))
    return dtensor.args[3][1]["_spec"].state  # _rebuild_from_type_v2(func, type, args, (None, slots))


def _edit(ckpt: Path, change: object, files: tuple[str, ...] = (R0,)) -> None:
    for name in files:
        tree = pe.load(ckpt / name)
        change(tree)  # type: ignore[operator]
        pe.save(ckpt / name, tree)


def _set(field: str, value: object, *, mesh: bool = False, name: str | None = None) -> object:
    def change(tree: pe.Call) -> None:
        spec = _spec(tree, name)
        (spec["mesh"].state if mesh else spec)[field] = value  # type: ignore[attr-defined]

    return change


def _split_factor(tree: pe.Call) -> None:
    placements = _spec(tree, "model.layers.0.self_attn.q_proj.weight")["placements"]
    (strided,) = (p for p in placements if p.func.name == "_StridedShard")  # type: ignore[attr-defined]
    strided.state["split_factor"] = 2**40


def _mesh_shape(tree: pe.Call) -> None:  # a 3000-deep tuple, as opcodes (the pickler would recurse)
    (axis,) = _spec(tree)["mesh"].state["_layout"].state["axes"]  # type: ignore[attr-defined]
    axis.state["shape"] = pe.Raw(pickle.BININT1 + b"\x02" + pickle.TUPLE1 * 3000)


def _collide(tree: pe.Call) -> None:  # {"model": {"embed_tokens.weight": <the next tensor>}} beside it
    tree.items.append(("model", {"embed_tokens.weight": tree.items[1][1]}))


def _huge_storage(ckpt: Path) -> None:
    """data/0's central directory entry of rank 0's file claims 0xFFFFFFF0 bytes (the file has ~90 KB)."""
    raw = bytearray((ckpt / R0).read_bytes())
    at = raw.find(b"PK\x01\x02")
    while not bytes(raw[at + 46 : at + 46 + struct.unpack_from("<H", raw, at + 28)[0]]).endswith(b"/data/0"):
        at = raw.find(b"PK\x01\x02", at + 4)
    struct.pack_into("<II", raw, at + 20, 0xFFFFFFF0, 0xFFFFFFF0)  # compressed and uncompressed sizes
    (ckpt / R0).write_bytes(bytes(raw))


TENSOR_META = pe.Call(pe.Global("torch.distributed.tensor._dtensor_spec", "TensorMeta"), (5, 5, 5), True)
CRAFTED = {  # case: (checkpoint, edit, what the message says)
    "split_factor": ("verl_tp", lambda c: _edit(c, _split_factor), "a split factor of 1099511627776"),
    "coordinate_float": ("verl", lambda c: _edit(c, _set("_coordinate_on_dim", (0.5,), mesh=True)), "0.5"),
    "mesh_shape_deep": ("verl", lambda c: _edit(c, _mesh_shape), "device mesh ckptconv cannot read"),
    "shard_order_mixed": ("verl", lambda c: _edit(c, _set("shard_order", ((0, (1, "a")),))), "shard order"),
    "shard_order_int": ("verl", lambda c: _edit(c, _set("shard_order", 5)), "a shard order of int"),
    "tensor_meta_int": ("verl", lambda c: _edit(c, _set("tensor_meta", TENSOR_META)), "disagree on its"),
    "placements_int": ("verl", lambda c: _edit(c, _set("placements", 3)), "placements of type int"),
    "collide": ("verl", lambda c: _edit(c, _collide, (R0, R1)), "'model.embed_tokens.weight' twice"),
    "storage_past_the_end": ("verl", _huge_storage, "storage 0 claims 4294967280 bytes, past the end"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_rank_file_is_refused_in_one_line(saved: Path, tmp_path: Path, capsys, case: str) -> None:
    """A spec, state dict or zip directory no torch writes (an endless loop, a traceback, a tensor silently
    overwritten, a storage inspect reports as 4 GiB): exit 2 naming rank 0's file, nothing written."""
    kind, edit, says = CRAFTED[case]
    ckpt = shutil.copytree(saved / kind, tmp_path / case)
    edit(ckpt)  # type: ignore[operator]
    for argv in (("dcp-to-hf", str(ckpt), str(tmp_path / "hf")), ("inspect", "--json", str(ckpt))):
        code, err = run(capsys, *argv)
        assert_one_line(code, err, f"{ckpt / R0}: ", says)
    assert not (tmp_path / "hf").exists()
