"""Merged LoRA sync into vLLM (issue 15): vLLM's log-probs equal HF with the merged adapter.

A tiny Qwen2 and a PEFT adapter on every linear (random A and B, so every adapter moves
the log-probs) are loaded into a Megatron TP=2 model (bridge + megatron_grpo/model/lora_peft.py); the
merged stream (W + scale B A per HF tensor, model/lora_peft.merged_stream) goes into a
colocated vLLM engine per rank (vLLM TP=1), the fingerprint check passes, and vLLM's
per-token prompt log-probs equal HF transformers' on peft's merge_and_unload of the same
adapter (float32, 1e-5 per token), while the adapter moves them by far more.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.harness import run_distributed
from tests.test_rollout_colocate import (ATOL, engine_kwargs, hf_logprobs, max_diff, needs_vllm,
                                         tiny_vllm_model)
from tests.test_rollout_sync import COMPLETIONS, PROMPTS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _body(rank, world_size, model_dir, adapter_dir):
    import torch.distributed as dist

    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.model.lora_peft import load_peft_adapter, merged_stream, peft_settings
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.model.lora import apply_lora
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.rollout.colocate import ColocateEngine
    from megatron_grpo.rollout.verify import StreamFingerprints, check_weight_sync
    from megatron_grpo.rollout.weights import load_weight_stream

    init_parallel(ParallelDims(world_size=world_size, tp=2))
    config, args = build_transformer_config(model_dir, tp=2)
    chunks = build_model(config, args)
    load_hf_weights(chunks, config, args, model_dir)
    apply_lora(chunks, config, args, peft_settings(adapter_dir))
    load_peft_adapter(chunks, adapter_dir)
    engine = ColocateEngine(model_dir, **engine_kwargs(vllm_tensor_parallel_size=1))
    seen = {}
    expected = StreamFingerprints()
    stream = merged_stream(chunks, export_hf_weights(chunks, config, args,
                                                     bucket_size_bytes=192 << 10))
    seen["stats"] = load_weight_stream(engine, expected.watch(stream))
    seen["checked"] = check_weight_sync(engine, expected.result)
    seen["score"] = engine.score(PROMPTS, COMPLETIONS)
    dist.barrier()
    engine.close()
    return seen


@needs_vllm
def test_merged_lora_sync_into_vllm(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora_vllm")
    base_dir = tiny_vllm_model(root / "base")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                      lora_dropout=0.0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapter_dir = root / "adapter"
    model.save_pretrained(adapter_dir)
    merged_dir = root / "merged"
    model.merge_and_unload().save_pretrained(merged_dir)
    for f in base_dir.iterdir():        # tokenizer files for the HF reference
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy2(f, merged_dir / f.name)

    seen = run_distributed(_body, world_size=2, args=(str(base_dir), str(adapter_dir)),
                           timeout=420)
    ref = hf_logprobs(merged_dir, PROMPTS, COMPLETIONS)
    assert max_diff(ref, hf_logprobs(base_dir, PROMPTS, COMPLETIONS)) > 1e-2
    for rank, s in enumerate(seen):
        assert s["stats"]["tensors"] == s["checked"] == 27, rank
        assert max_diff(s["score"], ref) < ATOL, rank
