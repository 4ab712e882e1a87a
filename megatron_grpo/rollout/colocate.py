"""A vLLM engine inside each training rank (colocate mode).

    engine = ColocateEngine("path/to/hf_model", vllm_tensor_parallel_size=2, temperature=0.9,
                            num_generations=8, max_completion_length=512, seed=42)
    completions = engine.generate(prompt_token_ids)      # this rank's prompts
    engine.generate(vllm_prompt_ids, images=[[pil, ...], ...])   # vision-language models
    engine.generate_turns(first_prompts, next_turn)       # multi-turn, continuous batching
    load_weight_stream(engine, bridge_buckets)            # weights.py

vLLM TP groups. Inside a torchrun world (torch.distributed already initialised),
vLLM runs with `distributed_executor_backend="external_launcher"`: every rank is
one vLLM worker and vLLM builds its groups from torch's world, with contiguous
ranks forming a TP group ([0, 1], [2, 3], ... for TP=2; the remaining dimension
is vLLM's "external data parallel": groups sample independently). The ranks of a
TP group run one engine together, so they must submit the same requests in the
same order with the same seed: `generate` all-gathers the ranks' prompts within
the group, every member generates for all of them, and each rank keeps its own
part. Different TP groups get different seeds (seed + group index), so two groups
never draw the same samples. With a world of one rank vLLM runs plainly in-process.
`generate_turns` (multi-turn) steps the engine itself and adds each trajectory's next
turn between steps; a TP group's ranks all-gather the requests they have ready before
every step, so their engines stay identical.

Rollout log-probs. The engine runs with `logprobs_mode="processed_logprobs"`: the
log-prob vLLM returns for a sampled token is taken from the distribution it was
sampled from, i.e. log_softmax(logits / temperature) after top-k / top-p masking
(renormalised over the kept tokens). With top_k=-1 and top_p=1 this is exactly the
trainer's log_softmax(logits / temperature); with top-k / top-p it is the
behaviour policy's true probability, which importance-sampling corrections need.
`raw_logprobs` (vLLM's default) would return log_softmax(logits) at temperature 1,
matching neither. Greedy sampling (temperature 0) returns log_softmax(logits).
`score` (prompt log-probs) is always temperature 1: prompt tokens skip sampling.
Non-finite ones reach the trainer as they come (server mode: vLLM's JSON writes -inf as
-9999 and cannot carry NaN): the rollout step drops a -inf token from the loss and
stops on NaN (train/rollout_step.py `checked_rollout_logps`).

KV cache. On CPU it is sized in bytes from the sequences in flight (kv_cache.py),
never as vLLM's fraction of the NUMA node; on GPU `vllm_gpu_memory_utilization`
applies unless `vllm_kv_cache_memory` is given.

Images (vision-language models, data/vision.py). A prompt's images go with its ids,
`{"prompt_token_ids": ids, "multi_modal_data": {"image": [PIL, ...]}}`, the ids holding
ONE image placeholder per image: vLLM runs the model's image processor (with the run's
`mm_processor_kwargs`, i.e. its pixel budget) and expands the placeholder itself. Each
completion of an image prompt carries the ids vLLM expanded the prompt to
(`Completion.prompt_token_ids`), which must equal the trainer's
(`VisionPrompt.check_expanded`). Where torchvision does not import (the CPU stack) the
engine applies compat's patches first (compat/vllm.py `image_models_without_torchvision`).

CPU layer. Every call into vLLM runs inside `platform.cpu.without_cuda_rewrite()`:
vLLM-CPU needs none of the CUDA->CPU rewriting Megatron does, and the mode's
per-torch-call cost was 20-40 % of a quickstart generate. A no-op on GPU.

Eager engines compile nothing. With `vllm_enforce_eager` every call into vLLM also runs
under `torch.compiler.set_stance("force_eager")`: vLLM compiles some helpers with
torch.compile whatever enforce_eager says (0.32: the sampler's token-rank count,
`batched_count_greater_than`, with inductor on CPU), and the first generate paid for it:
~4 CPU seconds of tracing, C++ compiles and ISA probes in 10 child interpreters per rank
(docs/benchmarks.md), for a `(x >= v).sum(-1)` whose eager result is the same integers.
On CPU an eager engine also runs RMSNorm with vLLM-CPU's C++ kernels instead of vLLM's
native torch version, which is written for inductor to fuse (compat/vllm.py
`cpu_norm_kernels`: -8 % CPU time of a quickstart generate; equal up to rounding).
"""
from __future__ import annotations

