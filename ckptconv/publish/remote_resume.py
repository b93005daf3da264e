"""`--resume` for an OUT in S3: what an interrupted run left under OUT/, and the check that keeps it.

In S3 every output file is one multipart upload that every rank sends parts of (remote_out, "parts"
granularity), or its one owner sends all of ("file": --write-granularity file, --quantize); nothing is
staged, so what a resume keeps lies in OUT itself, never complete before the run's completing object:

  OUT/.ckptconv-resume.json   the record: the run's fingerprint, its number of ranks and {file: upload id},
                              put by rank 0 once it started the uploads (before any part is sent) and
                              removed once the completing object is there;
  OUT/model-0000N-...         an object completed by the run, with the fingerprint and its own name in its
                              user metadata (`x-amz-meta-ckptconv-fingerprint`, given when its upload was
                              started);
  the uploads in progress     the parts each rank sent, which S3 keeps until the upload is completed or
                              aborted (ListParts gives each part's size and ETag).

A signal or a killed rank leaves all of it but a completing object it made (one line says so); any other
failure removes what the run wrote, as before (but a resumed run's record and what it kept). `--resume` (rank
0, holding OUT's lock) reads the record as an input (bounded, type-checked, plain file names: one that is not
is refused with one line), refuses one made for another fingerprint, and keeps an object only when its size is
the planned one and its metadata carries this run's fingerprint and its own name, and a part only when its
upload is the record's and S3 lists it in progress under that very key (ListMultipartUploads of OUT/), the run
has the record's number of ranks (parts are cut by ranks) and its size is the planned part's. Every other
upload in progress under OUT/ is aborted and its file written again. A part kept is not sent again when the
bytes its rank computes for it have the MD5 its ETag gives (else it is sent again: the ranks still compute its
bytes, a piece being read as a whole); an object kept is neither read nor written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptconv.errors import CkptconvError
from ckptconv.job.signals import deferred
from ckptconv.publish.multipart import META, abort_all, totals
from ckptconv.publish.parts import MAX_PARTS, plan_pieces
from ckptconv.publish.resume import digest
from ckptconv.remote.urls import UrlPath, filesystem, redact

if TYPE_CHECKING:
    from ckptconv.plan.types import OutFile, Write

RECORD = ".ckptconv-resume.json"
MAX_RECORD_BYTES = 1 << 20
MAX_UPLOADS = 100_000
MAX_PAGES = 1_000  # of a listing S3 gives 1,000 entries at a time
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")  # a file name of OUT's, never a path


@dataclass
class Kept:
    """What `--resume` keeps of an interrupted run under OUT."""

    whole: frozenset[str] = frozenset()
    """The objects complete with this run's fingerprint and planned size: neither read nor written."""
    uploads: dict[str, str] = field(default_factory=dict)
    """{file: upload id}: the uploads in progress this run goes on with."""
    parts: dict[str, dict[int, str]] = field(default_factory=dict)
    """{file: {part number: ETag}}: the parts of those uploads not sent again."""
    sizes: dict[str, int] = field(default_factory=dict)
    """{file: its size} of the `whole` objects of a DCP (hf-to-dcp), which the ranks check against torch's
    plan (`dcp_writer`)."""

    def count(self) -> int:
        """How many parts are kept."""
        return sum(len(p) for p in self.parts.values())


def tag(fingerprint: Iterable[str], name: str) -> str:
    """The fingerprint and the object's own name as one value of user metadata (an object copied onto
    another name of the same size does not pass for it)."""
    return digest(*fingerprint, name)


def put_record(url: UrlPath, fingerprint: tuple[str, ...], ranks: int, uploads: Mapping[str, str]) -> None:
    """Rank 0, once the uploads are started: the record of this run under OUT."""
    body = {"fingerprint": list(fingerprint), "ranks": ranks, "uploads": dict(uploads)}
    try:
        with deferred():
            filesystem(url).pipe_file((url / RECORD).key, json.dumps(body, sort_keys=True).encode())
    except Exception as e:
        raise CkptconvError(redact(f"{url / RECORD}: cannot write ({type(e).__name__}: {e})")) from None


def drop_record(url: UrlPath) -> None:
    """Rank 0, once the completing object is there: the record goes (a finished OUT holds none)."""
    try:
        with deferred():
            filesystem(url).rm_file((url / RECORD).key)
    except FileNotFoundError:
        pass
    except Exception as e:
        raise CkptconvError(redact(f"{url / RECORD}: cannot remove ({type(e).__name__}: {e})")) from None


