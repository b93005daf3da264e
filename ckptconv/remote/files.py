"""The objects under one URL, read by byte range: `RemoteFiles(root)`.

Call order: rank 0 lists the objects (`sizes`) and reads `.metadata` (`read`) while opening the checkpoint;
every rank that reads chunks says which byte ranges it will read (`expect`, a record at a time, ahead of
reading it) and reads them (`pread`). A read inside an expected range fetches, in one ranged GET, that range
and its expected neighbours at most `coalesce_gap` bytes apart (up to `span_limit` bytes), then serves the
reads that follow from the fetched span; any other read fetches exactly its bytes. Under torchrun every rank
also says which bytes the other ranks read (`elsewhere`, from the plan every rank holds: no collective), and
a request never reads across a gap holding any of them, so no byte is fetched by a rank that does not read
it (the ranks' requests overlap only on bytes several of them read). A fetched span is dropped
once every expected byte in it has been read (so memory holds what is fetched and not yet read, as a local
run holds its reads in flight), and spans are kept within `cache_bytes` anyway (the oldest go first).
Nothing is written to local disk.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.remote.ranges import Range, joined, merged, pieces, span_around, without
from ckptconv.remote.urls import UrlPath, coalesce_gap, filesystem, redact

_listings: dict[str, dict[str, int]] = {}  # URL -> its objects' sizes, listed once per process
_versions: dict[str, dict[str, tuple[str, ...]]] = {}  # URL -> size and version of each object
# what an object store's listing says of an object's version (S3, GCS, Azure), beside its size
VERSION_KEYS: tuple[str, ...] = ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash")
VERSION_KEYS += ("LastModified", "last_modified", "updated")


class RemoteFiles:
    """Ranged reads of the objects under `root`. Safe for concurrent threads."""

    def __init__(
        self,
        root: UrlPath,
        gap: int | None = None,
        cache_bytes: int = 256 << 20,
        sizes: dict[str, int] | None = None,
    ) -> None:
        self.root = root
        self.fs = filesystem(root)
        self.coalesce_gap = coalesce_gap() if gap is None else gap
        self.cache_bytes = cache_bytes
        self.span_limit = max(cache_bytes // 8, 1 << 20)
        self._sizes = sizes
        self._expected: dict[str, list[Range]] = {}
        self._elsewhere: dict[str, list[Range]] = {}  # bytes other ranks read (`joined`), never read across
        self._elsewhere_new: dict[str, list[Range]] = {}  # announced since they were last joined
        self._spans: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._unread: dict[tuple[str, int], list[Range]] = {}  # a span's expected ranges not read yet
        self._cached = 0
        self._inflight: dict[tuple[str, int, int], threading.Event] = {}  # spans being fetched
        self._lock = threading.Lock()
        self.bytes_fetched = 0
        self.requests = 0

    def sizes(self) -> dict[str, int]:
        """{name under root: size} of every object under `root` (one listing)."""
        if self._sizes is None:
            self._sizes = _listings.get(str(self.root))
        if self._sizes is None:
            prefix = self.root.key.rstrip("/") + "/"
            try:
                found = self.fs.find(self.root.key, detail=True)
            except Exception as e:
                raise remote_error(self.root, e) from None
            files = {
                path.removeprefix(prefix): info
                for path, info in found.items()
                if path.startswith(prefix) and info.get("type", "file") == "file"
            }
            self._sizes = {name: int(info.get("size") or 0) for name, info in files.items()}
            _listings[str(self.root)] = self._sizes
            _versions[str(self.root)] = {
                name: (str(info.get("size")), *(f"{k}={info[k]}" for k in VERSION_KEYS if k in info))
                for name, info in files.items()
            }
        return self._sizes

    def versions(self) -> dict[str, tuple[str, ...]]:
        """{name under root: its size and version (ETag, version id, last modified: what the listing gave)},
        from the listing `sizes` made (listed now if it was not)."""
        found = _versions.get(str(self.root))
        if found is None:
            _listings.pop(str(self.root), None)
            self._sizes = None
            self.sizes()
            found = _versions[str(self.root)]
        return found

    def exists(self, rel: str) -> bool:
        return rel in self.sizes()

    def read(self, rel: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of `rel`, exactly."""
        data = self._get(rel, offset, offset + length)
        if len(data) != length:
            raise CkptconvError(
                f"{self.root / rel}: holds {offset + len(data)} bytes, {offset + length} expected; "
                "the object changed or was truncated while being read, re-copy it"
            )
        return data

    def read_all(self, rel: str) -> bytes:
        """The whole of `rel` (a small object: `.metadata`, an index, a header)."""
        return self._get(rel, 0, None)

    def expect(self, rel: str, start: int, length: int) -> None:
        """This rank will read bytes [start, start + length) of `rel` (a chunk's record) soon. A range
        longer than `span_limit` is expected as pieces of that size (fetched one at a time, never whole)."""
        if length <= 0:
            return
        with self._lock:
            new = pieces(start, start + length, self.span_limit)
            self._expected[rel] = merged([*self._expected.get(rel, []), *new])

    def elsewhere(self, rel: str, start: int, length: int) -> None:
        """Another rank reads bytes [start, start + length) of `rel`: no request of this rank reads across a
        gap holding any of them (this rank fetches them only where it reads them itself). Call it before the
        reads it should shape (hf-to-dcp and dcp-to-hf announce every other rank's reads up front)."""
        if length > 0:
            with self._lock:
                self._elsewhere_new.setdefault(rel, []).append((start, start + length))

    def _others(self, rel: str) -> list[Range]:
        """The bytes of `rel` other ranks read, sorted and joined (those announced since, joined in now)."""
        new = self._elsewhere_new.pop(rel, None)
        if new:
            self._elsewhere[rel] = joined([*self._elsewhere.get(rel, []), *new])
        return self._elsewhere.get(rel, [])

    def forgo(self, rel: str, start: int, end: int) -> None:
        """Bytes [start, end) of `rel`, expected, will not be read after all (the zip entries around a
        chunk's data, once located): fetched spans no longer wait for them."""
        with self._lock:
            if rel in self._expected:
                self._expected[rel] = without(self._expected[rel], (start, end))
            for key in [k for k in self._spans if k[0] == rel]:
                self._unread[key] = without(self._unread[key], (start, end))
                if not self._unread[key]:
                    self._drop(key)

    def pread(self, rel: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes of `rel` at `offset`: from a fetched span, or by waiting for the span
        another thread is fetching, or by fetching the span around them, or exactly."""
        n = len(out)
        if n == 0:
            return
        want = (offset, offset + n)
        while True:
            with self._lock:
                cached = self._from_cache(rel, want)
                if cached is not None:
                    out[:] = cached
                    return
                cuts = self._cuts(rel, want)
                if cuts:  # across pieces or spans (a chunk's data read whole): one part at a time
                    break
                pending = next(
                    (
                        e
                        for (r, a, b), e in self._inflight.items()
                        if r == rel and a <= offset and want[1] <= b
                    ),
                    None,
                )
                taken = None if pending is not None else self._take_span(rel, want)
                span, expected = taken if taken is not None else (None, [])
                if span is not None and span != want:
                    done = self._inflight[(rel, *span)] = threading.Event()
            if pending is None:
                break
            pending.wait()  # then served from the cache (or, evicted meanwhile, fetched again)
        if cuts:
            for a, b in itertools.pairwise([offset, *cuts, want[1]]):
                self.pread(rel, a, out[a - offset : b - offset])
            return
        if span is None or span == want:
            out[:] = self.read(rel, offset, n)
            return
        try:
            data = self.read(rel, span[0], span[1] - span[0])
            out[:] = memoryview(data)[offset - span[0] : offset - span[0] + n]
            with self._lock:
                unread = without(expected, want)
                if unread:  # more of it will be read
                    self._keep(rel, span[0], data, unread)
        finally:
            with self._lock:
                del self._inflight[(rel, *span)]
            done.set()

    def _cuts(self, rel: str, want: Range) -> list[int]:
        """Where `want` crosses the edge of an expected range, a fetched span or one being fetched."""
        edges = {x for r in self._expected.get(rel, []) for x in r}
        edges.update(x for (r, a), data in self._spans.items() if r == rel for x in (a, a + len(data)))
        edges.update(x for (r, a, b) in self._inflight if r == rel for x in (a, b))
        return sorted(x for x in edges if want[0] < x < want[1])

    def _from_cache(self, rel: str, want: Range) -> memoryview | None:
        """`want` from a fetched span (dropped once all its expected bytes are read), or None."""
        for (name, start), data in reversed(self._spans.items()):
            if name == rel and start <= want[0] and want[1] <= start + len(data):
                left = self._unread[(name, start)] = without(self._unread[(name, start)], want)
                if not left:
                    self._drop((name, start))
                return memoryview(data)[want[0] - start : want[1] - start]
        return None

    def _drop(self, key: tuple[str, int]) -> None:
        self._cached -= len(self._spans.pop(key))
        del self._unread[key]

    def _take_span(self, rel: str, want: Range) -> tuple[Range, list[Range]] | None:
        """The span one GET fetches for `want` and the expected ranges in it (they then leave the list), or
        None."""
        expected = self._expected.get(rel, [])
        found = span_around(expected, want, self.coalesce_gap, self.span_limit, self._others(rel))
        if found is None:
            return None
        lo, hi = found
        span = (expected[lo][0], expected[hi - 1][1])
        inside = expected[lo:hi]
        del expected[lo:hi]
        return span, inside

    def _keep(self, rel: str, start: int, data: bytes, unread: list[Range]) -> None:
        self._spans[(rel, start)] = data
        self._unread[(rel, start)] = unread
        self._cached += len(data)
        while self._cached > self.cache_bytes and len(self._spans) > 1:
            self._drop(next(iter(self._spans)))

    def _get(self, rel: str, start: int, end: int | None) -> bytes:
        if end is not None and end <= start:
            return b""
        try:
            data = self.fs.cat_file(f"{self.root.key}/{rel}", start=start, end=end)
        except Exception as e:
            raise remote_error(self.root / rel, e) from None
        with self._lock:
            self.bytes_fetched += len(data)
            self.requests += 1
        return bytes(data)


_DENIED = ("Credential", "AccessDenied", "Forbidden", "Signature", "InvalidAccessKey", "Unauthorized")


def denied(e: BaseException) -> bool:
    """Whether a backend's error means the credentials are missing or not allowed."""
    return isinstance(e, PermissionError) or any(word in type(e).__name__ for word in _DENIED)


def forget(url: UrlPath) -> None:
    """Drop what this process knows of the objects under `url` (before listing them afresh)."""
    _listings.pop(str(url), None)
    _versions.pop(str(url), None)
    fs = filesystem(url)
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache(url.key)


def remote_error(url: Any, e: BaseException) -> CkptconvError:
    """The one-line error for a failed request on `url` (secrets of --storage-options redacted)."""
    if isinstance(e, FileNotFoundError):
        cause = "no such object (removed while being read?)"
        fix = "check the URL, and that nothing deletes the checkpoint while it is converted"
    elif denied(e):
        cause = "access denied"
        fix = "check the credentials (--storage-options, or the backend's usual variables and profiles)"
    else:
        cause = f"{type(e).__name__}: {e}".strip()
        fix = "check the URL, the endpoint and the network"
    return CkptconvError(redact(f"{url}: cannot read ({cause}); {fix}"))
