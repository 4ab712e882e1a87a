"""Time of the bridge's full export under TP=2 x PP=2 on CPU, against two baselines.

    python tools/bench_bridge.py                      # ~400 MB fp32 Qwen2-shaped model, 4 ranks
    python tools/bench_bridge.py --layers 2 --iters 2 # quicker
    python tools/bench_bridge.py --moe --ep 2 --etp 1 # Qwen3-MoE, experts split over 2 EP ranks

With --moe the model is a Qwen3-MoE (make_tiny_model's qwen3_moe family: --experts routed
experts of --moe_ffn each, top --topk, every layer sparse) under TP=2 x PP=2 with expert
parallel --ep and expert tensor parallel --etp (default: TP) on the same 4 ranks; the
floor then adds, per stage, the ETP all-gather of the experts' split tensors and one EP
broadcast of the experts each EP rank owns.

The model is built once with tools/make_tiny_model.py into --workdir (random weights),
loaded by the bridge in 4 gloo ranks (TP=2 x PP=2), then, with barriers around each
timed region and the fastest of --iters runs kept:
- ours: drain `export_hf_weights` (every rank receives every tensor; the consumer drops
  each bucket), plain and with offload_bridge;
- floor: the same bytes moved between the same ranks by raw collectives on preallocated
  contiguous buffers, nothing else: for each pipeline stage in turn, one TP all-gather of
  everything that stage gathers (its TP-split tensors, 1/tp per rank), then one PP
  broadcast of everything it owns. If a memcpy of the model's bytes is slower than that,
  the memcpy is the floor;
- disk round trip, the naive path: rank 0 writes the HF checkpoint (safetensors, from
  memory: the gather to rank 0 is not even counted) and every rank reads its bytes back
  into memory (no tensors built, a lower bound of a loader). Reads come from the page
  cache (the file was just written), which favours this path.

Wall times on a shared machine vary with its load (printed). The last line is
`bridge_export vs_floor=<ours/floor> vs_disk_roundtrip=<ours/disk>` (plain export).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/bench_bridge")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--bucket_mb", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--moe", action="store_true",
                   help="a Qwen3-MoE (qwen3_moe family) instead of the dense Qwen2")
    p.add_argument("--experts", type=int, default=8, help="--moe: routed experts per layer")
    p.add_argument("--topk", type=int, default=2, help="--moe: experts per token")
    p.add_argument("--moe_ffn", type=int, default=384,
                   help="--moe: each expert's intermediate size (moe_intermediate_size)")
    p.add_argument("--ep", type=int, default=1, help="--moe: expert model parallel size")
    p.add_argument("--etp", type=int, default=None,
                   help="--moe: expert tensor parallel size (default: TP = 2)")
    p.add_argument("--fsync", action="store_true",
                   help="disk round trip: fsync the written file (persisted, not only cached)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.moe and (a.ep != 1 or a.etp is not None):
        p.error(f"--ep {a.ep} / --etp {a.etp}: expert parallelism needs --moe")
    return a


def _family(a) -> str:
    return "qwen3_moe" if a.moe else "qwen2"


def _moe_sizes(a) -> dict | None:
    """make_tiny_model's `moe=` of the --moe case (None: dense)."""
    if not a.moe:
        return None
    return dict(num_experts=a.experts, num_experts_per_tok=a.topk,
                moe_intermediate_size=a.moe_ffn)


def _model_dir(a) -> str:
    name = f"qwen2_h{a.hidden}_l{a.layers}_f{a.ffn}_v{a.vocab}_{a.dtype}"
    if a.moe:
        name = (f"qwen3_moe_h{a.hidden}_l{a.layers}_e{a.experts}k{a.topk}_mf{a.moe_ffn}"
                f"_v{a.vocab}_{a.dtype}")
    return os.path.join(a.workdir, name)


