"""The memory plan: every byte a rank will hold, from the resolved options and the model's
checkpoint, before anything starts (no torch, no model).

    plan = memory_plan(cfg, world, nproc_per_node, max_prompt_tokens=40)
    print(plan.format())                 # one line per component, per rank and per machine
    plan.check(available)                # ValueError naming the options that would fit it

Parameter counts are read from the checkpoint's safetensors headers (every tensor's
shape; nothing else is read) and split as the run splits them: embedding on the first
pipeline stage and the output layer on the last (tied: both hold it when PP > 1), each
decoder layer's matrices over TP, its experts over EP x expert TP, norms replicated; the
largest stage is planned. Bytes per parameter follow Megatron-Core's mixed precision:
weights in the training dtype, a float32 gradient buffer (grad_reduce_in_fp32), float32
main weights (bf16 only) and Adam's two float32 moments, the last two divided over the
data-parallel ranks with the distributed optimizer. Activations follow one micro-batch
of the longest sequence through a decoder layer as Megatron's local layers store it for
backward (the attention scores too: CPU attention is unfused), times the layers of the
stage and the micro-batches in flight (PP: up to PP of them on the first stage).

Transient buffers (gradients of the vocabulary matrices in backward, the optimizer's
per-parameter temporaries, the sync's buckets, the final export's shard) are added to
the phase that holds them; the plan's peak is the largest phase. `RUNTIME_BYTES` (the
libraries, the interpreter, vLLM's own state) is a measured constant of the CPU stack
(tools/bench_peer.py --shapes real, docs/benchmarks.md); on a GPU the device figures
add the CUDA context and have not been checked against a measured run yet. The CPU
constants were measured on the quickstart's tiny model and the real shape.
"""
from __future__ import annotations

import json
import logging
import os
import re
import struct
from dataclasses import dataclass, field, replace
from typing import Optional

from ..config.hf_model import head_size, model_config, num_experts
from ..config.sizes import parse_size
from ..data import render_prompt
from ..rollout.kv_cache import kv_cache_bytes as _engine_kv_bytes, sequences_per_engine
from .measure import available_bytes, host_budget

GIB = float(1 << 30)
# The process itself on CPU: Python, torch, Megatron-Core, transformers, vLLM's engine
# state and the dataset (the quickstart's rank measured, minus its planned tensors).
RUNTIME_BYTES = int(0.5 * GIB)
# vLLM-CPU holds its weights about twice: as loaded and as oneDNN's packed copies (measured:
# 2.06 GB resident for the 0.99 GB bfloat16 model after a heap trim, an engine alone).
VLLM_CPU_WEIGHT_FACTOR = 2.1
CUDA_CONTEXT_BYTES = int(0.6 * GIB)     # a GPU's context and allocator slack (not measured)
VLLM_RUNTIME_BYTES = int(0.1 * GIB)     # vLLM's sampler and scheduler buffers beside its weights
# A fast tokenizer in memory against its tokenizer.json (measured: Qwen2.5's 151,665 tokens,
# an 11 MB file, ~0.22 GiB a copy)
TOKENIZER_FACTOR = 20
# final_hf/ (train/run.py save_final_hf): the export's bucket and the shards rank 0 holds
FINAL_BUCKET_BYTES = 256 << 20
FINAL_SHARD_BYTES = 512 << 20
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ---------------------------------------------------------------- the checkpoint's tensors
def checkpoint_tensors(model_dir: str) -> dict[str, int]:
    """name -> number of elements of every tensor of an HF safetensors checkpoint (the
    headers only: 8 bytes of length and a JSON table per file)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, int] = {}
    for name in files:
        with open(os.path.join(model_dir, name), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            n = 1
            for s in info["shape"]:
                n *= s
            out[key] = n
    return out


@dataclass(frozen=True)
class Split:
    """How the run splits a model: its tp, pp, ep and etp sizes."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1


@dataclass(frozen=True)
class ModelCounts:
    """Parameters of one model: in all, and on the largest pipeline stage of one rank."""
    total: int               # every tensor of the checkpoint (what vLLM holds, at TP 1)
    rank: int                # the largest stage's share on one rank
    rank_experts: int        # of which expert weights (their optimizer shards over expert DP)
    largest: int             # the largest tensor's elements on one rank (vocab matrices)
    vocab: int               # vocabulary rows
    hidden: int


