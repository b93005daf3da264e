"""The megatron-core harness (megatron.py, workers/megatron_save.py): Megatron-Core `dist_checkpointing.save`
checkpoints in the torch_dist format, written by megatron-core 0.16.1's own code under torchrun (gloo, CPU),
for issue #16. docs/notes/megatron-torch-dist.md describes what they hold.

Each checkpoint has the files megatron writes; its `.metadata` is read by torch's own FileSystemReader in a
process where megatron-core cannot be imported, and the tensors torch's dcp.load reads are the ones the worker
computed (expected.pt, gathered without megatron's checkpoint code); megatron's own dist_checkpointing.load
reads the same tensors and common state back. The pickles' globals are listed with pickletools, never by
unpickling.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import pickletools
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron import MEGATRON_DIR, REQUIREMENTS, VERSION, megatron_dir, run_megatron, saved

# checkpoint name -> the worker's arguments after OUT
CASES: dict[str, tuple[str, ...]] = {
    "sharded": ("sharded",),
    # Megatron-LM's defaults: DistributedOptimizer, dp_reshardable, stacked layers
    "gpt": ("gpt",),
    # megatron's non-distributed mixed-precision optimizer: per-parameter optimizer.state.* keys
    "gpt_local": ("gpt", "--optimizer", "local"),
    "moe": ("gpt", "--moe", "--sharding", "fully_reshardable"),
    # NeMo 2's metadata flag: per-layer and per-expert keys, SwiGLU halves as _w/_v
    "moe_singleton": ("gpt", "--moe", "--singleton-local-shards", "--optimizer", "none"),
}
FILES = {
    ".metadata",
    "common.pt",
    "metadata.json",
    "__0_0.distcp",
    "__0_1.distcp",
    "__1_0.distcp",
    "__1_1.distcp",
}
METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
# every global `.metadata` references besides the tensors' dtypes (torch.bfloat16, ...): torch's DCP
# metadata classes, plus the SavePlan records of the `all_local_plans` attribute megatron-core adds to the
# Metadata object
DCP = "torch.distributed.checkpoint"
METADATA_GLOBALS = {
    "torch.Size",
    "torch.serialization._get_layout",
    f"{DCP}.filesystem._StorageInfo",
    *(
        f"{DCP}.metadata.{name}"
        for name in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *(f"{DCP}.planner.{name}" for name in ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")),
}
TENSOR_GLOBALS = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2"}
NUMPY_GLOBALS = {"_codecs.encode", "numpy._core.multiarray._reconstruct", "numpy.dtype", "numpy.ndarray"}


@cache
def _built(root: Path, name: str) -> Path:
    """The checkpoint of case `name` (`megatron.saved`: once per session, shared with the other megatron
    tests; `root` is where this module writes its own files)."""
    return saved(*CASES[name])


@pytest.fixture(scope="session")
def megatron_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="session")
def loaded(megatron_root: Path) -> dict[str, dict[str, Any]]:
    """megatron's own load of every checkpoint, in one 1-rank torchrun: {name: {"tensors", "common"}}."""
    args = []
    for name in CASES:
        ckpt = _built(megatron_root, name)
        args += [str(ckpt), str(megatron_root / f"{name}-loaded.pt")]
    run_megatron(1, "load", *args)
    return {n: torch.load(megatron_root / f"{n}-loaded.pt", weights_only=True) for n in CASES}


def _expected(ckpt: Path) -> dict[str, Any]:
    return torch.load(ckpt.parent / "expected.pt", weights_only=True)


def _assert_tensors(actual: dict[str, torch.Tensor], expected: dict[str, Any]) -> None:
    """Same keys, dtypes, shapes and bytes; in a dp_reshardable flat optimizer tensor only the parameters'
    ranges (the padding between them is written from uninitialised memory)."""
    assert sorted(actual) == sorted(expected["tensors"])
    ranges = expected.get("dp_reshardable_index", {})
    for key, want in expected["tensors"].items():
        got = actual[key]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), key
        if key in ranges:
            assert ranges[key], key
            for _, _, _, start, end in ranges[key]:
                assert torch.equal(got[start:end], want[start:end]), (key, start, end)
        else:
            assert torch.equal(got, want), key


