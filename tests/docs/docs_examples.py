"""The worlds the README's and the docs' examples run in (tests/docs/test_docs_examples.py).

A ```bash block of a page that runs ckptconv is announced by the line before it:

    <!-- example: release quantized -->            the parts its sandbox is made of
    <!-- example: release | script ckpt/step-1000 release -->   the block is a script, run with these args

Each part is a set of files at the paths the examples name (`ckpt/step-1000`, `/models/base`, a hub repo id in
an offline hub cache, an S3 bucket), made once per session by the other project's own code where it has one:
transformers' `save_pretrained` for HF models, torch's `dcp.save` for DCP checkpoints, PEFT for LoRA runs,
megatron-core's `dist_checkpointing.save` (megatron.py), torchtune (tune.py). The torchtitan-named
checkpoints are made by `ckptconv hf-to-dcp --mapping` from a transformers model: the presets themselves are
held to torchtitan's own code in interop/test_presets_v2.py; here only the examples' commands are on trial.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- example: ([^>]*?) -->\n)?```bash\n(.*?)```", re.S)
RUNS = re.compile(r"(^|\s|/)ckptconv\s+(dcp-to-hf|hf-to-dcp|inspect|verify|--version|--help)\b")


@dataclass(frozen=True)
class Block:
    page: str
    number: int  # the block's position among the page's bash blocks
    parts: tuple[str, ...]  # empty: not announced
    script_args: tuple[str, ...] | None  # None: run line by line
    text: str

    @property
    def commands(self) -> list[str]:
        """The block's ckptconv command lines, continuations joined, trailing comments dropped."""
        lines = []
        for line in self.text.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if RUNS.search(line):
                lines.append(line)
        return lines

    @property
    def id(self) -> str:
        return f"{self.page.removesuffix('.md')}{self.number}"


ANNOTATION = re.compile(r"(?P<parts>[a-z0-9-]+(?: [a-z0-9-]+)*)(?: \| script(?P<args>(?: \S+)*))?")


def blocks() -> list[Block]:
    """Every bash block of the README and docs/*.md that runs ckptconv. An annotation that does not read
    `PART [PART ...]` or `PART ... | script ARG ...` is an error, not a block left out."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for number, (note, body) in enumerate(BLOCK.findall(text)):
            parsed = ANNOTATION.fullmatch(note) if note else None
            if note and parsed is None:
                raise ValueError(f"{page.name}: malformed annotation <!-- example: {note} -->")
            args = parsed["args"] if parsed else None
            block = Block(
                page.name,
                number,
                tuple(parsed["parts"].split()) if parsed else (),
                tuple(args.split()) if args is not None else None,
                body,
            )
            if block.commands:
                found.append(block)
        # a ckptconv command shown in any other fence (console, text, sh) would be neither parsed nor run
        for fence, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
            if fence != "bash" and any(RUNS.search(line) for line in body.splitlines()):
                raise ValueError(f"{page.name}: a ckptconv command in a ```{fence} block; show it in ```bash")
    return found


# ------------------------------------------------------------------------------------------------------------
# Parts: each writes its files under `root` (a part's own directory, copied into every sandbox using it).


def _hub(root: Path, repo: str, model: Path) -> None:
    """`model`'s files as one snapshot of `repo` in the huggingface_hub cache under root/.hf (HF_HOME)."""
    from hubcache import hub_cache

    hub_cache(root / ".hf", repo, {f.name: f.read_bytes() for f in model.iterdir() if f.is_file()})