def read_record(url: UrlPath) -> dict[str, Any] | None:
    """The record under OUT, or None where there is none. Read as an input: at most MAX_RECORD_BYTES, JSON
    of checked types, plain file names; one that is not: one line, exit 2 (nothing is kept on its word)."""
    where = url / RECORD
    try:
        with filesystem(url).open(where.key, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except Exception as e:
        raise CkptconvError(redact(f"{where}: cannot read ({type(e).__name__}: {e})")) from None
    record = _checked(raw)
    if record is None:
        raise CkptconvError(
            f"{where}: not a record of an interrupted ckptconv run; rerun with --overwrite instead of "
            "--resume to start over"
        )
    return record


def _checked(raw: bytes) -> dict[str, Any] | None:
    """The record `raw` holds, or None where it is not one."""
    if len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    fingerprint, ranks, uploads = record.get("fingerprint"), record.get("ranks"), record.get("uploads")
    if not (isinstance(fingerprint, list) and all(isinstance(x, str) for x in fingerprint)):
        return None
    if not (isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > 0):
        return None
    if not (isinstance(uploads, dict) and len(uploads) <= MAX_UPLOADS):
        return None
    if not all(isinstance(k, str) and _NAME.fullmatch(k) and isinstance(v, str) for k, v in uploads.items()):
        return None
    return {"fingerprint": tuple(fingerprint), "ranks": ranks, "uploads": uploads}


def resumed(
    url: UrlPath,
    record: Mapping[str, Any],
    fingerprint: tuple[str, ...],
    ranks: int,
    files: Sequence[OutFile],
    writes: Sequence[Write],
    names: Sequence[str],
    completing: str,
) -> Kept:
    """Rank 0, holding the lock: what this run (`fingerprint`, `ranks`, its `files` and `writes`) keeps of
    the interrupted run `record` describes, OUT holding `names`; the record's other uploads aborted. OUT
    complete, or holding data this run does not write: one line, exit 2, nothing changed."""
    _check_out(url, names, completing, ".safetensors", {f.name for f in files})
    pieces = plan_pieces(files, writes)
    part_sizes: dict[str, dict[int, int]] = {}
    for p in pieces:
        part_sizes.setdefault(p.file, {}).update((p.first_part + i, n) for i, n in enumerate(p.part_sizes()))
    sizes = {name: size for name, (size, _) in totals(pieces).items()}
    listed = in_progress(url)
    kept = keep(url, record, fingerprint, ranks, sizes, part_sizes, names, listed)
    left = abort_all(url, [(n, u) for n, ids in listed.items() for u in ids if kept.uploads.get(n) != u])
    if left:
        raise CkptconvError(f"{url}: --resume: cannot abort {', '.join(left[:5])}; abort them yourself")
    return kept


def keep(
    url: UrlPath,
    record: Mapping[str, Any],
    fingerprint: tuple[str, ...],
    ranks: int,
    sizes: Mapping[str, int],
    part_sizes: Mapping[str, Mapping[int, int]],
    names: Iterable[str],
    listed: Mapping[str, set[str]],
) -> Kept:
    """Rank 0, holding the lock: what of the interrupted run `record` describes this run keeps (`sizes`:
    {file: planned bytes}; `part_sizes`: {file: {part number: planned bytes}} at this run's ranks; `names`:
    the objects under OUT; `listed`: the uploads in progress under OUT, `in_progress`). A record of another
    fingerprint: one line, exit 2, nothing changed."""
    _check_fingerprint(url, record, fingerprint)
    present = set(names)
    whole = frozenset(n for n in sizes if n in present and _complete(url / n, sizes[n], tag(fingerprint, n)))
    kept = Kept(whole=whole)
    for name, upload_id in record["uploads"].items():
        listed_here = upload_id in listed.get(name, ())  # S3's word that it is this key's, in progress
        if name in whole or name not in sizes or record["ranks"] != ranks or not listed_here:
            continue
        parts = _parts(url / name, upload_id)
        if parts is None:
            continue  # completed, aborted or expired: written again
        planned = part_sizes.get(name, {})
        kept.uploads[name] = upload_id
        kept.parts[name] = {n: etag for n, (size, etag) in parts.items() if planned.get(n) == size}
    return kept


def _check_out(url: UrlPath, names: Sequence[str], completing: str, suffix: str, planned: set[str]) -> None:
    """Refuse an OUT holding a complete result (`completing`), or data files (`suffix`) or a deeper prefix
    this run does not write: one line, exit 2."""
    if completing in names:
        raise CkptconvError(
            f"{url}: --resume: holds a complete result ({completing}); nothing to resume (--overwrite "
            "replaces it)"
        )
    foreign = [n for n in names if (n.endswith(suffix) and n not in planned) or "/" in n]
    if foreign:
        raise CkptconvError(
            f"{url}: --resume: holds {', '.join(foreign[:5])}, which this run does not write; rerun with "
            "--overwrite to start over"
        )


def _check_fingerprint(url: UrlPath, record: Mapping[str, Any], fingerprint: Sequence[str]) -> None:
    """Refuse a record of another fingerprint: one line naming what changed, exit 2."""
    if tuple(record["fingerprint"]) != tuple(fingerprint):
        kinds = ("the source", "the options", "the plan")
        changed = [k for k, a, b in zip(kinds, fingerprint, record["fingerprint"], strict=False) if a != b]
        raise CkptconvError(
            f"{url}: --resume: {changed[0] if changed else 'the run'} changed since the interrupted run "
            "wrote there; rerun with --overwrite instead of --resume to start over"
        )


def resumed_whole(
    url: UrlPath,
    record: Mapping[str, Any],
    fingerprint: tuple[str, ...],
    ranks: int,
    planned: Iterable[str],
    names: Sequence[str],
    completing: str,
) -> Kept:
    """Rank 0, holding the lock: what a DCP run (hf-to-dcp: `planned` data file names, each written whole
    by its rank at this number of `ranks`) keeps of the interrupted run `record` describes, OUT holding
    `names`: every `.distcp` object whose metadata carries this fingerprint and its name, with its size.
    The other `.distcp` objects are removed and every upload in progress under OUT/ aborted (their files
    are written again). OUT complete, holding data this run does not write, another fingerprint or another
    number of ranks: one line, exit 2, nothing changed."""
    _check_out(url, names, completing, ".distcp", set(planned))
    data = [n for n in names if n.endswith(".distcp")]
    if record["ranks"] != ranks:
        raise CkptconvError(
            f"{url}: --resume: written by {record['ranks']} rank(s) and this run has {ranks}: a DCP's files "
            f"depend on the number of ranks; rerun with {record['ranks']} rank(s), or with --overwrite "
            "instead of --resume to start over"
        )
    _check_fingerprint(url, record, fingerprint)
    sizes = {n: _tagged_size(url / n, tag(fingerprint, n)) for n in data}
    whole = {n: size for n, size in sizes.items() if size is not None}
    stale = [n for n in data if n not in whole]
    left = abort_all(url, [(n, u) for n, ids in in_progress(url).items() for u in ids])
    fs = filesystem(url)
    for n in stale:
        try:
            fs.rm_file((url / n).key)
        except FileNotFoundError:
            pass
        except Exception:
            left.append(str(url / n))
    if left:
        raise CkptconvError(f"{url}: --resume: cannot remove {', '.join(left[:5])}; remove them yourself")
    return Kept(whole=frozenset(whole), sizes=whole)


def in_progress(url: UrlPath) -> dict[str, set[str]]:
    """{file name: its upload ids} of the multipart uploads S3 lists in progress directly under OUT/ (a
    bounded number of pages, each further than the last)."""
    fs = filesystem(url)
    bucket, key, _ = fs.split_path(url.key)
    prefix = key.rstrip("/") + "/"
    found: dict[str, set[str]] = {}
    markers: dict[str, str] = {}
    for _ in range(MAX_PAGES):
        try:
            reply = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
        except Exception as e:
            cause = f"{type(e).__name__}: {e}"
            raise CkptconvError(redact(f"{url}: cannot list its uploads in progress ({cause})")) from None
        for upload in reply.get("Uploads", []):
            full, upload_id = str(upload.get("Key", "")), upload.get("UploadId")
            name = full[len(prefix) :]
            if full.startswith(prefix) and _NAME.fullmatch(name) and isinstance(upload_id, str):
                found.setdefault(name, set()).add(upload_id)
        following = {
            "KeyMarker": reply.get("NextKeyMarker", ""),
            "UploadIdMarker": reply.get("NextUploadIdMarker", ""),
        }
        if not reply.get("IsTruncated") or following == markers or not following["KeyMarker"]:
            return found
        markers = following
    return found


def _complete(url: UrlPath, size: int, fingerprint_tag: str) -> bool:
    """Whether the object `url` is this run's: its planned size, and this fingerprint in its metadata."""
    return _tagged_size(url, fingerprint_tag) == size


def _tagged_size(url: UrlPath, fingerprint_tag: str) -> int | None:
    """The size of the object `url` when its metadata carries `fingerprint_tag`, else None."""
    fs = filesystem(url)
    bucket, key, _ = fs.split_path(url.key)
    try:
        head = fs.call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    except Exception as e:
        raise CkptconvError(redact(f"{url}: cannot read ({type(e).__name__}: {e})")) from None
    size = head.get("ContentLength")
    if head.get("Metadata", {}).get(META) != fingerprint_tag or not isinstance(size, int):
        return None
    return size


def _parts(url: UrlPath, upload_id: str) -> dict[int, tuple[int, str]] | None:
    """{part number: (size, ETag)} of the upload in progress `upload_id` of `url`, or None where it is not
    in progress any more."""
    fs = filesystem(url)
    bucket, key, _ = fs.split_path(url.key)
    found: dict[int, tuple[int, str]] = {}
    marker = 0
    for _ in range(MAX_PAGES):
        try:
            reply = fs.call_s3(
                "list_parts", Bucket=bucket, Key=key, UploadId=upload_id, PartNumberMarker=marker
            )
        except FileNotFoundError:
            return None  # S3's NoSuchUpload
        except Exception as e:
            cause = f"{type(e).__name__}: {e}"
            raise CkptconvError(redact(f"{url}: cannot list its upload's parts ({cause})")) from None
        for part in reply.get("Parts", []):
            number, size, etag = part.get("PartNumber"), part.get("Size"), part.get("ETag")
            if isinstance(number, int) and 1 <= number <= MAX_PARTS and isinstance(size, int):
                found[number] = (size, str(etag))
        following = reply.get("NextPartNumberMarker")
        if not reply.get("IsTruncated") or len(found) >= MAX_PARTS or not isinstance(following, int):
            return found
        if following <= marker:  # a listing that does not go on: what it gave so far
            return found
        marker = following
    return found
