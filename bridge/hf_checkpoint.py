"""Read a Hugging Face safetensors checkpoint by slices: one file or shards with an index.

    with HFCheckpoint(hf_dir) as ckpt:
        ckpt.shapes()                                  # name -> shape, headers only
        ckpt.read("model.layers.0.mlp.down_proj.weight", axis=1, start=0, stop=64)

Only the requested block is read from disk (safetensors' `get_slice`), so a rank
holding 1/tp of a tensor reads 1/tp of its bytes.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".distcp")


class HFCheckpoint:
    """aliases: (stored prefix, canonical prefix) pairs; a stored name starting with one is
    known by its canonical name (e.g. a VL checkpoint saved with in-memory names)."""

    def __init__(self, path: str | os.PathLike, aliases: tuple[tuple[str, str], ...] = ()):
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(self.path, SINGLE)):
            files = [SINGLE]
        else:
            raise ValueError(f"--model {self.path!r}: no {SINGLE} or {INDEX} found there; pass a "
                             "Hugging Face checkpoint folder saved with safetensors")
        missing = [f for f in files if not os.path.isfile(os.path.join(self.path, f))]
        if missing:
            raise ValueError(f"checkpoint {self.path!r}: {INDEX} lists shard files that do not "
                             f"exist: {missing}")
        self._handles = {f: safe_open(os.path.join(self.path, f), framework="pt") for f in files}
        self._file_of: dict[str, str] = {}
        for f, handle in self._handles.items():
            for name in handle.keys():
                self._file_of[name] = f
        self._stored: dict[str, str] = {}   # canonical name -> stored name
        for name in list(self._file_of):
            for stored, canonical in aliases:
                if name.startswith(stored):
                    new = canonical + name[len(stored):]
                    self._file_of[new] = self._file_of.pop(name)
                    self._stored[new] = name
                    break

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, read from the headers (no data)."""
        return {name: tuple(self._handles[f].get_slice(self._stored.get(name, name)).get_shape())
                for name, f in self._file_of.items()}

    def read(self, name: str, axis: int | None = None, start: int = 0,
             stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or its block [start, stop) along `axis` (0 or 1)."""
        tensor_slice = self._handles[self._file_of[name]].get_slice(self._stored.get(name, name))
        if axis is None:
            return tensor_slice[:]
        index = (slice(start, stop),) if axis == 0 else (slice(None), slice(start, stop))
        return tensor_slice[index]


def copy_hf_side_files(src: str, dst: str, dtype: torch.dtype | None = None) -> None:
    """config.json, tokenizer and generation files: everything but the weights. `dtype`:
    the dtype of the weights written beside them, which config.json then names (its
    `torch_dtype` / `dtype`, a multimodal model's text_config's too), so that loaders
    taking the checkpoint's dtype ("auto") get the weights as stored."""
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(dst, name))
    if dtype is not None and os.path.isfile(os.path.join(dst, "config.json")):
        set_config_dtype(os.path.join(dst, "config.json"), dtype)


def set_config_dtype(config_path: str, dtype: torch.dtype) -> None:
    """Name `dtype` in an HF config.json: every dtype key it has (`torch_dtype`, the
    `dtype` of transformers 5; at the top and in text_config), `torch_dtype` if none."""
    with open(config_path) as f:
        config = json.load(f)
    name = str(dtype).replace("torch.", "")
    parts = [config] + [config[k] for k in ("text_config",) if isinstance(config.get(k), dict)]
    named = [(part, key) for part in parts for key in ("torch_dtype", "dtype") if key in part]
    if named and all(part[key] == name for part, key in named):
        return                        # already right: the file stays byte for byte
    for part, key in named or [(config, "torch_dtype")]:
        part[key] = name
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def write_hf_checkpoint(buckets, out_dir: str, max_shard_size: int, write: bool) -> list[str]:
    """Write a bridge stream as HF safetensors (shards + index when more than one file).

    Every rank must iterate the stream (it is collective); only `write` ranks keep and
    write the tensors, holding at most one shard in memory. Returns the keys in order.
    """
    from safetensors.torch import save_file

    names, shard, shard_bytes, files, weight_map, total = [], {}, 0, [], {}, 0

    def flush():
        nonlocal shard, shard_bytes
        if shard and write:
            name = f"shard-{len(files):05d}.safetensors"
            save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(out_dir, name),
                      metadata={"format": "pt"})
            files.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    for bucket in buckets:
        for name, tensor in bucket:
            names.append(name)
            nbytes = tensor.numel() * tensor.element_size()
            total += nbytes
            if shard and shard_bytes + nbytes > max_shard_size:
                flush()
            if write:  # a copy: the bucket's buffer is reused for the next bucket
                shard[name] = tensor.clone()
            shard_bytes += nbytes
    flush()
    if not write:
        return names
    if len(files) == 1:
        os.replace(os.path.join(out_dir, files[0][0]), os.path.join(out_dir, "model.safetensors"))
        return names
    for i, (tmp_name, keys) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(os.path.join(out_dir, tmp_name), os.path.join(out_dir, final))
        weight_map.update({k: final for k in keys})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names
