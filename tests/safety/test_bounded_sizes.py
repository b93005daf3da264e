"""Bounded work on sizes and patterns from the input (issue #34, item 3): sizes from config.json, mapping
expressions and shard file names are checked against the tensor and the destination before anything is
allocated or counted through; a chunk layout is checked for tiling in O(n log n); user regexes run in
linear time (RE2) with `re`'s results on ordinary patterns.

The exploits run under `bounded`: a time limit (SIGALRM: `re` checks signals while it backtracks) and an
address-space limit, so that the code before this change fails these tests instead of the machine."""

from __future__ import annotations

import json
import math
import re
import resource
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_bad_input import assert_one_line, run
from test_hf_to_dcp import load_plain
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from ckptconv.core import layout
from ckptconv.core.dtypes import DtypePolicy
from ckptconv.core.layout import tiling_problem
from ckptconv.core.user_regex import UserRegex
from ckptconv.errors import CkptconvError
from ckptconv.lora.settings import LoraSettings
from ckptconv.mapping import load_mapping
from ckptconv.mapping.patterns import Pattern
from ckptconv.mapping.rules import map_keys
from ckptconv.quant import fp8
from ckptconv.quant.policy import QuantPolicy

MEMORY = 2 * 2**30  # address space an exploit may add to the test process before it fails


@contextmanager
def bounded(seconds: float = 20.0, memory: int = MEMORY) -> Iterator[None]:
    """Run the body with at most `memory` more bytes of address space and `seconds` of time."""
    status = Path("/proc/self/status").read_text().splitlines()
    vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + memory if hard == resource.RLIM_INFINITY else min(vm + memory, hard)

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def mapping(tmp_path: Path, rules: str) -> object:
    path = tmp_path / "m.toml"
    path.write_text('[mapping]\nname = "t"\n' + rules)
    return load_mapping(str(path))


# -- weight_block_size from config.json ------------------------------------------------------------------


def fp8_source(path: Path, weight: torch.Tensor, scale: torch.Tensor, block: object) -> Path:
    """A block-FP8 HF directory saved by safetensors' own writer, its config.json saying `block`."""
    path.mkdir()
    save_file(
        {"a.weight": weight, "a.weight_scale_inv": scale},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    qc = {"quant_method": "fp8", "weight_block_size": block}
    (path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "quantization_config": qc}))
    return path


def test_an_fp8_block_larger_than_the_weight_dequantizes_in_the_weights_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A block of 10**9 (one block for any real weight) dequantizes with temporaries of the weight's size,
    to the values one block gives: the scale times each value, rounded once."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(5, 7, generator=g) * 100).to(fp8.FP8)
    scale = torch.tensor([[0.037]])
    src = fp8_source(tmp_path / "src", weight, scale, [10**9, 10**9])
    with bounded():
        code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
    assert code == 0, err
    got = load_plain(tmp_path / "out")["a.weight"]
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got, (weight.float() * scale).to(torch.bfloat16))


@pytest.mark.parametrize(
    ("block", "shown"),
    [
        ([128] * 200_000, "[128, 128, 128"),  # a huge list: named in a line of normal length
        ([10**30, 10**30], "[1000000000000000000000000000000, "),  # beyond int64
        ([2**31 + 1, 2**31 + 1], "[2147483649, 2147483649]"),  # beyond any weight, up to torch's int64
    ],
)
def test_a_weight_block_size_out_of_range_is_one_short_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], block: list[int], shown: str
) -> None:
    src = fp8_source(tmp_path / "src", torch.zeros(4, 4).to(fp8.FP8), torch.ones(1, 1), block)
    with bounded():
        code, err = run(capsys, "hf-to-dcp", str(src), str(tmp_path / "out"))
    assert_one_line(code, err, "config.json", "weight_block_size", shown, "1 <= n <= 2147483648")
    assert len(err) < 400 and not (tmp_path / "out").exists()


# -- sizes of mapping rules: from config.json, expressions and the tensor ---------------------------------


