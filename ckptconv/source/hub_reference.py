"""A hub repo id as a base model (`--reference`, `--copy-from`, `inspect --reference`, a side of `verify
--layout`): its index and config.json (for `--copy-from` its other side files too) through huggingface_hub's
cache, and its safetensors headers, never a weight byte: online by HTTP range reads parsed by ckptconv's
own bounded reader (`hub_headers`), offline (HF_HUB_OFFLINE) from the cached snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckptconv.core.specs import HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.files import exists, listdir
from ckptconv.formats.hf import INDEX_FILE, open_hf
from ckptconv.publish.copy_from import uncopied_patterns
from ckptconv.remote.urls import is_url
from ckptconv.source.hub import download, looks_like_repo_id
from ckptconv.source.hub_headers import read_headers

# what a reference needs: the index (the file of each key) and config.json (sizes, a quantized model's
# dtypes); by their names, as fnmatch's `*` spans folders: a pattern would fetch every index file anywhere in
# the repo (a crafted repo's, of any size), though only the top one is read
REFERENCE_PATTERNS = [INDEX_FILE, "config.json"]


@dataclass(frozen=True)
class HubBase:
    """A hub repo read as a base model: the cached folder of its small files, and its headers."""

    given: str
    """The repo id as given: `org/name`, or `org/name@revision`."""
    directory: Path
    """Its snapshot folder in the hub cache: the index and config.json (with side files, what --copy-from
    copies); its weights only where they were cached before."""
    checkpoint: HfCheckpoint | None
    """Its tensors from its headers (a quantized weight as its logical tensor); None: not read, or the repo
    holds no safetensors."""


def hub_repo(text: str | Path, revision: str | None = None) -> tuple[str, str | None] | None:
    """(repo id, revision) when `text` names a hub repo, `org/name` (at `revision`) or `org/name@rev`, and
    no local path; None for a local path or a URL."""
    spelled = str(text)
    if is_url(spelled) or exists(Path(spelled)):
        return None
    name, at, rev = spelled.partition("@")
    if not looks_like_repo_id(name) or (at and not rev):
        return None
    return name, rev if at else revision


def fetch(
    text: str | Path,
    flag: str | None,
    *,
    revision: str | None = None,
    side_files: bool = False,
    headers: bool = True,
) -> HubBase | None:
    """The hub repo `text` names (None: `text` is no repo id): its small files through the cache and, with
    `headers`, its safetensors headers. Errors are one line naming `flag` (None: the repo id alone)."""
    repo = hub_repo(text, revision)
    if repo is None:
        return None
    repo_id, rev = repo
    given = str(text)
    named = given if flag is None else f"{flag} {given}"
    try:
        if side_files:  # everything --copy-from copies, and the index: never the weights
            directory = download(repo_id, rev, None, uncopied_patterns())
        else:
            directory = download(repo_id, rev, REFERENCE_PATTERNS)
        checkpoint = _headers(repo_id, directory) if headers else None
    except CkptconvError as e:
        said = str(e).removeprefix(f"{repo_id}@{rev}: " if rev else f"{repo_id}: ")
        raise CkptconvError(f"{named}: {said}", exit_code=e.exit_code) from None
    return HubBase(given, directory, checkpoint)


def _headers(repo_id: str, directory: Path) -> HfCheckpoint | None:
    """The repo's tensors from its headers: read from the cached snapshot offline (its weights must be
    cached), by ranged reads online (`hub_headers`); None: the repo holds no safetensors."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        # an online run's --reference caches the index and config.json alone: no weights to read offline
        if not any(name.endswith(".safetensors") for name in listdir(directory)):
            raise CkptconvError(
                "its safetensors files are not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                "download it once online, or pass a local directory"
            )
        return open_hf(directory)
    return read_headers(repo_id, directory)
