"""Under torchrun: ckptconv's CLI with the S3 store refusing one rank's writes.

usage: failing_s3.py RANK AFTER ARGV...: on rank RANK, every S3 write request (upload_part, put_object,
complete_multipart_upload) after the first AFTER fails as a failing server's does (an OSError), on both of
s3fs's request paths; the other ranks are untouched. Then `ckptconv ARGV...`.
"""

import os
import sys
from typing import Any

import s3fs

from ckptconv.cli.app import main

WRITES = ("upload_part", "put_object", "complete_multipart_upload")


def failing_calls(after: int) -> tuple[Any, Any]:
    """s3fs's request methods (sync `call_s3`, async `_call_s3`) refusing every write after the first
    `after` as a failing server does: an OSError for the request."""
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

    return failing_sync, failing_async


if __name__ == "__main__":
    if int(os.environ["RANK"]) == int(sys.argv[1]):
        sync_call, async_call = failing_calls(int(sys.argv[2]))
        s3fs.S3FileSystem.call_s3 = sync_call  # type: ignore[method-assign]
        s3fs.S3FileSystem._call_s3 = async_call  # type: ignore[method-assign]
    main(sys.argv[3:])