def test_a_rope_rule_on_an_empty_tensor_of_2_30_rows_is_planned_without_its_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchtitan-llama3's q permutation on an empty [2**30, 0] wq (its rows are in no byte of the file):
    no permutation is made for it, both ways, and the tensor keeps its shape."""
    ckpt = tmp_path / "ckpt"
    state = {
        "layers.0.attention.qkv_linear.wq.weight": torch.empty(2**30, 0),
        "tok_embeddings.weight": torch.ones(4, 2),
    }
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8}))
    hf, back = tmp_path / "hf", tmp_path / "back"
    with bounded():
        code, err = run(
            capsys, "dcp-to-hf", str(ckpt), str(hf), "--mapping", "torchtitan-llama3", "--config", str(config)
        )
        assert code == 0, err
        shutil.copy(config, hf / "config.json")
        code, err = run(capsys, "hf-to-dcp", str(hf), str(back), "--mapping", "torchtitan-llama3", "--verify")
        assert code == 0, err
    assert load_file(hf / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"].shape == (2**30, 0)
    assert load_plain(back)["layers.0.attention.qkv_linear.wq.weight"].shape == (2**30, 0)  # type: ignore[union-attr]


def test_heads_from_config_are_never_counted_through_on_an_empty_tensor(tmp_path: Path) -> None:
    m = mapping(tmp_path, '[[rule]]\nruntime = "wq"\nhf = "q"\npermute = "q"\n')
    with bounded():
        mapped = map_keys(m, "to_hf", {"wq": (0, 4096)}, {"num_attention_heads": 10**18})  # type: ignore[arg-type]
    assert mapped.targets[0].shape == (0, 4096) and mapped.targets[0].parts[0].perm is None


STACK = '[[rule]]\nruntime = "w"\nhf = "e.{e}.w"\nstack = "e"\n'
GROUPS = '[[rule]]\nruntime = "w"\nhf = ["q", "k", "v"]\ngroups = "groups"\n'
SIZES = '[[rule]]\nruntime = "w"\nhf = ["q", "k"]\nsizes = ["big * big * big", "0"]\n'
NARROW = '[[rule]]\nruntime = "w"\nhf = "x"\nnarrow = "vocab_size"\nmultiple = "multiple"\n'
PERMUTE = '[[rule]]\nruntime = "w"\nhf = "x"\npermute = "q"\n'


@pytest.mark.parametrize(
    ("rules", "direction", "shape", "config", "needles"),
    [
        (STACK, "to_hf", (2**30, 0), {}, ["[1073741824, 0] holds no data", "1073741824 blocks"]),
        (GROUPS, "to_hf", (6, 4), {"groups": 0}, ["does not split into 0 groups"]),
        (GROUPS, "to_hf", (0, 4), {"groups": 10**15}, ["holds no data", "1000000000000000 blocks"]),
        (SIZES, "to_hf", (6, 4), {"big": 10**1500}, ["config key 'big' is larger than any tensor dim"]),
        (SIZES, "to_hf", (6, 4), {"big": 2**30}, ["size 'big * big * big' is larger than any tensor dim"]),
        (NARROW, "to_hf", (16, 4), {"vocab_size": -1, "multiple": 8}, ["narrow keeps -1 of dim 0"]),
        (
            NARROW,
            "to_runtime",
            (2**62 + 2, 0),
            {"vocab_size": 2**62 + 2, "multiple": 2**62 + 1},
            ["over 2**63"],
        ),
        (PERMUTE, "to_hf", (), {"num_attention_heads": 1}, ["0-d tensor"]),
    ],
)
def test_sizes_from_config_are_checked_against_the_tensor(
    tmp_path: Path, rules: str, direction: str, shape: tuple[int, ...], config: dict, needles: list[str]
) -> None:
    """A size from config.json or a mapping expression that the tensor does not back (an empty tensor's
    dims, a division by zero, a padding of terabytes, a number of thousands of digits) is one error."""
    m = mapping(tmp_path, rules)
    key = "w" if direction == "to_hf" else "x"
    with bounded(), pytest.raises(CkptconvError) as e:
        map_keys(m, direction, {key: shape}, config)  # type: ignore[arg-type]
    assert all(n in str(e.value) for n in needles), str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_a_padding_is_checked_against_the_tensor_it_pads(tmp_path: Path) -> None:
    """Megatron's padding of a tiny vocabulary (50 rows to a multiple of 128 * 8: 974 rows of zeros) is made;
    a multiple from config.json that would add more zeros than the tensor and 2**24 together is refused."""
    m = mapping(tmp_path, NARROW)
    out = map_keys(m, "to_runtime", {"x": (50, 4)}, {"vocab_size": 50, "multiple": 128 * 8})  # type: ignore[arg-type]
    assert out.targets[0].shape == (1024, 4)
    with (
        bounded(),
        pytest.raises(CkptconvError, match=r"adds 3999999800 zeros, more than the tensor's own 200"),
    ):
        map_keys(m, "to_runtime", {"x": (50, 4)}, {"vocab_size": 50, "multiple": 10**9})  # type: ignore[arg-type]


# -- shard files of torch's distributed HF writer named with a huge rank ----------------------------------


def test_a_shard_file_named_with_a_huge_rank_is_a_missing_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = tmp_path / "shards"
    writer = HuggingFaceStorageWriter(str(shards), save_distributed=True)
    dcp.save({"a.weight": torch.randn(4, 3), "b": torch.arange(5)}, storage_writer=writer, no_dist=True)
    (first,) = shards.iterdir()
    assert first.name == "shard-00001-model-00001-of-00001.safetensors"
    for rank in ("99999999999999", "9" * 200):
        name = f"shard-{rank}-model-00001-of-00001.safetensors"
        shutil.copy(first, shards / name)
        with bounded():
            code, err = run(capsys, "dcp-to-hf", str(shards), str(tmp_path / "out"))
        assert_one_line(code, err, "no shard file of rank 2", "incomplete")
        (shards / name).unlink()
    code, err = run(capsys, "dcp-to-hf", str(shards), str(tmp_path / "out"))
    assert code == 0, err


# -- tiling in O(n log n) ---------------------------------------------------------------------------------

Box = tuple[tuple[int, ...], tuple[int, ...]]


def reference(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    """What a tiling check must say, by counting how often each element is covered (duplicates and empty
    blocks count for nothing): None, "outside", "hole" or "overlap" (as tiling_problem orders them)."""
    unique = [b for b in dict.fromkeys(boxes) if math.prod(b[1])]
    if any(
        s < 0 or o < 0 or o + s > n
        for offsets, sizes in unique
        for o, s, n in zip(offsets, sizes, shape, strict=True)
    ):
        return "outside"
    count: dict[tuple[int, ...], int] = {}
    for offsets, sizes in unique:
        for cell in _cells(offsets, sizes):
            count[cell] = count.get(cell, 0) + 1
    covered, total = sum(count.values()), math.prod(shape)
    if covered != total:
        return "hole" if covered < total else "overlap"
    return None if all(n == 1 for n in count.values()) else "overlap"


def _cells(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    cells: list[tuple[int, ...]] = [()]
    for o, s in zip(offsets, sizes, strict=True):
        cells = [(*c, i) for c in cells for i in range(o, o + s)]
    return cells


def _guillotine(draw: st.DrawFn, offsets: tuple[int, ...], sizes: tuple[int, ...], depth: int) -> list[Box]:
    """A tiling of the block by recursive cuts (each piece may be cut again along any dim)."""
    dims = [d for d, s in enumerate(sizes) if s > 1]
    if not dims or depth == 0 or draw(st.integers(0, 4)) == 0:
        return [(offsets, sizes)]
    d = draw(st.sampled_from(dims))
    at = draw(st.integers(1, sizes[d] - 1))
    lo = (offsets, (*sizes[:d], at, *sizes[d + 1 :]))
    hi = ((*offsets[:d], offsets[d] + at, *offsets[d + 1 :]), (*sizes[:d], sizes[d] - at, *sizes[d + 1 :]))
    return _guillotine(draw, *lo, depth - 1) + _guillotine(draw, *hi, depth - 1)


def _pinwheel(rows: int, cols: int, x1: int, x2: int, y1: int, y2: int) -> list[Box]:
    """Five blocks around a centre: a tiling no straight cut separates."""
    return [
        ((0, 0), (x1, y2)),
        ((0, y2), (x2, cols - y2)),
        ((x2, y1), (rows - x2, cols - y1)),
        ((x1, 0), (rows - x1, y1)),
        ((x1, y1), (x2 - x1, y2 - y1)),
    ]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """Tilings (grids, recursive cuts, pinwheels, up to 4-D) and edits of them that make every kind of
    hole, overlap and out-of-bounds block, next to arbitrary blocks."""
    rank = draw(st.sampled_from([1, 2, 2, 2, 3, 3, 4]))
    shape = tuple(draw(st.integers(0 if rank > 1 else 1, 8)) for _ in range(rank))
    kind = draw(st.sampled_from(["cuts", "cuts", "pinwheel", "random"]))
    if kind == "pinwheel" and rank == 2 and min(shape) >= 3:
        x1, x2 = sorted(draw(st.lists(st.integers(1, shape[0] - 1), min_size=2, max_size=2, unique=True)))
        y1, y2 = sorted(draw(st.lists(st.integers(1, shape[1] - 1), min_size=2, max_size=2, unique=True)))
        boxes = _pinwheel(*shape, x1, x2, y1, y2)
    elif kind == "random":
        box = (
            st.tuples(*(st.integers(-1, n) for n in shape)),
            st.tuples(*(st.integers(-1, n + 1) for n in shape)),
        )
        boxes = draw(st.lists(st.tuples(*box), max_size=6))
    else:
        boxes = _guillotine(draw, (0,) * rank, shape, depth=draw(st.integers(1, 6)))
    for _ in range(draw(st.integers(0, 2))):
        boxes = _edit(draw, shape, boxes)
    return shape, draw(st.permutations(boxes))


def _edit(draw: st.DrawFn, shape: tuple[int, ...], boxes: list[Box]) -> list[Box]:
    if not boxes:
        return boxes
    i = draw(st.integers(0, len(boxes) - 1))
    (offsets, sizes), d = boxes[i], draw(st.integers(0, len(shape) - 1))
    edit = draw(
        st.sampled_from(["drop", "repeat", "move", "slide", "slide", "grow", "shrink", "add", "trade"])
    )
    if edit == "drop":
        return boxes[:i] + boxes[i + 1 :]
    if edit == "repeat":
        return [*boxes, boxes[i]]
    if edit == "add":
        return [*boxes, ((0,) * len(shape), tuple(draw(st.integers(0, n)) for n in shape))]
    step = draw(st.sampled_from([-1, 1]))
    if edit == "slide":  # moved by one, inside the tensor where it can be: an overlap and a hole alike
        step = 1 if offsets[d] + sizes[d] < shape[d] else -1
        edit = "move"
    if edit == "trade":  # one block grows by a slab of another's size along `d`: the same elements in all
        j = draw(st.integers(0, len(boxes) - 1))
        (o2, s2), slab = boxes[j], math.prod(sizes[:d] + sizes[d + 1 :])
        if j == i or slab == 0 or sizes[d] <= 0 or s2[d] <= 0 or math.prod(s2[:d] + s2[d + 1 :]) != slab:
            return boxes
        out = list(boxes)
        out[i] = (offsets, (*sizes[:d], sizes[d] + 1, *sizes[d + 1 :]))
        out[j] = (o2, (*s2[:d], s2[d] - 1, *s2[d + 1 :]))
        return out
    if edit == "move":
        return [*boxes[:i], ((*offsets[:d], offsets[d] + step, *offsets[d + 1 :]), sizes), *boxes[i + 1 :]]
    change = 1 if edit == "grow" else -1
    return [*boxes[:i], (offsets, (*sizes[:d], sizes[d] + change, *sizes[d + 1 :])), *boxes[i + 1 :]]


@settings(max_examples=1000, deadline=None)
@given(layouts())
def test_tiling_verdicts_are_the_counted_ones(case: tuple[tuple[int, ...], list[Box]]) -> None:
    """The tiling check (exact corner counts, and the polynomial at a random point it uses past
    `CORNER_DIMS` cut dims) says what counting covered elements says; an element it names as covered twice,
    or not at all, is."""
    shape, boxes = case
    want = reference(shape, boxes)
    got = tiling_problem(shape, boxes)
    assert (got is None) == (want is None) and (want is None or want in (got or "")), (shape, boxes, got)
    with mock.patch.object(layout, "CORNER_DIMS", 0):
        forced = tiling_problem(shape, boxes)
    assert (forced is None) == (want is None) and (want is None or want in (forced or "")), (
        shape,
        boxes,
        forced,
    )
    named = re.search(r"(holds? element|but not) \[([0-9, ]*)\]", got or "")
    if named:
        point = tuple(int(v) for v in named.group(2).split(","))
        covering = [b for b in dict.fromkeys(boxes) if math.prod(b[1]) and point in _cells(*b)]
        assert len(covering) == 0 if named.group(1) == "but not" else len(covering) >= 2, (got, boxes)


def brick_wall(rows: int, per_row: int, width: int) -> list[Box]:
    """Each row cut in `per_row` blocks at its own places: no two rows share a cut, so the grid of all cuts
    has rows * (rows * per_row) cells, and no block is one cell of it."""
    boxes = []
    for r in range(rows):
        cuts = [0, *(k * width // per_row + r + 1 for k in range(1, per_row)), width]
        boxes += [((r, a), (1, b - a)) for a, b in pairwise(cuts)]
    return boxes


@contextmanager
def python_steps(budget: int, path: str) -> Iterator[list[int]]:
    """Count the lines of Python run in `path` (a list of one count), failing past `budget`: work in pairs
    of blocks or cells of a grid is Python lines each, so a quadratic check exceeds any small budget."""
    steps = [0]

    def line(frame: object, event: str, arg: object) -> object:
        if event == "line":
            steps[0] += 1
            if steps[0] > budget:
                raise AssertionError(f"more than {budget} Python steps in {path}")
        return line

    def call(frame: object, event: str, arg: object) -> object:
        return line if frame.f_code.co_filename == path else None  # type: ignore[attr-defined]

    sys.settrace(call)
    try:
        yield steps
    finally:
        sys.settrace(None)


def test_two_hundred_thousand_chunks_of_one_tensor_are_checked_in_a_bounded_number_of_steps() -> None:
    """200,000 chunks of a [2000, 10**6] tensor laid out like a brick wall (the grid of their cuts has
    4 * 10**8 cells): the check runs a few hundred Python lines whatever the count of chunks (passes in C over
    all of them, and two sorts), where comparing pairs of chunks would be 2 * 10**10 steps."""
    rows, per_row, width = 2000, 100, 10**6
    boxes = brick_wall(rows, per_row, width)
    assert len(boxes) == 200_000
    with python_steps(2000, layout.__file__) as steps:
        assert tiling_problem((rows, width), boxes) is None
    small = brick_wall(20, per_row, width)
    with python_steps(2000, layout.__file__) as few:
        assert tiling_problem((20, width), small) is None
    assert steps[0] <= few[0] + 50, (steps, few)  # the same steps for 2,000 chunks as for 200,000
    (r, c), (h, w) = small[1234]
    small[1234] = ((r, c), (h, w + 1))  # overlaps its neighbour; the row's last block then falls short
    (r, c), (h, w) = small[1299]
    small[1299] = ((r, c), (h, w - 1))
    with python_steps(2000, layout.__file__):
        problem = tiling_problem((20, width), small)
    assert problem is not None and f"chunk at {list(small[1234][0])} overlaps chunk at" in problem


# -- user regexes: linear time, re's results ---------------------------------------------------------------

KEYS = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.12.mlp.down_proj.weight",
    "model.layers.3.mlp.experts.7.gate_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "layers.0.attention.wq.weight",
    "model.layers.1.mlp.gate.weight",
    "Model.Layers.10.Router.Bias",
    "a{,2}b",
    "x.aab.y",
]
PATTERNS = [
    r"norm",
    r"lm_head",
    r"^model\.embed",
    r"\.weight$",
    r"layers\.(0|12)\.",
    r"layers\.\d+\.mlp\.experts\.\d+\.",
    r"(^|\.)gate\.weight$",
    r"q_proj|k_proj|v_proj",
    r"(?i)router",
    r"(?i:LAYERS)\.1",
    r"[a-z]+_proj",
    r"experts\.[0-9]{1,2}\.",
    r"\bmlp\b",
    r"^(?:model\.)?layers\.[13]\.",
    r"down_proj\.weight",
    r"a{,2}b",
    r"x\.a{2,}b",
    r"[.]gate",
    r"[^.]+\.weight$",
    r"\x6c\u006d_head",
    r"(?P<name>mlp)\.(down|gate)",
    r"",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_ordinary_patterns_match_as_re_matches_them(pattern: str) -> None:
    """--fp32, --quantize-skip (searched in the key) and rank_pattern / alpha_pattern (PEFT's match of
    `(.*\\.)?(KEY)$`) give `re`'s results, through the code that uses them."""
    policy = DtypePolicy(torch.bfloat16, [pattern])
    quant = QuantPolicy(skip=[pattern])
    plain = QuantPolicy()
    lora = LoraSettings(r=8, alpha=16, rank_pattern={pattern: 4}, alpha_pattern={pattern: 2})
    for key in KEYS:
        found = re.search(pattern, key) is not None
        assert policy.forces_fp32(key) == found and UserRegex(pattern, "x").search(key) == found, key
        selected = plain.selects(key, (4, 4), torch.float32, False) and not found
        assert quant.selects(key, (4, 4), torch.float32, False) == selected, key
        try:
            peft = re.match(rf"(.*\.)?({pattern})$", key) is not None
        except re.error:  # `(?i)` inside PEFT's group: re refuses it (RE2 reads it as a flag of the group)
            continue
        rank, alpha = (4, 2) if peft else (8, 16)
        assert lora.rank(key) == rank and lora.scaling(key) == alpha / rank, key