def _globals(data: bytes) -> set[str]:
    """module.qualname of every GLOBAL / STACK_GLOBAL in a pickle, by pickletools (nothing is loaded). A
    stack of the string operands seen (None for anything else) and the memo give STACK_GLOBAL its two."""
    found: set[str] = set()
    strings: list[str | None] = []
    memo: dict[int, str | None] = {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = strings[-1] if strings else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            strings.append(memo.get(arg))
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
            strings.append(None)
        elif op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
            strings.append(None)
        else:
            strings.append(None)
    return found


def _torch_save_globals(data: bytes) -> set[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return set().union(*(_globals(z.read(n)) for n in z.namelist() if n.endswith("data.pkl")))


def test_pinned_install() -> None:
    """megatron-core is installed from the pins (--no-deps --target), the pins are exact, and the install is
    the version the harness names."""
    pins = [line for line in REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    assert all("==" in line and ";" not in line for line in pins), pins
    assert f"megatron-core=={VERSION}" in pins
    root = megatron_dir()
    assert (
        root == MEGATRON_DIR and (root / "megatron-requirements.txt").read_text() == REQUIREMENTS.read_text()
    )
    assert (root / "megatron" / "core" / "dist_checkpointing" / "serialization.py").is_file()
    assert (root / f"megatron_core-{VERSION}.dist-info").is_dir()


def test_worker_failure_raises(tmp_path: Path) -> None:
    """A failing worker is an error carrying its output, never a skip or a hang."""
    with pytest.raises(RuntimeError, match="unrecognized arguments: --bogus"):
        run_megatron(2, "gpt", str(tmp_path / "ckpt"), "--bogus")


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_files(megatron_root: Path, name: str) -> None:
    """2 ranks x 2 writer threads: four .distcp files, the pickled DCP .metadata, megatron's common.pt (the
    non-sharded values, rank 0) and metadata.json (the backends)."""
    ckpt = _built(megatron_root, name)
    assert {p.name for p in ckpt.iterdir()} == FILES
    assert json.loads((ckpt / "metadata.json").read_text()) == METADATA_JSON


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_torch_reads_without_megatron(megatron_root: Path, name: str, tmp_path: Path) -> None:
    """torch's FileSystemReader reads `.metadata`, and dcp.load every tensor, in a process where megatron-core
    cannot be imported: the keys, shapes and dtypes are the worker's, and so are the values."""
    ckpt = _built(megatron_root, name)
    out = tmp_path / "read.pt"
    code = (
        "import importlib.util, sys, torch\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint.metadata import TensorStorageMetadata\n"
        "assert importlib.util.find_spec('megatron') is None\n"
        "md = dcp.FileSystemReader(sys.argv[1]).read_metadata()\n"
        "t = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}\n"
        "sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in t.items()}\n"
        "dcp.load(sd, checkpoint_id=sys.argv[1], no_dist=True)\n"
        "others = sorted(set(md.state_dict_metadata) - set(t))\n"
        "torch.save({'tensors': sd, 'others': others, 'attrs': sorted(vars(md))}, sys.argv[2])\n"
        "assert not any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ckpt), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # not tests/support/, whose megatron.py would shadow the package name
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    read = torch.load(out, weights_only=True)
    expected = _expected(ckpt)
    _assert_tensors(read["tensors"], expected)
    assert read["attrs"] == [
        "all_local_plans",
        "planner_data",
        "state_dict_metadata",
        "storage_data",
        "storage_meta",
        "version",
    ]
    # the non-tensor items are megatron's ShardedObjects, one pickled object per shard
    assert read["others"] and all("/shard_" in k for k in read["others"])


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_pickle_globals(megatron_root: Path, name: str) -> None:
    """What the pickles reference (read with pickletools): `.metadata` only torch classes, among them DCP's
    SavePlan records; common.pt argparse.Namespace (the args); the ShardedObjects in the .distcp files torch's
    tensor rebuilding and, for Megatron-LM's rng_state, numpy's array classes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ckpt = _built(megatron_root, name)
    raw = (ckpt / ".metadata").read_bytes()
    assert raw[:2] == b"\x80\x04"  # a plain pickle (protocol 4), not a torch.save zip
    dtypes = {str(t.dtype) for t in _expected(ckpt)["tensors"].values()}
    # Python's own pickler names enum members through builtins.getattr in some 3.11 patch releases (CI's
    # 3.11.2) and not in others: it is not something the checkpoint chose
    assert _globals(raw) - {"builtins.getattr"} == METADATA_GLOBALS | dtypes
    common = _torch_save_globals((ckpt / "common.pt").read_bytes())
    assert "argparse.Namespace" in common and common <= {
        "argparse.Namespace",
        "torch.FloatStorage",
        *TENSOR_GLOBALS,
    }
    md = FileSystemReader(str(ckpt)).read_metadata()
    objects: dict[str, set[str]] = {}
    for index, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata):
            with open(ckpt / info.relative_path, "rb") as f:
                f.seek(info.offset)
                objects[index.fqn] = _torch_save_globals(f.read(info.length))
    for key, refs in objects.items():
        if key.startswith("rng_state/") and name != "sharded":
            assert refs == {*NUMPY_GLOBALS, *TENSOR_GLOBALS, "torch.ByteStorage"}, key
        elif key.startswith("rng_state/"):
            assert refs == {*TENSOR_GLOBALS, "torch.LongStorage"}, key
        elif ".per_bucket_numel" in key:
            assert refs == {"torch.bfloat16"}, key  # {(param dtype, grad dtype): [numel per bucket]}
        else:
            assert refs == set(), key  # _extra_state (None), the optimizer's param_groups
    # common.pt needs argparse.Namespace allowed, as megatron-core registers it with add_safe_globals
    with pytest.raises(pickle.UnpicklingError, match=r"argparse\.Namespace"):
        torch.load(ckpt / "common.pt", weights_only=True)
    with torch.serialization.safe_globals([argparse.Namespace]):
        saved = torch.load(ckpt / "common.pt", weights_only=True)
    expected = _expected(ckpt)["common"]
    assert vars(saved["args"]) == expected["args"]
    assert {k: v for k, v in saved.items() if k in expected and k != "args"} == {
        k: v for k, v in expected.items() if k != "args"
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_megatron_load(loaded: dict[str, dict[str, Any]], megatron_root: Path, name: str) -> None:
    """megatron-core's dist_checkpointing.load (on 1 rank, the checkpoint written by 2) reads every tensor
    back as the worker computed it, and the common values on top."""
    ckpt = _built(megatron_root, name)
    expected = _expected(ckpt)
    _assert_tensors(loaded[name]["tensors"], expected)
    common = loaded[name]["common"]
    assert {k: common[k] for k in expected["common"]} == expected["common"]
    for key, value in expected.get("objects", {}).items():
        assert common[key].keys() == value.keys(), key
        assert all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(common[key].values(), value.values(), strict=True)
        ), key
    extra = [k for k in common if k.endswith("._extra_state") or "._extra_state/" in k]
    assert all(common[k] is None for k in extra)
    assert bool(extra) == (name != "sharded")


# gpt: (global shape, dtype, chunks as (offsets, sizes)) of a few keys; TP=2 over 2 ranks
GPT_LAYOUT: dict[str, tuple[list[int], torch.dtype, set[tuple[tuple[int, ...], tuple[int, ...]]]]] = {
    # vocab 50 padded to 64, rows split over TP
    "embedding.word_embeddings.weight": ([64, 32], torch.bfloat16, {((0, 0), (32, 32)), ((32, 0), (32, 32))}),
    # [layer, (heads + 2 * query groups) * kv_channels, hidden]: one query group [q q k v] per TP rank
    "decoder.layers.self_attention.linear_qkv.weight": (
        [2, 64, 32],
        torch.bfloat16,
        {((layer, row, 0), (1, 32, 32)) for layer in (0, 1) for row in (0, 32)},
    ),
    # SwiGLU fc1 is [gate (40 rows); up (40 rows)]: TP rank r writes rows r*20 of each half
    "decoder.layers.mlp.linear_fc1.weight": (
        [2, 80, 32],
        torch.bfloat16,
        {((layer, row, 0), (1, 20, 32)) for layer in (0, 1) for row in (0, 20, 40, 60)},
    ),
    # row-parallel: input columns split
    "decoder.layers.mlp.linear_fc2.weight": (
        [2, 32, 40],
        torch.bfloat16,
        {((layer, 0, col), (1, 32, 20)) for layer in (0, 1) for col in (0, 20)},
    ),
    # the local spec's input_layernorm, under TransformerEngine's name; replicated over TP: one chunk a layer
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (
        [2, 32],
        torch.bfloat16,
        {((0, 0), (1, 32)), ((1, 0), (1, 32))},
    ),
}


@pytest.mark.slow
def test_gpt_layout(megatron_root: Path) -> None:
    """The layout issue #16 has to undo, pinned on the dense checkpoint: layers stacked on axis 0, TP shards
    as chunks, SwiGLU halves, QKV rows and padded vocabulary; the DistributedOptimizer's dp_reshardable
    state as flat fp32 buckets, one per TP rank, whose chunks are the parameters' ranges (and padding)."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = _built(megatron_root, "gpt")
    md = FileSystemReader(str(ckpt)).read_metadata()
    for key, (shape, dtype, chunks) in GPT_LAYOUT.items():
        tm = md.state_dict_metadata[key]
        assert (list(tm.size), tm.properties.dtype) == (shape, dtype), key
        assert {(tuple(c.offsets), tuple(c.sizes)) for c in tm.chunks} == chunks, key
    expected = _expected(ckpt)
    config = json.loads((ckpt.parent / "config.json").read_text())
    assert config["padded_vocab_size"] == 64 and config["vocab_size"] == 50
    flat = expected["dp_reshardable_index"]
    bf16 = "(torch.bfloat16, torch.bfloat16)"  # the grad buffer's (param dtype, grad dtype)
    stem = "optimizer.distributed.dp_group_idx_{}.gbuf_idx_0.dtype_" + bf16 + ".bucket_idx_0."
    assert sorted(flat) == sorted(
        stem.format(g) + s for g in (0, 1) for s in ("param", "exp_avg", "exp_avg_sq")
    )
    for key, rows in flat.items():
        tm = md.state_dict_metadata[key]
        assert tm.properties.dtype == torch.float32 and len(tm.size) == 1
        starts = {c.offsets[0] for c in tm.chunks}
        assert {r[3] for r in rows} <= starts  # every parameter starts a chunk
        assert sum(c.sizes[0] for c in tm.chunks) == tm.size[0]  # the padding is written too
        # every parameter once, the last one first (megatron fills buckets in reverse order)
        assert sorted(r[0] for r in rows) == sorted(expected["model"]) and rows[0][0] == "output_layer.weight"
