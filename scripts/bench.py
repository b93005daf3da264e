"""Run one of ckptconv's benchmarks: `python scripts/bench.py NAME [options]` (`NAME --help` says what it
measures; the benchmarks are the modules of scripts/benchmarks/). Every benchmark takes `--out FILE`: its
results as JSON with the machine, the versions and the date (docs/benchmarks/*.json are the published ones).

usage (from the repository root):
  .venv/bin/python scripts/bench.py convert --quick        # the conversions at 0.25 GB, one run: a smoke test
  .venv/bin/python scripts/bench.py convert --shapes dense --sizes 0.5,1,2,4 --runs 1 --out convert.json
  .venv/bin/python scripts/bench.py memory --shapes dense --sizes 1,4 --runs 1
  .venv/bin/python scripts/bench.py plan --scales 0.1,0.3,1 --out plan.json
  .venv/bin/python scripts/bench.py lora --gb 4 --runs 3
  .venv/bin/python scripts/bench.py s3 --size-gb 1 --nproc 2
  .venv/bin/python scripts/bench.py save-hf --gb 1 --runs 3
  .venv/bin/python scripts/bench.py durable --shapes dense --sizes 1 --runs 1
  .venv/bin/python scripts/bench.py dequant --gb 1 --runs 3
  .venv/bin/python scripts/bench.py resume --size 4 --at 50,75    # a run stopped, then --resume
  .venv/bin/python scripts/bench.py scaling --sizes 0.05 --ranks 1,2    # scripts/scaling.sh: 16 GB, 1-8 ranks
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks import convert, dequant, durable, lora, memory, plan, resume, s3, save_hf, scaling

BENCHMARKS = {
    "convert": convert,
    "memory": memory,
    "durable": durable,
    "plan": plan,
    "lora": lora,
    "s3": s3,
    "save-hf": save_hf,
    "dequant": dequant,
    "resume": resume,
    "scaling": scaling,
}


def parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="scripts/bench.py", description=__doc__, formatter_class=raw)
    sub = p.add_subparsers(dest="name", metavar="NAME", required=True)
    for name, module in BENCHMARKS.items():
        doc = module.__doc__ or ""
        summary = " ".join(doc.split("\n\n")[0].split())
        one = sub.add_parser(
            name, help=summary, description=doc, formatter_class=raw, parents=[module.OPTIONS]
        )
        module.add_arguments(one)
        one.set_defaults(main=module.main)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.main(args))


if __name__ == "__main__":
    sys.exit(main())
