"""LoRA on Megatron against PEFT: one 2-rank gloo world, TP=1, TP=2, PP=2, TP=2+SP,
PP=2 x VPP=2 (interleaved schedule, 4 micro-batches), CP=2 (sequence split, padded).

The reference is an independent implementation: a tiny Qwen2 in HF transformers wrapped
by `peft` (every linear targeted, rslora, A and B set to random values so that every
adapter shows in the output; modules_to_save embed_tokens and lm_head, their trained
copies perturbed so that they show too). The Megatron model loads the HF base through the bridge and
the PEFT adapter folder through megatron_grpo/model/lora_peft.py, then must give
- the same logits (fp32, <= 1e-4) at every layout;
- the same adapter (and embed_tokens / lm_head) gradients as PEFT for one CE loss (so TP=2
  = TP=1 = PEFT), and no gradient on any other base parameter;
- with adapters disabled, the base model's logits (the reference policy of a LoRA run:
  the original embed_tokens / lm_head, not the trained ones);
- a merged export stream (W + s B A per HF tensor) equal to PEFT's merge_and_unload;
- an adapter-only sync stream (model/lora_peft.adapter_stream, in buckets) holding exactly the
  PEFT adapter's tensors, at every layout (TP gathers, PP stages);
- a PEFT adapter written from the gathered factors that peft loads with the same logits.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from tests.harness import run_distributed

# (tp, pp, vpp, cp, sequence parallel); SP and CP run under Megatron's DDP, whose
# finalize_model_grads sums the sequence-partial adapter gradients over TP (SP) and the
# per-slice ones over CP. VPP needs 4 layers (1 per chunk) and >= PP micro-batches.
LAYOUTS = [(1, 1, None, 1, False), (2, 1, None, 1, False), (1, 2, None, 1, False),
           (2, 1, None, 1, True), (1, 2, 2, 1, False), (1, 1, None, 2, False)]
MERGE_LAYOUT = (2, 1, None, 1, False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAVED = ["lm_head", "embed_tokens"]                      # --modules_to_save
SAVED_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
SEQ, MBS = 10, 4


def _batch(vocab):
    from tests.mcore_utils import fixed_batches

    return fixed_batches(1, MBS, SEQ, vocab, seed=3)


def _world(rank, world_size, model_dir, adapter_dir, out_dir):
    from bridge import export_hf_weights, load_hf_weights
    from megatron_grpo.convert import megatron_logits
    from megatron_grpo.model.lora_peft import (adapter_stream, gather_adapters, load_peft_adapter,
                                               merge_lora_stream, peft_settings, save_peft_adapter)
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.model.lora import adapters_disabled, apply_lora
    from megatron_grpo.platform import ParallelDims, init_parallel
    out = {}
    for layout in LAYOUTS:
        tp, pp, vpp, cp, sp = layout
        init_parallel(ParallelDims(world_size=world_size, tp=tp, pp=pp, vpp=vpp, cp=cp))
        config, args = build_transformer_config(model_dir, tp=tp, pp=pp, vpp=vpp, cp=cp,
                                                sequence_parallel=sp)
        chunks = build_model(config, args)
        load_hf_weights(chunks, config, args, model_dir)
        settings = peft_settings(adapter_dir)
        apply_lora(chunks, config, args, settings)
        load_peft_adapter(chunks, adapter_dir)
        ddp = sp or cp > 1
        if ddp:
            chunks = wrap_ddp(config, chunks)
        ids, pos, labels = _batch(args.vocab_size)[0]
        logits_fn = _cp_logits if cp > 1 else megatron_logits
        logits = logits_fn(chunks, config, args, ids)
        with adapters_disabled(chunks):
            base_logits = logits_fn(chunks, config, args, ids)
        for c in chunks:
            c.train()
        _ce_backward(chunks, config, ids, pos, labels, args.vocab_size)
        base_grads = [n for c in chunks for n, p in c.named_parameters()
                      if "_lora." not in n and not n.endswith(SAVED_PARAMS) and (p.grad is not None
                                                or getattr(p, "main_grad", None) is not None)]
        trainable = sorted(n for c in chunks for n, p in c.named_parameters() if p.requires_grad)
        grads = gather_adapters(chunks, source=lambda p: p.main_grad if ddp else p.grad)
        factors = gather_adapters(chunks)
        # adapter-only sync's stream (small buckets: several per sync)
        buckets = [[(n, t.clone()) for n, t in b]
                   for b in adapter_stream(chunks, bucket_size_bytes=4 << 10)]
        merged = {}
        if layout == MERGE_LAYOUT:
            stream = export_hf_weights(chunks, config, args, bucket_size_bytes=32 << 10)
            for bucket in merge_lora_stream(stream, factors, settings):
                merged.update({n: t.clone() for n, t in bucket})
            if rank == 0:
                save_peft_adapter(out_dir, factors, settings, base_model=model_dir)
        out[layout] = dict(logits=logits, base_logits=base_logits, grads=grads,
                       base_grads=base_grads, trainable=trainable, merged=merged,
                       buckets=buckets)
    return out


def _cp_logits(chunks, config, args, ids):
    """HF-vocab logits [B, S, V] under context parallelism: each CP rank runs its two
    sequence slices (padded to a multiple of 2 * cp), the slices are gathered back."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_grpo.data.cp_split import gather_from_cp, shard_batch

    (model,) = chunks
    pos = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    shard = shard_batch({"input_ids": ids, "position_ids": pos},
                        ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
    model.eval()
    with torch.no_grad():
        out = model(shard["input_ids"], shard["position_ids"], None)      # [B, S/cp, V/tp]
        out = gather_from_tensor_model_parallel_region(out)[..., :args.vocab_size]
        return gather_from_cp(out.float(), seq_len=ids.shape[1])


def _ce_backward(chunks, config, ids, pos, labels, vocab):
    """Token-mean CE over the HF vocab (as the PEFT reference computes it: Megatron's own
    CE would include the padded vocab rows) through Megatron's pipeline schedule.

    CP: each rank sums the CE of its valid tokens and divides by the whole batch's token
    count (the schedule's x cp and finalize_model_grads' 1 / cp cancel). VPP: the batch
    runs as 2 * `microbatch_group_size_per_vp_stage` (= 2 PP) micro-batches, each loss
    scaled by their number (the schedule divides it back), so the sum is the same token mean.
    With only PP micro-batches (all in rank 0's warm-up) a forward-backward pass of
    Megatron 0.16's interleaved schedule hangs on gloo (rank 0 in send_forward_recv_forward,
    rank 1 in send_forward_backward_recv_forward_backward); forward_only runs."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_grpo.data.cp_split import shard_batch

    cp = ps.get_context_parallel_world_size()
    mask = torch.ones(labels.shape)
    if cp > 1:
        shard = shard_batch({"input_ids": ids, "position_ids": pos, "labels": labels}, cp,
                            ps.get_context_parallel_rank())
        ids, pos, labels = shard["input_ids"], shard["position_ids"], shard["labels"]
        mask = shard.valid.float()
    count = mask.sum()
    if cp > 1:
        torch.distributed.all_reduce(count, group=ps.get_context_parallel_group())
    n = 2 * config.microbatch_group_size_per_vp_stage if len(chunks) > 1 else 1
    micro = list(zip(*(t.chunk(n) for t in (ids, pos, labels, mask))))

    def step(data_iterator, model):
        m_ids, m_pos, m_labels, m_mask = next(data_iterator)
        out = model(m_ids, m_pos, None)

        def loss_fn(o):
            full = gather_from_tensor_model_parallel_region(o)[..., :vocab].float()
            ce = torch.nn.functional.cross_entropy(full.reshape(-1, vocab), m_labels.reshape(-1),
                                                   reduction="none")
            loss = (ce * m_mask.reshape(-1)).sum() / count * n
            return loss, {"loss": loss.detach().clone()}
        return out, loss_fn

    data = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    get_forward_backward_func()(forward_step_func=step, data_iterator=data, model=chunks,
                                num_microbatches=n, seq_length=ids.shape[1],
                                micro_batch_size=ids.shape[0] // n, forward_only=False)


def _peft_model(model_dir, adapter_dir=None):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        return PeftModel.from_pretrained(base, adapter_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=6, target_modules=TARGETS,
                                            lora_dropout=0.0, use_rslora=True,
                                            modules_to_save=SAVED))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("lora")
    model_dir = str(make_tiny_model(root / "base", family="qwen2", num_layers=4,
                                    num_key_value_heads=2, vocab_size=999))
    peft_model = _peft_model(model_dir)
    adapter_dir = str(root / "adapter")
    peft_model.save_pretrained(adapter_dir)
    ids, _, labels = _batch(999)[0]
    logits = peft_model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))
    loss.backward()
    # PEFT's parameter names -> its saved names (the modules_to_save copy under the module's)
    grads = {n.replace(".default", "").replace(".modules_to_save", ""): p.grad.clone()
             for n, p in peft_model.named_parameters() if p.grad is not None}
    assert len([n for n in grads if "lora_" not in n]) == len(SAVED)
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits = peft_model(input_ids=ids).logits
    merged = {k: v.clone() for k, v in peft_model.merge_and_unload().state_dict().items()}
    ref = dict(logits=logits.detach(), base_logits=base_logits, grads=grads, merged=merged)
    out_dir = str(root / "exported")
    results = run_distributed(_world, world_size=2, args=(model_dir, adapter_dir, out_dir),
                              timeout=400)
    return dict(model_dir=model_dir, adapter_dir=adapter_dir, out_dir=out_dir, ids=ids, ref=ref,
                results=results)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_peft(world, layout):
    ref = world["ref"]
    for r in world["results"]:
        got = r[layout]
        assert (got["logits"] - ref["logits"]).abs().max() <= 1e-4
        assert (got["base_logits"] - ref["base_logits"]).abs().max() <= 1e-4
        # the adapters matter: with them on, the logits are not the base's
        assert (ref["logits"] - ref["base_logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapter_grads_equal_peft(world, layout):
    ref = world["ref"]["grads"]
    for r in world["results"]:
        got = r[layout]
        assert got["base_grads"] == []
        assert got["trainable"] and all("_lora.lora_" in n or n.endswith(SAVED_PARAMS)
                                        for n in got["trainable"])
        assert sorted(got["grads"]) == sorted(ref)
        for name, g in got["grads"].items():
            scale = ref[name].abs().max().item()
            assert scale > 0, name
            assert (g - ref[name]).abs().max().item() <= 1e-4 * max(1.0, scale), name


def test_merged_stream_equals_peft_merge(world):
    ref = world["ref"]["merged"]
    for r in world["results"]:
        merged = r[MERGE_LAYOUT]["merged"]
        assert sorted(merged) == sorted(ref)
        for name, t in merged.items():
            assert (t - ref[name]).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapter_stream_is_the_peft_adapter(world, layout):
    """Adapter-only sync's stream: every PEFT tensor of the adapter once, exactly the file
    that was loaded (gathered over TP, from every PP stage), in several buckets."""
    from safetensors.torch import load_file

    want = load_file(os.path.join(world["adapter_dir"], "adapter_model.safetensors"))
    want = {k: v for k, v in want.items() if "lora_" in k}   # not modules_to_save's
    for r in world["results"]:
        buckets = r[layout]["buckets"]
        assert len(buckets) > 2
        got = [item for b in buckets for item in b]
        assert sorted(n for n, _ in got) == sorted(want)
        for name, t in got:
            assert torch.equal(t, want[name].to(t.dtype)), name


def test_exported_adapter_loads_in_peft(world):
    model = _peft_model(world["model_dir"], world["out_dir"])
    with torch.no_grad():
        logits = model(input_ids=world["ids"]).logits
    assert (logits - world["ref"]["logits"]).abs().max() <= 1e-4


@pytest.mark.parametrize("saved, targets", [
    (["q_proj", "v_proj"], ("q_proj", "v_proj")),
    # peft saves all-linear expanded to module paths
    (["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"], ("o_proj", "down_proj")),
    (r".*\.(q_proj|up_proj)", ("q_proj", "up_proj")),          # a regex, full match
    ("all-linear", tuple(TARGETS))])
def test_peft_settings_target_spellings(tmp_path, saved, targets):
    import json

    from megatron_grpo.model.lora_peft import peft_settings

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": saved,
         "use_rslora": True}))
    s = peft_settings(str(tmp_path))
    assert s.targets == targets
    assert s.scale == 32 / 4          # rslora: alpha / sqrt(r)


def test_peft_settings_rejects_what_is_not_supported(tmp_path):
    import json

    from megatron_grpo.model.lora_peft import peft_settings

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
         "modules_to_save": ["lm_head", "score"]}))
    with pytest.raises(ValueError, match=r"modules_to_save lm_head score: \['score'\] not "
                                         "supported; allowed: any of embed_tokens lm_head"):
        peft_settings(str(tmp_path))
    # What PEFT writes for a plain adapter loads; DoRA, per-module ranks or alphas, LoRA
    # biases would load as plain LoRA (another model): refused, by name.
    plain = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
             "use_dora": False, "lora_bias": False, "alpha_pattern": {}, "rank_pattern": {},
             "layers_to_transform": None, "layers_pattern": None}
    (tmp_path / "adapter_config.json").write_text(json.dumps(plain))
    assert peft_settings(str(tmp_path)).scale == 2.0
    for extra in ({"use_dora": True}, {"alpha_pattern": {"q_proj": 64}}, {"lora_bias": True},
                  {"rank_pattern": {"q_proj": 4}}, {"layers_to_transform": [0]}):
        (tmp_path / "adapter_config.json").write_text(json.dumps({**plain, **extra}))
        [(key, value)] = extra.items()
        with pytest.raises(ValueError, match=re.escape(f"sets {key} {value!r}; supported")):
            peft_settings(str(tmp_path))


def test_peft_settings_reads_modules_to_save(tmp_path):
    import json

    from megatron_grpo.model.lora_peft import peft_config, peft_settings

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
         "modules_to_save": ["lm_head", "model.embed_tokens"]}))
    s = peft_settings(str(tmp_path))
    assert s.modules_to_save == ("embed_tokens", "lm_head")
    assert peft_config(s)["modules_to_save"] == ["embed_tokens", "lm_head"]


def test_offload_model_moves_the_modules_to_save_original():
    """offload_model frees the frozen original of a --modules_to_save parameter too (it is
    not a parameter, so it would stay on the device while vLLM generates) and brings it back."""
    from megatron_grpo.rollout.offload import offload_model, onload_model

    chunk = torch.nn.Embedding(8, 4)
    p = chunk.weight
    p.lora_original = p.detach().clone() + 1
    want = p.lora_original.clone()
    offload_model([chunk])
    left = p.lora_original.untyped_storage().nbytes()
    onload_model([chunk])     # before any assert: pytest must not print a freed tensor
    assert left == 0
    assert torch.equal(p.lora_original, want)