import contextlib
import gc
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ..data.vision import is_vision_language, model_type
from ..platform.compat import vllm as compat
from ..platform.cpu import without_cuda_rewrite
from .kv_cache import kv_cache_engine_kwargs, parse_size
from .weights import adapter_name
from .worker_ext import WORKER_EXTENSION


@dataclass
class Completion:
    """One sampled completion of one prompt."""
    prompt_index: int           # index into the prompts this rank passed to generate()
    token_ids: List[int]        # sampled tokens, eos included when generation stopped there
    text: str
    truncated: bool             # stopped by max_completion_length (finish_reason == "length")
    # Rollout log-prob of each sampled token (see module doc); None when the sampling
    # options asked for none (SamplingOptions.logprobs).
    logprobs: Optional[List[float]]
    finish_reason: Optional[str] = None
    # Router replay R3 (routing.py): the experts each MoE layer routed every token the
    # model read to, [len(prompt) + len(token_ids) - 1, moe layers, top-k] uint8 (int16 > 256 experts).
    routed_experts: Optional[Any] = None
    # Image prompts: the prompt ids vLLM sampled from, placeholders expanded.
    prompt_token_ids: Optional[List[int]] = None


def vllm_tp_groups(world_size: int, vllm_tensor_parallel_size: int) -> List[List[int]]:
    """vLLM's TP groups in a colocated world: contiguous blocks of ranks.

    Raises ValueError, before anything heavy starts, when TP does not divide the world.
    """
    tp = vllm_tensor_parallel_size
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"vllm_tensor_parallel_size={tp!r} must be a positive integer")
    if world_size % tp != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"vllm_tensor_parallel_size={tp} does not divide the world size {world_size}: in "
            f"colocate mode every rank joins one vLLM TP group. Use one of {divisors}")
    return [list(range(g * tp, (g + 1) * tp)) for g in range(world_size // tp)]


def _world() -> tuple:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class SamplingOptions:
    """What generate() samples; per-call overrides go through generate(**overrides)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    max_completion_length: int = 512
    num_generations: int = 1
    # Return each sampled token's log-prob (Completion.logprobs; None without). Off, vLLM
    # skips the log-softmax over the vocabulary and the per-token bookkeeping of every step.
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (disabled) or >= 1")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length={self.max_completion_length} must be >= 1")
        if self.num_generations < 1:
            raise ValueError(f"num_generations={self.num_generations} must be >= 1")


@dataclass(frozen=True)
class EngineSettings:
    """How a colocated engine is built and what it samples: the rollout options of the
    same names, read once (`train.setup.engine_settings`) and passed whole. The checks
    that need no vLLM run on construction: a bad option fails in milliseconds."""
    vllm_tensor_parallel_size: int = 1
    vllm_gpu_memory_utilization: float = 0.9
    vllm_max_model_len: Optional[int] = None
    vllm_enforce_eager: bool = False
    vllm_enable_prefix_caching: bool = True
    vllm_max_num_seqs: Optional[int] = None
    vllm_kv_cache_memory: Union[None, int, str] = None
    # Sequences the engine holds at once (sizes the CPU KV cache); None:
    # vllm_max_num_seqs, else one prompt's group.
    sequences_in_flight: Optional[int] = None
    vllm_engine_kwargs: Optional[Dict[str, Any]] = None
    # Vision-language models: most images per prompt ({"image": N}; None: vLLM's
    # default) and the image processor's overrides (the pixel budget, data/vision.py).
    vllm_limit_mm_per_prompt: Optional[Dict[str, int]] = None
    mm_processor_kwargs: Optional[Dict[str, Any]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    max_completion_length: int = 512
    num_generations: int = 1
    logprobs: bool = True
    seed: int = 42
    dtype: str = "auto"
    sleep_level: int = 0
    # Return the experts vLLM routed each token to with every completion (router replay
    # R3, routing.py); turns vLLM's prefix caching off (a cached prefix has no routing) and
    # runs the model eagerly (a compiled graph would not call the capture hook).
    return_routed_experts: bool = False
    # Adapter-only LoRA sync: vLLM serves the base weights loaded at start plus one LoRA
    # adapter of rank <= vllm_max_lora_rank, replaced by every sync (sync.py).
    vllm_enable_lora: bool = False
    vllm_max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must "
                             "be in (0, 1] (the fraction of GPU memory; not used on CPU)")
        parse_size(self.vllm_kv_cache_memory)
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level={self.sleep_level!r} must be 0, 1 or 2")
        self.sampling()

    def sampling(self) -> SamplingOptions:
        return SamplingOptions(self.temperature, self.top_p, self.top_k, self.repetition_penalty,
                               self.max_completion_length, self.num_generations, self.logprobs)


class ColocateEngine:
    """vllm.LLM in this rank, sharing the torch.distributed world with the trainer
    (a rollout.engine.RolloutEngine; `tp_size`: the ranks of its vLLM TP group).

    `settings`: an `EngineSettings`; a one-off caller may give its fields as keywords
    instead, not both."""

    def __init__(self, model: str, settings: Optional[EngineSettings] = None, **options) -> None:
        if settings is None:
            settings = EngineSettings(**options)
        elif options:
            raise TypeError(f"ColocateEngine: pass either `settings` or keywords, not both "
                            f"(got {sorted(options)})")
        st = self.settings = settings
        # Every check that needs no vLLM runs first: a bad option fails in milliseconds.
        self.rank, self.world_size = _world()
        groups = vllm_tp_groups(self.world_size, st.vllm_tensor_parallel_size)
        self.sampling = st.sampling()
        self.tp_size = st.vllm_tensor_parallel_size
        self.group_index = self.rank // self.tp_size
        self.group_ranks = groups[self.group_index]
        self.sleep_level = st.sleep_level
        self.seed = st.seed + self.group_index
        self.tp_group = None
        if self.tp_size > 1:
            import torch.distributed as dist

            # Every rank takes part in creating every group (a collective).
            self.tp_group, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")

        # The engine core must live in this process (external_launcher insists anyway).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        compat.check_version()   # an untested vLLM fails here, not inside a worker
        from vllm import LLM
        from vllm.platforms import current_platform

        self.cpu_shm_token = None     # the name of this engine's TP shared memory on CPU
        if self.tp_group is not None and current_platform.is_cpu():
            import torch.distributed as dist

            token = [uuid.uuid4().hex[:12]]      # one per engine start, the group's first rank's
            dist.broadcast_object_list(token, src=self.group_ranks[0], group=self.tp_group)
            self.cpu_shm_token = token[0]
            compat.name_cpu_shm(self.cpu_shm_token)
        self.model_path = model
        self.vision = is_vision_language(model)
        if self.vision:
            compat.image_models_without_torchvision(model_type(model))

        # The KV cache in bytes (kv_cache.py): on CPU never a fraction of the NUMA node.
        # Sequences in flight: the caller's figure (the trainer passes its share of the
        # generation batch), else vllm_max_num_seqs, else one prompt's group.
        sequences = st.sequences_in_flight or st.vllm_max_num_seqs or st.num_generations
        kv_kwargs = kv_cache_engine_kwargs(
            model, on_cpu=current_platform.is_cpu(), size=st.vllm_kv_cache_memory,
            sequences=sequences, max_model_len=st.vllm_max_model_len,
            tensor_parallel_size=self.tp_size, dtype=st.dtype, engine_kwargs=st.vllm_engine_kwargs)
        kwargs: Dict[str, Any] = dict(
            model=model, tokenizer=model, dtype=st.dtype, seed=self.seed,
            tensor_parallel_size=self.tp_size,
            gpu_memory_utilization=st.vllm_gpu_memory_utilization,
            # Under router replay the model runs eagerly: vLLM compiles its graph once,
            # before the capture hook exists, and the graph never calls it (routing.py).
            max_model_len=st.vllm_max_model_len,
            enforce_eager=st.vllm_enforce_eager or st.return_routed_experts,
            # A prefix served from the cache has no routing (routing.py).
            enable_prefix_caching=(st.vllm_enable_prefix_caching
                                   and not st.return_routed_experts),
            logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
            # Sleeping frees memory only where vLLM supports it (CUDA, ROCm, XPU); on CPU
            # the sleep/wake calls still run, and free nothing.
            enable_sleep_mode=st.sleep_level > 0 and current_platform.is_sleep_mode_available(),
        )
        if st.return_routed_experts:
            # The capture matches routing records to requests by the token ids of each step's
            # rows; async scheduling (vLLM's default on GPU; CPU forces it off) holds -1 for
            # every just-sampled token there until the device copy. Not run on a GPU yet.
            kwargs["async_scheduling"] = False
        # At most the sequences the engine is sized for: --vllm_max_num_seqs, else the
        # trainer's share of a rollout (ms-swift's default), else vLLM's (256).
        max_num_seqs = st.vllm_max_num_seqs or st.sequences_in_flight
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        if self.vision and st.vllm_limit_mm_per_prompt is not None:
            kwargs["limit_mm_per_prompt"] = dict(st.vllm_limit_mm_per_prompt)
        if self.vision and st.mm_processor_kwargs:
            kwargs["mm_processor_kwargs"] = dict(st.mm_processor_kwargs)
        if st.vllm_enable_lora:   # one adapter at a time: each sync replaces it
            kwargs.update(enable_lora=True, max_lora_rank=st.vllm_max_lora_rank, max_loras=1)
        if self.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if kwargs["enforce_eager"]:   # vLLM-CPU's C++ RMSNorm, not 8 torch calls (module doc)
            kwargs.update(compat.cpu_norm_kernels())
        kwargs.update(kv_kwargs)
        kwargs.update(st.vllm_engine_kwargs or {})
        # vLLM's start-up calls gc.collect() several times (model loading, memory profiling),
        # each a pass over every object of the process, the collector on or off. What is
        # alive now stays alive (modules, the trainer's model): frozen first, those passes
        # see only the engine's own objects. A launched worker gets here with the collector
        # off since it started (cli.py); a collect here found 17,000 small objects to free
        # (quickstart; no change in RSS), which it leaves.
        if gc.isenabled():
            gc.collect()
        gc.freeze()
        with self._in_vllm():
            self.llm = LLM(**kwargs)
            self.tokenizer = self.llm.get_tokenizer()
            if st.return_routed_experts:
                self.llm.collective_rpc("mg_capture_routing")
        self.engine_steps = 0     # engine steps run by generate_turns
        self.lora_request = None  # the adapter every request runs with (adapter-only sync)
        self.adapter_version = 0
        self._requests = 0        # request ids of generate_turns

    def close(self) -> None:
        """Shut the engine down (at the end of a run).

        vLLM's teardown also destroys torch.distributed's process groups (its
        `cleanup_dist_env_and_memory`), so nothing collective can follow. Without
        this call the same teardown runs at interpreter exit.
        """
        llm, self.llm = self.llm, None
        if llm is not None:
            with self._in_vllm():
                compat.shutdown_llm(llm)

    @contextlib.contextmanager
    def _in_vllm(self):
        """The context of every call into vLLM: outside the CUDA->CPU mode and, for an
        eager engine, with torch.compile off (module doc)."""
        import torch

        eager = self.settings.vllm_enforce_eager or self.settings.return_routed_experts
        stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
        with without_cuda_rewrite(), stance:
            yield

    # ------------------------------------------------------------------ TP-group plumbing
    def _in_tp_group(self, items: Sequence[Any], run: Callable[[List[Any]], List[Any]]) -> List[Any]:
        """Run `run` on the items of every rank of this vLLM TP group; return this rank's
        part. `run` maps a list of items to a list of results, one per item."""
        if self.tp_group is None:
            return run(list(items))
        import torch.distributed as dist

        gathered: List[Any] = [None] * self.tp_size
        dist.all_gather_object(gathered, list(items), group=self.tp_group)
        flat = [x for part in gathered for x in part]
        results = run(flat)
        local = self.rank - self.group_ranks[0]
        start = sum(len(part) for part in gathered[:local])
        return results[start:start + len(items)]

    # ------------------------------------------------------------------ sampling
    def _sampling_params(self, detokenize: bool = True, **overrides):
        """vLLM's SamplingParams of a call. `flat_logprobs`: vLLM keeps the sampled
        tokens' log-probs in flat lists (`_completion` reads them) instead of a dict of
        `Logprob` objects per token. `detokenize=False`: vLLM neither decodes the text
        nor, for every sampled token, its log-prob's token string (`decoded_token`,
        which nothing here reads); the caller decodes the text (`detokenize`)."""
        from vllm import SamplingParams

        opts = SamplingOptions(**{**self.sampling.__dict__, **overrides})
        return SamplingParams(
            n=opts.num_generations, temperature=opts.temperature, top_p=opts.top_p,
            top_k=opts.top_k, repetition_penalty=opts.repetition_penalty,
            max_tokens=opts.max_completion_length, logprobs=0 if opts.logprobs else None,
            flat_logprobs=True, detokenize=detokenize)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 images: Optional[Sequence[Sequence[Any]]] = None, **overrides) -> List[Completion]:
        """Sample `num_generations` completions for each prompt (token-id lists).

        `images`: per prompt, its images (PIL, in placeholder order; [] for none), for a
        vision-language model; the prompt ids then hold one image placeholder per image
        (see the module docstring). Collective over the vLLM TP group: its ranks call
        together (any prompt counts). Returns completions ordered by prompt, then sample;
        `prompt_index` refers to this rank's list. `overrides`: any SamplingOptions field
        for this call.
        """
        # The text is decoded here, as vLLM's detokenizer would (`detokenize`), where the
        # tokenizer lets us: vLLM then skips its per-token decoding.
        own_text = decodes_like_vllm(self.tokenizer)
        params = self._sampling_params(detokenize=not own_text, **overrides)
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        if images is not None:
            if not self.vision:
                raise ValueError(f"generate: images given, but {self.model_path} is not a "
                                 "vision-language model")
            if len(images) != len(prompts):
                raise ValueError(f"generate: {len(prompts)} prompts but {len(images)} image lists")
        items = [(p, list(images[i]) if images is not None else []) for i, p in enumerate(prompts)]

        def run(all_items: List[tuple]) -> List[List[Completion]]:
            requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}} if imgs
                        else {"prompt_token_ids": p} for p, imgs in all_items]
            with self._in_vllm():
                outs = self.llm.generate(requests, params, use_tqdm=False,
                                         lora_request=self.lora_request)
            result = []
            for i, (out, (_, imgs)) in enumerate(zip(outs, all_items)):
                group = [_completion(i, c, detokenize(self.tokenizer, out.prompt_token_ids, c)
                                     if own_text else None, params.logprobs is not None)
                         for c in out.outputs]
                if imgs:
                    for c in group:
                        c.prompt_token_ids = list(out.prompt_token_ids)
                result.append(group)
            if self.settings.return_routed_experts:
                self._attach_routing([p for p, _ in all_items], result)
            return result

        per_prompt = self._in_tp_group(items, run)
        result = []
        for i, group in enumerate(per_prompt):
            for c in group:
                c.prompt_index = i
                result.append(c)
        return result

    def _attach_routing(self, prompts: List[List[int]], groups: List[List[Completion]]) -> None:
        """Give every completion the routing vLLM recorded for it (routing.py): the rows of
        the tokens it read, prompt + completion less the last sampled token."""
        done = [c for group in groups for c in group]
        fed = [prompts[c.prompt_index] + c.token_ids[:-1] for c in done]
        with self._in_vllm():
            routed = self.llm.collective_rpc("mg_take_routing", args=(fed,))[0]
        for c, r, seq in zip(done, routed, fed):
            if r is None:
                raise RuntimeError(f"router replay: vLLM recorded no routing for a completion "
                                   f"of {len(seq)} tokens read (prompt index {c.prompt_index})")
            c.routed_experts = r

    def generate_turns(self, prompt_token_ids: Sequence[Sequence[int]],
                       next_turn: Callable[[int, Completion], Optional[Sequence[int]]],
                       **overrides) -> None:
        """Continuous batching across turns: one completion per prompt, and as soon as
        prompt i's completion c is done, `next_turn(i, c)` gives i's next prompt (ids,
        submitted to the engine at once while the others keep decoding) or None (i is
        finished). Returns when every chain is finished. `overrides`: SamplingOptions
        fields (num_generations is always 1).

        vLLM's engine is driven step by step through its public `LLMEngine` calls
        (`renderer.render_cmpl`, `add_request`, `step`, `has_unfinished_requests`, as
        `LLM.generate` does inside): `LLM.generate` itself runs the engine until every
        request of its call is done, which would make a finished turn wait for the
        slowest of its round. `engine_steps` counts the steps.

        Collective over the vLLM TP group, in lockstep: its ranks run the same engine, so
        before every step they all-gather the requests each rank has ready (its own
        chains' next turns) and all add the same requests in the same order (by rank);
        a chain's `next_turn` runs on the rank that owns it. They stop together: the
        engines are identical, so "nothing gathered and nothing unfinished" is too.
        """
        # A trajectory carries its turns' log-probs (trajectory.py): always asked for.
        params = self._sampling_params(**{**overrides, "num_generations": 1, "logprobs": True})
        compat.final_output_only(params)
        engine = self.llm.llm_engine
        member = self.rank - self.group_ranks[0]
        ready = [(i, [int(t) for t in p]) for i, p in enumerate(prompt_token_ids)]
        owner: Dict[str, tuple] = {}             # request id -> (member rank, chain index)
        try:
            self._run_turns(engine, params, member, ready, owner, next_turn)
        except BaseException:
            if owner:        # leave nothing behind for the engine's next caller
                with self._in_vllm():
                    engine.abort_request(list(owner))
            raise

    def _run_turns(self, engine, params, member, ready, owner, next_turn) -> None:
        """generate_turns' loop: gather what is ready, add it, step, hand out what finished."""
        while True:
            if self.tp_group is None:
                batch = [(member, i, ids) for i, ids in ready]
            else:
                import torch.distributed as dist

                gathered: List[Any] = [None] * self.tp_size
                dist.all_gather_object(gathered, ready, group=self.tp_group)
                batch = [(m, i, ids) for m, part in enumerate(gathered) for i, ids in part]
            ready = []
            with self._in_vllm():
                inputs = engine.renderer.render_cmpl([{"prompt_token_ids": ids}
                                                      for _, _, ids in batch]) if batch else []
                for (m, i, _), prompt in zip(batch, inputs):
                    self._requests += 1
                    request_id = f"mg-turn-{self._requests}"
                    engine.add_request(request_id, prompt, params,
                                       lora_request=self.lora_request)
                    owner[request_id] = (m, i)
                if not engine.has_unfinished_requests():
                    break
                outputs = engine.step()
                self.engine_steps += 1
            for out in outputs:
                if not out.finished:
                    continue
                m, i = owner.pop(out.request_id)
                if m == member:
                    ids = next_turn(i, _completion(i, out.outputs[0]))
                    if ids is not None:
                        ready.append((i, [int(t) for t in ids]))

    def score(self, prompt_ids: Sequence[Sequence[int]],
              completion_ids: Sequence[Sequence[int]]) -> List[List[float]]:
        """Per-token log-probs (temperature 1) of each completion given its prompt.

        vLLM's prompt log-probs over prompt + completion, read at the completion's
        positions. Collective over the vLLM TP group, like generate().
        """
        from vllm import SamplingParams

        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        pairs = [([int(t) for t in p], [int(t) for t in c])
                 for p, c in zip(prompt_ids, completion_ids)]
        for p, c in pairs:
            if not p or not c:
                raise ValueError("score: every prompt and completion needs at least one token")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

        def run(all_pairs):
            with self._in_vllm():
                outs = self.llm.generate([{"prompt_token_ids": p + c} for p, c in all_pairs],
                                         params, use_tqdm=False, lora_request=self.lora_request)
            return [prompt_logprobs_of(out, p, c) for out, (p, c) in zip(outs, all_pairs)]

        return self._in_tp_group(pairs, run)

    # ------------------------------------------------------------------ engine plumbing
    # The interface weights.py and verify.py drive (rollout.engine.RolloutEngine).
    def begin_weight_update(self) -> None:
        with self._in_vllm():
            self.llm.collective_rpc("mg_begin_weight_update")

    def load_bucket(self, bucket: Sequence) -> None:
        with self._in_vllm():
            self.llm.collective_rpc("mg_load_weights", args=(list(bucket),))

    def finish_weight_update(self, complete: bool = True) -> None:
        # An incomplete update fails the run that sent it (weights.load_weight_stream
        # raises): this engine is never sampled from again.
        with self._in_vllm():
            self.llm.collective_rpc("mg_finish_weight_update")

    def reset_prefix_cache(self) -> None:
        """After a weight update: cached KV blocks, and for a vision-language model the
        cached vision-tower outputs (keyed by image hash), were computed with the old
        weights. The encoder cache is reset in the scheduler and the worker together;
        without it vLLM-CPU 0.32 fails on the first image seen again after a sleep /
        update cycle ("Encoder cache miss for <hash>": the scheduler still lists it)."""
        with self._in_vllm():
            self.llm.reset_prefix_cache()
            if self.vision:
                self.llm.llm_engine.reset_encoder_cache()

    def begin_adapter_update(self) -> None:
        with self._in_vllm():
            self.llm.collective_rpc("mg_begin_adapter_update")

    def load_adapter_bucket(self, bucket: Sequence) -> None:
        with self._in_vllm():
            self.llm.collective_rpc("mg_load_adapter", args=(list(bucket),))

    def finish_adapter_update(self, peft_config: dict) -> str:
        """Register the adapter sent since begin_adapter_update under a new id and name
        (the old one is removed); every later request runs with it. Returns its name."""
        self.adapter_version += 1
        name = adapter_name(self.adapter_version)
        with self._in_vllm():
            self.llm.collective_rpc("mg_finish_adapter_update",
                                    args=(self.adapter_version, dict(peft_config)))
            self.lora_request = compat.lora_request(name, self.adapter_version)
        return name

    def adapter_fingerprints(self) -> List[dict]:
        """Per vLLM engine (here one: this rank's), its workers' adapter fingerprints."""
        with self._in_vllm():
            return [self.llm.collective_rpc("mg_adapter_fingerprints")]

    def sleep(self, level: int) -> None:
        with self._in_vllm():
            self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """Wake vLLM up; a no-op when it is awake (the trainer may sync a fresh engine)."""
        if not getattr(self, "asleep", False):
            return
        with self._in_vllm():
            self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    def weight_fingerprints(self) -> List[List[dict]]:
        """Fingerprint pieces of this rank's engine, i.e. of the whole vLLM TP group
        (collective over it; each rank holds one worker's shard)."""
        with self._in_vllm():
            pieces = [p for worker in self.llm.collective_rpc("mg_fingerprint_pieces")
                      for p in worker]
        if self.tp_group is None:
            return [pieces]
        import torch.distributed as dist

        gathered: List[Any] = [None] * self.tp_size
        dist.all_gather_object(gathered, pieces, group=self.tp_group)
        return [[p for part in gathered for p in part]]


def _completion(prompt_index: int, c, text: Optional[str] = None,
                with_logprobs: bool = True) -> Completion:
    """A Completion of vLLM's CompletionOutput `c`; `text`: decoded by the caller (else
    vLLM's); `with_logprobs`: whether the sampling asked for log-probs (else None)."""
    token_ids = list(c.token_ids)
    logprobs = None
    if with_logprobs:
        logprobs = compat.flat_sampled_logprobs(c.logprobs, token_ids)
        if logprobs is None:
            # logprobs=0: each entry holds the sampled token (plus nothing else).
            logprobs = [float(entry[tok].logprob)
                        for tok, entry in zip(token_ids, c.logprobs or [])]
    if logprobs is not None and len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens")
    return Completion(prompt_index=prompt_index, token_ids=token_ids,
                      text=c.text if text is None else text,
                      truncated=c.finish_reason == "length", logprobs=logprobs,
                      finish_reason=c.finish_reason)


def decodes_like_vllm(tokenizer) -> bool:
    """Whether `detokenize` gives vLLM's text for this tokenizer: one that vLLM decodes
    with `tokenizers`' DecodeStream (a fast tokenizer); others go through vLLM's slow
    Python detokenizer, and keep it."""
    return compat.detokenizes_with_stream(tokenizer)


def detokenize(tokenizer, prompt_token_ids: Sequence[int], c) -> str:
    """The text vLLM's fast incremental detokenizer gives completion `c` (for the
    SamplingParams `generate` uses: special tokens skipped, no stop strings), computed once
    from the token ids instead of by vLLM per token, which also decodes every sampled
    token's log-prob entry (~13 % of a quickstart generate, docs/benchmarks.md). Not always
    `tokenizer.decode(ids)`: the stop token is not decoded and a trailing incomplete UTF-8
    character is held back (compat/vllm.py `detokenize_like_vllm`)."""
    return compat.detokenize_like_vllm(tokenizer, prompt_token_ids, c.token_ids,
                                       stopped=c.finish_reason == "stop")


def prompt_logprobs_of(out, prompt: List[int], completion: List[int]) -> List[float]:
    """Log-probs of `completion`'s tokens from a RequestOutput over prompt + completion."""
    entries = out.prompt_logprobs  # one per prompt position; the first is None
    full = prompt + completion
    return [float(entries[pos][full[pos]].logprob) for pos in range(len(prompt), len(full))]