def _timed(fn, iters: int) -> float:
    import torch.distributed as dist

    best = float("inf")
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def _worker(a) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    from bridge import export_hf_weights, load_hf_weights
    from bridge.export import _plan
    from bridge.groups import megatron_groups
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel, init_process_group

    init_process_group()
    init_parallel(ParallelDims(world_size=dist.get_world_size(), tp=2, pp=2, ep=a.ep, etp=a.etp))
    path = _model_dir(a)
    config, args = build_transformer_config(path, tp=2, pp=2, dtype=a.dtype, ep=a.ep, etp=a.etp)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, path)
    groups = megatron_groups()
    bucket = a.bucket_mb << 20

    def drain(offload):
        for b in export_hf_weights(chunks, config, args, bucket_size_bytes=bucket,
                                   offload_bridge=offload):
            del b

    results = {"ours (plain)": _timed(lambda: drain(False), a.iters),
               "ours (offload_bridge)": _timed(lambda: drain(True), a.iters)}

    # Floor: what each stage gathers over TP (ETP for experts), broadcasts over EP (the
    # experts of each EP rank) and over PP, as raw collectives on preallocated buffers.
    ep_rank, ep_ranks, ep_grp, etp_grp, etp = 0, [dist.get_rank()], None, None, 1
    if getattr(config, "num_moe_experts", None):
        from megatron.core import parallel_state as ps

        from bridge.moe import ep_group, ep_layout

        ep_rank = ep_layout(config)[0]
        ep_grp, ep_ranks = ep_group()
        etp_grp = ps.get_expert_tensor_parallel_group()
        etp = ps.get_expert_tensor_parallel_world_size()
    items = _plan(chunks, config, args, groups, None, lambda p: p.detach(), ep_rank)
    nbytes = lambda it: it.dtype.itemsize * int(torch.Size(it.shape).numel())  # noqa: E731
    total = sum(nbytes(it) for it in items)
    per_stage = []   # (dense TP-split bytes / tp, my experts' ETP-split bytes / etp,
    #                  bytes of the experts each EP rank owns, all bytes of the stage)
    for stage in range(groups.pp):
        mine = [it for it in items if it.owner == stage]
        dense = [it for it in mine if it.ep_owner is None]
        experts = [it for it in mine if it.ep_owner == ep_rank]
        split = sum(nbytes(it) for it in dense if it.unit.layout.tp_split) // groups.tp
        esplit = sum(nbytes(it) for it in experts if it.unit.layout.tp_split) // etp
        owned = [sum(nbytes(it) for it in mine if it.ep_owner == e) for e in range(len(ep_ranks))]
        per_stage.append((split, esplit, owned, sum(nbytes(it) for it in mine)))
    send = torch.empty(max(max(s, e) for s, e, _, _ in per_stage), dtype=torch.uint8)
    gathered = torch.empty(max(groups.tp, etp) * send.numel(), dtype=torch.uint8)
    full = torch.empty(max(f for _, _, _, f in per_stage), dtype=torch.uint8)
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def floor():
        for stage, (split, esplit, owned, everything) in enumerate(per_stage):
            if stage == groups.pp_rank:
                gather_into(gathered[:groups.tp * split], send[:split], group=groups.tp_group)
                if etp_grp is not None:
                    gather_into(gathered[:etp * esplit], send[:esplit], group=etp_grp)
                if ep_grp is not None and len(ep_ranks) > 1:
                    for e, n in enumerate(owned):
                        dist.broadcast(full[:n], src=ep_ranks[e], group=ep_grp)
            dist.broadcast(full[:everything], src=groups.pp_ranks[stage], group=groups.pp_group)

    results["floor: raw collectives"] = _timed(floor, a.iters)
    src, dst = torch.empty(total, dtype=torch.uint8), torch.empty(total, dtype=torch.uint8)
    results["floor: memcpy"] = _timed(lambda: dst.copy_(src), a.iters)
    del src, dst, send, gathered, full

    # Naive: rank 0 writes the HF checkpoint, every rank reads it back.
    ckpt = os.path.join(a.workdir, "roundtrip.safetensors")
    state = load_file(os.path.join(path, "model.safetensors")) if dist.get_rank() == 0 else None

    landing = bytearray(2 * total)  # bigger than the file: its header included

    def disk():
        if dist.get_rank() == 0:
            save_file(state, ckpt)
            if a.fsync:
                fd = os.open(ckpt, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        dist.barrier()
        with open(ckpt, "rb", buffering=0) as f:  # every byte into this rank's memory
            view = memoryview(landing)
            got = 0
            while (n := f.readinto(view[got:])):
                got += n

    results["disk round trip"] = _timed(disk, a.iters)
    if dist.get_rank() == 0:
        os.remove(ckpt)
        _report(a, results, total)


def _report(a, results: dict, total: int) -> None:
    floor = max(results["floor: raw collectives"], results["floor: memcpy"])
    ours = results["ours (plain)"]
    kind = (f"qwen3_moe hidden={a.hidden} layers={a.layers} experts={a.experts} top{a.topk} "
            f"moe_ffn={a.moe_ffn}" if a.moe else
            f"qwen2 hidden={a.hidden} layers={a.layers} ffn={a.ffn}")
    mesh = f"; EP={a.ep} x ETP={a.etp or 2}" if a.moe else ""
    print(f"model: {kind} vocab={a.vocab} "
          f"{a.dtype}: {total / 1e6:.0f} MB HF tensors; TP=2 x PP=2{mesh}, 4 gloo ranks; "
          f"bucket {a.bucket_mb} MiB; best of {a.iters}; disk fsync={a.fsync}; "
          f"load_avg_1min={os.getloadavg()[0]:.1f}")
    print(f"{'path':<24} {'seconds':>8} {'GB/s':>7} {'vs ours':>8}")
    for name, t in results.items():
        print(f"{name:<24} {t:8.3f} {total / t / 1e9:7.2f} {t / ours:8.3f}")
    print(f"bridge_export vs_floor={ours / floor:.3f} "
          f"vs_disk_roundtrip={ours / results['disk round trip']:.3f}")


def main(argv=None) -> None:
    a = _args(argv)
    if a.worker:
        _worker(a)
        return
    path = _model_dir(a)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        from tools.make_tiny_model import make_tiny_model

        print(f"building {path} ...", flush=True)
        make_tiny_model(path, family=_family(a), num_layers=a.layers, hidden_size=a.hidden,
                        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                        intermediate_size=a.ffn, vocab_size=a.vocab, dtype=a.dtype,
                        moe=_moe_sizes(a))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           os.path.abspath(__file__), "--worker"] + (argv if argv is not None else sys.argv[1:])
    raise SystemExit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
