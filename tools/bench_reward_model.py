"""Output reward model scoring: ours against a plain transformers loop, and its share of
a GRPO step.

1. Scoring: `N` conversations (a prompt and a completion of up to `--max_tokens`
   tokens, random lengths) through megatron_grpo's RewardModel (batches of
   `--batch_size`, padded) and through the loop a user would write with transformers (one
   conversation at a time, no padding), the same model and texts, fastest of `--iters`:

       reward_model per_completion_ratio=<ours / loop> ours_ms=... loop_ms=... max_abs_diff=...

2. `--run`: the reward-model quickstart (configs/quickstart_rm_cpu.yaml, 2 processes) for
   `--steps` steps; the median of `timing/score` over `timing/step` (first 2 left out):

       reward_model score_share=<score / step> score_s=... step_s=...

    python tools/bench_reward_model.py [--n 64] [--hidden 512] [--layers 4] [--run]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.make_tiny_model import make_tiny_model, make_tiny_reward_model  # noqa: E402
from tools.quickstart import dtype_args  # noqa: E402


def conversations(n: int, max_tokens: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    words = "the answer is seven plus three equals ten and so on".split()
    return [[{"role": "user", "content": f"What is {rng.randint(1, 9)} + {rng.randint(1, 9)}?"},
             {"role": "assistant", "content": " ".join(rng.choice(words)
                                                     for _ in range(rng.randint(1, max_tokens)))}]
            for _ in range(n)]


def loop_scores(path: str, convs: list) -> list:
    """One conversation at a time through transformers, as a user would write it."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for messages in convs:
            ids = tok.apply_chat_template(messages, return_tensors="pt", return_dict=True)
            out.append(float(model(**ids).logits[0, 0]))
    return out


def scoring(args) -> None:
    from megatron_grpo.rewards.reward_model import RewardModel

    work = tempfile.mkdtemp(prefix="bench-rm-")
    policy = make_tiny_model(os.path.join(work, "policy"), family="qwen2", vocab_size=999)
    rm = str(make_tiny_reward_model(os.path.join(work, "rm"), policy, hidden_size=args.hidden,
                                    num_layers=args.layers))
    convs = conversations(args.n, args.max_tokens)
    ours = RewardModel(rm, batch_size=args.batch_size)
    answers = [c[-1]["content"] for c in convs]
    best = {"ours": float("inf"), "loop": float("inf")}
    for _ in range(args.iters):
        t0 = time.perf_counter()
        got = ours(answers, messages=convs)
        best["ours"] = min(best["ours"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        want = loop_scores(rm, convs)
        best["loop"] = min(best["loop"], time.perf_counter() - t0)
    diff = max(abs(a - b) for a, b in zip(got, want))
    per = {k: 1000 * v / args.n for k, v in best.items()}
    print(f"reward_model per_completion_ratio={best['ours'] / best['loop']:.3f} "
          f"ours_ms={per['ours']:.2f} loop_ms={per['loop']:.2f} max_abs_diff={diff:.2e} "
          f"n={args.n} hidden={args.hidden} layers={args.layers}", flush=True)


def share(args) -> None:
    from tools.make_tiny_model import make_digit_reward_model
    from tools.quickstart import build_tiny

    config = os.path.join(ROOT, "configs", "quickstart_rm_cpu.yaml")
    work = tempfile.mkdtemp(prefix="bench-rm-run-")
    policy = build_tiny(work)
    rm = str(make_digit_reward_model(os.path.join(work, "tiny-digits-rm"), policy))
    out = os.path.join(work, "run")
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "rlhf", "--config", config,
                    "--model", policy, "--reward_model", rm, "--output_dir", out,
                    "--train_iters", str(args.steps), *dtype_args(config)],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][2:]
    score = statistics.median(r["timing/score"] for r in rows if "timing/score" in r)
    step = statistics.median(r["timing/step"] for r in rows)
    print(f"reward_model score_share={score / step:.3f} score_s={score:.4f} step_s={step:.3f}",
          flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--run", action="store_true", help="also the quickstart's scoring share")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    scoring(args)
    if args.run:
        share(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
