"""The validation set: `--val_dataset` files, or prompts held out of `--dataset`.

    train, val = load_datasets(cfg.data, cfg.evaluation, seed=cfg.training.seed)   # val may be None

`--split_dataset_ratio r` holds out max(int(n * r), 1) of the n DISTINCT prompts of
`--dataset` (as ms-swift: at least one), drawn with the seed, or the last ones when
`--dataset_shuffle false` (what HF's train_test_split without shuffling does, which
ms-swift calls). "Distinct" is by the chat messages (and the images of image rows): a
`#N` suffix larger than the file repeats rows, and a repeated prompt must not land on
both sides, so every copy of a held-out prompt leaves the training set and the validation
set keeps one copy.
The split is a pure function of (dataset, ratio, seed, shuffle): every rank, and every
resumed run, computes the same one.
"""
from __future__ import annotations

import hashlib
import json
import random
from typing import List, Optional, Tuple

from .loading import PromptDataset, load_prompt_dataset


def prompt_key(messages: List[dict], images: Optional[list] = None) -> str:
    """Identity of a prompt: its chat messages (system prompt included) and its images
    (image rows often share one question: the images tell them apart)."""
    key = json.dumps(messages, sort_keys=True, ensure_ascii=False)
    return key + "".join("\0" + _image_key(ref) for ref in images or [])


def _image_key(ref) -> str:
    """A path as given; bytes (or a {"bytes"} dict, a PIL image) by their digest."""
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    if hasattr(ref, "tobytes"):                          # a PIL image
        ref = ref.tobytes()
    if isinstance(ref, (bytes, bytearray)):
        return hashlib.sha1(ref).hexdigest()
    return str(ref)


def split_validation(dataset: PromptDataset, ratio: float, seed: int, shuffle: bool = True
                     ) -> Tuple[PromptDataset, Optional[PromptDataset]]:
    """(train, validation) of `dataset`; validation None for ratio 0.

    Validation rows keep their order in the file (first copy of each held-out prompt);
    training rows keep theirs, without any copy of a held-out prompt.
    """
    if not 0 <= ratio < 1:
        raise ValueError(f"--split_dataset_ratio {ratio} must be in [0, 1)")
    if ratio == 0:
        return dataset, None
    keys = [prompt_key(m, dataset.images[i] if dataset.images else None)
            for i, m in enumerate(dataset.messages)]
    first: dict = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    distinct = list(first)                              # in order of first appearance
    n = len(distinct)
    k = max(int(n * ratio), 1)
    if k >= n:
        raise ValueError(f"--split_dataset_ratio {ratio} holds out {k} of the {n} distinct prompts "
                         "of --dataset, leaving none to train on. Fix: a smaller ratio, more "
                         "prompts, or a separate --val_dataset FILE")
    held = set(random.Random(seed).sample(distinct, k) if shuffle else distinct[n - k:])
    val = sorted(first[key] for key in held)
    train = [i for i, key in enumerate(keys) if key not in held]
    return dataset.subset(train), dataset.subset(val)


def load_datasets(data, evaluation, seed: int) -> Tuple[PromptDataset, Optional[PromptDataset]]:
    """The training prompts and the validation prompts (None without a validation set).

    data: DataOptions (dataset, system, columns, dataset_shuffle); evaluation: EvalOptions
    (val_dataset, val_dataset_shuffle, split_dataset_ratio). A --val_dataset takes
    precedence over split_dataset_ratio (ms-swift); it is read like --dataset.
    """
    train = load_prompt_dataset(data.dataset, seed=seed, system=data.system, columns=data.columns)
    if evaluation.val_dataset:
        val = load_prompt_dataset(evaluation.val_dataset, seed=seed, system=data.system,
                                  columns=data.columns, option="--val_dataset")
        if evaluation.val_dataset_shuffle:
            order = list(range(len(val)))
            random.Random(seed).shuffle(order)
            val = val.subset(order)
        return train, val
    return split_validation(train, evaluation.split_dataset_ratio, seed,
                            shuffle=data.dataset_shuffle)
