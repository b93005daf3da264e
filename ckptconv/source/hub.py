"""Models on the Hugging Face Hub: which sources are repo ids, and their snapshots (weights and config only)
through huggingface_hub's cache."""

from __future__ import annotations

import re
from pathlib import Path

from ckptconv.errors import CkptconvError
from ckptconv.formats.files import mode_of

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what hf-to-dcp and inspect fetch from the hub: weights, index, config, and a ckptconv stash if any
HUB_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "ckptconv_state.json",
]


def looks_like_repo_id(src: str) -> bool:
    return bool(_REPO_ID.match(src)) and mode_of(Path(src)) is None


def download(
    repo_id: str,
    revision: str | None,
    patterns: list[str] | None = HUB_PATTERNS,
    ignore: list[str] | None = None,
) -> Path:
    """The local snapshot of a hub repo (by default weights and config only; else the files `patterns`
    match and `ignore` does not), through huggingface_hub's cache.

    Honors HF_HOME and HF_HUB_OFFLINE: offline, a cached snapshot is used and an uncached one is an error.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        found = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, ignore_patterns=ignore)
        return Path(found)
    except HFValidationError as e:
        raise CkptconvError(
            f"{where}: not a valid hub repo id or revision ({first_line(e)}); pass org/name or a local path"
        ) from None
    except LocalEntryNotFoundError:
        raise CkptconvError(
            f"{where}: not in the local Hugging Face cache and the hub cannot be reached "
            "(HF_HUB_OFFLINE is set or no network); download it once online, or pass a local directory"
        ) from None
    except RevisionNotFoundError:
        raise CkptconvError(f"{where}: no such revision; check --revision") from None
    except RepositoryNotFoundError:
        raise CkptconvError(
            f"{where}: no such repository on the hub (or it is private: run `hf auth login`)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CkptconvError(f"{where}: download failed ({type(e).__name__}: {first_line(e)})") from None


def first_line(e: Exception) -> str:
    """The first line of an exception's message, at most 300 characters."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
