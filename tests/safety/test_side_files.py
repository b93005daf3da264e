"""Files read beside a checkpoint (issue #34, item 2): `.hf_metadata/`, config.json, adapter_config.json, the
stash and what --copy-from copies are read only as the checkpoint's own regular files (symlinks followed
within it, a hub snapshot's into its blobs), each under a size limit checked before it is read, and a FIFO
named by any file flag is refused without blocking."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import _env, ckptconv
from test_hostile_inputs import HANG, _hub_cache, _hub_env, assert_refused, hf_dir

from ckptconv.formats.files import CONFIG_BYTES, COPIED_FILE_BYTES, COPIED_TOTAL_BYTES, STASH_BYTES

GiB = 2**30


def sparse(path: Path, size: int) -> None:
    """A file of `size` bytes that takes no disk space (`truncate -s`)."""
    with open(path, "wb") as f:
        f.truncate(size)


def cli(
    *args: str, rlimits: dict[int, int] | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The CLI in a new interpreter, under `rlimits` (RLIMIT_AS: a read of a whole huge file fails at once;
    RLIMIT_FSIZE: a huge copy is killed instead of filling the disk)."""

    def limit() -> None:
        for which, value in (rlimits or {}).items():
            resource.setrlimit(which, (value, value))

    return subprocess.run(
        [sys.executable, "-m", "ckptconv", *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=HANG,
        stdin=subprocess.DEVNULL,
        preexec_fn=limit,
    )


# -- torch's distributed HF writer output and NeMo Automodel's .hf_metadata beside it ----------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank's `HuggingFaceStorageWriter(save_distributed=True)` output, saved by torch itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    out = tmp_path_factory.mktemp("side") / "shards"
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(8, 4, generator=g), "model.norm.weight": torch.ones(4)}
    writer = HuggingFaceStorageWriter(
        str(out), save_distributed=True, fqn_to_index_mapping=dict.fromkeys(state, 1)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return out


def with_metadata(shards: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of `shards` with a `.hf_metadata/` holding config.json (as NeMo Automodel leaves it), a
    directory `outside` beside it with a config.json and a file that is nobody's model; and OUT."""
    src = tmp_path / "src"
    shutil.copytree(shards, src)
    (src / ".hf_metadata").mkdir()
    (src / ".hf_metadata" / "config.json").write_text('{"model_type": "llama"}')
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text('{"model_type": "not this one"}')
    (outside / "id_rsa").write_text("a private key")
    return src, outside, tmp_path / "out"


def test_hf_metadata_linked_to_another_directory_is_refused(shards: Path, tmp_path: Path) -> None:
    src, outside, out = with_metadata(shards, tmp_path)
    proc = ckptconv("dcp-to-hf", str(src), str(out), "-q")  # the real directory: its config.json is copied
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}
    shutil.rmtree(src / ".hf_metadata")
    (src / ".hf_metadata").symlink_to(outside)  # was copied whole into OUT (id_rsa and all)
    for flags in (["--overwrite"], ["--dry-run"], ["--overwrite", "--keep-file-split"]):
        proc = ckptconv("dcp-to-hf", str(src), str(out), *flags)
        assert_refused(proc, ".hf_metadata", "outside the checkpoint directory")
    assert not (out / "id_rsa").exists()
    assert json.loads((out / "config.json").read_text()) == {"model_type": "llama"}


def _link_out(src: Path, outside: Path) -> str:
    (src / ".hf_metadata" / "config.json").unlink()
    (src / ".hf_metadata" / "config.json").symlink_to(outside / "config.json")
    return "outside the checkpoint directory"


def _fifo(src: Path, outside: Path) -> str:
    os.mkfifo(src / ".hf_metadata" / "generation_config.json")
    return "is a FIFO"


def _directory_out(src: Path, outside: Path) -> str:
    (src / ".hf_metadata" / "tokenizer").symlink_to(outside)
    return "outside the checkpoint directory"


def _loop(src: Path, outside: Path) -> str:
    (src / ".hf_metadata" / "tokenizer").mkdir()
    (src / ".hf_metadata" / "tokenizer" / "again").symlink_to("..")
    return "a symlink loop"


def _sparse(src: Path, outside: Path) -> str:
    sparse(src / ".hf_metadata" / "tokenizer.json", 2 * COPIED_FILE_BYTES)
    return f"more than the {COPIED_FILE_BYTES}"


CRAFTED: dict[str, Callable[[Path, Path], str]] = {
    "config.json linked out": _link_out,
    "a FIFO": _fifo,
    "a directory linked out": _directory_out,
    "a link loop": _loop,
    "a sparse tokenizer.json": _sparse,
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_hf_metadata_files_are_refused_before_anything_is_written(
    shards: Path, tmp_path: Path, case: str
) -> None:
    """Refused while planning (by --dry-run too), not after the weights are written, and never read."""
    src, outside, out = with_metadata(shards, tmp_path)
    needle = CRAFTED[case](src, outside)
    for flags in ([], ["--dry-run"]):
        assert_refused(
            ckptconv("dcp-to-hf", str(src), str(out), *flags, timeout=HANG), ".hf_metadata/", needle
        )
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["outside", "src"]


# -- config.json and the stash beside an HF source ---------------------------------------------------------

MAPPING = """
[mapping]
name = "side-files"

[[rule]]
runtime = "tok_embeddings.weight"
hf = "model.embed.weight"
"""


def test_config_json_linked_out_of_an_hf_source_is_neither_read_nor_kept(tmp_path: Path) -> None:
    hf = hf_dir(tmp_path / "hf")
    mapping = tmp_path / "m.toml"
    mapping.write_text(MAPPING)
    (tmp_path / "secret.json").write_text('{"token": "not the model config"}')
    (hf / "config.json").symlink_to(tmp_path / "secret.json")
    out = tmp_path / "out"
    flags = ("--mapping", str(mapping), "--allow-unmapped")
    for args in (["hf-to-dcp", str(hf), str(out), *flags], ["inspect", str(hf), *flags]):
        assert_refused(ckptconv(*args), "config.json", "outside the checkpoint directory")
    assert not out.exists()
    (hf / "config.json").unlink()
    (hf / "config.json").symlink_to(hf / "model.safetensors")  # followed within the checkpoint: read, refused
    assert_refused(
        ckptconv("hf-to-dcp", str(hf), str(out), *flags), "config.json", "not a readable JSON config"
    )


def test_hub_snapshot_side_files_link_into_blobs_and_no_further(tmp_path: Path) -> None:
    """A snapshot's config.json and ckptconv_state.json are links into the repo's blobs/: read as today (the
    config kept beside the mapped DCP, the stash's items restored); a config.json "blob" outside the repo's
    cache folder is refused."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"model.embed.weight": torch.ones(8, 4), "step": 7}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True
    )
    release = tmp_path / "release"
    assert ckptconv("dcp-to-hf", str(tmp_path / "dcp"), str(release), "-q").returncode == 0
    config = b'{"model_type": "llama", "vocab_size": 8}'
    files = {p.name: p.read_bytes() for p in release.iterdir()} | {"config.json": config}
    assert "ckptconv_state.json" in files
    snapshot, _ = _hub_cache(tmp_path / "home", files)
    mapping = tmp_path / "m.toml"
    mapping.write_text(MAPPING)
    env = _hub_env(tmp_path / "home")
    out = tmp_path / "out"
    proc = cli(
        "hf-to-dcp", "org/name", str(out), "--mapping", str(mapping), "--allow-unmapped", "-q", env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").read_bytes() == config
    assert '"step"' in ckptconv("inspect", str(out), "--json").stdout
    (tmp_path / "elsewhere.json").write_bytes(config)
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(tmp_path / "elsewhere.json")
    proc = cli(
        "hf-to-dcp",
        "org/name",
        str(tmp_path / "out2"),
        "--mapping",
        str(mapping),
        "--allow-unmapped",
        env=env,
    )
    assert_refused(proc, "config.json", "outside the checkpoint directory")


def test_a_huge_stash_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A sparse ckptconv_state.json of 64 GiB: refused by its size, not read into memory (under a 6 GiB
    address space the read would fail with a MemoryError traceback)."""
    hf = hf_dir(tmp_path / "hf")
    sparse(hf / "ckptconv_state.json", 64 * GiB)
    proc = cli("hf-to-dcp", str(hf), str(tmp_path / "out"), rlimits={resource.RLIMIT_AS: 6 * GiB})
    assert_refused(proc, "ckptconv_state.json", f"more than the {STASH_BYTES}")


# -- adapter_config.json beside a DCP, and --lora-config ---------------------------------------------------


@pytest.fixture(scope="module")
def peft_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama wrapped by PEFT, its state dict saved by torch's dcp.save (RUN/dcp), and PEFT's own
    `save_pretrained` of the adapter (RUN/adapter, with its adapter_config.json)."""
    import torch.distributed.checkpoint as dcp
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    run = tmp_path_factory.mktemp("peft")
    config = tf.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    torch.manual_seed(0)
    model = get_peft_model(
        tf.LlamaForCausalLM(config), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    )
    dcp.save(model.state_dict(), checkpoint_id=str(run / "dcp"), no_dist=True)
    model.save_pretrained(run / "adapter")
    return run


def test_adapter_config_beside_a_dcp_is_the_checkpoints_own(peft_dcp: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "dcp"
    shutil.copytree(peft_dcp / "dcp", ckpt)
    trainer = peft_dcp / "adapter" / "adapter_config.json"
    out = tmp_path / "out"
    beside = ckpt / "adapter_config.json"
    beside.symlink_to(trainer)  # was read, its alpha used, and written into OUT by --lora adapter
    for mode in ("adapter", "merge"):
        assert_refused(
            ckptconv("dcp-to-hf", str(ckpt), str(out), "--lora", mode), "adapter_config.json", "outside"
        )
    assert "alpha unknown" in ckptconv("inspect", str(ckpt)).stdout  # inspect does not read it either
    beside.unlink()
    os.mkfifo(beside)  # was passed over as absent
    assert_refused(ckptconv("dcp-to-hf", str(ckpt), str(out), "--lora", "merge", timeout=HANG), "FIFO")
    beside.unlink()
    beside.mkdir()
    assert_refused(
        ckptconv("dcp-to-hf", str(ckpt), str(out), "--lora", "merge"), "adapter_config.json", "directory"
    )
    assert not out.exists()
    beside.rmdir()
    shutil.copy(trainer, beside)  # the checkpoint's own: read
    proc = ckptconv("dcp-to-hf", str(ckpt), str(out), "--lora", "adapter", "-q")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 4


def test_lora_config_flag_a_fifo_or_a_huge_file_is_refused_unread(peft_dcp: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    flag = tmp_path / "adapter_config.json"
    os.mkfifo(flag)  # blocked forever in read_bytes()
    args = ("dcp-to-hf", str(peft_dcp / "dcp"), str(out), "--lora", "merge", "--lora-config", str(flag))
    assert_refused(ckptconv(*args, timeout=HANG), "adapter_config.json", "FIFO")
    flag.unlink()
    sparse(flag, 64 * GiB)  # was read whole, then cut to 10 MiB
    assert_refused(
        cli(*args, rlimits={resource.RLIMIT_AS: 6 * GiB}),
        "adapter_config.json",
        f"more than the {CONFIG_BYTES}",
    )
    assert not out.exists()


# -- --copy-from: walked and bounded before anything is written ------------------------------------------


def _dag(base: Path, levels: int = 10) -> None:
    """l0/{a,b} -> l1, l1/{a,b} -> l2, ...: 2**levels paths to one small file, without a loop."""
    for i in range(levels):
        (base / f"l{i}").mkdir(parents=True)
        for name in "ab":
            (base / f"l{i}" / name).symlink_to(f"../l{i + 1}")
    (base / f"l{levels}").mkdir()
    (base / f"l{levels}" / "vocab.txt").write_text("a\n")


def _deep(base: Path, depth: int = 40) -> None:
    path = base.joinpath(*["d"] * depth)
    path.mkdir(parents=True)
    (path / "vocab.txt").write_text("a\n")


def _many(base: Path) -> None:
    base.mkdir()
    for i in range(COPIED_TOTAL_BYTES // (COPIED_FILE_BYTES - 1) + 1):
        sparse(base / f"part{i}.json", COPIED_FILE_BYTES - 1)


def _loop_up(base: Path) -> None:
    (base / "sub").mkdir()
    (base / "sub" / "up").symlink_to("..")


COPIES: dict[str, tuple[Callable[[Path], None], str]] = {
    "a loop": (_loop_up, "a symlink loop"),
    "a link DAG": (_dag, "copied already"),
    "deep nesting": (_deep, "nested more than 32 deep"),
    "a sparse tokenizer.json": (
        lambda base: sparse(base / "tokenizer.json", COPIED_FILE_BYTES + 1),
        f"more than the {COPIED_FILE_BYTES}",
    ),
    "too much in all": (_many, f"more than {COPIED_TOTAL_BYTES} bytes"),
}


@pytest.mark.parametrize("case", list(COPIES))
def test_copy_from_is_bounded_before_anything_is_written(shards: Path, tmp_path: Path, case: str) -> None:
    """Each refused by name at once (RLIMIT_FSIZE: a copy of a huge file is killed, not left to fill the
    disk), nothing written."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    make, needle = COPIES[case]
    make(base / "x" if case == "too much in all" else base)
    out = tmp_path / "out"
    proc = cli(
        "dcp-to-hf", str(shards), str(out), "--copy-from", str(base), rlimits={resource.RLIMIT_FSIZE: 2**26}
    )
    assert_refused(proc, str(base), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_copy_from_leaves_weights_behind_at_every_level(shards: Path, tmp_path: Path) -> None:
    """A Llama repo's `original/` holds consolidated.00.pth (the whole model again) beside params.json."""
    base = tmp_path / "base"
    (base / "original").mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / "original" / "params.json").write_text("{}")
    torch.save({"w": torch.ones(2)}, base / "original" / "consolidated.00.pth")
    (base / "onnx").mkdir()
    (base / "onnx" / "model.onnx").write_bytes(b"\x08\x07")
    (base / "original" / ".cache").mkdir()
    (base / "original" / ".cache" / "x.lock").write_text("")
    out = tmp_path / "out"
    proc = ckptconv("dcp-to-hf", str(shards), str(out), "--copy-from", str(base), "-q")
    assert proc.returncode == 0, proc.stderr
    copied = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert copied == ["config.json", "model.safetensors", "onnx", "original", "original/params.json"]
