"""Prompt datasets, chat messages and the resumable prompt sampler.

    ds = load_prompt_dataset(cfg.data.dataset, seed=cfg.training.seed, system=cfg.data.system,
                             columns=cfg.data.columns)
    sampler = PromptSampler(len(ds), prompts_per_batch, seed=cfg.training.seed,
                            shuffle=cfg.data.dataset_shuffle)
    idx = sampler.next_batch(); prompts = [render_prompt(tok, ds.messages[i]) for i in idx]
    columns = ds.reward_columns(idx, num_generations)       # for rewards.score
    train, val = load_datasets(cfg.data, cfg.evaluation, seed=cfg.training.seed)  # val: or None
"""
import os

from .loading import (PROMPT_COLUMNS, PromptDataset, drop_long_prompts, load_prompt_dataset,
                      parse_dataset_spec, prompt_length, read_rows, sample_indices)
from .sampler import PromptSampler, shard
from .split import load_datasets, split_validation
from .template import render_prompt

BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin")


def builtin_dataset(name: str) -> str:
    """Path of a shipped dataset: 'countdown' or 'arithmetic'."""
    path = os.path.join(BUILTIN_DIR, f"{name}.jsonl")
    if not os.path.isfile(path):
        names = sorted(f[:-6] for f in os.listdir(BUILTIN_DIR) if f.endswith(".jsonl"))
        raise ValueError(f"no builtin dataset {name!r}; available: {names}")
    return path


__all__ = ["PROMPT_COLUMNS", "PromptDataset", "PromptSampler", "builtin_dataset", "drop_long_prompts",
           "load_datasets", "load_prompt_dataset", "parse_dataset_spec", "prompt_length",
           "read_rows", "render_prompt",
           "sample_indices", "shard", "split_validation", "BUILTIN_DIR"]
