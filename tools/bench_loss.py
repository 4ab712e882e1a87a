"""Peak memory and time of the fused log-prob/entropy kernel vs the naive full-logits path.

    python tools/bench_loss.py                  # the default sizes, all cores
    python tools/bench_loss.py --threads 1 --sizes 1024x1024x151936

Both paths compute, for random fp32 hidden `[T, H]`, weight `[V, H]` and targets, the
forward and backward of `loss = sum(c1 * logp + c2 * entropy)` (random c1, c2) at temperature
0.7, TP=1:
  naive: logits = hidden @ W^T / t in fp32 ([T, V]), log_softmax, gather, entropy from it;
  fused: megatron_grpo.kernels.vocab_parallel_logprobs (chunked, recomputed in backward).

Memory is measured honestly for CPU tensors, where torch keeps no allocator statistics: each
(path, size) runs in a FRESH subprocess that builds its inputs, records its resident set size
(RSS, /proc/self/statm) as the baseline, then runs warm-up + timed iterations and reads the
process's lifetime peak RSS (getrusage ru_maxrss). Peak minus baseline is the extra memory of
forward+backward, gradients included (both paths return the same [V, H] weight gradient).
Large buffers come from mmap and go back to the OS when freed, so RSS follows live tensors;
small ones may stay in malloc's heap, which can only over-count (never hide) memory.
Time is the fastest of `--repeats` forward+backward iterations after one warm-up.

The last line printed is `loss_kernel peak_memory_ratio=<fused/naive> time_ratio=<fused/naive>`
for the last size (by default the V=151936 one).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SIZES = ("4096x1024x32768", "2048x1024x151936")
TEMPERATURE = 0.7


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _naive(hidden, weight, targets, temperature):
    import torch

    logits = (hidden @ weight.t()).float() / temperature              # [T, V] fp32
    logp_all = torch.log_softmax(logits, dim=-1)                        # [T, V]
    logp = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)          # [T]
    ent = -(logp_all.exp() * logp_all).sum(dim=-1)                      # [T]
    return logp, ent


def _worker(args) -> None:
    """One path at one size, in its own process; prints one JSON line."""
    import torch

    sys.path.insert(0, REPO)
    from megatron_grpo.kernels import vocab_parallel_logprobs

    torch.set_num_threads(args.threads)
    T, H, V = (int(x) for x in args.size.split("x"))
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g, dtype=dtype) * 0.05).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    c1 = torch.randn(T, generator=g)
    c2 = torch.randn(T, generator=g)
    baseline = _rss_bytes()

    times = []
    for i in range(args.repeats + 1):
        hidden.grad = None
        weight.grad = None
        t0 = time.perf_counter()
        if args.worker == "naive":
            logp, ent = _naive(hidden, weight, targets, TEMPERATURE)
        else:
            logp, ent = vocab_parallel_logprobs(
                hidden, weight, targets, temperature=TEMPERATURE,
                chunk_size_tokens=args.chunk_tokens, chunk_size_vocab=args.chunk_vocab)
        (c1 * logp + c2 * ent).sum().backward()
        if i > 0:   # iteration 0 is the warm-up
            times.append(time.perf_counter() - t0)
        del logp, ent
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
    print(json.dumps({"path": args.worker, "size": args.size, "time_s": min(times),
                      "peak_extra_bytes": peak - baseline, "baseline_bytes": baseline}))


def _run_one(path: str, size: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--size", size,
           "--threads", str(args.threads), "--repeats", str(args.repeats),
           "--chunk-tokens", str(args.chunk_tokens), "--chunk-vocab", str(args.chunk_vocab),
           "--dtype", args.dtype]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    sys.path.insert(0, REPO)
    from megatron_grpo.kernels import DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNK_VOCAB

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES),
                   help="TxHxV triples; the ratio line is for the last one")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch.set_num_threads in every run (default: all cores)")
    p.add_argument("--repeats", type=int, default=2, help="timed iterations after a warm-up")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--chunk-vocab", type=int, default=DEFAULT_CHUNK_VOCAB)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of hidden and weight (the loss math is fp32 in both paths)")
    p.add_argument("--worker", choices=("naive", "fused"), help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return

    gib = 1024 ** 3
    print(f"threads={args.threads} repeats={args.repeats} dtype={args.dtype} "
          f"chunk_tokens={args.chunk_tokens} chunk_vocab={args.chunk_vocab} "
          f"temperature={TEMPERATURE}")
    print(f"{'T':>6} {'H':>6} {'V':>7} | {'naive GiB':>9} {'fused GiB':>9} {'mem ratio':>9} | "
          f"{'naive s':>8} {'fused s':>8} {'time ratio':>10}")
    mem_ratio = time_ratio = float("nan")
    for size in args.sizes:
        naive = _run_one("naive", size, args)
        fused = _run_one("fused", size, args)
        mem_ratio = fused["peak_extra_bytes"] / naive["peak_extra_bytes"]
        time_ratio = fused["time_s"] / naive["time_s"]
        T, H, V = size.split("x")
        print(f"{T:>6} {H:>6} {V:>7} | {naive['peak_extra_bytes'] / gib:9.3f} "
              f"{fused['peak_extra_bytes'] / gib:9.3f} {mem_ratio:9.3f} | "
              f"{naive['time_s']:8.2f} {fused['time_s']:8.2f} {time_ratio:10.3f}", flush=True)
    print(f"loss_kernel peak_memory_ratio={mem_ratio:.4f} time_ratio={time_ratio:.4f}")


if __name__ == "__main__":
    main()