def _cli(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptconv", *args, "--quiet"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def _tiny(family: str, path: Path, **options: object) -> Path:
    from families import tiny

    return tiny(family, path, **options)


def release(root: Path) -> None:
    """A tiny Qwen3.5 (gated delta-net layers: fp32 `A_log`) trained to bf16-exact values:
    ckpt/step-1000 its DCP ({"model", "step"}, fp32); models/base and the hub's Qwen/Qwen3-8B its bf16
    release with A_log fp32, release/ that release again; a.safetensors / b.safetensors it and it nudged
    by 1e-4; shared/ckpt a copy of the DCP."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    tiny = _tiny("qwen3_5", root / "tiny")
    weights = load_file(tiny / "model.safetensors")
    fp32 = {k: v if k.endswith("A_log") else v.to(torch.bfloat16).float() for k, v in weights.items()}
    bf16 = {k: v if k.endswith("A_log") else v.to(torch.bfloat16) for k, v in weights.items()}
    base = root / "models" / "base"
    base.mkdir(parents=True)
    shutil.copy(tiny / "config.json", base)
    save_file(bf16, base / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(tiny)
    dcp.save(
        {"model": fp32, "step": torch.tensor(1000)},
        checkpoint_id=str(root / "ckpt" / "step-1000"),
        no_dist=True,
    )
    shutil.copytree(base, root / "release")
    shutil.copytree(root / "ckpt" / "step-1000", root / "shared" / "ckpt")
    _hub(root, "Qwen/Qwen3-8B", base)
    shutil.copy(base / "model.safetensors", root / "a.safetensors")
    nudged = {k: v + 1e-4 if v.is_floating_point() else v for k, v in bf16.items()}  # as saved in base
    save_file(nudged, root / "b.safetensors")


def titan_llama(root: Path) -> None:
    """A tiny Llama as models/Llama-3.1-8B and the hub's meta-llama/Llama-3.1-8B (config.json beside), and
    ckpt/step-1000 its torchtitan checkpoint ({"model": torchtitan names})."""
    model = _tiny("llama", root / "models" / "Llama-3.1-8B")
    shutil.copy(model / "config.json", root / "config.json")
    _hub(root, "meta-llama/Llama-3.1-8B", model)
    _cli(
        "hf-to-dcp",
        str(model),
        str(root / "ckpt" / "step-1000"),
        "--mapping",
        "torchtitan-llama3",
        "--prefix",
        "model.",
    )


def titan_qwen3(root: Path) -> None:
    """release/: a tiny Qwen3; ckpt/runtime: the same under torchtitan's names (torchtitan-qwen3)."""
    model = _tiny("qwen3", root / "release")
    _cli("hf-to-dcp", str(model), str(root / "ckpt" / "runtime"), "--mapping", "torchtitan-qwen3")


def titan_gpt_oss(root: Path) -> None:
    """A tiny gpt-oss (bf16 layout) as ckpt/, its torchtitan checkpoint, with its config.json beside."""
    model = _tiny("gpt_oss", root / "hf")
    shutil.copy(model / "config.json", root / "config.json")
    _cli("hf-to-dcp", str(model), str(root / "ckpt"), "--mapping", "torchtitan-gpt-oss")
    shutil.rmtree(model)


def my_model(root: Path) -> None:
    """A tiny Qwen3-MoE (transformers' fused experts) as models/base (config.json beside), ckpt/step-1000 its
    torchtitan checkpoint, and my_model.toml: a user's copy of the torchtitan-qwen3 preset writing HF's fused
    expert layout."""
    model = _tiny("qwen3", root / "models" / "base", moe=True)
    shutil.copy(model / "config.json", root / "config.json")
    _cli("hf-to-dcp", str(model), str(root / "ckpt" / "step-1000"), "--mapping", "torchtitan-qwen3")
    preset = (ROOT / "ckptconv" / "mapping" / "presets" / "torchtitan-qwen3.toml").read_text()
    assert 'hf_experts = "per_expert"' in preset
    (root / "my_model.toml").write_text(preset.replace('hf_experts = "per_expert"', 'hf_experts = "fused"'))


def transformers_runtime(root: Path) -> None:
    """A tiny Qwen3-MoE as models/Qwen3-30B-A3B (save_pretrained: experts per expert), and ckpt/step-1000 the
    same model's `state_dict()` (transformers 5's runtime layout: experts fused) saved with `dcp.save`."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = _tiny("qwen3", root / "models" / "Qwen3-30B-A3B", moe=True)
    live = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    dcp.save(live.state_dict(), checkpoint_id=str(root / "ckpt" / "step-1000"))


def megatron(root: Path) -> None:
    """A Qwen3 GPTModel saved by megatron-core's own `dist_checkpointing.save` (tests/support/megatron.py) as
    iter_0000100 and run/iter_0001000, its transformers config.json, models/Qwen3-8B its HF release, and
    run/fsdp/iter_0000200 that release as Megatron-FSDP's fsdp_dtensor (tests/interop/test_megatron_fsdp_*.py
    check the format against torch's own DTensor saves and megatron-core's key functions)."""
    from megatron import saved
    from test_megatron_gpt import hf_config

    ckpt = saved("gpt", "--qk-layernorm", "--singleton-local-shards", "--optimizer", "none")
    shutil.copytree(ckpt, root / "iter_0000100")
    shutil.copytree(ckpt, root / "run" / "iter_0001000")
    config = hf_config(json.loads((ckpt.parent / "config.json").read_text()))
    config.save_pretrained(root / "cfg")
    shutil.move(root / "cfg" / "config.json", root / "config.json")
    shutil.rmtree(root / "cfg")
    release = root / "models" / "Qwen3-8B"  # as released: the weights and their config.json
    _cli(
        "dcp-to-hf",
        str(ckpt),
        str(release),
        "--mapping",
        "megatron-gpt",
        "--config",
        str(root / "config.json"),
    )
    shutil.copy(root / "config.json", release)
    fsdp = root / "run" / "fsdp" / "iter_0000200"
    _cli("hf-to-dcp", str(release), str(fsdp), "--mapping", "megatron-gpt", "--format", "fsdp_dtensor")


def lora(root: Path) -> None:
    """A PEFT LoRA run (r=4, alpha=32, every projection, B non-zero as training makes it) on a tiny Llama:
    models/base the base, ckpt/step-500 and ckpt/lora-run the run saved with `dcp.save` ({"model", "step"}),
    and PEFT's own `save_pretrained` of the adapter (run/, the hub's my-org/my-adapter) and of
    `merge_and_unload()` (merged/, fp32)."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = _tiny("llama", root / "models" / "base")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=32, target_modules=targets, init_lora_weights=False)
    )
    state = {"model": peft.state_dict(), "step": torch.tensor(500)}
    dcp.save(state, checkpoint_id=str(root / "ckpt" / "step-500"), no_dist=True)
    shutil.copytree(root / "ckpt" / "step-500", root / "ckpt" / "lora-run")
    peft.save_pretrained(root / "run")
    _hub(root, "my-org/my-adapter", root / "run")
    peft.merge_and_unload().save_pretrained(root / "merged")


