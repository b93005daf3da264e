"""DeepSpeed ZeRO-1/2/3 checkpoints against DeepSpeed 0.19.8's own code (issue #39, item 2).

DeepSpeed itself (support/deepspeed.py, support/workers/deepspeed_train.py; CPU, gloo, 2 ranks, bf16) trains
a tiny transformers Llama one step under ZeRO-1 (untied), ZeRO-2 and ZeRO-3 (tied embedding and LM head, one
frozen layernorm) and saves it with `engine.save_checkpoint`; its own
`zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` gives the expected weights. Checked here:

- dcp-to-hf's fp32 release equals zero_to_fp32's weights bit for bit (the `latest` tag followed, or the
  `global_step1/` directory given), `--dtype bf16` their cast; the tied head is the embedding, the frozen
  layernorm DeepSpeed's own fragment(s); so does the universal checkpoint DeepSpeed's own ds_to_universal.py
  makes of the ZeRO-2 and ZeRO-3 ones;
- `--deepspeed-weights module` equals the engine's 16-bit module weights (ZeRO-1/2); ZeRO-3, which keeps none
  there, is refused with exit 2;
- the Adam moments are never read: their bytes overwritten with garbage change nothing, and the bytes read
  are the weights' bytes;
- a rank file whose pickle calls os.system is refused (exit 2) without running it; a missing rank file is
  named;
- the review's crafted checkpoints (the ZeRO-2 one changed: bad alignment paddings, partition counts, shapes
  and mp_world_size, a partition or storage past its file's end, a `latest` naming no tag directory) are
  refused by dcp-to-hf and inspect alike: exit 2, one line naming the file, nothing written;
- (slow) 1 and 2 ranks write byte-identical releases.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ckptconv
from deepspeed import trained
from test_bad_input import assert_one_line, run
from test_dcp_to_hf import load_dir, same_bits

from ckptconv.formats.deepspeed_pickle import read_pickled

SPECS = ("1", "2_tied_frozen_universal", "3_tied_frozen_universal")
STEP = "global_step1"


@pytest.fixture(scope="module")
def runs() -> Path:
    return trained(*SPECS)


def convert(src: Path, out: Path, *flags: str, nproc: int = 0) -> dict[str, torch.Tensor]:
    """dcp-to-hf of `src` (RUN/ckpt or RUN/ckpt/global_step1) with RUN/config copied."""
    config = next(p / "config" for p in src.parents if (p / "config").is_dir())
    proc = ckptconv("dcp-to-hf", str(src), str(out), "--copy-from", str(config), *flags, nproc=nproc)
    assert proc.returncode == 0, proc.stderr
    return load_dir(out)


def expected(run: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(run / name, weights_only=True)


def check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, bad


@pytest.mark.parametrize("spec", SPECS)
def test_fp32_equals_zero_to_fp32(runs: Path, tmp_path: Path, spec: str) -> None:
    run = runs / spec
    want = expected(run, "fp32.pt")
    got = convert(run / "ckpt", tmp_path / "out", "--dtype", "keep")
    check_equal(got, want)
    if spec == "1":
        return
    assert same_bits(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert got["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16  # DeepSpeed's fragment
    if spec.startswith("3"):  # the tag directory given directly, and bf16 the cast of the fp32 weights
        got = convert(run / "ckpt" / STEP, tmp_path / "bf16", "--dtype", "bf16")
        check_equal(got, {k: v.to(torch.bfloat16) for k, v in want.items()})


@pytest.mark.parametrize("spec", SPECS[1:])
def test_universal_equals_zero_to_fp32(runs: Path, tmp_path: Path, spec: str) -> None:
    run = runs / spec
    got = convert(run / "universal", tmp_path / "out", "--dtype", "keep")
    check_equal(got, expected(run, "fp32.pt"))


@pytest.mark.parametrize("spec", SPECS[:2])
def test_module_weights(runs: Path, tmp_path: Path, spec: str) -> None:
    run = runs / spec
    got = convert(run / "ckpt", tmp_path / "out", "--deepspeed-weights", "module", "--dtype", "bf16")
    check_equal(got, expected(run, "module.pt"))


def test_zero3_module_refused(runs: Path, tmp_path: Path) -> None:
    run = runs / SPECS[2]
    proc = ckptconv("dcp-to-hf", str(run / "ckpt"), str(tmp_path / "out"), "--deepspeed-weights", "module")
    assert proc.returncode == 2, proc.stderr
    assert "--deepspeed-weights module" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def _moments(file: Path, root: Path) -> list[tuple[int, int]]:
    """(offset, length) of every Adam moment's storage in a rank's optimizer states file."""
    pickled = read_pickled(root, str(file.relative_to(root)))
    state = pickled.value["optimizer_state_dict"]
    base = state.get("base_optimizer_state") or state.get("optimizer_state_dict")
    places = []
    for per_param in base["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            places.append(pickled.storages[per_param[name].storage_key])
    return places


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2]])
def test_moments_never_read(runs: Path, tmp_path: Path, spec: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs / spec, run)
    moments = 0
    for file in sorted((run / "ckpt" / STEP).glob("*optim_states.pt")):
        places = _moments(file, run / "ckpt")
        assert places
        with open(file, "r+b") as f:
            for offset, length in places:
                f.seek(offset)
                f.write(b"\xff" * length)  # NaNs where the moments were
                moments += length
    proc = ckptconv(
        "dcp-to-hf",
        str(run / "ckpt"),
        str(tmp_path / "out"),
        "--dtype",
        "keep",
        "--json",
        "--copy-from",
        str(run / "config"),
    )
    assert proc.returncode == 0, proc.stderr
    check_equal(load_dir(tmp_path / "out"), expected(run, "fp32.pt"))
    read = sum(r["bytes_read"] for r in json.loads(proc.stdout)["ranks"])
    # every key's weights once (a tied head: the embedding's bytes, read again for it), nothing else
    weights = sum(v.numel() * v.element_size() for v in expected(run, "fp32.pt").values())
    assert read == weights and moments > read  # the moments: more bytes than all that was read


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize(
    "name, key",
    [
        ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "optimizer_state_dict"),
        ("mp_rank_00_model_states.pt", "module"),
    ],
)
def test_crafted_pickle_refused(runs: Path, tmp_path: Path, name: str, key: str) -> None:
    """A REDUCE of os.system in an optimizer-states or a model-states file: refused by name, never run."""
    run = tmp_path / "run"
    shutil.copytree(runs / SPECS[1], run)
    marker = tmp_path / "ran"
    rank1 = run / "ckpt" / STEP / name
    assert rank1.is_file()
    buf = io.BytesIO()
    torch.save({key: _Boom(marker)}, buf)
    rank1.write_bytes(buf.getvalue())
    proc = ckptconv("dcp-to-hf", str(run / "ckpt"), str(tmp_path / "out"))
    assert proc.returncode == 2 and not marker.exists(), proc.stderr
    assert str(rank1) in proc.stderr and "system" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    assert zipfile.is_zipfile(rank1)  # a real torch.save file, refused for its pickle alone


def test_missing_rank_named(runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs / SPECS[0], run)
    (run / "ckpt" / STEP / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    proc = ckptconv("dcp-to-hf", str(run / "ckpt"), str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "optim_states.pt" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_two_ranks_byte_identical(runs: Path, tmp_path: Path) -> None:
    for spec in (SPECS[1], SPECS[2]):
        src = runs / spec / "ckpt"
        convert(src, tmp_path / spec / "one", "--dtype", "keep")
        convert(src, tmp_path / spec / "two", "--dtype", "keep", nproc=2)
        names = sorted(p.name for p in (tmp_path / spec / "one").iterdir())
        assert names == sorted(p.name for p in (tmp_path / spec / "two").iterdir())
        for name in names:
            assert (tmp_path / spec / "one" / name).read_bytes() == (
                tmp_path / spec / "two" / name
            ).read_bytes()


class _Global:
    """A global named in a pickle, loaded as its name alone (nothing imported) and pickled back by name."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: object) -> _Call:
        return _Call(self, list(args))


