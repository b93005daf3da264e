"""A non-tensor item's torch.save bytes loaded within the read limits, or kept as bytes and never loaded.

torch's weights_only load runs no code, but it is not bounded: `bytearray(n)` is allowed (gigabytes from a
few bytes of pickle), `set` and `OrderedDict` copy a memoized list as often as the stream asks, and a
deflated `data.pkl` inflates to whatever the zip declares. So an item is first read with stand-ins
(formats/opaque.scan), its zip and pickle charged to one `limits.Budget`; torch.load sees it only when that
read stayed within the limits, the zip declares no more than the budget has left, and every global the
pickle names has a stand-in that charged what the real call builds. An item naming anything else is kept
as its bytes (the caller stashes them) with the names as the reason, as when weights_only refuses it.
"""

from __future__ import annotations

import io
from typing import Any

from ckptconv.errors import CkptconvError
from ckptconv.formats.opaque import scan
from ckptconv.formats.safe_pickle import trusted
from ckptconv.formats.torch_zip import TorchZip
from ckptconv.job.limits import Budget


def load_item(raw: bytes, fqn: str, where: object) -> tuple[Any, str | None]:
    """(the value of the item `fqn` stored as `raw` in `where`, None) once loaded, or (None, why not)."""
    import torch

    budget = Budget(where)
    why = _why_not(raw, budget)
    if why is None or (trusted() is not None and raw[:4] == _ZIP):  # --trust-pickle: the user vouches for it
        TorchZip(raw, where, budget).check_declared(budget.bytes_left())
    if why is None:
        try:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True), None
        except Exception as e:
            why = f"is not loadable with weights_only ({type(e).__name__})"
    loaded = trusted()
    if loaded is None:
        return None, why
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
    except Exception as e:
        raise CkptconvError(f"{fqn!r}: cannot be loaded even with --trust-pickle ({str(e)[:200]})") from None
    loaded.append(f"{fqn} ({why.removeprefix('holds ')})")
    return value, None


_ZIP = b"PK\x03\x04"


def _why_not(raw: bytes, budget: Budget) -> str | None:
    """Why torch.load may not be given `raw` (None: it may), from a read with stand-ins within `budget`."""
    if raw[:4] != _ZIP:  # the legacy format: several pickles, only the first of which a scan would read
        return "is not a torch.save zip"
    try:
        scanned = scan(raw, budget)
    except CkptconvError:
        raise  # a limit: the item is refused, not kept
    except Exception as e:  # whatever the pickle or the zip is: kept as bytes, never loaded
        return f"is not a readable torch.save record ({type(e).__name__})"
    unmodeled = scanned.unmodeled()
    return f"holds {', '.join(unmodeled)}" if unmodeled else None
