"""vLLM TP=2 colocated on 2 training ranks (external_launcher): generate and sync.

The model has one kv head, so at TP=2 vLLM replicates it on both ranks: the
fingerprint check must count the replica once (and check both copies agree),
while q heads, gate/up rows, o/down columns and the vocabulary are sharded.
One world, one engine per rank, several checks (vLLM start-up is the cost).
"""
from __future__ import annotations

import pytest

from megatron_grpo.rollout.buckets import iter_safetensors_buckets, perturb_buckets, save_hf_copy
from tests.harness import run_distributed
from tests.test_rollout_colocate import (ATOL, TEMPERATURE, engine_kwargs, hf_logprobs, max_diff,
                                         needs_vllm, sync_leaving_out, tiny_vllm_model)

# Each rank brings its own prompts (different counts on purpose).
RANK_PROMPTS = {0: [[5, 17, 230, 41], [400, 12]], 1: [[7, 8, 9, 10, 11, 12]]}
RANK_COMPLETIONS = {0: [[99, 100, 3], [1, 2, 250, 7]], 1: [[300, 301, 302]]}


def _tp2_body(rank, world_size, model_dir, left_out):
    import torch.distributed as dist

    from megatron_grpo.rollout.colocate import ColocateEngine
    from megatron_grpo.rollout.verify import StreamFingerprints, check_weight_sync
    from megatron_grpo.rollout.weights import load_weight_stream

    seen = {}
    engine = ColocateEngine(model_dir, **engine_kwargs(vllm_tensor_parallel_size=2))
    seen["tp_rank"] = engine.llm.collective_rpc("mg_tp_rank")
    seen["generate"] = [c.__dict__ for c in engine.generate(RANK_PROMPTS[rank])]

    expected = StreamFingerprints()
    stream = perturb_buckets(iter_safetensors_buckets(model_dir, num_buckets=4), seed=1)
    seen["stats"] = load_weight_stream(engine, expected.watch(stream))
    seen["checked"] = check_weight_sync(engine, expected.result)
    seen["score"] = engine.score(RANK_PROMPTS[rank], RANK_COMPLETIONS[rank])

    seen["left_out_error"] = sync_leaving_out(engine, model_dir, left_out, num_buckets=4)
    dist.barrier()
    engine.close()
    return seen


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_vllm_tp2_colocated_generates_and_syncs(tmp_path):
    base = tiny_vllm_model(tmp_path / "base", num_key_value_heads=1)
    changed = save_hf_copy(base, tmp_path / "perturbed",
                           perturb_buckets(iter_safetensors_buckets(base), seed=1))
    left_out = "model.layers.0.self_attn.q_proj.weight"
    seen = run_distributed(_tp2_body, world_size=2, args=(str(base), left_out), timeout=300)

    assert [s["tp_rank"] for s in seen] == [[(0, 2)], [(1, 2)]]  # one TP group of 2
    for rank, s in enumerate(seen):
        gen, prompts = s["generate"], RANK_PROMPTS[rank]
        # This rank's prompts only, num_generations each, indexed into its own list.
        assert [c["prompt_index"] for c in gen] == [i for i in range(len(prompts)) for _ in "ab"]
        ref = hf_logprobs(base, [prompts[c["prompt_index"]] for c in gen],
                          [c["token_ids"] for c in gen], TEMPERATURE)
        assert max_diff([c["logprobs"] for c in gen], ref) < ATOL

        assert s["checked"] == 27 and s["stats"]["tensors"] == 27  # 2 layers x 12 + 3
        ref = hf_logprobs(changed, prompts, RANK_COMPLETIONS[rank])
        assert max_diff(s["score"], ref) < ATOL

        err = s["left_out_error"]
        assert f"{left_out}: held by vLLM but absent from the trainer's stream" in err
        assert "1 problem(s)" in err