class _Call:
    """A REDUCE (or NEWOBJ) of a `_Global`, with the SETITEMS, APPENDS and BUILD that followed it."""

    def __init__(self, func: _Global, args: list[object], newobj: bool = False) -> None:
        self.func, self.args, self.newobj = func, args, newobj
        self.items: list[tuple[object, object]] = []
        self.appended: list[object] = []
        self.state: object = None

    def __setitem__(self, key: object, value: object) -> None:
        self.items.append((key, value))

    def append(self, value: object) -> None:
        self.appended.append(value)

    def extend(self, values: list[object]) -> None:
        self.appended.extend(values)

    def __setstate__(self, state: object) -> None:
        self.state = state


class _Pid(tuple):  # type: ignore[type-arg]
    """A storage's persistent id, pickled back as it was."""


class _Load(pickle._Unpickler):  # type: ignore[name-defined,misc]
    def find_class(self, module: str, name: str) -> object:
        found = _Global(module, name)
        found.__new__ = lambda cls, *args: _Call(found, list(args), newobj=True)  # type: ignore[method-assign]
        return found

    def persistent_load(self, pid: object) -> object:
        return _Pid(pid)  # type: ignore[arg-type]


class _Dump(pickle._Pickler):  # type: ignore[name-defined,misc]
    def persistent_id(self, obj: object) -> object:
        return tuple(obj) if type(obj) is _Pid else None

    def save(self, obj: object, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif isinstance(obj, _Call):
            self.save(obj.func)
            self.save(tuple(obj.args))
            self.write(pickle.NEWOBJ if obj.newobj else pickle.REDUCE)
            for opcode, values in ((pickle.SETITEMS, obj.items), (pickle.APPENDS, obj.appended)):
                if values:
                    self.write(pickle.MARK)
                    for value in values:
                        for part in value if opcode == pickle.SETITEMS else (value,):
                            self.save(part)
                    self.write(opcode)
            if obj.state is not None:
                self.save(obj.state)
                self.write(pickle.BUILD)
        else:
            super().save(obj, save_persistent_id)


def _mutate(file: Path, change: Callable[[Any], None]) -> None:
    """`file`'s data.pkl loaded without running it, changed, and written back (the other entries as were)."""
    with zipfile.ZipFile(file) as z:
        entries = [(info.filename, z.read(info.filename)) for info in z.infolist()]
    name = next(n for n, _ in entries if n.endswith("/data.pkl"))
    value = _Load(io.BytesIO(dict(entries)[name])).load()
    change(value)
    buf = io.BytesIO()
    _Dump(buf, protocol=2).dump(value)
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as z:
        for n, data in entries:
            z.writestr(n, buf.getvalue() if n == name else data)


def _osd(change: Callable[[dict[str, Any]], None]) -> Callable[[Any], None]:
    return lambda value: change(value["optimizer_state_dict"])


def _load(file: Path) -> Any:
    with zipfile.ZipFile(file) as z:
        return _Load(io.BytesIO(z.read(next(n for n in z.namelist() if n.endswith("/data.pkl"))))).load()


def _cross_zero(file: Path) -> None:
    """Paddings that start parameter 1 where parameter 0 started, and end the group where it ended."""
    shapes = [
        v.args[0] for _, v in _load(file.parent / "mp_rank_00_model_states.pt")["param_shapes"][0].items
    ]
    pads = [0] * len(shapes)
    pads[0], pads[-1] = -math.prod(shapes[0]), math.prod(shapes[0])
    _mutate(file, _osd(lambda o: o.update(param_alignment_paddings=[pads])))


def _huge_storage(file: Path) -> None:
    """data/0's central directory entry claims 0x7FFFFFF0 bytes in a file of a few hundred KB."""
    raw = bytearray(file.read_bytes())
    at = raw.index(b"PK\x01\x02")  # the first central directory entry
    while True:
        name_len = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46 : at + 46 + name_len].endswith(b"/data/0"):
            struct.pack_into("<II", raw, at + 20, 0x7FFFFFF0, 0x7FFFFFF0)
            break
        at = raw.index(b"PK\x01\x02", at + 46)
    file.write_bytes(bytes(raw))


