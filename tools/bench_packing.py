"""Tokens/s of the GRPO training pass on packed (`--padding_free true`) vs padded micro-batches.

    python tools/bench_packing.py                       # defaults below, 1 thread
    python tools/bench_packing.py --max_completion 512 --threads 2

A generation batch as GRPO makes it: `--samples` completions, prompts of 16-48 tokens,
completion lengths drawn uniformly from 8..`--max_completion` (some stop early, some run
to the limit). As the trainer does, the padded micro-batches are all padded to the
longest sample of the batch (one length for the pipeline schedule); the packed ones hold
only real tokens (train/packing.py). Both run the same Qwen2-shaped model built here
(random weights, Megatron-Core's local layers, one process, TP=PP=CP=1) and the same
micro-batches through `train_micro_batches` (the forward and backward of the dapo loss
through Megatron's schedule, as in a training step) and `forward_logprobs` (the old /
reference log-prob pass). The padded model runs Megatron's own local attention, the
packed one the project's per-sequence attention (model/cp_attention.py).

Time is the fastest of `--iters` passes after one warm-up pass, on the wall clock (or the
process's CPU time with `--clock cpu`, steadier on a shared machine); tokens/s counts real
tokens (prompt + completion - 1 per sample) per second. The last line printed is

    packing tokens_per_s_ratio=<packed/padded, training pass> pad_fraction=<pad / padded tokens>
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _model_config(a) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_size": a.hidden, "intermediate_size": a.hidden * 4,
            "num_attention_heads": a.heads, "num_key_value_heads": max(1, a.heads // 2),
            "num_hidden_layers": a.layers, "vocab_size": a.vocab, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_theta": 10000.0}


def _samples(a):
    import torch

    from megatron_grpo.train import Sample

    g = torch.Generator().manual_seed(a.seed)
    out = []
    for _ in range(a.samples):
        p = int(torch.randint(16, 49, (1,), generator=g))
        c = int(torch.randint(8, a.max_completion + 1, (1,), generator=g))
        out.append(Sample(prompt_ids=torch.randint(0, a.vocab, (p,), generator=g).tolist(),
                          completion_ids=torch.randint(0, a.vocab, (c,), generator=g).tolist(),
                          advantage=float(torch.randn((), generator=g))))
    return out


def _clock(kind: str) -> float:
    return time.process_time() if kind == "cpu" else time.perf_counter()


def _best(fn, iters: int, clock: str) -> float:
    fn()                                            # warm-up: first-call allocations
    best = float("inf")
    for _ in range(iters):
        t0 = _clock(clock)
        fn()
        best = min(best, _clock(clock) - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=32, help="completions in the batch")
    ap.add_argument("--micro_batch_size", type=int, default=8)
    ap.add_argument("--max_completion", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    from megatron_grpo.algorithms import count_partials, loss_normalizer
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.train import (LossOptions, forward_logprobs, micro_batches,
                                     train_micro_batches)
    from megatron_grpo.train.batch import collate

    init_parallel(ParallelDims(world_size=1))
    hf = _model_config(a)
    samples = _samples(a)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
    longest, real = max(lengths), sum(lengths)
    padded_tokens = longest * len(samples)
    batches = micro_batches(samples, a.micro_batch_size, pad_to_length=longest)
    full = collate(samples)
    counts = count_partials(full["completion_mask"], full["completion_mask"])
    opts = LossOptions(loss_type="dapo")
    norm = loss_normalizer("dapo", counts, generation_counts=counts,
                           max_completion_length=a.max_completion)
    rows = {}
    for name, packed in (("padded", False), ("packed", True)):
        config, args = build_transformer_config(hf)
        torch.manual_seed(a.seed)
        chunks = wrap_ddp(config, build_model(config, args, padding_free=packed))

        def train():
            for c in chunks:
                c.zero_grad_buffer()
            train_micro_batches(chunks, batches, opts, normalizer=norm, vocab_size=a.vocab)

        def forward():
            forward_logprobs(chunks, batches, temperature=1.0, vocab_size=a.vocab)

        rows[name] = (_best(train, a.iters, a.clock), _best(forward, a.iters, a.clock))
        del chunks
    pad_fraction = 1.0 - real / padded_tokens
    print(f"[bench_packing] {len(samples)} samples, {len(batches)} micro-batches of "
          f"{a.micro_batch_size}, lengths {min(lengths)}..{longest} "
          f"(mean {real / len(samples):.0f})"
          f", model hidden {a.hidden} x {a.layers} layers, vocab {a.vocab}, {a.threads} thread(s)"
          f", {a.clock} clock, best of {a.iters}")
    print(f"{'':8} {'train s':>9} {'train tok/s':>12} {'forward s':>10} {'fwd tok/s':>10}")
    for name, (t_train, t_fwd) in rows.items():
        print(f"{name:8} {t_train:9.3f} {real / t_train:12.0f} {t_fwd:10.3f} {real / t_fwd:10.0f}")
    ratio = rows["padded"][0] / rows["packed"][0]
    fwd_ratio = rows["padded"][1] / rows["packed"][1]
    print(f"forward-only tokens_per_s_ratio={fwd_ratio:.3f}")
    print(f"packing tokens_per_s_ratio={ratio:.3f} pad_fraction={pad_fraction:.3f}")


if __name__ == "__main__":
    main()
