"""--recompute_granularity / --recompute_method / --recompute_num_layers / --recompute_modules.

A real Megatron GPTModel (tiny Qwen2, 4 layers) runs forward and backward once per
setting, from the same weights and batch. Recomputation must not change a single
gradient, and must keep fewer activations alive between forward and backward: every
tensor autograd saves during the forward is seen by a saved-tensor hook and its storage
counted once (parameters left out). No timing is measured.
"""
import pytest
import torch

from tests.harness import run_distributed
from tests.mcore_utils import TINY_QWEN2, fixed_batches

SETTINGS = {
    "none": dict(recompute_granularity="none"),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    "selective_mlp": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "mlp"]),
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=2),
}


def _saved_bytes_and_grads(chunks, ids, pos, labels):
    model = chunks[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return sum(saved.values()), loss.item(), grads


def _body(rank, world, tp):
    from megatron_grpo.model import build_model, build_transformer_config
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world, tp=tp), seed=1234)
    ((ids, pos, labels),) = fixed_batches(1, 2, 32, TINY_QWEN2["vocab_size"])
    out = {}
    for name, recompute in SETTINGS.items():
        config, args = build_transformer_config(TINY_QWEN2, tp=tp, recompute=recompute,
                                                attention_backend="auto")
        torch.manual_seed(1234)
        chunks = build_model(config, args)
        out[name] = _saved_bytes_and_grads(chunks, ids, pos, labels)
        out[name + "_config"] = (config.recompute_granularity, config.recompute_method,
                                 config.recompute_num_layers, config.attention_backend.name)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_recompute_same_gradients_fewer_saved_activations(tp):
    for out in run_distributed(_body, tp, args=(tp,), timeout=240):
        assert out["none_config"] == (None, None, None, "local")
        assert out["full_block_config"] == ("full", "block", 2, "local")
        base_bytes, base_loss, base_grads = out["none"]
        for name in SETTINGS:
            nbytes, loss, grads = out[name]
            assert loss == base_loss, name
            assert grads.keys() == base_grads.keys()
            for k in grads:
                torch.testing.assert_close(grads[k], base_grads[k], rtol=0, atol=1e-6,
                                           msg=lambda m: f"{name} {k}: {m}")
        b = {name: out[name][0] for name in SETTINGS}
        # Selective keeps the attention's inputs instead of its softmax probabilities;
        # recomputing the MLP too saves more; full keeps one input per recomputed group.
        assert b["selective"] < b["none"], b
        assert b["selective_mlp"] < b["selective"], b
        assert b["full_uniform"] < b["selective_mlp"], b
        assert b["full_uniform"] < b["full_block"] < b["none"], b
