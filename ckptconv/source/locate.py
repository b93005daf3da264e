"""Where a command's input is: a local checkpoint (never the unfinished output of an interrupted run) or a hub
repo id, downloaded through huggingface_hub's cache (weights and config only)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from ckptconv.core.keyorder import natural_key
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import METADATA_FILE, is_dcp_dir
from ckptconv.formats.files import exists, is_directory, is_regular, listdir
from ckptconv.formats.hf import is_hf_dir
from ckptconv.formats.names import refuse_partial
from ckptconv.job.world import World, everyone, from_main
from ckptconv.remote.files import RemoteFiles
from ckptconv.remote.urls import UrlPath, file_path, location
from ckptconv.source.hub import download, looks_like_repo_id

T = TypeVar("T")


def for_all(world: World, find: Callable[[], T]) -> T:
    """`find()` (where the inputs are) on rank 0 alone, its result or its error on every rank. Inputs in
    object storage come with the listings rank 0 made, so no other rank lists a prefix again."""
    from ckptconv.remote import tree

    found, known = everyone(world, from_main, world, lambda: (find(), tree.known()))
    tree.remember(known)
    return found


def dcp_source(src: Path) -> Path:
    """The DCP directory the user means (`src`, or the one checkpoint directly inside it), or a
    CkptconvError saying what `src` is instead. A URL (`s3://bucket/prefix`) is a checkpoint in object
    storage: a prefix with a `.metadata` object, or with one checkpoint one level down; a `file://` URL is
    the local path it names."""
    src = location(src, "SRC")
    if isinstance(src, UrlPath):
        return _remote_dcp(src)
    if not exists(src):
        raise CkptconvError(f"{src}: no such file or directory")
    refuse_partial(src)
    if is_dcp_dir(src):
        return src
    if is_regular(src) or is_hf_dir(src):
        if src.suffix == ".safetensors" or is_directory(src):
            raise CkptconvError(f"{src}: is a Hugging Face safetensors checkpoint, not DCP; use hf-to-dcp")
        raise CkptconvError(f"{src}: is a file; dcp-to-hf reads a DCP checkpoint directory (with .metadata)")
    inner = checkpoints_inside(src) if is_directory(src) else []
    # accelerate's pytorch_model_fsdp_0/ (optimizer_0/ beside), Megatron's iter_0000100/, torchtitan's step-N/
    models = [p for p in inner if not p.name.startswith("optimizer")]
    if len(models) == 1:
        return models[0]
    if len(inner) == 1:
        return inner[0]
    if inner:
        names = ", ".join(p.name + "/" for p in inner[:4]) + (", ..." if len(inner) > 4 else "")
        raise CkptconvError(f"{src}: holds {len(inner)} DCP checkpoints ({names}); point at one of them")
    raise CkptconvError(
        f"{src}: not a DCP checkpoint (no .metadata inside); point at the checkpoint directory"
    )


def _remote_dcp(url: UrlPath) -> UrlPath:
    names = RemoteFiles(url).sizes()
    if METADATA_FILE in names:
        return url
    inner = _dcp_inside(names)
    models = [name for name in inner if not name.startswith("optimizer")]
    if len(models) == 1 or len(inner) == 1:
        return url / (models or inner)[0]
    if inner:
        shown = ", ".join(name + "/" for name in inner[:4]) + (", ..." if len(inner) > 4 else "")
        raise CkptconvError(f"{url}: holds {len(inner)} DCP checkpoints ({shown}); point at one of them")
    if any(name.endswith((".safetensors", ".safetensors.index.json")) for name in names) or (
        not names and _object(url)
    ):
        raise CkptconvError(f"{url}: is a Hugging Face safetensors checkpoint, not DCP; use hf-to-dcp")
    if not names:
        raise CkptconvError(f"{url}: no such object or prefix (or no access to list it)")
    raise CkptconvError(
        f"{url}: not a DCP checkpoint (no .metadata under it); point at the checkpoint prefix"
    )


def _dcp_inside(names: Iterable[str]) -> list[str]:
    """The DCP checkpoints one level under a prefix holding objects `names`."""
    found = {n.rsplit("/", 1)[0] for n in names if n.count("/") == 1 and n.endswith("/" + METADATA_FILE)}
    return sorted(found)


def _object(url: UrlPath) -> bool:
    """Whether `url` names one .safetensors object (not a prefix)."""
    from ckptconv.remote import tree

    return url.name.endswith(".safetensors") and tree.size(url) is not None


def _remote_hf(url: UrlPath) -> UrlPath:
    """The HF checkpoint at `url`: a prefix with .safetensors objects directly under it, or one object."""
    names = RemoteFiles(url).sizes()
    if not names and _object(url):
        return url
    if not names:
        raise CkptconvError(f"{url}: no such object or prefix (or no access to list it)")
    if METADATA_FILE in names or _dcp_inside(names):
        raise CkptconvError(f"{url}: is a DCP checkpoint, not Hugging Face safetensors; use dcp-to-hf")
    if not any(n.endswith(".safetensors") and "/" not in n for n in names):
        raise CkptconvError(
            f"{url}: no .safetensors objects directly under it (only safetensors weights are read, not .bin)"
        )
    return url


def _remote_any(url: UrlPath) -> UrlPath:
    """A DCP or HF checkpoint in object storage (inspect's and verify's inputs)."""
    names = RemoteFiles(url).sizes()
    dcp = METADATA_FILE in names or _dcp_inside(names)
    return _remote_dcp(url) if dcp else _remote_hf(url)


def checkpoints_inside(directory: Path) -> list[Path]:
    """The DCP checkpoints one level down (a training run's save directory), sorted naturally by name."""
    found = [directory / n for n in listdir(directory) if not n.startswith(".") and is_dcp_dir(directory / n)]
    return sorted(found, key=lambda p: natural_key(p.name))


def _local_or_hub(src: str, revision: str | None, check: Callable[[Path], None]) -> Path:
    path = location(src)
    if exists(path):
        if revision is not None:
            raise CkptconvError(f"--revision applies to hub repo ids; {src} is a local path")
        refuse_partial(path)
        check(path)
        return path
    if looks_like_repo_id(src):
        return download(src, revision)
    raise CkptconvError(f"{src}: no such file or directory, and not a hub repo id (org/name)")


def hf_source(src: str, revision: str | None, flag: str = "SRC") -> Path:
    """The safetensors file or directory `src` names: local, a hub repo id (downloaded if needed), or a URL
    (object storage: read in place; a `file://` URL is the local path it names)."""
    url = location(src, flag)
    if isinstance(url, UrlPath):
        if revision is not None:
            raise CkptconvError(f"--revision applies to hub repo ids; {src} is a URL")
        return _remote_hf(url)
    src = str(file_path(src) or src)

    def check(path: Path) -> None:
        if is_dcp_dir(path):
            what = (
                "a DCP checkpoint"
                if is_directory(path / ".metadata") or exists(path / ".metadata")
                else ("torch's distributed HF writer output (per-rank shards with DCP_SHARDING_INFO)")
            )
            raise CkptconvError(f"{path}: is {what}, not whole Hugging Face tensors; use dcp-to-hf")
        if not is_directory(path) and path.suffix != ".safetensors":
            raise CkptconvError(f"{path}: not a .safetensors file")
        if is_directory(path) and not is_hf_dir(path):
            raise CkptconvError(
                f"{path}: no .safetensors files (only safetensors weights are read, not .bin)"
            )

    return _local_or_hub(src, revision, check)


def adapter_source(world: World, adapter: str | None) -> Path | None:
    """Where `--lora-adapter` is (a hub repo id is downloaded by rank 0), or None without one."""
    if adapter is None:
        return None
    return for_all(world, lambda: hf_source(adapter, None, "--lora-adapter"))


def any_source(src: str, revision: str | None = None) -> Path:
    """A DCP directory, an HF directory or .safetensors file, or a hub repo id (verify's and inspect's
    inputs); a URL names either kind in object storage, a `file://` URL the local path it names."""
    url = location(src)
    if isinstance(url, UrlPath):
        return _remote_any(url)
    src = str(file_path(src) or src)

    def check(path: Path) -> None:
        if not (is_dcp_dir(path) or is_hf_dir(path) or path.suffix == ".safetensors"):
            raise CkptconvError(
                f"{path}: neither a DCP checkpoint (.metadata) nor safetensors (a directory or a file)"
            )

    return _local_or_hub(src, revision, check)