def _longer(osd: dict[str, Any]) -> None:  # rank 1's fp32 partition claims 10x the elements its storage has
    record = osd["single_partition_of_fp32_groups"][0]
    record.args[2] = (record.args[2][0] * 10,)


def _many_dims(value: Any) -> None:  # every parameter as (1,) * 100 + (numel,)
    group = value["param_shapes"][0]
    group.items = [(k, (1,) * 100 + (math.prod(v.args[0]),)) for k, v in group.items]


MODEL_FILE = f"{STEP}/mp_rank_00_model_states.pt"
OPTIM0 = f"{STEP}/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
OPTIM1 = f"{STEP}/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
CRAFTED: dict[str, tuple[str, Callable[[Path], None], str]] = {
    # the case: (the file the message names, how the ZeRO-2 checkpoint is changed, what the message says)
    "paddings_str": (
        OPTIM0,
        lambda f: _mutate(f, _osd(lambda o: o.update(param_alignment_paddings=["ab"]))),
        "param_alignment_paddings",
    ),
    "paddings_short": (
        OPTIM0,
        lambda f: _mutate(f, _osd(lambda o: o.update(param_alignment_paddings=[[0]]))),
        "param_alignment_paddings",
    ),
    "paddings_negative": (OPTIM0, _cross_zero, "non-negative"),
    "partition_count_mixed": (
        OPTIM0,
        lambda f: _mutate(f, _osd(lambda o: o.update(partition_count=[2, "x"]))),
        "partition_count [2, 'x']",
    ),
    "partition_long": (OPTIM1, lambda f: _mutate(f, _osd(_longer)), "lies outside its storage"),
    "shapes_ndim": (MODEL_FILE, lambda f: _mutate(f, _many_dims), "of 101 dimensions"),
    "mp_world_list": (
        MODEL_FILE,
        lambda f: _mutate(f, lambda v: v.update(mp_world_size=[1])),
        "mp_world_size [1]",
    ),
    "storage_huge": (MODEL_FILE, _huge_storage, "past the end"),
    "latest_dotdot": ("latest", lambda f: f.write_bytes(b"../../etc"), "holds '../../etc'"),
    "latest_not_utf8": ("latest", lambda f: f.write_bytes(b"\xff\xfe"), "not UTF-8"),
    "latest_devzero": ("latest", lambda f: (f.unlink(), f.symlink_to("/dev/zero")), "a character device"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_checkpoint_refused(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """A ZeRO-2 checkpoint changed as the review crafted it: exit 2, one line naming the file (the path as
    given), nothing written, by dcp-to-hf and inspect alike."""
    named, change, says = CRAFTED[case]
    ckpt = shutil.copytree(runs / SPECS[1] / "ckpt", tmp_path / "ckpt", ignore=shutil.ignore_patterns("*.py"))
    change(ckpt / named)
    for argv in (("dcp-to-hf", str(ckpt), str(tmp_path / "out")), ("inspect", str(ckpt), "--json")):
        code, err = run(capsys, *argv)
        assert_one_line(code, err, f"{ckpt / named}: ", says)
    assert not (tmp_path / "out").exists()
