"""DeepSpeed's enums as Python 3.11.2 (CI's) pickles them, `getattr(ZeroStageEnum, "gradients")`, read by the
allowlist of formats/deepspeed_pickle.py; any other getattr refused. (3.11.7 pickles them as
`ZeroStageEnum(2)`, which the DeepSpeed tests' checkpoints hold on this machine.)"""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path

import pytest
import torch

from ckptconv.errors import CkptconvError
from ckptconv.formats.deepspeed_pickle import read_pickled


class _ByName(int, enum.Enum):
    def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
        return getattr, (self.__class__, self._name_)


def _fake_module(name: str, cls_name: str, members: dict[str, object], base: type) -> type:
    module = types.ModuleType(name)
    cls = enum.Enum(cls_name, members, type=base, module=name)  # type: ignore[call-overload]
    cls.__reduce_ex__ = _ByName.__reduce_ex__
    setattr(module, cls_name, cls)
    sys.modules[name] = module
    return cls


def test_an_enum_pickled_by_name_is_read_and_any_other_getattr_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    stages = {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3}
    zero = _fake_module("deepspeed.runtime.zero.config", "ZeroStageEnum", stages, int)

    class Sneaky:  # getattr of an allowed class, but no member of it: a way to reach its methods
        def __reduce_ex__(self, protocol: object) -> tuple[object, ...]:
            return getattr, (zero, "mro")

    try:
        torch.save({"zero_stage": zero["gradients"], "w": torch.ones(2)}, tmp_path / "states.pt")
        torch.save({"x": Sneaky()}, tmp_path / "sneaky.pt")
    finally:
        sys.modules.pop("deepspeed.runtime.zero.config", None)
    assert b"getattr" in (tmp_path / "states.pt").read_bytes()
    assert read_pickled(tmp_path, "states.pt").value["zero_stage"] == 2
    with pytest.raises(CkptconvError, match="getattr"):
        read_pickled(tmp_path, "sneaky.pt")
