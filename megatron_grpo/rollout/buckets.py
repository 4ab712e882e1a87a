"""Weight streams read from an HF safetensors folder, in the bridge's stream format.

The bridge exports a Megatron model as an iterator of buckets, each a list of
(HF name, full tensor). This module produces the same from a checkpoint on disk
(tests, benchmarks, and the server's "reload from disk" baseline), reading one
tensor at a time so that only the current bucket is in memory.
"""
from __future__ import annotations

import json
import math
import pathlib
import shutil
import zlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch


def safetensors_index(model_dir) -> Dict[str, pathlib.Path]:
    """HF name -> the .safetensors file holding it (sharded or single-file checkpoints)."""
    from safetensors import safe_open

    model_dir = pathlib.Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / f for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files (not an HF checkpoint folder?)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                out[name] = f
    return out


def _layer_order(name: str) -> Tuple:
    """Sort key: embeddings, then layer by layer, then the rest (as the bridge emits)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return (1, int(parts[i + 1]), name)
    return (0 if "embed" in name else 2, 0, name)


def iter_safetensors_buckets(model_dir, num_buckets: Optional[int] = None,
                             bucket_bytes: Optional[int] = None,
                             dtype: Optional[torch.dtype] = None
                             ) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Yield buckets of (HF name, tensor) from an HF checkpoint folder.

    `num_buckets`: split the tensors into about this many buckets of similar size;
    `bucket_bytes`: close a bucket once it holds at least this many bytes; neither:
    one bucket. `dtype`: cast (None keeps the stored dtype).
    """
    from safetensors import safe_open

    if num_buckets is not None and num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets} must be >= 1")
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    where = safetensors_index(model_dir)
    names = sorted(where, key=_layer_order)
    sizes = {}
    for f in set(where.values()):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                sl = handle.get_slice(name)
                item = torch.empty(0, dtype=_ST_DTYPES.get(sl.get_dtype(), torch.float32))
                sizes[name] = math.prod(sl.get_shape()) * item.element_size()
    if num_buckets is not None:
        bucket_bytes = max(1, math.ceil(sum(sizes.values()) / num_buckets))
    bucket, held = [], 0
    handles = {}
    try:
        for name in names:
            f = where[name]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt")
            tensor = handles[f].get_tensor(name)
            if dtype is not None:
                tensor = tensor.to(dtype)
            bucket.append((name, tensor))
            held += sizes[name]
            if bucket_bytes is not None and held >= bucket_bytes:
                yield bucket
                bucket, held = [], 0
        if bucket:
            yield bucket
    finally:
        handles.clear()


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def perturb_buckets(buckets, scale: float = 0.05, seed: int = 1
                    ) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Deterministically changed weights: x + scale * mean|x| * noise(seed, name).

    The noise of each tensor depends only on (seed, name), so the same call gives the
    same stream whatever the bucketing. Stands in for "the weights after an optimizer
    step" in tests and benchmarks.
    """
    for bucket in buckets:
        out = []
        for name, x in bucket:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(x.shape, generator=gen, dtype=torch.float32)
            # The mean in float64, rounded to float32: the same bits whatever the number of
            # threads (a float32 sum over threads depends on how it is split).
            delta = scale * x.double().abs().mean().float() * noise
            out.append((name, (x.float() + delta).to(x.dtype)))
        yield out


def save_hf_copy(src_dir, dst_dir, buckets) -> pathlib.Path:
    """Write an HF checkpoint at `dst_dir`: the config and tokenizer files of `src_dir`
    with the tensors of `buckets` (e.g. a perturbed stream), for reference models."""
    from safetensors.torch import save_file

    src_dir, dst_dir = pathlib.Path(src_dir), pathlib.Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != \
                "model.safetensors.index.json":
            shutil.copy2(f, dst_dir / f.name)
    tensors = {name: t.contiguous() for bucket in buckets for name, t in bucket}
    save_file(tensors, str(dst_dir / "model.safetensors"), metadata={"format": "pt"})
    return dst_dir
