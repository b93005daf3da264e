"""A reference model as planning sees it (`Base`: its keys, shapes, dtypes and files, from its index and
headers), what a conversion asks of it (`Following`, its messages worded by `Words`), and what a plan took
from it (`Adopted`). Pure data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Words:
    """How the reference's messages name the options: dcp-to-hf's flags (`FLAG_WORDS`), or save_hf's
    keywords (`KEYWORD_WORDS`)."""

    lead: str = ""
    """Put before every refusal ("save_hf: ")."""
    assign: str = " "
    """Between an option and its value: `--reference BASE`, `reference=BASE`."""
    reference: str = "--reference"
    """The option naming a reference alone."""
    copy_from: str = "--copy-from"
    """The option naming a model whose files are copied (and, holding weights, the reference)."""
    file_split: str = "--file-split"
    """The option choosing the file split."""
    split_reference: str = "--file-split reference"
    """The file split by the reference."""
    split_size: str = "--file-split size"
    """The file split by size."""
    lora_adapter: str = "--lora adapter"
    """Writing a LoRA adapter."""
    allow: str = "--allow-layout-change"
    """The option allowing a layout that differs from the reference."""
    fixes: str = "--prefix, --mapping or --hf-experts"
    """The options that change the output's keys and shapes."""
    out: str = "OUT"
    """The output, in the refusal."""
    dtypes: str = "--dtype and --fp32"
    """The options choosing the output's dtypes."""


FLAG_WORDS = Words()
KEYWORD_WORDS = Words(
    lead="save_hf: ",
    assign="=",
    reference="reference",
    copy_from="copy_from",
    file_split="file_split",
    split_reference="file_split='reference'",
    split_size="file_split='size'",
    lora_adapter="lora='adapter'",
    allow="allow_layout_change=True",
    fixes="mapping or hf_experts",
    out="the output",
    dtypes="dtype and fp32",
)


@dataclass(frozen=True)
class Following:
    """What a conversion asks of its reference: which directory (if any) it is, and how it is followed and
    checked (dcp-to-hf's flags, save_hf's keywords)."""

    reference: Path | None = None
    """The reference named alone (`--reference`)."""
    copy_from: Path | None = None
    """The model whose files are copied: the reference when it holds weights and `reference` is None."""
    by_files: bool = False
    """Each tensor into the reference's file for it (`--file-split reference`)."""
    adapter: bool = False
    """A LoRA adapter is written: its keys are no base's, so nothing is followed or compared."""
    allow_layout_change: bool = False
    """Write an output whose keys or shapes differ from the reference, each difference a warning."""
    quantized: bool = False
    """The output is quantized (`--quantize`): its dtypes differ on purpose, so neither followed nor
    compared."""
    words: Words = FLAG_WORDS
    """How the messages name the options."""


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
    words: Words = field(default=FLAG_WORDS, compare=False)
    """How messages about it name the options."""

    @property
    def text(self) -> str:
        """How messages name it: `--copy-from base/` (`copy_from=base/`)."""
        return f"{self.flag}{self.words.assign}{self.path}"


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
