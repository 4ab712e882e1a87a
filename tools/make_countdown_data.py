"""Write the builtin datasets: megatron_grpo/data/builtin/{countdown,arithmetic}.jsonl.

    python tools/make_countdown_data.py                       # both, default sizes and seed
    python tools/make_countdown_data.py --task countdown --n 400 --seed 1234 --out my.jsonl

Deterministic: the same arguments write the same bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_grpo.data.synthetic import make_arithmetic, make_countdown  # noqa: E402

BUILTIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "megatron_grpo", "data", "builtin")
DEFAULT_N = {"countdown": 400, "arithmetic": 200}


def write_jsonl(rows, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["countdown", "arithmetic", "all"], default="all")
    ap.add_argument("--n", type=int, default=None, help="rows (default: 400 countdown, 200 arithmetic)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="output file (one task only); default: the builtin folder")
    args = ap.parse_args(argv)
    tasks = ["countdown", "arithmetic"] if args.task == "all" else [args.task]
    if args.out and len(tasks) > 1:
        ap.error("--out needs a single --task")
    for task in tasks:
        make = make_countdown if task == "countdown" else make_arithmetic
        rows = make(n=args.n or DEFAULT_N[task], seed=args.seed)
        path = args.out or os.path.join(BUILTIN, f"{task}.jsonl")
        write_jsonl(rows, path)
        print(f"wrote {len(rows)} {task} rows to {path}")


if __name__ == "__main__":
    main()
