"""A reference model as planning sees it (`Base`: its keys, shapes, dtypes and files, from its index and
headers), and what a plan took from it (`Adopted`). Pure data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Base:
    """A reference model as planning follows it, read from its index and safetensors headers alone."""

    flag: str
    """The flag that named it: --reference or --copy-from."""
    path: str
    """The directory (or hub repo id) as given."""
    tensors: dict[str, tuple[tuple[int, ...], str]]
    """key -> (shape, torch's dtype name), in file order, then the order of the data in each file."""
    files: dict[str, str]
    """key -> the name of the file holding it."""
    indexed: bool = True
    """It has a `model.safetensors.index.json` (False: one `.safetensors` file alone)."""

    @property
    def text(self) -> str:
        """How messages name it: `--copy-from base/`."""
        return f"{self.flag} {self.path}"


@dataclass
class Adopted:
    """What the plan took from the reference (the --json report's `reference.adopted`)."""

    experts: str | None = None
    """The HF form of the MoE experts its keys are in (None: not chosen by the reference)."""
    left_out: list[str] = field(default_factory=list)
    """Keys that only copy another written tensor, left out as the reference lacks them."""
    written: list[str] = field(default_factory=list)
    """Tied heads written as the reference holds them (tie_word_embeddings would leave them out)."""
    dtypes: dict[str, list[str]] = field(default_factory=dict)
    """dtype name -> the keys written in it as in the reference (where the default would differ)."""
    file_split: bool = False
    """Each tensor written to the file the reference names for it (`--file-split reference`)."""

    def to_json(self) -> dict[str, Any]:
        """The --json report's entry."""
        return {
            "experts": self.experts,
            "left_out": self.left_out,
            "written": self.written,
            "dtypes": self.dtypes,
            "file_split": self.file_split,
        }

    def lines(self, base: Base) -> list[str]:
        """The info lines to print: one for the layout adopted, one per dtype kept as in the reference."""
        said = []
        if self.experts is not None:
            said.append(f"experts {self.experts}")
        if self.left_out:
            said.append(f"{len(self.left_out)} copy(ies) left out ({_eg(self.left_out)})")
        if self.written:
            said.append(f"{len(self.written)} tied head(s) written ({_eg(self.written)})")
        if self.file_split:
            said.append("its file names")
        out = [f"{', '.join(said)} as in {base.text}"] if said else []
        for name, keys in self.dtypes.items():
            out.append(f"{len(keys)} tensor(s) kept {name} as in the reference ({_eg(keys)})")
        return out


def _eg(keys: Sequence[str]) -> str:
    return f"e.g. {keys[0]}" if len(keys) > 1 else keys[0]
