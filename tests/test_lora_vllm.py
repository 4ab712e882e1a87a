"""LoRA sync into vLLM: vLLM's log-probs equal HF with the merged adapter.

A tiny Qwen2 and PEFT adapters on every linear (random A and B, so every adapter moves
the log-probs) are loaded into a Megatron TP=2 model (bridge + megatron_grpo/model/lora_peft.py).

One world and one colocated vLLM engine per rank (vLLM TP=1, LoRA enabled) for all of it:
starting the world and the engines is most of the cost.

Adapter-only sync (--vllm_enable_lora): vLLM keeps the base weights it loaded and gets
only the adapter's PEFT tensors, through the trainer's own WeightSync, in buckets;
`check_weight_sync` proves vLLM holds exactly them (and only that adapter). Colocated:
log-probs equal HF with the merged adapter; a second adapter synced next replaces the
first (new id, the log-probs follow it: nothing stale), and a wrong expectation fails
the check. Server mode (`megatron rollout --vllm_enable_lora true`): sync + check, and
both ranks' clients sample with the new adapter (log-probs as HF's).

Merged sync, last: the merged stream (W + scale B A per HF tensor,
model/lora_peft.merged_stream) of the model with adapter 2 goes into the same engines'
base weights, the fingerprint check of all 27 tensors passes, and vLLM's per-token prompt
log-probs without an adapter request equal HF transformers' on peft's merge_and_unload of
adapter 2 (float32, 1e-5 per token), while each adapter moves them by far more. (The
merged sync of a run without --vllm_enable_lora, into a plain engine, is checked after
every step by tests/test_lora_e2e.py's --check_weight_sync.)
"""
from __future__ import annotations

import shutil
import types

import pytest
import torch

from tests.harness import rollout_server, run_distributed
from tests.test_rollout_colocate import (ATOL, engine_kwargs, hf_logprobs, max_diff, needs_vllm,
                                         tiny_vllm_model)