_ATOMS = st.sampled_from(["a", "b", ".", r"\.", r"\d", r"\w", "[ab]", "[^a]", "[a-c.]", "(a|b)", "(?:ab|.)"])
_QUANTIFIERS = st.sampled_from(["", "", "*", "+", "?", "{2}", "{1,2}", "{,2}", "{2,}", "*?", "+?"])


@st.composite
def ordinary(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.tuples(_ATOMS, _QUANTIFIERS).map("".join), min_size=1, max_size=5))
    body = "|".join(parts) if draw(st.booleans()) and len(parts) > 1 else "".join(parts)
    return draw(st.sampled_from(["", "^"])) + body + draw(st.sampled_from(["", "$"]))


@settings(max_examples=300, deadline=None)
@given(ordinary(), st.lists(st.text("ab.1_", max_size=8), min_size=1, max_size=5))
def test_generated_ordinary_patterns_search_and_match_as_re_does(pattern: str, keys: list[str]) -> None:
    compiled = UserRegex(pattern, "--fp32")
    for key in keys:
        assert compiled.search(key) == (re.search(pattern, key) is not None), key
        assert compiled.match(key) == (re.match(pattern, key) is not None), key


def test_catastrophic_patterns_finish_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`(a+)+$` and its kind against keys of long runs: `re` would try every way of splitting the run."""
    long_key = "model." + "a" * 5000 + "!.weight"
    with bounded(seconds=10):
        assert not DtypePolicy(torch.bfloat16, ["(a+)+$"]).forces_fp32(long_key)
        assert QuantPolicy(skip=["(a|aa)+$"]).selects(long_key, (4, 4), torch.float32, False)
        lora = LoraSettings(r=8, alpha=16, rank_pattern={"(a+)+": 4}, alpha_pattern={r"([\w.]+)+!": 1})
        assert lora.rank(long_key) == 8 and lora.scaling(long_key) == 2.0
        ckpt = tmp_path / "ckpt"
        dcp.save(
            {"a" * 60 + "!": torch.ones(2, 2), "w": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True
        )
        code, err = run(
            capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), "--fp32", "(a+)+$", "--dtype", "bf16"
        )
    assert code == 0, err


@pytest.mark.parametrize(
    ("flag", "pattern", "needle"),
    [
        ("--fp32", "(?=norm)", "invalid perl operator"),
        ("--fp32", r"(a)\1", "invalid escape sequence"),
        ("--quantize-skip", "a++", "bad repetition operator"),
        ("--quantize-skip", "(" * 5000, "missing )"),
    ],
)
def test_a_pattern_re2_cannot_take_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, pattern: str, needle: str
) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save({"model.norm.weight": torch.ones(2)}, checkpoint_id=str(ckpt), no_dist=True)
    extra = ["--quantize", "fp8"] if flag == "--quantize-skip" else []
    code, err = run(capsys, "dcp-to-hf", str(ckpt), str(tmp_path / "out"), *extra, flag, pattern)
    assert_one_line(code, err, flag, "is not a valid regular expression", needle, "RE2 syntax")
    assert len(err) < 500 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["(", "[a-", "x{2,1}", "\ud800"])
def test_a_rank_pattern_re2_cannot_take_is_a_ckptconv_error(key: str) -> None:
    lora = LoraSettings(r=8, alpha=16, rank_pattern={key: 4}, source="--lora-config run/adapter_config.json")
    with pytest.raises(
        CkptconvError, match=r"adapter_config.json: rank_pattern key .* is not a valid regular expression"
    ):
        lora.rank("model.layers.0.self_attn.q_proj")


def test_mapping_key_patterns_parse_in_linear_time() -> None:
    """A mapping key's `{placeholder + offset}` is found in one pass, whatever the key's length."""
    with bounded(seconds=5):
        assert Pattern("{a + b" + " " * 200_000 + "x").placeholders == frozenset()
        assert Pattern("layers.{layer + n}" + " " * 200_000 + ".w").slots == (("layer", "+", "n"),)
