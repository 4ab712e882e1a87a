"""bfloat16 against float32 on this CPU: one rank's share of a quickstart step, both phases.

    python tools/bench_dtype.py                     # the quickstart's tiny Qwen2, 40 rounds
    python tools/bench_dtype.py --model DIR --iters 20

Why: configs/quickstart_cpu.yaml trains and samples in bfloat16, and tools/quickstart.py
falls back to float32 on a CPU without bf16 instructions. This measures both dtypes in ONE
process, alternating every round, on the process's CPU time (one thread), so that the
machine's drift between minutes (25-45 % on a shared VM) falls on both alike:

    generate   vLLM (the CPU engine, eager, prefix caching, as a colocated rank runs it):
               the rank's 2 prompts x 8 samples x 24 tokens (min_tokens = max_tokens)
    train      the Megatron model's forward + backward of the dapo loss through
               `train_micro_batches` (Megatron's schedule): 16 samples of 22 + 24 tokens,
               micro-batches of 8, no activation recompute

With `ONEDNN_MAX_CPU_ISA=AVX512_CORE` in the environment oneDNN leaves out its bf16
instructions (an x86 CPU without AVX512-BF16 / AMX, roughly). The last line printed is

    dtype_bf16 generate_ratio=<bf16/fp32> train_ratio=<bf16/fp32>

(below 1: bf16 the faster), from the medians of `--iters` rounds after 3 warm-up rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DTYPES = ("float32", "bfloat16")
PROMPT, COMPLETION, PROMPTS, GENERATIONS, MICRO = 22, 24, 2, 8, 8   # one quickstart rank


def _timed(fns: dict, iters: int) -> dict:
    """CPU seconds of each function per round, the functions alternated every round."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            times[name].append(time.process_time() - t0)
    return times


def generate_fns(model: str) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from megatron_grpo.platform.cpu import without_cuda_rewrite

    prompts = [{"prompt_token_ids": [(7 * p + i) % 900 + 5 for i in range(PROMPT)]}
               for p in range(PROMPTS)]
    params = SamplingParams(n=GENERATIONS, max_tokens=COMPLETION, min_tokens=COMPLETION,
                            temperature=1.0, seed=0, detokenize=False)
    fns = {}
    for dtype in DTYPES:
        llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=256, seed=0,
                  kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True)

        def generate(llm=llm):
            with without_cuda_rewrite():
                llm.generate(prompts, params, use_tqdm=False)
        fns[dtype] = generate
    return fns


def train_fns(model: str) -> dict:
    import torch

    from megatron_grpo.algorithms import count_partials, loss_normalizer
    from megatron_grpo.config.hf_model import model_config
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.train import LossOptions, Sample, micro_batches, train_micro_batches
    from megatron_grpo.train.batch import collate

    init_parallel(ParallelDims(world_size=1))
    vocab = model_config(model).language["vocab_size"]
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(0, vocab, (PROMPT,), generator=g).tolist(),
                      completion_ids=torch.randint(0, vocab, (COMPLETION,), generator=g).tolist(),
                      advantage=float(torch.randn((), generator=g)))
               for _ in range(PROMPTS * GENERATIONS)]
    batches = micro_batches(samples, MICRO, pad_to_length=PROMPT + COMPLETION - 1)
    counts = count_partials(*[collate(samples)["completion_mask"]] * 2)
    norm = loss_normalizer("dapo", counts, generation_counts=counts,
                           max_completion_length=COMPLETION)
    opts = LossOptions(loss_type="dapo")
    fns = {}
    for dtype in DTYPES:
        config, args = build_transformer_config(hf, dtype=dtype,
                                                recompute=dict(recompute_granularity="none"))
        torch.manual_seed(0)
        chunks = wrap_ddp(config, build_model(config, args))

        def train(chunks=chunks):
            for c in chunks:
                c.zero_grad_buffer()
            train_micro_batches(chunks, batches, opts, normalizer=norm, vocab_size=vocab)
        fns[dtype] = train
    return fns


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="an HF model folder (default: the quickstart's tiny Qwen2, built here)")
    ap.add_argument("--iters", type=int, default=40, help="rounds per dtype and phase")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from tools.quickstart import build_tiny

            model = build_tiny(tmp)
        medians = {}
        for phase, make in (("generate", generate_fns), ("train", train_fns)):
            times = _timed(make(model), a.iters)
            for dtype, ts in times.items():
                q1, med, q3 = statistics.quantiles(ts, n=4)
                print(f"[bench_dtype] {phase:8} {dtype:8} median {med:.4f} CPU s "
                      f"(quartiles {q1:.4f} .. {q3:.4f}, {len(ts)} rounds)", flush=True)
            medians[phase] = statistics.median(times["bfloat16"]) / statistics.median(times["float32"])
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    print(f"[bench_dtype] ONEDNN_MAX_CPU_ISA={isa or 'unset'}; torch {torch.__version__}")
    print(f"dtype_bf16 generate_ratio={medians['generate']:.3f} train_ratio={medians['train']:.3f}")


if __name__ == "__main__":
    main()
