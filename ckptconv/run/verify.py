"""verify: do two checkpoints hold the same tensors? Any format on either side, bit-exact by default.

Each side (DCP directory, HF directory, .safetensors file, hub repo id) is opened as a `sides.Side`: its
tensors under HF key names and a way to read one whole tensor. A DCP side goes through the same selection (the
`model` group, `--prefix`) and key mapping as dcp-to-hf, dtypes kept, so a conversion's output is compared
with exactly what it was made from. Keys are shared out over the ranks (largest first, like output files);
each rank reads and compares its keys one at a time (memory: the tensor pair being compared) and the
findings are gathered on every rank, so the verdict does not depend on the number of ranks.

What matches is `compare.compare`'s rule (bit for bit by default, or a tolerance), applied a slab at a
time: a rank holds the tensor pair it compares plus one slab's temporaries.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptconv.core.keyorder import natural_key
from ckptconv.errors import VerifyMismatch
from ckptconv.formats.files import exists
from ckptconv.formats.hf import checkpoint_root
from ckptconv.job.ui import Ui
from ckptconv.job.world import World, everyone
from ckptconv.mapping import load_config
from ckptconv.options import VerifyOptions
from ckptconv.plan.to_hf import assign_owners
from ckptconv.remote.urls import is_url
from ckptconv.run.compare import Finding, Tolerance, compare, describe
from ckptconv.run.sides import Side, dequantized_notes, open_sides
from ckptconv.source.locate import any_source, for_all


@dataclass
class Report:
    a: str
    b: str
    compared: int
    nbytes: int
    findings: list[Finding]
    tolerance: Tolerance | None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    untied: list[str] = field(default_factory=list)  # of `notes`: tied output heads left out (`tied`)

    @property
    def match(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {
            "command": "verify",
            "a": self.a,
            "b": self.b,
            "match": self.match,
            "compared": self.compared,
            "compared_bytes": self.nbytes,
            "mismatches": [asdict(f) for f in self.findings],
            "tolerance": asdict(self.tolerance) if self.tolerance else None,
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
        }


def verify_sides(a: Side, b: Side, world: World, ui: Ui, tolerance: Tolerance | None = None) -> Report:
    """Collective: compare every key (this rank's share, with a progress display); the same `Report` on every
    rank."""
    start = time.perf_counter()
    untied = a.untied(world) + b.untied(world)
    keys = sorted(a.shapes.keys() | b.shapes.keys(), key=natural_key)
    findings = [
        Finding(k, "only_in_a" if k in a.shapes else "only_in_b", _side(a, k), _side(b, k))
        for k in keys
        if (k in a.shapes) != (k in b.shapes)
    ]
    common = [k for k in keys if k in a.shapes and k in b.shapes]
    sizes = [max(_nbytes(a, k), _nbytes(b, k)) for k in common]
    owners = assign_owners(sizes, world.size)
    own = [k for k, owner in zip(common, owners, strict=True) if owner == world.rank]
    mine: list[Finding] = []
    error: Exception | None = None
    progress_label = f"rank {world.rank} of {world.size}: verifying"
    with ui.bytes_progress(progress_label, sum(_nbytes(b, k) for k in own)) as progress:
        try:
            for key in own:  # from object storage, neighbouring tensors are then fetched together
                a.expect(key)
                b.expect(key)
            for key in own:
                if a.shapes[key][0] != b.shapes[key][0]:
                    mine.append(Finding(key, "shape", _side(a, key), _side(b, key)))
                    continue
                finding = compare(key, a.read(key), b.read(key), tolerance)
                if finding is not None:
                    mine.append(finding)
                progress.advance(_nbytes(b, key))
        except Exception as e:  # every rank must reach the gather below
            error = e
    world.agree(error)
    a.check_pieces(world)  # chunks read in pieces (split experts) against their CRC-32
    b.check_pieces(world)
    for part in world.all_gather_object(mine):
        findings.extend(part)
    order = {k: i for i, k in enumerate(keys)}
    findings.sort(key=lambda f: order[f.key])
    seconds = time.perf_counter() - start
    notes = dequantized_notes(a, b) + untied
    nbytes = sum(sizes)
    return Report(str(a.path), str(b.path), len(common), nbytes, findings, tolerance, seconds, notes, untied)


def _side(side: Side, key: str) -> dict[str, Any] | None:
    if key not in side.shapes:
        return None
    shape, dtype = side.shapes[key]
    return describe(shape, dtype)


def _nbytes(side: Side, key: str) -> int:
    shape, dtype = side.shapes[key]
    return math.prod(shape) * dtype.itemsize


def verify(a: str, b: str, options: VerifyOptions = VerifyOptions(), *, world: World, ui: Ui) -> Report:
    """Collective: compare checkpoint `a` with `b` (paths or hub repo ids) as `options` say. Rank 0
    downloads repo ids."""
    mapping = options.mapping
    path_a, path_b = locate(world, a, b, options)

    def prepare() -> tuple[Side, Side]:
        return open_sides(
            path_a,
            path_b,
            prefix=mapping.prefix,
            mapping=mapping.mapping,
            config=model_config(path_a, path_b, options),
            allow_unmapped=mapping.allow_unmapped,
            lora=options.lora,
            megatron_tp=options.megatron_tp,
        )

    side_a, side_b = everyone(world, prepare)
    try:
        return verify_sides(side_a, side_b, world, ui, tolerance_of(options))
    finally:
        side_a.close()
        side_b.close()


def locate(world: World, a: str, b: str, options: VerifyOptions) -> tuple[Path, Path]:
    """Collective: where A and B are (rank 0 downloads hub repo ids, `--revision` for those among them)."""

    def where(src: str) -> Path:
        return any_source(src, None if exists(Path(src)) or is_url(src) else options.revision)

    return for_all(world, lambda: (where(a), where(b)))


def model_config(path_a: Path, path_b: Path, options: VerifyOptions) -> dict[str, Any]:
    """The model config a mapping reads: `--config`, else the config.json beside A, else beside B."""
    config = options.mapping.config
    beside = ((p / "config.json", checkpoint_root(p)) for p in (path_a, path_b) if exists(p / "config.json"))
    found = (config, None) if config else next(beside, (None, None))
    return load_config(*found)


def tolerance_of(options: VerifyOptions) -> Tolerance | None:
    """The tolerance `options` give (None: bit for bit)."""
    return None if options.bit_for_bit else Tolerance(options.atol or 0.0, options.rtol or 0.0)


def check_output(source: Side, output: Side, world: World, ui: Ui) -> None:
    """Collective, for `--verify`: raise VerifyMismatch (exit 1) unless `output` holds `source`'s tensors."""
    try:
        report = verify_sides(source, output, world, ui)
    finally:
        source.close()
        output.close()
    if not report.match:
        first, more = report.findings[0], len(report.findings) - 1
        raise VerifyMismatch(
            f"--verify: the output differs from {source.path}: {first.line()}"
            + (f" (and {more} more)" if more else "")
            + "; nothing was written"
        )
    quantized = f" ({len(source.dequantized)} FP8 weights as the source's block-FP8 round trip)"
    ui.info(
        f"verified: {report.compared} tensors match the source bit for bit"
        + (quantized if source.dequantized else "")
        + source.encoded_note
        + "".join(f"; {note}" for note in report.untied)
    )
