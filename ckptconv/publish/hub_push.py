"""`dcp-to-hf ... --push-to-hub REPO_ID`: the published result, uploaded by rank 0 with huggingface_hub.

Call order: `PushRequest.check()` on every rank before any work (a malformed repo id or flag fails at once);
after OUT is published, `push(request, out)` on rank 0 only. The upload is one commit (`upload_folder`), or
huggingface_hub's resumable large-folder upload where there are more than `LARGE_FOLDER_FILES` files and the
installed huggingface_hub has it (several commits; not with `--create-pr` or `--commit-message`, which ask
for one). The token comes from the usual places (`HF_TOKEN`, `hf auth login`). Any failure is one
CkptconvError saying what went wrong, that the result is kept at OUT, and the command that uploads it later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.errors import CkptconvError

LARGE_FOLDER_FILES = 100
DEFAULT_MESSAGE = "Upload the model converted by ckptconv"


@dataclass(frozen=True)
class PushRequest:
    repo_id: str
    revision: str | None = None  # a branch, created from main when missing
    private: bool | None = None  # for a repo this creates; an existing repo keeps its visibility
    commit_message: str | None = None
    create_pr: bool = False

    def check(self) -> None:
        """Every rank, before any work: the repo id and flags are well formed."""
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(self.repo_id)
        except Exception as e:
            raise CkptconvError(
                f"--push-to-hub {self.repo_id!r}: not a repo id ({e}); use org/name"
            ) from None
        if "/" not in self.repo_id:
            raise CkptconvError(f"--push-to-hub {self.repo_id!r}: name the owner too (org/name or user/name)")


def push(request: PushRequest, out: Path, api: Any = None) -> dict[str, Any]:
    """Rank 0: upload every file of the published `out` to the hub repo; the commit's (or PR's) URL."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    files = sorted(p for p in out.iterdir() if p.is_file())
    large = (
        len(files) > LARGE_FOLDER_FILES
        and not request.create_pr
        and request.commit_message is None
        and hasattr(api, "upload_large_folder")
    )
    try:
        api.create_repo(request.repo_id, repo_type="model", private=request.private, exist_ok=True)
        if request.revision is not None:
            api.create_branch(request.repo_id, branch=request.revision, repo_type="model", exist_ok=True)
        if large:
            api.upload_large_folder(
                repo_id=request.repo_id,
                folder_path=out,
                repo_type="model",
                revision=request.revision,
                private=request.private,
            )
            endpoint = str(getattr(api, "endpoint", "https://huggingface.co")).rstrip("/")
            commit_url, pr_url = f"{endpoint}/{request.repo_id}/tree/{request.revision or 'main'}", None
        else:
            info = api.upload_folder(
                repo_id=request.repo_id,
                folder_path=out,
                repo_type="model",
                revision=request.revision,
                commit_message=request.commit_message or DEFAULT_MESSAGE,
                create_pr=request.create_pr,
            )
            commit_url, pr_url = str(info.commit_url), getattr(info, "pr_url", None)
    except Exception as e:
        raise CkptconvError(
            f"--push-to-hub {request.repo_id}: {_cause(e)}; the result is kept in {out} "
            f"(upload it later with: hf upload {request.repo_id} {out})"
        ) from None
    return {
        "repo_id": request.repo_id,
        "revision": request.revision,
        "files": len(files),
        "commits": "several (large-folder upload)" if large else "one",
        "commit_url": commit_url,
        "pr_url": pr_url,
    }


def _cause(e: BaseException) -> str:
    """What went wrong, in a few words a user can act on."""
    name = type(e).__name__
    status = getattr(getattr(e, "response", None), "status_code", None)
    if name == "LocalTokenNotFoundError" or status == 401:
        return "no valid token (set HF_TOKEN or run `hf auth login`)"
    if name == "RevisionNotFoundError":
        return "no such revision (branch) in the repo"
    if name == "RepositoryNotFoundError" or status == 404:
        return "the repo does not exist or the token cannot see it"
    if status == 403 or name == "GatedRepoError":
        return "the token has no write access to the repo"
    if name == "OfflineModeIsEnabled":
        return "HF_HUB_OFFLINE is set"
    if any(word in name for word in ("Connect", "Timeout", "Network")) or isinstance(e, ConnectionError):
        return "cannot reach the Hub (check the network and HF_ENDPOINT)"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{name}: {first}" if first else name
