"""The trainer's weights into the rollout engine, and device memory between the two.

    sync = WeightSync(policy, engine, cfg.rollout)
    sync.hand_over()          # colocate: trainer memory off the device, vLLM awake
    completions = engine.generate(...)
    sync.take_back()          # colocate: vLLM asleep, trainer memory back
    ... optimizer steps ...
    info = sync()             # stream the new weights into vLLM (docs/architecture.md, step 7)

A sync streams the bridge's HF buckets (`bridge.export_hf_weights`) into the engine
bucket by bucket. Every trainer rank iterates the stream (the export is collective);
in server mode rank 0 alone uploads. One staging buffer (`bridge.BucketBuffer`) holds
the buckets for every sync, since allocating it is slow; when it lives in accelerator
memory it is dropped before vLLM generates and re-made by the next sync.

LoRA: by default vLLM gets the merged weights `W + scale B A` (model/lora_peft.py). With
`vllm_enable_lora` it keeps the base weights it loaded at start, and each sync streams
only the adapter's factors (PEFT names, gathered over TP factor by factor), which vLLM
registers as a new adapter that every later request runs with.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from bridge import BucketBuffer, export_hf_weights
from bridge.mappings import get_mapping
from bridge.mappings.vision import HF_PREFIX as VISION_HF_PREFIX

from ..model.lora import is_adapter_param, lora_settings
from ..model.lora_peft import adapter_stream, merged_stream, peft_config
from ..platform import device
from ..platform.cpu import without_cuda_rewrite
from .offload import offload_model, offload_optimizer, onload_model, onload_optimizer
from .verify import AdapterFingerprints, StreamFingerprints, check_adapter_sync, check_weight_sync
from .weights import load_adapter_stream, load_weight_stream, sleep, wake_up


class WeightSync:
    """Owns the weight stream into `engine` and the memory hand-over around generation.

    policy: train.setup.Policy (chunks, config, args, optimizer); rollout: the run's
    rollout options (vllm_mode, sleep_level, move_model_batches, offload_bridge,
    check_weight_sync, offload_model, offload_optimizer).
    """

    def __init__(self, policy, engine, rollout) -> None:
        self.policy, self.engine, self.opts = policy, engine, rollout
        self.is_server = rollout.vllm_mode == "server"
        self.staging = None     # bridge.BucketBuffer, reused by every sync
        self._bucket_bytes = None

    def bucket_bytes(self) -> int:
        """move_model_batches buckets per sync (of an upper bound of the HF model's bytes:
        every rank's TP/PP shards summed; adapter-only sync: of the adapter's), else 512 MiB."""
        if not self.opts.move_model_batches:
            return 512 << 20
        if self._bucket_bytes is None:   # the parameters' sizes never change: once per run
            params = [p for c in self.policy.chunks for n, p in c.named_parameters()
                      if not self.opts.vllm_enable_lora or is_adapter_param(n)]
            total = sum(p.numel() * p.element_size() for p in params)
            total = torch.tensor(float(total), device=device())  # NCCL reduces device tensors only
            dist.all_reduce(total)
            self._bucket_bytes = int(total.item() // self.opts.move_model_batches) + 1
        return self._bucket_bytes

    def __call__(self) -> dict:
        """Stream the policy's HF weights into vLLM (collective over every trainer rank);
        with check_weight_sync, prove vLLM holds them. Returns the engine's load info."""
        r, policy = self.opts, self.policy
        if not self.is_server:   # vLLM slept through training (sleep_level > 0): its weights
            # back first, its KV cache only once the trainer's state is off (hand_over)
            wake_up(self.engine, ["weights"], level=r.sleep_level)
        bucket = self.bucket_bytes()
        if r.vllm_enable_lora:
            return self._sync_adapter(bucket)
        if self.staging is None:
            first = next(p for c in policy.chunks for p in c.parameters())
            self.staging = BucketBuffer("cpu" if r.offload_bridge else first.device)
        stream = export_hf_weights(policy.chunks, policy.config, policy.args,
                                   bucket_size_bytes=bucket, offload_bridge=r.offload_bridge,
                                   staging=self.staging,
                                   include=getattr(policy, "sync_include", None))
        # LoRA: W + scale * B @ A per HF tensor, in its bucket slot (model/lora_peft.py)
        stream = merged_stream(policy.chunks, stream)
        expected = StreamFingerprints() if r.check_weight_sync else None
        aliases = get_mapping(policy.args.family).vllm_aliases    # vLLM's names, if its own
        return self._deliver(stream, expected, lambda s: load_weight_stream(self.engine, s),
                             lambda info: check_weight_sync(
                                 self.engine, expected.result, aliases,
                                 getattr(policy, "sync_include", None)))

    def _deliver(self, stream, expected, load, check) -> dict:
        """Feed `stream` to the engine through `load` (in server mode rank 0 alone uploads;
        the other ranks iterate it to take part in its collectives), then, with
        `expected` fingerprints, `check(info)` what the engine holds.

        The streams (the bridge's export, the adapters; generators, run as they are
        consumed) name no CUDA device: on a CPU-only machine they run without the
        CUDA->CPU mode, whose per-torch-call cost was ~10 % of a quickstart sync
        (docs/benchmarks.md). A no-op on GPU."""
        if expected is not None:
            stream = expected.watch(stream)
        with without_cuda_rewrite():
            if self.is_server and dist.get_rank() != 0:
                for _ in stream:
                    pass
                info = {}
            else:
                info = load(stream)
                if expected is not None:
                    check(info)
        if self.is_server:   # the other ranks sample from the server next: after the upload
            dist.barrier()
        # Colocated, each rank loaded its own engine (a vLLM TP group's ranks load theirs
        # together inside vLLM): nothing to wait for.
        return info

    def _sync_adapter(self, bucket: int) -> dict:
        """Adapter-only sync: the factors in buckets of at most `bucket` bytes (collective
        over every trainer rank); in server mode rank 0 alone uploads. Adapters on the
        vision tower (--freeze_vit / --freeze_aligner false) are not sent to vLLM's LoRA:
        the tower goes merged (W + scale * B @ A) into vLLM's own tower weights first
        (`_sync_merged_tower`)."""
        settings = lora_settings(self.policy.chunks)
        if settings.tower or settings.aligner:
            self._sync_merged_tower(bucket)
        stream = adapter_stream(self.policy.chunks, bucket_size_bytes=bucket)
        expected = AdapterFingerprints(settings.scale) if self.opts.check_weight_sync else None
        info = self._deliver(
            stream, expected, lambda s: load_adapter_stream(self.engine, s, peft_config(settings)),
            lambda info: check_adapter_sync(self.engine, expected, info["lora_id"],
                                            get_mapping(self.policy.args.family).vllm_aliases))
        if self.is_server:            # every rank's client samples with the new adapter
            names = [self.engine.lora_names]    # each server's name for it
            dist.broadcast_object_list(names, src=0)
            self.engine.lora_names = names[0]
        return info

    def _sync_merged_tower(self, bucket: int) -> dict:
        """The vision tower's HF tensors (those the sync filter streams), merged with their
        adapters, into vLLM's base weights; vLLM's LoRA keeps the language model's adapter
        (vLLM 0.32's LoRA on the tower, `enable_tower_connector_lora`, is experimental and
        not used). Base weights are streamed each time, so nothing accumulates."""
        policy, r = self.policy, self.opts
        base = getattr(policy, "sync_include", None)

        def include(name: str) -> bool:
            return name.startswith(VISION_HF_PREFIX) and (base is None or base(name))

        stream = merged_stream(policy.chunks, export_hf_weights(
            policy.chunks, policy.config, policy.args, bucket_size_bytes=bucket,
            offload_bridge=r.offload_bridge, include=include))
        expected = StreamFingerprints() if r.check_weight_sync else None
        aliases = get_mapping(policy.args.family).vllm_aliases
        return self._deliver(stream, expected, lambda s: load_weight_stream(self.engine, s),
                             lambda info: check_weight_sync(self.engine, expected.result,
                                                            aliases, include))

    def hand_over(self) -> None:
        """Before vLLM generates: free the trainer's accelerator memory for it, then give
        vLLM its KV cache back (colocate mode; its weights are back since the last sync:
        the staged wake-up keeps the trainer's state and vLLM's whole memory from being on
        the device together)."""
        r = self.opts
        if self.staging is not None and self.staging.device.type != "cpu":
            self.staging = None       # the bucket buffer: accelerator memory for vLLM
        if self.is_server:
            return                    # a server has its own memory
        if r.offload_model:
            offload_model(self.policy.chunks)
        if r.offload_optimizer:
            offload_optimizer(self.policy.optimizer)
        wake_up(self.engine, ["kv_cache"], level=r.sleep_level)

    def take_back(self, *, keep_awake: bool = False) -> None:
        """After vLLM generated (colocate mode): put it to sleep (unless `keep_awake`: it
        generates next) and bring the trainer's state back."""
        r = self.opts
        if self.is_server:
            return
        if not keep_awake:
            sleep(self.engine, r.sleep_level)
        if r.offload_optimizer:
            onload_optimizer(self.policy.optimizer)
        if r.offload_model:
            onload_model(self.policy.chunks)
