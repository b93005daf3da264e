"""Under torchrun: ckptconv's CLI with the S3 store refusing one rank's writes.

usage: failing_s3.py RANK AFTER ARGV...: on rank RANK, every S3 write request (upload_part, put_object,
complete_multipart_upload) after the first AFTER fails as a failing server's does (an OSError), on both of
s3fs's request paths; the other ranks are untouched. Then `ckptconv ARGV...`.
"""

import os
import sys
from typing import Any

import s3fs

from ckptconv.cli import main

WRITES = ("upload_part", "put_object", "complete_multipart_upload")


def refuse_after(after: int) -> None:
    seen = [0]
    sync_call, async_call = s3fs.S3FileSystem.call_s3, s3fs.S3FileSystem._call_s3

    def refuse(method: str) -> None:
        if method in WRITES:
            seen[0] += 1
            if seen[0] > after:
                raise OSError(5, "InternalError: We encountered an internal error. Please try again.")

    def failing_sync(self: Any, method: str, *args: Any, **kw: Any) -> Any:
        refuse(method)
        return sync_call(self, method, *args, **kw)

    async def failing_async(self: Any, method: str, *args: Any, **kw: Any) -> Any:
        refuse(method)
        return await async_call(self, method, *args, **kw)

    s3fs.S3FileSystem.call_s3 = failing_sync  # type: ignore[method-assign]
    s3fs.S3FileSystem._call_s3 = failing_async  # type: ignore[method-assign]


if __name__ == "__main__":
    if int(os.environ["RANK"]) == int(sys.argv[1]):
        refuse_after(int(sys.argv[2]))
    main(sys.argv[3:])