def torchtune(root: Path) -> None:
    """torchtune 0.6.1's own LoRA Llama 3 (support/workers/tune_lora.py): ckpt/ its DCP, config.json its HF
    config."""
    from tune import run_script

    run_script(ROOT / "tests" / "support" / "workers" / "tune_lora.py", str(root / "run"))
    shutil.move(root / "run" / "dcp", root / "ckpt")
    shutil.move(root / "run" / "config.json", root / "config.json")
    shutil.rmtree(root / "run")


def quantized(root: Path) -> None:
    """The hub's deepseek-ai/DeepSeek-V3: a tiny DeepSeek-V3 (an MTP layer too) in block FP8 by DeepSeek's
    math; openai/gpt-oss-20b: a tiny gpt-oss with its experts in MXFP4 (tests/support/families.py);
    RedHatAI/Llama-w4a16: a tiny Llama in compressed-tensors' W4A16 made by compressed-tensors (ct.py)."""
    from ct import release as ct_release
    from ct import scheme
    from families import pack_mxfp4, quantize_fp8, sized

    work = root / "work"
    sizes = {"hidden_size": 160, "intermediate_size": 200, "moe_intermediate_size": 136}
    quantize_fp8(sized("deepseek_v3", work / "ds", sizes, mtp=1), work / "ds-fp8")
    _hub(root, "deepseek-ai/DeepSeek-V3", work / "ds-fp8")
    pack_mxfp4(
        sized("gpt_oss", work / "oss", {"hidden_size": 64, "intermediate_size": 96}), work / "oss-mxfp4"
    )
    _hub(root, "openai/gpt-oss-20b", work / "oss-mxfp4")
    llama = sized("llama", work / "llama", {"hidden_size": 256, "intermediate_size": 384})
    ct_release(llama, work / "llama-w4a16", {"group_0": scheme("W4A16", ["Linear"], group_size=32)})
    _hub(root, "RedHatAI/Llama-w4a16", work / "llama-w4a16")
    shutil.rmtree(work)


def s3(root: Path) -> None:
    """What the test puts into the S3 server's `bucket` (tests/docs/test_docs_examples.py): run/step-1000 (the
    release part's checkpoint) and models/llama-3-8b (a tiny Llama)."""
    release(root / "run-source")
    shutil.move(root / "run-source" / "ckpt" / "step-1000", root / "bucket" / "run" / "step-1000")
    shutil.rmtree(root / "run-source")
    _tiny("llama", root / "bucket" / "models" / "llama-3-8b")


PARTS: dict[str, Callable[[Path], None]] = {
    "release": release,
    "titan-llama": titan_llama,
    "titan-qwen3": titan_qwen3,
    "titan-gpt-oss": titan_gpt_oss,
    "my-model": my_model,
    "transformers": transformers_runtime,
    "megatron": megatron,
    "lora": lora,
    "torchtune": torchtune,
    "quantized": quantized,
    "s3": s3,
}

_BUILT: dict[str, Path] = {}


def part(name: str) -> Path:
    """The part's directory, made once per session."""
    if name not in _BUILT:
        root = Path(tempfile.mkdtemp(prefix=f"ckptconv-docs-{name}-"))
        import atexit

        atexit.register(shutil.rmtree, root, True)
        PARTS[name](root)
        _BUILT[name] = root
    return _BUILT[name]
