"""A torch.save zip opened within the read limits: its directory read whole only when small, each entry
inflated only up to the size it declares, and that size checked against the budget before a byte is inflated.

Python's `zipfile` reads a directory of any size the end record claims (one `ZipInfo` of about 500 bytes per
46-byte entry), and `ZipFile.read` inflates an entry to whatever size it declares: a 64 MB `common.pt`
can declare 64 GB. torch's own reader (miniz, behind `torch.load`) allocates each record's declared size
and inflates into it. So every declared size is held to the budget first (`declared`), entries are read
through zipfile's stream, which never returns more than an entry declares and checks its CRC-32 at the
end, and an entry name given twice (which zipfile and miniz could resolve to different entries) is refused.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.job.limits import Budget, exceeded

MAX_DIRECTORY_BYTES = (
    4 * 2**20
)  # a zip's central directory (a torch.save record's holds 6 entries + 1 a storage)


class _Capped(io.RawIOBase):
    """`file` for zipfile, refusing a read of more than `most` bytes while `most` is set (the directory's)."""

    def __init__(self, file: Any, most: int | None) -> None:
        self.file, self.most = file, most

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self.file.seek(offset, whence))

    def tell(self) -> int:
        return int(self.file.tell())

    def read(self, n: int | None = -1) -> bytes:
        if self.most is not None:
            if n is None or n < 0:  # to the end (the end record and a comment)
                here = self.file.tell()
                n = self.file.seek(0, io.SEEK_END) - here
                self.file.seek(here)
            if n > self.most:
                raise _TooBig
        return bytes(self.file.read(n))

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _TooBig(Exception):
    pass


class TorchZip:
    """The entries of one torch.save zip (`data`: its bytes, or a seekable file), by their names without the
    archive's directory (`data.pkl`, `byteorder`, `data/0`); `where` names it in errors."""

    def __init__(self, data: bytes | Any, where: object, budget: Budget) -> None:
        self.where, self.budget = where, budget
        capped = _Capped(io.BytesIO(data) if isinstance(data, bytes) else data, MAX_DIRECTORY_BYTES)
        try:
            self.zip = zipfile.ZipFile(capped)
        except _TooBig:
            raise CkptconvError(
                f"{where}: a zip directory of more than {MAX_DIRECTORY_BYTES} bytes; not a torch.save file "
                "(the file is corrupt or hostile)"
            ) from None
        except (CkptconvError, zipfile.BadZipFile):
            raise
        except Exception as e:  # struct.error, ValueError, OverflowError ... of a malformed directory
            raise zipfile.BadZipFile(f"a malformed zip directory ({type(e).__name__})") from None
        capped.most = None
        budget.bytes(sum(len(i.filename) + 100 for i in self.zip.infolist()), "zip directory")
        self.entries: dict[str, zipfile.ZipInfo] = {}
        for info in self.zip.infolist():
            name = info.filename.split("/", 1)[-1]
            if name in self.entries:
                raise zipfile.BadZipFile(f"entry {name[:100]!r} appears twice")
            self.entries[name] = info

    def declared(self) -> int:
        """The bytes every entry declares it inflates to."""
        return sum(info.file_size for info in self.entries.values())

    def check_declared(self, most: int) -> None:
        """Refuse a zip whose entries together declare more than `most` bytes (before torch.load inflates
        them: it allocates what each declares)."""
        if self.declared() > most:
            raise exceeded(self.where, "bytes", most, f"its zip entries declare {self.declared()} bytes")

    def read(self, name: str, most: int | None = None) -> bytes:
        """Entry `name` (KeyError when there is none), whose declared size must be within `most` and the
        budget; inflated no further than that size."""
        info = self.entries[name]
        if most is not None and info.file_size > most:
            raise zipfile.BadZipFile(f"{name} declares {info.file_size} bytes, more than {most}")
        self.budget.bytes(info.file_size, f"{name} declares {info.file_size} bytes")
        try:
            with self.zip.open(info) as stream:  # inflates no further than the declared size, checks the CRC
                data = stream.read(info.file_size)
        except (CkptconvError, zipfile.BadZipFile):
            raise
        except Exception as e:  # an unknown compression, encryption, a broken deflate stream ...
            raise zipfile.BadZipFile(f"{name} cannot be read ({type(e).__name__})") from None
        if len(data) != info.file_size:
            raise zipfile.BadZipFile(
                f"{name} inflates to {len(data)} bytes, not the {info.file_size} declared"
            )
        return data
