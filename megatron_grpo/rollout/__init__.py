"""Rollout on vLLM: the colocated engine, server mode and its client, weight sync,
and the check that vLLM holds the trainer's weights.

    engine.py     RolloutEngine: the Protocol both samplers implement (the trainer's view)
    colocate.py   ColocateEngine: vllm.LLM inside each training rank (external_launcher)
    sync.py       WeightSync: the trainer's weights into the engine, memory hand-over
    weights.py    load_weight_stream (bucket by bucket, in place), sleep / wake_up
    verify.py     per-tensor fingerprints on both sides; check_weight_sync
    server.py     `megatron rollout`: vLLM's OpenAI server + weight-update routes
    client.py     RolloutClient: the trainer's side of server mode
    buckets.py    weight streams read from an HF folder (tests, benchmarks)
    worker_ext.py the methods vLLM's workers gain (worker_extension_cls)

Nothing here imports vLLM at module level: option errors surface before any
engine starts, and the package imports where vLLM is not installed.
"""
from .client import RolloutClient, RolloutServerError
from .colocate import ColocateEngine, Completion, SamplingOptions, vllm_tp_groups
from .engine import RolloutEngine
from .verify import StreamFingerprints, WeightSyncError, check_weight_sync, fingerprint
from .weights import load_weight_stream, sleep, wake_up

__all__ = [
    "RolloutEngine", "ColocateEngine", "Completion", "SamplingOptions", "vllm_tp_groups",
    "RolloutClient", "RolloutServerError",
    "StreamFingerprints", "WeightSyncError", "check_weight_sync", "fingerprint",
    "load_weight_stream", "sleep", "wake_up",
]
