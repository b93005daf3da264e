"""The `torch.save` zip container a pickle travels in (Megatron's `common.pt`, a DCP non-tensor item): its
record names taken from torch.save's own output, the pickle as `data.pkl`, tensor storages as `data/KEY`; or
a spoilt container: deflated, a bare pickle, two data.pkl, none, cut short, a 300 MB zip bomb."""

from __future__ import annotations

import functools
import io
import zipfile

from fuzz_oracle import mostly


def storage_records() -> dict[str, bytes]:
    return {"0": b"\0" * 16, "1": b"", "3": b"\1" * 4}


@functools.cache
def _template() -> list[str]:
    """The record names of a torch.save file, from torch.save itself (`archive/data.pkl`, ...)."""
    import torch

    buf = io.BytesIO()
    torch.save(0, buf)
    return zipfile.ZipFile(buf).namelist()


@functools.cache
def _bomb(prefix: str, inflated: int) -> bytes:
    """A torch.save zip whose data.pkl is a valid pickle of 0 padded to `inflated` bytes of zeros (deflated:
    about a thousandth of that on disk)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open(f"{prefix}/data.pkl", "w", force_zip64=True) as f:
            f.write(b"\x80\x02K\x00.")
            zeros = bytes(2**20)
            for _ in range(inflated // len(zeros)):
                f.write(zeros)
        for name in _template():
            if not name.endswith("data.pkl"):
                z.writestr(name, _record(name))
    return buf.getvalue()


def _record(name: str) -> bytes:
    tail = name.rsplit("/", 1)[-1]
    return {"byteorder": b"little", "version": b"3\n", ".format_version": b"1"}.get(tail, b"0")


SPOILT = ["deflated", "raw", "two", "none", "truncated", "bomb"]
CONTAINERS = mostly("zip", SPOILT)


def container(kind: str, pkl: bytes) -> bytes:
    """`pkl` as torch.save would hold it (`zip`), or a spoilt variant: deflated, a bare pickle, two data.pkl,
    none, the zip cut short, or a 300 MB zip bomb of zeros (the pickle ignored)."""
    names = _template()
    prefix = names[0].split("/", 1)[0]
    if kind == "raw":
        return pkl
    if kind == "bomb":
        return _bomb(prefix, 300 * 2**20)
    buf = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if kind == "deflated" else zipfile.ZIP_STORED
    with zipfile.ZipFile(buf, "w", method) as z:
        for name in names:
            if name.endswith("data.pkl"):
                if kind != "none":
                    z.writestr(name, pkl)
                if kind == "two":
                    z.writestr(f"{prefix}2/data.pkl", pkl)
            else:
                z.writestr(name, _record(name))
        for key, data in storage_records().items():
            z.writestr(f"{prefix}/data/{key}", data)
    raw = buf.getvalue()
    return raw[: len(raw) // 2] if kind == "truncated" else raw
