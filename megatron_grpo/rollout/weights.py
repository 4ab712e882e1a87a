"""Weight sync into vLLM, and sleeping around training.

    expected = StreamFingerprints()                       # optional: verify.py
    load_weight_stream(engine, expected.watch(bridge.export_buckets(...)))
    check_weight_sync(engine, expected.result)

`engine` is a rollout.engine.RolloutEngine: a ColocateEngine (colocate mode) or a
RolloutClient (server mode), both with begin_weight_update / load_bucket /
finish_weight_update / reset_prefix_cache.
The stream is an iterable of buckets, each a list of (HF name, full tensor) in the
model's dtype; every rank of the vLLM TP group passes the same stream (each worker
keeps its own slice). How many buckets (`move_model_batches`) is the producer's
business: any number works, including one and including a bucket that splits a
layer's tensors (vLLM buffers a layer until it is complete). Only the bucket in
hand is referenced here, so the model is never held twice.

Sleep levels (ms-swift's `sleep_level`): 0 never sleeps; 1 frees the KV cache and
offloads the weights to host memory; 2 frees both (the next sync must then bring
all weights: wake_up(engine, ["weights"]), load the stream, wake_up(engine,
["kv_cache"])). On CPU vLLM cannot free memory this way; the calls still run.
"""
from __future__ import annotations

import time
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

Bucket = Sequence[Tuple[str, torch.Tensor]]


def load_weight_stream(engine, buckets: Iterable[Bucket]) -> dict:
    """Load every bucket into vLLM in place, then reset the prefix cache.

    Returns {"buckets": n, "tensors": m, "bytes": b, "seconds": s}. An empty stream
    is an error: it would leave vLLM silently on the old weights.
    """
    start = time.perf_counter()
    n_buckets = n_tensors = n_bytes = 0
    engine.begin_weight_update()
    complete = False
    try:
        for bucket in buckets:
            bucket = list(bucket)
            if not bucket:
                continue
            for name, tensor in bucket:
                if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"a bucket item must be (str, torch.Tensor), got "
                                    f"({type(name).__name__}, {type(tensor).__name__})")
                n_bytes += tensor.numel() * tensor.element_size()
            engine.load_bucket(bucket)
            n_buckets += 1
            n_tensors += len(bucket)
            del bucket  # drop our reference before the producer makes the next one
        complete = True
    finally:
        # Always leave buffered-reload mode, even if the stream failed part-way (a server
        # then refuses to sample until a whole update arrives).
        engine.finish_weight_update(complete=complete)
    if n_tensors == 0:
        raise ValueError("load_weight_stream: the weight stream was empty")
    # Cached KV blocks were computed with the old weights.
    engine.reset_prefix_cache()
    return {"buckets": n_buckets, "tensors": n_tensors, "bytes": n_bytes,
            "seconds": time.perf_counter() - start}


def adapter_name(lora_id: int) -> str:
    """The name vLLM serves adapter `lora_id` (>= 1) under; a sync's adapter gets the next
    id, so a request never meets an adapter, prefix-cache entry or model name of an older one."""
    return f"mgrpo-lora-{int(lora_id)}"


def adapter_id(name: str) -> int:
    """The id of an adapter named by adapter_name."""
    return int(name.rsplit("-", 1)[1])


def load_adapter_stream(engine, buckets: Iterable[Bucket], peft_config: dict) -> dict:
    """Adapter-only LoRA sync: send every bucket of (PEFT name, full factor), then make
    them the adapter vLLM samples with (a new one: the previous is removed, and the
    prefix cache, computed with it, is reset). The base weights are not touched.

    Returns {"buckets", "tensors", "bytes", "seconds", "lora_name", "lora_id"}; an empty
    stream is an error (vLLM would keep the old adapter)."""
    start = time.perf_counter()
    n_buckets = n_tensors = n_bytes = 0
    engine.begin_adapter_update()
    for bucket in buckets:
        bucket = list(bucket)
        if not bucket:
            continue
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        engine.load_adapter_bucket(bucket)
        n_buckets += 1
        n_tensors += len(bucket)
        del bucket
    if n_tensors == 0:
        raise ValueError("load_adapter_stream: the adapter stream was empty")
    name = engine.finish_adapter_update(peft_config)
    engine.reset_prefix_cache()
    return {"buckets": n_buckets, "tensors": n_tensors, "bytes": n_bytes,
            "seconds": time.perf_counter() - start, "lora_name": name,
            "lora_id": adapter_id(name)}


def sleep(engine, level: int) -> None:
    """Put vLLM to sleep for training (level 0: do nothing)."""
    if level not in (0, 1, 2):
        raise ValueError(f"sleep_level={level!r} must be 0, 1 or 2")
    if level > 0:
        engine.sleep(level)


def wake_up(engine, tags: Optional[List[str]] = None, level: int = 1) -> None:
    """Wake vLLM up after training (`tags`: "weights" / "kv_cache" for a staged
    wake-up at level 2; None: everything). Level 0: nothing to do."""
    if level not in (0, 1, 2):
        raise ValueError(f"sleep_level={level!r} must be 0, 1 or 2")
    if level > 0:
        engine.wake_up(tags)
