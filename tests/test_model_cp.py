"""Context parallelism on the local layer spec: a tiny Qwen2 with CP equals the same model at CP=1.

Each test runs two phases on the same ranks: first the reference (CP=1: Megatron's own
DotProductAttention, the spare ranks as data-parallel replicas fed the same batch),
then the CP run; the same seed gives the same weights (checked). Sequences of 13 tokens
are padded to 16 for cp=2 (2*cp = 4 chunks) and the padding is masked out.
"""
import pytest
import torch

from tests.harness import run_distributed
from tests.mcore_utils import TINY_QWEN2

SEED, B, SEQ = 1234, 2, 13
LENGTHS = (13, 9)                  # row 1 is right-padded after 9 tokens
PROMPT = 3                         # the first tokens carry no loss, like a prompt


def _batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TINY_QWEN2["vocab_size"], (B, SEQ + 1), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pos = torch.arange(SEQ).expand(B, SEQ).contiguous()
    mask = torch.zeros(B, SEQ)
    for i, n in enumerate(LENGTHS):
        mask[i, PROMPT:n] = 1.0
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "loss_mask": mask}


def _phase(world, tp, cp, sequence_parallel=False):
    """Build the model under (tp, cp[, SP]), run one forward/backward and one forward.

    Returns this rank's (params, main grads, full logits [B, SEQ, vocab]).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_grpo.data.cp_split import gather_from_cp, shard_batch
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world, tp=tp, cp=cp), seed=SEED)
    config, args = build_transformer_config(TINY_QWEN2, tp=tp, cp=cp,
                                            sequence_parallel=sequence_parallel)
    torch.manual_seed(SEED)
    chunks = wrap_ddp(config, build_model(config, args))
    model = chunks[0]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    shard = shard_batch(_batch(), cp, ps.get_context_parallel_rank(),
                        sp_size=tp if sequence_parallel else 1)
    ids, pos, labels = shard["input_ids"], shard["position_ids"], shard["labels"]
    mask = shard["loss_mask"] * shard.valid                     # [B, S/cp]
    # The loss is (sum of masked per-token CE) / (masked tokens of the whole sequence):
    # each CP rank sums its own tokens, the count is reduced across CP.
    count = mask.sum()
    torch.distributed.all_reduce(count, group=ps.get_context_parallel_group())

    def forward_step(data_iterator, model):
        per_token = model(ids, pos, None, labels=labels)       # CE [B, S/cp]

        def loss_fn(ce):
            loss = (ce.float() * mask).sum() / count
            return loss, {"loss": loss.detach().clone()}
        return per_token, loss_fn

    # Scaling rule (Megatron 0.16.1, 2-tuple loss_fn, calculate_per_token_loss=False):
    # the schedule multiplies each rank's loss by cp and divides by num_microbatches (1
    # here); finalize_model_grads sums the grads over the DP x CP group and multiplies by
    # 1 / (dp * cp). The grad is therefore (1/dp) * sum over DP replicas of the sum over
    # CP ranks of grad(local sum / global count) = the DP mean of the exact gradient of
    # (global sum / global count). The x cp and 1/cp cancel: the test undoes no factor,
    # and the reference's DP replicas (same batch) average to the same gradient.
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=chunks,
        num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=B, forward_only=False)
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}

    with torch.no_grad():
        logits = model(ids, pos, None)                           # [B, S/cp, V/tp]
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        logits = gather_from_cp(logits, seq_len=SEQ)[..., :TINY_QWEN2["vocab_size"]]
    return params, grads, logits


def _compare(rank, world, tp, cp, variants):
    """The CP=1 reference, then one CP run per sequence_parallel flag in `variants`."""
    ref_params, ref_grads, ref_logits = _phase(world, tp, 1)
    out = []
    for sequence_parallel in variants:
        params, grads, logits = _phase(world, tp, cp, sequence_parallel)
        assert params.keys() == ref_params.keys()
        out.append({
            "same_weights": all(torch.equal(params[n], ref_params[n]) for n in params),
            "logit_diff": (logits - ref_logits).abs().max().item(),
            "logit_scale": ref_logits.abs().max().item(),
            "grad_diff": {n: (grads[n] - ref_grads[n]).abs().max().item() for n in grads},
            "grad_scale": {n: ref_grads[n].abs().max().item() for n in grads}})
    return out


# TP=2 x CP=2 runs without and with sequence parallelism (13 tokens -> 16 = 2*cp*tp).
@pytest.mark.parametrize("tp,cp,world,variants", [
    pytest.param(1, 2, 2, (False,), id="cp2"),
    pytest.param(2, 2, 4, (False, True), id="tp2-cp2", marks=pytest.mark.slow)])
def test_cp_equals_cp1(tp, cp, world, variants):
    results = run_distributed(_compare, world, args=(tp, cp, variants), timeout=300)
    for rank, runs in enumerate(results):
        for sp, r in zip(variants, runs):
            where = f"rank {rank}, sequence_parallel={sp}"
            assert r["same_weights"], f"{where}: the CP model's weights differ from CP=1's"
            assert r["logit_scale"] > 0.1
            assert r["logit_diff"] < 1e-4, f"{where}: logits differ by {r['logit_diff']}"
            # Every parameter gets a gradient, equal to CP=1's at fp32 tolerance.
            for name, diff in r["grad_diff"].items():
                scale = r["grad_scale"][name]
                assert scale > 0, f"{where}: {name} has no gradient"
                assert diff <= 1e-5 + 1e-4 * scale, (
                    f"{where}: grad of {name} differs by {diff} (max |grad| {scale})")
