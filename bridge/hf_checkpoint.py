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

import torch
from safetensors import safe_open

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


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
