"""Output reward models: Hugging Face sequence classifiers with one label, as reward
functions (`--reward_model PATH [PATH ...]`).

Each completion is scored as ms-swift scores it: the reward model's own tokenizer and
chat template render the prompt's messages with the completion as the assistant's last
turn, and the score is the classification head's output at the last token
(transformers' ...ForSequenceClassification picks the last non-padding token). Each rank
scores the completions it sampled (the reward functions' contract: rollout_step.py),
in batches of `batch_size`, in the training dtype, on the training device.

`check_reward_model` reads the folder's JSON files only (no torch), so that a wrong path,
a causal LM, a classifier with several labels or a tokenizer without a chat template is
refused with the option checks, before anything starts.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, List, Optional, Sequence

from .registry import RewardFunc

SEQUENCE_CLASSIFIER = "ForSequenceClassification"


def check_reward_model(path: str, plugin: str = "default") -> Optional[str]:
    """Why `path` cannot be an output reward model here (one line naming it), or None. A
    plugin's reward model (--reward_model_plugin) may be any model with a tokenizer."""
    where = f"--reward_model {path!r}"
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return (f"{where}: no config.json there. Fix: pass a local Hugging Face folder of a "
                "sequence-classification model (e.g. Qwen2ForSequenceClassification)")
    if plugin != "default":
        return None if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else \
            f"{where} (--reward_model_plugin {plugin}): no tokenizer_config.json there"
    with open(config) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if not any(a.endswith(SEQUENCE_CLASSIFIER) for a in archs):
        return (f"{where} is a {', '.join(archs) or cfg.get('model_type', 'model')} checkpoint, "
                f"not a sequence classifier (architectures ending in {SEQUENCE_CLASSIFIER}): an "
                "output reward model scores a conversation with one number. A generative judge "
                "goes through --reward_model_plugin")
    labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 1))
    if labels != 1:
        return (f"{where} has {labels} labels (id2label); an output reward model has one "
                "(its score)")
    if not _has_chat_template(path):
        return (f"{where}: its tokenizer has no chat template (tokenizer_config.json "
                "chat_template or chat_template.jinja), which renders the conversation it scores")
    return None


def _has_chat_template(path: str) -> bool:
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):
        return True
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return bool(json.load(f).get("chat_template"))


def _training_device(device: Optional[str]) -> str:
    """`device`, else the rank's training device: its GPU where there is one, else the CPU."""
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def reward_model_name(path: str) -> str:
    """The name of a reward model's metrics and completions column: its folder's name."""
    return os.path.basename(os.path.normpath(path))


class RewardModel:
    """One output reward model; called as a reward function (rewards/registry.py):
    `rm(completions, messages=[...], **columns)` -> one float per completion."""

    def __init__(self, path: str, *, batch_size: int = 8, dtype: str = "float32",
                 device: Optional[str] = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path, self.batch_size = path, max(1, int(batch_size))
        self.device = _training_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype)).to(self.device).eval()
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The head reads the last token that is not padding: the model must know the pad id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def texts(self, messages: Sequence[Sequence[dict]]) -> List[str]:
        """Each conversation as the reward model's chat template renders it."""
        return [self.tokenizer.apply_chat_template(list(m), tokenize=False) for m in messages]

    def __call__(self, completions: Sequence[str], messages: Optional[Sequence[Any]] = None,
                 **kwargs) -> List[float]:
        import torch

        if messages is None:
            raise ValueError(f"reward model {self.path!r} needs each completion's `messages`")
        ids = self.tokenizer(self.texts(messages), add_special_tokens=False)["input_ids"]
        # Batches of similar lengths (sorted), so that padding stays small.
        order = sorted(range(len(ids)), key=lambda j: len(ids[j]))
        scores: List[float] = [0.0] * len(ids)
        with torch.no_grad():
            for i in range(0, len(order), self.batch_size):
                rows = order[i:i + self.batch_size]
                batch = self.tokenizer.pad({"input_ids": [ids[j] for j in rows]},
                                           return_tensors="pt")
                logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits
                for j, score in zip(rows, logits[:, 0].float().tolist()):
                    scores[j] = score
        bad = [j for j, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            raise ValueError(f"reward model {self.path!r} scored completion {bad[0]} "
                             f"{scores[bad[0]]} (not finite)")
        return scores


class DefaultRMPlugin:
    """ms-swift's reward-model plugin contract (`--reward_model_plugin NAME`, a class in
    `rm_plugins`): built as `cls(model=..., template=...)` with the reward model folder's
    model (None when the class sets `load_model = False`, e.g. a judge served elsewhere)
    and its tokenizer (which carries the chat template; ms-swift passes its template),
    then called as `plugin(inputs)` with one dict per completion, `messages` (the
    conversation, the completion last) and the dataset's other columns; it returns one
    float per input (a list or a tensor; None: the input is not scored)."""

    load_model = True      # False: the plugin does not use the folder's weights

    def __init__(self, model, template):
        self.model, self.template = model, template

    def __call__(self, inputs: List[dict]) -> List[Optional[float]]:
        raise NotImplementedError(f"{type(self).__name__} must define __call__(inputs)")


# name -> plugin class (ms-swift's `rm_plugins`); a file of --external_plugins adds to it.
rm_plugins: dict = {}


class _PluginRewardModel:
    """A --reward_model_plugin reward model as a reward function: the reward function's
    keyword lists turned into ms-swift's `inputs`, one score per input checked."""

    def __init__(self, path: str, plugin_name: str, dtype: str, device: Optional[str]):
        import torch
        from transformers import (AutoConfig, AutoModelForCausalLM,
                                  AutoModelForSequenceClassification, AutoTokenizer)

        cls = rm_plugins[plugin_name]
        self.path, self.plugin_name = path, plugin_name
        model = None
        if getattr(cls, "load_model", True):
            archs = AutoConfig.from_pretrained(path).architectures or []
            auto = AutoModelForSequenceClassification if any(
                a.endswith(SEQUENCE_CLASSIFIER) for a in archs) else AutoModelForCausalLM
            device = _training_device(device)
            model = auto.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        self.plugin = cls(model=model, template=AutoTokenizer.from_pretrained(path))

    def __call__(self, completions: Sequence[str], messages: Optional[Sequence[Any]] = None,
                 **columns) -> List[Optional[float]]:
        columns.pop("trainer_state", None)
        inputs = [{"messages": list(messages[i]) if messages is not None else [],
                   **{k: v[i] for k, v in columns.items()}} for i in range(len(completions))]
        out = self.plugin(inputs)
        out = out.tolist() if hasattr(out, "tolist") else list(out)
        where = f"--reward_model_plugin {self.plugin_name} ({self.path!r})"
        if len(out) != len(inputs):
            raise ValueError(f"{where} returned {len(out)} scores for {len(inputs)} inputs")
        for i, v in enumerate(out):
            if v is not None and not math.isfinite(float(v)):
                raise ValueError(f"{where} scored input {i} {v} (not finite)")
        return out


def reward_model_funcs(entries: Sequence[dict], device: Optional[str] = None) -> list:
    """The run's reward models (config/reward_models.py's resolved entries: name, path,
    batch_size, dtype, plugin) as reward functions (RewardFunc)."""
    funcs = []
    for e in entries:
        plugin = e.get("plugin", "default")
        fn = RewardModel(e["path"], batch_size=e["batch_size"], dtype=e["dtype"],
                         device=device) if plugin == "default" else \
            _PluginRewardModel(e["path"], plugin, e["dtype"], device)
        funcs.append(RewardFunc(e["name"], fn))
    return funcs