def count_model(model_dir: str, split: Split) -> ModelCounts:
    """Parameters of the checkpoint at `model_dir` under `split` (module docstring)."""
    tensors = checkpoint_tensors(model_dir)
    hf = model_config(model_dir).language
    layers = int(hf["num_hidden_layers"])
    hidden = int(hf["hidden_size"])
    vocab = int(hf["vocab_size"])
    tied = bool(hf.get("tie_word_embeddings", False))
    per_stage = -(-layers // split.pp)
    stage_dense = [0] * split.pp
    stage_experts = [0] * split.pp
    first, last, largest = 0, 0, 0
    for name, n in tensors.items():
        m = _LAYER.search(name)
        if "visual" in name or "vision" in name:
            first += n                        # the vision tower: first stage, whole
        elif m and int(m.group(1)) < layers:
            stage = int(m.group(1)) // per_stage
            if ".experts." in name:
                stage_experts[stage] += n // (split.ep * split.etp)
            elif name.endswith(("norm.weight", "norm.bias", "mlp.gate.weight",
                                "shared_expert_gate.weight")):
                stage_dense[stage] += n       # norms and the routers: replicated over TP
            else:
                stage_dense[stage] += n // split.tp
        elif "embed_tokens" in name:
            first += n // split.tp
            largest = max(largest, n // split.tp)
            if tied:
                last += n // split.tp if split.pp > 1 else 0
        elif "lm_head" in name:
            last += n // split.tp
            largest = max(largest, n // split.tp)
        else:
            last += n                         # the final norm
    stages = [stage_dense[s] + stage_experts[s] + (first if s == 0 else 0)
              + (last if s == split.pp - 1 else 0) for s in range(split.pp)]
    big = max(range(split.pp), key=lambda s: stages[s])
    return ModelCounts(total=sum(tensors.values()), rank=stages[big],
                       rank_experts=stage_experts[big], largest=largest, vocab=vocab,
                       hidden=hidden)


# ---------------------------------------------------------------- the plan
@dataclass
class Line:
    name: str
    nbytes: int
    phases: tuple = ()          # () resident throughout; else the phases that hold it
    note: str = ""


@dataclass
class MemoryPlan:
    lines: list = field(default_factory=list)
    ranks_per_machine: int = 1
    device: str = "cpu"         # where the model lives: "cpu" or "cuda"
    options: list = field(default_factory=list)   # (what to change, bytes it saves per rank)

    def resident(self) -> int:
        return sum(x.nbytes for x in self.lines if not x.phases)

    def phase_bytes(self) -> dict:
        phases = {p for x in self.lines for p in x.phases} or {"train"}
        base = self.resident()
        return {p: base + sum(x.nbytes for x in self.lines if p in x.phases) for p in phases}

    @property
    def peak(self) -> int:
        """The largest phase of one rank."""
        return max(self.phase_bytes().values())

    @property
    def peak_phase(self) -> str:
        phases = self.phase_bytes()
        return max(phases, key=phases.get)

    @property
    def machine_peak(self) -> int:
        return self.peak * self.ranks_per_machine

    def format(self, available: Optional[int] = None) -> str:
        width = max(len(x.name) for x in self.lines)
        out = [f"memory plan (per rank; {self.ranks_per_machine} rank"
               f"{'s' if self.ranks_per_machine != 1 else ''} per machine, "
               f"{'GPU' if self.device == 'cuda' else 'CPU'} memory):"]
        for x in self.lines:
            when = "" if not x.phases else f"  [{', '.join(x.phases)}]"
            note = f"  ({x.note})" if x.note else ""
            out.append(f"  {x.name:<{width}} {x.nbytes / GIB:7.2f} GiB{when}{note}")
        out.append(f"  {'peak (' + self.peak_phase + ')':<{width}} {self.peak / GIB:7.2f} GiB per rank, "
                   f"{self.machine_peak / GIB:.2f} GiB per machine"
                   + (f" of {available / GIB:.2f} GiB available" if available else ""))
        if self.options:
            out.append("  options that lower it: " + "; ".join(
                f"{what} -{saved / GIB:.2f} GiB" for what, saved in self.options))
        return "\n".join(out)

    def check(self, available: Optional[int], where: str = "this machine") -> None:
        """ValueError when the machine's share exceeds `available` bytes (None: unknown)."""
        if available is None or self.machine_peak <= available:
            return
        fixes = "; ".join(f"{what} (-{saved / GIB:.2f} GiB per rank)"
                          for what, saved in self.options) or "a larger machine"
        raise ValueError(
            f"the memory plan does not fit: {self.machine_peak / GIB:.2f} GiB on {where} "
            f"({self.ranks_per_machine} x {self.peak / GIB:.2f} GiB per rank at its "
            f"{self.peak_phase} peak) against {available / GIB:.2f} GiB available. Options that "
            f"lower it: {fixes}. The plan (--dry_run true prints it):\n{self.format(available)}")


def _dtype_bytes(bf16: bool) -> int:
    return 2 if bf16 else 4


def _activation_bytes(cfg, counts: ModelCounts, model_dir: str, seq: int, split: Split) -> int:
    """One micro-batch's activations kept for backward on the largest stage (module
    docstring), with the configured recompute, in the training dtype."""
    hf = model_config(model_dir).language
    t, p = cfg.training, cfg.parallel
    h = counts.hidden
    heads = int(hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or heads)
    hd = head_size(hf)
    inter = int(hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 4 * h)
    if num_experts(hf):
        inter *= int(hf.get("num_experts_per_tok") or 1)
    b = _dtype_bytes(bool(t.bf16))
    tokens = t.micro_batch_size * seq
    tp = split.tp
    per_token = (5 * h + (heads + 2 * kv) * hd // tp + 3 * inter // tp) * b
    scores = t.micro_batch_size * (heads // tp) * seq * seq * 2 * b
    granularity = t.recompute_granularity or "none"
    layers = -(-int(hf["num_hidden_layers"]) // split.pp)
    if granularity == "full":
        layer_bytes = tokens * h * b          # the layer's input only; one layer recomputed
        extra = tokens * per_token + scores
    elif granularity == "selective" and "core_attn" in (t.recompute_modules or ["core_attn"]):
        layer_bytes, extra = tokens * per_token, scores
    else:
        layer_bytes, extra = tokens * per_token + scores, 0
    in_flight = split.pp if split.pp > 1 else 1
    return (layers * layer_bytes + extra) * in_flight


def memory_plan(cfg, world_size: int, ranks_per_machine: int, *,
                max_prompt_tokens: Optional[int] = None, device: str = "cpu",
                kv_cache_bytes: Optional[int] = None, options: bool = True) -> MemoryPlan:
    """The plan of `cfg` (a resolved GRPOConfig) on `world_size` ranks, `ranks_per_machine`
    of them on one machine. max_prompt_tokens: the longest prompt (None: --max_length, else
    the engine's context); kv_cache_bytes: each engine's KV cache (None: as the run sizes
    it)."""
    p, m = cfg.parallel, cfg.model
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    split = Split(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.expert_model_parallel_size, etp)
    counts = count_model(m.model, split)
    seq = _longest_sequence(cfg, max_prompt_tokens)
    if kv_cache_bytes is None and cfg.rollout.vllm_mode == "colocate" and cfg.rollout.use_vllm:
        kv_cache_bytes = _kv_cache(cfg, world_size, seq)
    lines = _state_lines(cfg, counts, split, world_size)
    lines += _engine_lines(cfg, counts, device, kv_cache_bytes)
    lines += _transient_lines(cfg, counts, split, seq, world_size, lines)
    plan = MemoryPlan(lines, ranks_per_machine, device)
    if options:
        plan.options = _options(cfg, world_size, ranks_per_machine, plan, max_prompt_tokens,
                                device, kv_cache_bytes)
    return plan


def _shards(cfg, split: Split, world_size: int) -> tuple[int, int]:
    """Over how many ranks the distributed optimizer splits the dense and the expert
    parameters' main weights and Adam state (1, 1 without it)."""
    p = cfg.parallel
    if not p.use_distributed_optimizer:
        return 1, 1
    dp = world_size // (split.tp * split.pp * p.context_parallel_size)
    return dp * p.context_parallel_size, max(1, world_size // (split.ep * split.etp * split.pp))


def _trained(cfg, counts: ModelCounts) -> tuple[int, int]:
    """Trained parameters on the rank: (dense, experts); LoRA: the adapters only."""
    if cfg.training.tuner_type in ("lora", "lora_llm"):
        return _lora_params(cfg, counts), 0
    return counts.rank - counts.rank_experts, counts.rank_experts


def _state_lines(cfg, counts: ModelCounts, split: Split, world_size: int) -> list:
    """The model state: weights, gradient buffer, main weights, Adam, other models."""
    t, g, m = cfg.training, cfg.grpo, cfg.model
    b = _dtype_bytes(bool(t.bf16))
    shard, expert_shard = _shards(cfg, split, world_size)
    dense, experts = _trained(cfg, counts)
    over = f", over {shard} DP ranks" if shard > 1 else ""
    lines = [Line("model weights", counts.rank * b,
                  note=f"{counts.rank / 1e6:.0f}M parameters on this rank, "
                       f"{'bf16' if t.bf16 else 'fp32'}"),
             Line("gradient buffer", (dense + experts) * 4, note="fp32")]
    if t.bf16:
        lines.append(Line("main params", (dense * 4) // shard + (experts * 4) // expert_shard,
                          note="fp32" + over))
    lines.append(Line("optimizer states", (dense * 8) // shard + (experts * 8) // expert_shard,
                      note="Adam m, v fp32" + over))
    if g.beta and t.tuner_type not in ("lora", "lora_llm"):
        ref = count_model(m.ref_model, split) if m.ref_model else counts
        lines.append(Line("reference model", ref.rank * b, note="beta > 0"))
    if m.teacher_model:
        lines.append(Line("teacher model", count_model(m.teacher_model, split).rank * b))
    models = cfg.reward.reward_models or []
    if models:     # HF classifiers, whole on every rank, each in its dtype
        n = [sum(checkpoint_tensors(e["path"]).values()) for e in models]
        size = sum(k * (4 if e["dtype"] == "float32" else 2) for k, e in zip(n, models))
        lines.append(Line("reward models", size, note=f"{len(models)} classifier(s), "
                          f"{sum(n) / 1e6:.0f}M parameters, whole on each rank"))
    return lines


def _engine_lines(cfg, counts: ModelCounts, device: str, kv_cache_bytes: Optional[int]) -> list:
    """A colocated vLLM engine, the process's libraries, the tokenizers."""
    r, m = cfg.rollout, cfg.model
    b = _dtype_bytes(bool(cfg.training.bf16))
    lines = []
    colocated = r.vllm_mode == "colocate" and r.use_vllm
    if colocated:
        vtp = r.vllm_tensor_parallel_size
        # On a GPU vLLM sleeps while Megatron trains: level 1 frees its KV cache, level 2
        # its weights too (woken for the sync). vLLM-CPU's sleep frees nothing.
        asleep = device == "cuda" and r.sleep_level > 0
        factor = VLLM_CPU_WEIGHT_FACTOR if device == "cpu" else 1.0
        lines.append(Line("vLLM weights", int(counts.total * b * factor) // vtp,
                          ("generate", "sync") if asleep and r.sleep_level == 2 else (),
                          note=f"whole model / vLLM TP {vtp}"
                               + (f", x{factor:g}: loaded and oneDNN-packed" if factor != 1 else "")))
        lines.append(Line("vLLM KV cache", (kv_cache_bytes or 0) // vtp,
                          ("generate",) if asleep else ()))
        lines.append(Line("vLLM runtime", VLLM_RUNTIME_BYTES))
    lines.append(Line("runtime", RUNTIME_BYTES if device == "cpu" else CUDA_CONTEXT_BYTES,
                      note="libraries, interpreter" if device == "cpu" else "CUDA context"))
    tokenizer = os.path.join(m.model, "tokenizer.json")
    if os.path.isfile(tokenizer):      # host memory: the trainer's copy and vLLM's
        copies = 2 if colocated else 1
        lines.append(Line("tokenizers", copies * TOKENIZER_FACTOR * os.path.getsize(tokenizer),
                          note=f"{copies} loaded, ~{TOKENIZER_FACTOR}x tokenizer.json each"))
    return lines


def _transient_lines(cfg, counts: ModelCounts, split: Split, seq: int, world_size: int,
                     resident: list) -> list:
    """What one phase holds on top of the resident state."""
    t, r = cfg.training, cfg.rollout
    b = _dtype_bytes(bool(t.bf16))
    shard, _ = _shards(cfg, split, world_size)
    dense, _ = _trained(cfg, counts)
    lora = t.tuner_type in ("lora", "lora_llm")
    lines = [Line("activations", _activation_bytes(cfg, counts, cfg.model.model, seq, split),
                  ("train", "logprobs"),
                  note=f"micro-batch {t.micro_batch_size} x {seq} tokens, recompute "
                       f"{t.recompute_granularity or 'none'}")]
    # The embedding's gradient in the weights' dtype and the output layer's in fp32 (the
    # fused loss), each before its add into the gradient buffer, and the add's fp32 copy.
    lines.append(Line("vocab-matrix gradients", 0 if lora else counts.largest * (b + 4 + 4),
                      ("train",), note="embedding / output layer, in backward"))
    # torch's Adam on CPU: a float32 temporary per parameter shard (its denominator) and
    # the clip's scaled copies: about one main-param shard in all with the distributed
    # optimizer (measured), half of it with the plain one.
    lines.append(Line("optimizer temporaries",
                      (dense * 4) // shard + (counts.largest * 4) // shard
                      if cfg.parallel.use_distributed_optimizer
                      else (dense * 4) // 2 + counts.largest * 4, ("optimizer",)))
    model_bytes = counts.total * b
    bucket = 512 << 20 if not r.move_model_batches else model_bytes // r.move_model_batches
    lines.append(Line("sync buckets", min(bucket, model_bytes) + counts.largest * split.tp * b,
                      ("sync",), note="export bucket + transfer buffer"))
    lines.append(Line("checkpoint save", (_line_bytes(resident, "main params")
                                          + _line_bytes(resident, "optimizer states")) // 2,
                      ("save",), note="the writer's copies, at most half the optimizer's state"))
    # (a bucket buffer's pages become resident as far as they are written: no more than
    # the model's bytes)
    lines.append(Line("final export", min(FINAL_SHARD_BYTES, model_bytes)
                      + min(max(FINAL_BUCKET_BYTES, counts.largest * split.tp * b), model_bytes),
                      ("export",), note="rank 0: a safetensors shard + the export bucket"))
    return lines


def _line_bytes(lines, name: str) -> int:
    return sum(x.nbytes for x in lines if x.name == name)


def _lora_params(cfg, counts: ModelCounts) -> int:
    """A LoRA adapter's parameters on one rank: rank x (in + out) for each of a layer's
    seven linears (every linear: ms-swift's `all-linear`), an upper bound."""
    hf = model_config(cfg.model.model).language
    h = counts.hidden
    inter = int(hf.get("intermediate_size") or 4 * h)
    per_layer = cfg.training.lora_rank * (4 * (h + h) + 3 * (h + inter))
    layers = -(-int(hf["num_hidden_layers"]) // cfg.parallel.pipeline_model_parallel_size)
    return per_layer * layers


def _longest_sequence(cfg, max_prompt_tokens: Optional[int]) -> int:
    r, g = cfg.rollout, cfg.grpo
    prompt = max_prompt_tokens if max_prompt_tokens is not None else cfg.data.max_length
    context = r.vllm_max_model_len
    if prompt is None:
        return int(context or 4096)
    seq = int(prompt) + int(g.max_completion_length)
    return min(seq, int(context)) if context else seq


def _kv_cache(cfg, world_size: int, seq: int) -> int:
    """Each engine's KV cache as the run sizes it on CPU (rollout/kv_cache.py); 0 where
    vLLM sizes it itself (a GPU without --vllm_kv_cache_memory)."""
    r, g = cfg.rollout, cfg.grpo
    size = parse_size(r.vllm_kv_cache_memory)
    if size is not None:
        return size
    sequences = sequences_per_engine(g.generation_batch_size, g.num_generations, world_size,
                                     r.vllm_tensor_parallel_size, r.vllm_max_num_seqs)
    return _engine_kv_bytes(cfg.model.model, sequences=sequences,
                          max_model_len=r.vllm_max_model_len or seq,
                          tensor_parallel_size=r.vllm_tensor_parallel_size,
                          dtype="bfloat16" if cfg.training.bf16 else "float32")


def _options(cfg, world_size, ranks_per_machine, plan, max_prompt_tokens, device, kv):
    """What each change that keeps the results would save per rank, largest first."""
    t, p, g = cfg.training, cfg.parallel, cfg.grpo
    tries = []
    tp = p.tensor_model_parallel_size
    dp = world_size // (tp * p.pipeline_model_parallel_size * p.context_parallel_size)
    if dp > 1 and not p.use_distributed_optimizer:
        tries.append(("--use_distributed_optimizer true",
                      lambda: replace(cfg, parallel=replace(p, use_distributed_optimizer=True))))
    if dp % 2 == 0:
        tries.append((f"--tensor_model_parallel_size {tp * 2}",
                      lambda: replace(cfg, parallel=replace(p, tensor_model_parallel_size=tp * 2))))
    if t.micro_batch_size > 1:
        half = max(1, t.micro_batch_size // 2)
        tries.append((f"--micro_batch_size {half}",
                      lambda: replace(cfg, training=replace(t, micro_batch_size=half))))
    if (t.recompute_granularity or "none") != "full":
        tries.append(("--recompute_granularity full",
                      lambda: replace(cfg, training=replace(t, recompute_granularity="full",
                                                          recompute_method="uniform",
                                                          recompute_num_layers=1))))
    if g.beta and t.tuner_type not in ("lora", "lora_llm") and not cfg.model.ref_model:
        tries.append(("--beta 0", lambda: replace(cfg, grpo=replace(g, beta=0.0))))
    out = []
    config_log = logging.getLogger("megatron_grpo.config")
    for what, make in tries:
        try:
            disabled, config_log.disabled = config_log.disabled, True
            try:    # a variant's option checks: its warnings are not about the run started
                alt_cfg = make()
            finally:
                config_log.disabled = disabled
            alt = memory_plan(alt_cfg, world_size, ranks_per_machine,
                              max_prompt_tokens=max_prompt_tokens, device=device,
                              kv_cache_bytes=kv, options=False)
        except (ValueError, TypeError, ZeroDivisionError, KeyError):
            continue       # a change the options refuse for this run
        saved = plan.peak - alt.peak
        if saved > 0:
            out.append((what, saved))
    return sorted(out, key=lambda x: -x[1])



# ---------------------------------------------------------------- for the command line
def longest_prompt_tokens(cfg, dataset, sample: int = 64) -> Optional[int]:
    """Tokens of the longest prompt, rendered as the trainer renders it: the `sample`
    longest by characters are tokenized (the rest cannot be longer by much). None for a
    dataset with images (their tokens depend on the processor): --max_length bounds it."""
    if dataset is None or dataset.images is not None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.model)
    texts = [render_prompt(tokenizer, m, enable_thinking=cfg.data.enable_thinking)
             for m in dataset.messages]
    longest = sorted(texts, key=len, reverse=True)[:sample]
    n = max((len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in longest),
            default=0)
    return min(n, cfg.data.max_length) if cfg.data.max_length else n


def plan_for_launch(cfg, dataset, world_size: int, ranks_per_machine: int,
                    device: str = "cpu") -> tuple[MemoryPlan, Optional[int]]:
    """The run's plan and the bytes this machine has for it (None: unknown)."""
    plan = memory_plan(cfg, world_size, ranks_per_machine,
                       max_prompt_tokens=longest_prompt_tokens(cfg, dataset), device=device)
    avail = available_bytes() if device == "cpu" else {}
    return plan, host_budget(avail) if device == "cpu" else None


def summary(plan: MemoryPlan, available: Optional[int]) -> dict:
    """What the launcher keeps to explain a killed rank (launch.describe_failure)."""
    return {"peak": plan.peak, "peak_phase": plan.peak_phase, "machine_peak": plan.machine_peak,
            "available": available, "options": [list(o) for o in plan.options]}


def short_format(plan: MemoryPlan, available: Optional[int]) -> str:
    """The plan in two lines, for the start of a run."""
    parts = " + ".join(f"{x.name} {x.nbytes / GIB:.2f}" for x in plan.lines if not x.phases)
    return (f"[megatron] memory plan per rank (GiB): {parts} = {plan.resident() / GIB:.2f} "
            f"resident; peak {plan.peak / GIB:.2f} ({plan.peak_phase}); "
            f"{plan.machine_peak / GIB:.2f} per machine"
            + (f" of {available / GIB:.2f} available" if available else "")
            + " (--dry_run true: every line)")
