"""The reward models of a run, from three places, as one list.

ms-swift's GRPO guides name reward models three ways, all accepted here:
- `--reward_model PATH [PATH ...]`, weighted by `--reward_weights` after the reward
  functions (ms-swift's order);
- `--reward_config FILE.yaml`, a file holding `reward_models:`;
- `reward_models:` in the run's own YAML config (or, on the command line, one JSON
  object per model);
each model entry `{name, path, weight[, batch_size, dtype]}`. They resolve into
`reward.reward_models`, one entry per model with every key filled (`source` says where
it came from), and `reward.reward_weights`, one weight per reward function and then per
reward model; the trainer builds its reward models from the first, the advantage from
the second. Resolving twice changes nothing (a resolved list is kept as it is).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

from ..rewards.reward_model import check_reward_model, reward_model_name, rm_plugins
from .errors import Problems

ENTRY_KEYS = ("name", "path", "weight", "batch_size", "dtype", "plugin")
DTYPES = ("bfloat16", "float16", "float32")


def read_reward_config(path: str, p: Problems) -> List[Dict[str, Any]]:
    """The `reward_models:` list of a reward_config YAML file; problems for anything else."""
    import yaml   # light; only for a run that names a reward_config

    option = f"--reward_config {path!r}"
    if not p.require(os.path.isfile(path), f"{option}: file not found"):
        return []
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not p.require(isinstance(data, dict), f"{option}: expected a mapping with reward_models:"):
        return []
    extra = sorted(set(data) - {"reward_models"})
    p.require(not extra, f"{option}: unknown key(s) {extra}; allowed: reward_models")
    models = data.get("reward_models") or []
    if not p.require(isinstance(models, list) and all(isinstance(m, dict) for m in models),
                     f"{option}: reward_models must be a list of mappings "
                     f"({', '.join(ENTRY_KEYS)})"):
        return []
    return [dict(m, source="--reward_config") for m in models]


def _entry(raw: Dict[str, Any], where: str, weight: float, training_bf16: bool,
           batch_size: int, p: Problems) -> Dict[str, Any]:
    """One reward model's entry with every key filled, its problems recorded."""
    unknown = sorted(set(raw) - set(ENTRY_KEYS) - {"source"})
    p.require(not unknown, f"{where}: unknown key(s) {unknown}; allowed: {', '.join(ENTRY_KEYS)}")
    path = raw.get("path")
    if not p.require(isinstance(path, str) and path, f"{where}: no path (the reward model's "
                                                     "Hugging Face folder)"):
        path = ""
    plugin = raw.get("plugin") or "default"
    p.require(plugin == "default" or plugin in rm_plugins,
              f"{where}: reward model plugin {plugin!r} is not registered; registered: "
              f"{['default', *sorted(rm_plugins)]}. Fix: register it in a file passed with "
              "--external_plugins (rm_plugins['NAME'] = YourPlugin)")
    problem = check_reward_model(path, plugin) if path else None
    p.require(problem is None, f"{where}: {problem}" if where != "--reward_model" else
              (problem or ""))
    dtype = raw.get("dtype") or ("bfloat16" if training_bf16 else "float32")
    p.require(dtype in DTYPES, f"{where}: dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    size = raw.get("batch_size", batch_size)
    p.require(isinstance(size, int) and size >= 1,
              f"{where}: batch_size {size!r} must be an integer >= 1")
    try:
        weight = float(raw.get("weight", weight))
    except (TypeError, ValueError):
        p.add(f"{where}: weight {raw.get('weight')!r} is not a number")
    return {"name": str(raw.get("name") or reward_model_name(path)), "path": path,
            "weight": weight, "batch_size": size, "dtype": dtype, "plugin": plugin,
            "source": raw.get("source", "reward_models")}


def has_reward_models(r) -> bool:
    """Whether the run names any reward model (before or after resolving)."""
    return bool(r.reward_model or r.reward_models or r.reward_config)


def resolve_reward_models(r, training_bf16: bool, p: Problems) -> None:
    """reward.reward_models and reward.reward_weights from --reward_model, --reward_config
    and reward_models (module docstring); every problem recorded in `p`."""
    if r.reward_models and all("source" in m and "weight" in m for m in r.reward_models):
        return                                          # resolved already
    if r.reward_model_batch_size < 1:
        p.add(f"--reward_model_batch_size {r.reward_model_batch_size} must be >= 1")
    n_funcs, n_cli = len(r.reward_funcs), len(r.reward_model)
    if r.reward_weights is not None:
        models = f" and --reward_model {r.reward_model}" if r.reward_model else ""
        p.require(len(r.reward_weights) == n_funcs + n_cli,
                  f"--reward_weights {r.reward_weights} has {len(r.reward_weights)} values but "
                  f"--reward_funcs {r.reward_funcs}{models} name {n_funcs + n_cli}. Fix: give one "
                  "weight per reward function, then one per --reward_model (models of "
                  "reward_models / --reward_config carry their own weight), or drop "
                  "--reward_weights (1 each)")
    weights = list(r.reward_weights or [1.0] * (n_funcs + n_cli))
    weights += [1.0] * (n_funcs + n_cli - len(weights))
    listed = [dict(m, source=m.get("source", "reward_models")) for m in r.reward_models or []]
    if r.reward_config:
        listed += read_reward_config(r.reward_config, p)
    plugins = list(r.reward_model_plugin or [])
    p.require(len(plugins) <= n_cli, f"--reward_model_plugin {plugins} names {len(plugins)} "
                                     f"plugins for {n_cli} --reward_model folders. Fix: one per "
                                     "reward model, by position (default: the classifier)")
    plugins += ["default"] * (n_cli - len(plugins))
    entries = [_entry({"path": path, "plugin": plugins[i], "source": "--reward_model"},
                      "--reward_model", weights[n_funcs + i], training_bf16,
                      r.reward_model_batch_size, p)
               for i, path in enumerate(r.reward_model)]
    entries += [_entry(m, f"{m['source']} entry {i} ({m.get('name') or m.get('path')!r})", 1.0,
                       training_bf16, r.reward_model_batch_size, p)
                for i, m in enumerate(listed)]
    seen = set(r.reward_funcs)
    for e in entries:
        p.require(e["name"] not in seen,
                  f"reward model {e['path']!r}: its name {e['name']!r} is already a reward "
                  "function's or another reward model's; metrics would mix them. Fix: rename "
                  "the folder, or give it another name in reward_models")
        seen.add(e["name"])
    r.reward_models = entries or None
    if entries:
        r.reward_weights = weights[:n_funcs] + [e["weight"] for e in entries]