from tests.test_rollout_sync import COMPLETIONS, PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _random_adapter(base_dir, root, name: str, seed: int):
    """A PEFT adapter (r=4, all-linear, random A and B) of `base_dir` and the merged HF
    model (with the tokenizer files) as its reference. Returns (adapter_dir, merged_dir)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                      lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapter_dir, merged_dir = root / f"{name}_adapter", root / f"{name}_merged"
    model.save_pretrained(adapter_dir)
    model.merge_and_unload().save_pretrained(merged_dir)
    for f in base_dir.iterdir():        # tokenizer files for the HF reference
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy2(f, merged_dir / f.name)
    return adapter_dir, merged_dir


def _lora_model(world_size, model_dir, adapter_dir):
    from bridge import load_hf_weights
    from megatron_grpo.model.lora_peft import load_peft_adapter, peft_settings
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.model.lora import apply_lora
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world_size, tp=2))
    config, args = build_transformer_config(model_dir, tp=2)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, model_dir)
    apply_lora(chunks, config, args, peft_settings(adapter_dir))
    load_peft_adapter(chunks, adapter_dir)
    return chunks, config, args


# --------------------------------------------------------------------------- adapter-only
def _sync_opts(mode: str):
    """The rollout options WeightSync reads (cfg.rollout's names)."""
    return types.SimpleNamespace(vllm_mode=mode, sleep_level=0, move_model_batches=3,
                                 offload_bridge=False, check_weight_sync=True,
                                 vllm_enable_lora=True, offload_model=False,
                                 offload_optimizer=False)


def _adapter_body(rank, world_size, model_dir, adapter_dirs, port):
    import torch.distributed as dist

    from bridge import export_hf_weights
    from megatron_grpo.model.lora_peft import adapter_stream, load_peft_adapter, merged_stream
    from megatron_grpo.model.lora import lora_settings
    from megatron_grpo.rollout.client import RolloutClient
    from megatron_grpo.rollout.colocate import ColocateEngine
    from megatron_grpo.rollout.sync import WeightSync
    from megatron_grpo.rollout.verify import (AdapterFingerprints, StreamFingerprints,
                                              WeightSyncError, check_adapter_sync,
                                              check_weight_sync)
    from megatron_grpo.rollout.weights import load_weight_stream

    chunks, config, args = _lora_model(world_size, model_dir, adapter_dirs[0])
    policy = types.SimpleNamespace(chunks=chunks, config=config, args=args, optimizer=None)
    engine = ColocateEngine(model_dir, **engine_kwargs(vllm_tensor_parallel_size=1,
                                                       vllm_enable_lora=True,
                                                       vllm_max_lora_rank=8))
    seen = {"base": engine.score(PROMPTS, COMPLETIONS)}
    sync = WeightSync(policy, engine, _sync_opts("colocate"))
    seen["info_1"] = sync()                 # adapter 1 (check_weight_sync inside)
    seen["score_1"] = engine.score(PROMPTS, COMPLETIONS)
    load_peft_adapter(chunks, adapter_dirs[1])
    seen["info_2"] = sync()                 # adapter 2 replaces it
    seen["score_2"] = engine.score(PROMPTS, COMPLETIONS)
    seen["held_2"] = engine.adapter_fingerprints()[0][0]["ids"]
    # A wrong expectation (scale x2 on B) fails, naming the B tensors.
    wrong = AdapterFingerprints(lora_settings(chunks).scale * 2)
    for _ in wrong.watch(adapter_stream(chunks)):
        pass
    try:
        check_adapter_sync(engine, wrong, 2)
    except WeightSyncError as e:
        seen["wrong"] = str(e)

    # Server mode: rank 0 uploads, every rank's client samples with the new adapter.
    client = RolloutClient(vllm_server_port=port, vllm_server_timeout=400, num_generations=1,
                           max_completion_length=4)
    client.wait_until_ready()
    seen["server_info"] = WeightSync(policy, client, _sync_opts("server"))()
    seen["server_name"] = client.lora_name
    seen["server_score"] = client.score(PROMPTS, COMPLETIONS)

    # Merged sync into the same engine (the base weights become W + s B A of adapter 2):
    # the fingerprints of every tensor check, and without an adapter request vLLM's
    # log-probs are HF's on peft's merge_and_unload of adapter 2.
    expected = StreamFingerprints()
    stream = merged_stream(chunks, export_hf_weights(chunks, config, args,
                                                     bucket_size_bytes=192 << 10))
    seen["merged_stats"] = load_weight_stream(engine, expected.watch(stream))
    seen["merged_checked"] = check_weight_sync(engine, expected.result)
    engine.lora_request = None
    seen["merged_score"] = engine.score(PROMPTS, COMPLETIONS)
    dist.barrier()
    engine.close()          # (vLLM's teardown ends torch.distributed: nothing collective after)
    return seen


@needs_vllm
def test_lora_sync_adapter_only_server_and_merged(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_vllm_adapter")
    base_dir = tiny_vllm_model(root / "base")
    # The server starts while the references are computed and the world comes up.
    with rollout_server(base_dir, root / "server.log", "--vllm_max_model_len", "256",
                        "--vllm_enforce_eager", "true", "--vllm_engine_kwargs",
                        '{"dtype": "float32"}', "--vllm_enable_lora", "true",
                        "--vllm_max_lora_rank", "8", "--vllm_kv_cache_memory", "64MiB",
                        wait=False) as server:
        (a1, m1), (a2, m2) = (_random_adapter(base_dir, root, "a", seed=5),
                              _random_adapter(base_dir, root, "b", seed=6))
        seen = run_distributed(_adapter_body, world_size=2,
                               args=(str(base_dir), [str(a1), str(a2)], server.port), timeout=600)
    base = hf_logprobs(base_dir, PROMPTS, COMPLETIONS)
    ref_1 = hf_logprobs(m1, PROMPTS, COMPLETIONS)
    ref_2 = hf_logprobs(m2, PROMPTS, COMPLETIONS)
    assert min(max_diff(ref_1, base), max_diff(ref_2, ref_1)) > 1e-2
    n_factors = 2 * 7 * 2          # A and B of 7 targets in each of 2 layers
    for rank, s in enumerate(seen):
        assert max_diff(s["base"], base) < ATOL, rank
        for v in (1, 2):
            info = s[f"info_{v}"]
            assert info["tensors"] == n_factors and info["buckets"] >= 2, (rank, info)
            assert info["lora_name"] == f"mgrpo-lora-{v}", rank
            # only the adapter travels: 2 layers x fp32 x r=4 x sum of (in + out) per target
            assert info["bytes"] == 2 * 4 * 4 * (256 + 192 + 192 + 256 + 3 * 384), (rank, info)
        assert max_diff(s["score_1"], ref_1) < ATOL, rank
        assert max_diff(s["score_2"], ref_2) < ATOL, rank
        assert s["held_2"] == [2], rank
        assert "(14 problem(s))" in s["wrong"] and "lora_B.weight: differs in vLLM" in s["wrong"]
        assert "lora_A.weight: differs" not in s["wrong"], rank
        assert s["server_name"] == "mgrpo-lora-1", rank
        assert max_diff(s["server_score"], ref_2) < ATOL, rank
    assert seen[0]["server_info"]["tensors"] == n_factors and seen[1]["server_info"] == {}
    for rank, s in enumerate(seen):     # merged sync
        assert s["merged_stats"]["tensors"] == s["merged_checked"] == 27, rank
        assert max_diff(s["merged_score"], ref_2) < ATOL, rank
