"""verify --layout: do two checkpoints have the same layout? Key names, shapes, dtypes and, for two HF
directories, the file split (which file holds each key), from the index, the safetensors headers and
`.metadata` alone: no tensor bytes are read. For CI: a release against its base model.

An HF side is its headers as stored: a quantized weight and its scale are two keys, each in its stored dtype.
A DCP side is seen as `verify` sees it (the `model` group or `--prefix`, stripped; with `--mapping`, under HF
names in the other side's expert form; `--lora`), in the dtypes of its `.metadata`. The differences use
`verify`'s vocabulary (only_in_a, only_in_b, shape, and here dtype and file) and exit codes: 0 the same
layout, 1 a difference, 2 bad input.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ckptconv.core.dtype_names import short_name
from ckptconv.core.keyorder import natural_key
from ckptconv.core.specs import HfCheckpoint
from ckptconv.errors import CkptconvError
from ckptconv.formats.dcp import is_dcp_dir, open_dcp
from ckptconv.formats.files import is_directory
from ckptconv.formats.hf import open_hf
from ckptconv.job.world import World, everyone, from_main
from ckptconv.options import VerifyOptions
from ckptconv.plan.reference import compare
from ckptconv.run.compare import Finding
from ckptconv.run.sides import dcp_outs
from ckptconv.run.verify import Report, locate, model_config
from ckptconv.source.hub_reference import HubBase, fetch
from ckptconv.source.locate import for_all

Layout = dict[str, tuple[tuple[int, ...], str, str | None]]  # key -> (shape, dtype name, file or None)
# plan.reference's kinds, A as the planned side and B as the reference
_KINDS = {"extra": "only_in_a", "missing": "only_in_b", "shape": "shape", "dtype": "dtype"}
_ORDER = ("only_in_a", "only_in_b", "shape", "dtype", "file")


class LayoutReport(Report):
    """`verify --layout`'s report: `Report`'s fields (nothing compared byte by byte), `layout` true."""

    def to_json(self) -> dict[str, Any]:
        doc = super().to_json()
        return {"command": doc.pop("command"), "layout": True, **doc}


def hf_layout(path: Path, headers: HfCheckpoint | None = None) -> Layout:
    """An HF directory's or file's tensors as stored (a quantized weight's parts each a key), each with its
    file name in a directory (None for a single file: no split to compare); `headers`: a hub repo's, read
    already (`path` its snapshot folder)."""
    directory = is_directory(path)
    found: Layout = {}
    for logical in (open_hf(path) if headers is None else headers).tensors.values():
        for t in logical.quant.parts if logical.quant is not None else (logical,):
            found[t.key] = (t.shape, t.dtype_name, t.file.name if directory else None)
    return found


def dcp_layout(
    path: Path, options: VerifyOptions, config: dict[str, object], like: Layout | None, notes: list[str]
) -> Layout:
    """A DCP directory's tensors as `verify` names them, in `.metadata`'s dtypes (with a mapping, in the
    expert form that shares the most keys with the other side's `like`); what is left out, in `notes`."""
    m = options.mapping
    outs, heads = dcp_outs(
        open_dcp(path),
        m.prefix,
        m.mapping,
        config,
        m.allow_unmapped,
        like=None if like is None else like.keys(),
        lora=options.lora,
    )
    if heads:  # whether a head differs from its embedding is a question of values: verify without --layout
        notes.append(
            f"{path}: {len(heads)} output head(s) tie_word_embeddings leaves out are not keys here "
            "(--layout reads no values to tell whether they differ from the embedding)"
        )
    return {key: (t.shape, short_name(t.dtype), None) for key, t in outs.items()}


def differences(a: Layout, b: Layout) -> list[Finding]:
    """Every layout difference of A from B, in key order (natural), then by kind."""

    def side(layout: Layout, key: str) -> dict[str, object] | None:
        if key not in layout:
            return None
        shape, dtype, file = layout[key]
        return {"shape": list(shape), "dtype": dtype, **({"file": file} if file is not None else {})}

    tensors = {k: (v[0], v[1]) for k, v in a.items()}, {k: (v[0], v[1]) for k, v in b.items()}
    found = [Finding(d.key, _KINDS[d.kind], side(a, d.key), side(b, d.key)) for d in compare(*tensors)]
    for key in a.keys() & b.keys():
        file_a, file_b = a[key][2], b[key][2]
        if file_a is not None and file_b is not None and file_a != file_b:
            found.append(Finding(key, "file", side(a, key), side(b, key)))
    return sorted(found, key=lambda f: (natural_key(f.key), _ORDER.index(f.kind)))


def compare_layouts(
    path_a: Path,
    path_b: Path,
    options: VerifyOptions,
    hub: tuple[HubBase | None, HubBase | None] = (None, None),
) -> LayoutReport:
    """The layout report of A against B (rank 0's work: headers and `.metadata` only); `hub`: the repo ids
    among them, whose paths are their snapshot folders, with their headers read."""
    start = time.perf_counter()
    if options.mapping.mapping and not (is_dcp_dir(path_a) or is_dcp_dir(path_b)):
        raise CkptconvError("--mapping applies to DCP checkpoints; neither A nor B is one")
    layouts: list[Layout | None] = [None, None]
    for i, (path, repo) in enumerate(zip((path_a, path_b), hub, strict=True)):
        if repo is not None:
            layouts[i] = hf_layout(path, repo.checkpoint)
        elif not is_dcp_dir(path):
            layouts[i] = hf_layout(path)
    config = model_config(path_a, path_b, options)
    notes: list[str] = []
    for i, path in enumerate((path_a, path_b)):
        if layouts[i] is None:
            layouts[i] = dcp_layout(path, options, config, layouts[1 - i], notes)
    a, b = layouts
    assert a is not None and b is not None
    findings = differences(a, b)
    if not all(file is not None for layout in (a, b) for _, _, file in layout.values()):
        notes.append("file split not compared: A and B are not both HF directories")
    compared = len(a.keys() & b.keys())
    seconds = time.perf_counter() - start
    name_a, name_b = (str(p) if h is None else h.given for p, h in zip((path_a, path_b), hub, strict=True))
    return LayoutReport(name_a, name_b, compared, 0, findings, None, seconds, notes)


def verify_layout(a: str, b: str, options: VerifyOptions, *, world: World) -> LayoutReport:
    """Collective: compare the layouts of checkpoints `a` and `b` (paths or hub repo ids: their index,
    config.json and headers only, never a weight byte); rank 0 reads the headers and `.metadata`, every rank
    gets the same report."""

    def fetched() -> tuple[HubBase | None, HubBase | None]:
        found = fetch(a, None, revision=options.revision), fetch(b, None, revision=options.revision)
        for side in found:
            if side is not None and side.checkpoint is None:
                raise CkptconvError(f"{side.given}: holds no safetensors files; --layout compares HF models")
        return found

    hub = for_all(world, fetched)
    hub_a, hub_b = hub
    # a repo id is its snapshot folder from here on (nothing more is downloaded)
    where_a = a if hub_a is None else str(hub_a.directory)
    where_b = b if hub_b is None else str(hub_b.directory)
    path_a, path_b = locate(world, where_a, where_b, options)
    return everyone(world, from_main, world, lambda: compare_layouts(path_a, path_b, options, hub))
