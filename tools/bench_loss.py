"""Peak memory and time of the fused log-prob/entropy kernel vs the naive full-logits path.

    python tools/bench_loss.py                  # the default sizes, all cores
    python tools/bench_loss.py --threads 1 --sizes 1024x1024x151936

Both paths compute, for random fp32 hidden `[T, H]`, weight `[V, H]` and targets, the
forward and backward of `loss = sum(c1 * logp + c2 * entropy)` (random c1, c2) at temperature
0.7, TP=1:
  naive: logits = hidden @ W^T / t in fp32 ([T, V]), log_softmax, gather, entropy from it;
  fused: megatron_grpo.kernels.vocab_parallel_logprobs (chunked, recomputed in backward).

Memory is measured for CPU tensors, where torch keeps no allocator statistics, from the
operating system: each (path, size) runs in a FRESH subprocess that first runs its path once at
a tiny size (so library code pages and thread pools are already resident), builds its inputs,
records its resident set size (RSS, /proc/self/statm) as the baseline, runs `--iters`
forward+backward iterations and reads the process's lifetime peak RSS (getrusage ru_maxrss).
Peak minus baseline is the extra memory of forward+backward, gradients included (both paths
return the same [V, H] weight gradient, a floor neither can go under). Buffers above malloc's
mmap threshold go back to the OS when freed, so RSS follows live tensors; smaller ones may stay
in malloc's heap, which can only over-count (never hide) memory.

Time is the fastest of the `--iters` iterations, on two clocks: wall time, and the process's
CPU time (user + system, all threads; time.process_time). There is no JIT or caching allocator
on CPU (every iteration maps and faults in its big buffers afresh), so the first iteration is
not special. On a shared machine other processes inflate wall times unevenly; CPU time counts
only the work this process did, so it is the steadier figure there (`--clock cpu` puts it in
the last line). Worker threads wait passively (OMP_WAIT_POLICY=PASSIVE) so that a thread
spinning at a barrier while its partner is descheduled does not count as work.

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

    def step(hidden, weight, targets, c1, c2):
        if args.worker == "naive":
            logp, ent = _naive(hidden, weight, targets, TEMPERATURE)
        else:
            logp, ent = vocab_parallel_logprobs(
                hidden, weight, targets, temperature=TEMPERATURE,
                chunk_size_tokens=args.chunk_tokens, chunk_size_vocab=args.chunk_vocab)
        (c1 * logp + c2 * ent).sum().backward()

    # Tiny run first: page in the code and start the thread pools before the baseline.
    tiny = (hidden[:8].detach().clone().requires_grad_(),
            weight[:64].detach().clone().requires_grad_(), targets[:8] % 64, c1[:8], c2[:8])
    step(*tiny)
    del tiny
    baseline = _rss_bytes()

    times, cpu_times = [], []
    for _ in range(args.iters):
        hidden.grad = None
        weight.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        step(hidden, weight, targets, c1, c2)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB
    print(json.dumps({"path": args.worker, "size": args.size, "time_s": min(times), "cpu_s": min(cpu_times),
                      "peak_extra_bytes": peak - baseline, "baseline_bytes": baseline}))


def _run_one(path: str, size: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", path, "--size", size,
           "--threads", str(args.threads), "--iters", str(args.iters),
           "--chunk-tokens", str(args.chunk_tokens), "--chunk-vocab", str(args.chunk_vocab),
           "--dtype", args.dtype]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="PASSIVE")
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
    p.add_argument("--iters", type=int, default=2,
                   help="forward+backward iterations per run; the fastest is reported")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--chunk-vocab", type=int, default=DEFAULT_CHUNK_VOCAB)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of hidden and weight (the loss math is fp32 in both paths)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="clock of the time_ratio in the last line (the table shows both)")
    p.add_argument("--worker", choices=("naive", "fused"), help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return

    gib = 1024 ** 3
    print(f"threads={args.threads} iters={args.iters} dtype={args.dtype} "
          f"chunk_tokens={args.chunk_tokens} chunk_vocab={args.chunk_vocab} "
          f"temperature={TEMPERATURE} load_avg_1min={os.getloadavg()[0]:.1f}")
    print(f"{'T':>5} {'H':>5} {'V':>6} | {'naive GiB':>9} {'fused GiB':>9} {'ratio':>6} | "
          f"{'naive s':>7} {'fused s':>7} {'ratio':>6} | {'naive cpu':>9} {'fused cpu':>9} "
          f"{'ratio':>6}")
    mem_ratio = time_ratio = float("nan")
    for size in args.sizes:
        naive = _run_one("naive", size, args)
        fused = _run_one("fused", size, args)
        mem_ratio = fused["peak_extra_bytes"] / naive["peak_extra_bytes"]
        wall_ratio = fused["time_s"] / naive["time_s"]
        cpu_ratio = fused["cpu_s"] / naive["cpu_s"]
        time_ratio = wall_ratio if args.clock == "wall" else cpu_ratio
        T, H, V = size.split("x")
        print(f"{T:>5} {H:>5} {V:>6} | {naive['peak_extra_bytes'] / gib:9.3f} "
              f"{fused['peak_extra_bytes'] / gib:9.3f} {mem_ratio:6.3f} | "
              f"{naive['time_s']:7.2f} {fused['time_s']:7.2f} {wall_ratio:6.3f} | "
              f"{naive['cpu_s']:9.2f} {fused['cpu_s']:9.2f} {cpu_ratio:6.3f}", flush=True)
    print(f"(load_avg_1min at the end: {os.getloadavg()[0]:.1f}; time_ratio below uses the "
          f"{args.clock} clock)")
    print(f"loss_kernel peak_memory_ratio={mem_ratio:.4f} time_ratio={time_ratio:.4f}")


if __name__ == "__main__":
    main()
