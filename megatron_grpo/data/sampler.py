"""A deterministic, resumable order of prompts, one generation batch at a time.

Epoch e visits every prompt index once, in the permutation seeded by (seed, e)
(or in file order without shuffling). A batch that reaches the end of an epoch
continues into the next one, so no prompt is skipped at the boundary. The state
is (epoch, position in that epoch's order); restoring it with load_state_dict
continues the exact sequence: no prompt repeated or skipped across a resume.

    sampler = PromptSampler(len(dataset), prompts_per_batch=gen_batch // num_generations, seed=42)
    idx = sampler.next_batch()                # [prompts_per_batch] global prompt indices
    mine = shard(idx, dp_rank, dp_size)       # this data-parallel rank's whole groups
"""
from __future__ import annotations

import math
import random
from typing import Any, Dict, Iterator, List, Sequence


class PromptSampler:
    def __init__(self, num_prompts: int, prompts_per_batch: int, seed: int = 42,
                 shuffle: bool = True) -> None:
        if num_prompts < 1:
            raise ValueError(f"the dataset has {num_prompts} prompts; at least one is needed")
        if prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch {prompts_per_batch} must be >= 1")
        self.num_prompts = num_prompts
        self.prompts_per_batch = prompts_per_batch
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0           # next index into the current epoch's order
        self._order_cache = (-1, [])

    def order(self, epoch: int) -> List[int]:
        """The visiting order of `epoch` (a pure function of seed, epoch, size)."""
        if self._order_cache[0] != epoch:
            idx = list(range(self.num_prompts))
            if self.shuffle:
                # One integer seed per (seed, epoch); random.Random(int) is stable across runs.
                random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
            self._order_cache = (epoch, idx)
        return self._order_cache[1]

    def next_batch(self) -> List[int]:
        """The next prompts_per_batch prompt indices; advances the state."""
        batch: List[int] = []
        while len(batch) < self.prompts_per_batch:
            order = self.order(self.epoch)
            take = min(self.prompts_per_batch - len(batch), self.num_prompts - self.position)
            batch.extend(order[self.position:self.position + take])
            self.position += take
            if self.position == self.num_prompts:
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            yield self.next_batch()

    @property
    def consumed(self) -> int:
        """Prompts drawn so far, over all epochs."""
        return self.epoch * self.num_prompts + self.position

    def batches_for_epochs(self, num_epochs: float) -> int:
        """Generation batches that cover num_epochs passes (the last one may be partial)."""
        return max(1, math.ceil(self.num_prompts * num_epochs / self.prompts_per_batch))

    def state_dict(self) -> Dict[str, Any]:
        return {"num_prompts": self.num_prompts, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self.position,
                "prompts_per_batch": self.prompts_per_batch}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue where `state` left off; the dataset, seed and shuffle must be the same."""
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data order: the checkpoint has {key}={state[key]!r}, this run "
                    f"{getattr(self, key)!r}. Fix: resume with the same --dataset (and #N), --seed "
                    "and --dataset_shuffle, or start a new output_dir")
        if not 0 <= state["position"] < self.num_prompts or state["epoch"] < 0:
            raise ValueError(f"corrupt sampler state: epoch {state['epoch']}, position {state['position']}")
        # prompts_per_batch may change on resume: the order continues all the same.
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def shard(batch: Sequence[int], rank: int, world: int) -> List[int]:
    """The contiguous slice of `batch` for `rank` of `world` (equal sizes required)."""
    if len(batch) % world != 0:
        raise ValueError(f"{len(batch)} prompts do not split evenly over {world} ranks")
    size = len(batch) // world
    return list(batch[rank * size:(rank + 1) * size])
