"""Prompt datasets from local jsonl / json / parquet files.

Each row becomes chat `messages` (ready for a tokenizer's chat template) plus
its other columns (`solution`, `target`, `nums`, ...), which the reward
functions receive. The prompt comes from, in this order of preference:
  - `messages`: a list of {"role", "content"}; a final assistant turn is dropped
    (GRPO generates it);
  - `prompt`: a string (one user turn) or a message list (TRL's format);
  - `query`: a string (one user turn).
The system prompt is the row's own (a leading system message, else a `system`
column), else `--system` (ms-swift's precedence).

Vision-language rows (ms-swift's format) add an `images` column: a list of paths, bytes,
`{"bytes", "path"}` dicts or base64 data URIs, one per `<image>` tag of the messages (tags
missing are added at the start of the first user turn, as ms-swift does). It is kept
apart (`PromptDataset.images`, not a reward column); data/vision.py encodes it.

`path#N` samples N rows as ms-swift does: N // len full copies of the file in
order, then N % len distinct rows drawn by a permutation seeded with `seed`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .vision import add_image_tags, image_refs

PROMPT_COLUMNS = ("messages", "prompt", "query")
IMAGES_COLUMN = "images"
_CONSUMED = set(PROMPT_COLUMNS) | {"system", IMAGES_COLUMN}   # turned into messages, not passed to rewards
_ROLES = {"system", "user", "assistant", "tool"}
_TEXT_COLUMNS = ("question", "problem", "instruction", "input", "text")  # for the error's hint


def parse_dataset_spec(spec: str, option: str = "--dataset") -> Tuple[str, Optional[int]]:
    """'data.jsonl#100' -> ('data.jsonl', 100); 'data.jsonl' -> ('data.jsonl', None).
    `option`: the flag named in errors (--dataset, --val_dataset)."""
    path, sep, suffix = spec.rpartition("#")
    if not sep:
        return spec, None
    if not suffix.isdigit() or int(suffix) < 1:
        raise ValueError(f"{option} {spec!r}: the #N suffix must be a positive number of rows, "
                         f"got {suffix!r}. Fix: e.g. {path}#100")
    return path, int(suffix)


def read_rows(path: str, option: str = "--dataset") -> List[Dict[str, Any]]:
    """All rows of a .jsonl, .json (list of objects, or object of columns) or .parquet file.
    `option`: the flag named in errors."""
    if not os.path.isfile(path):
        raise ValueError(f"{option} {path!r}: file not found (datasets are not downloaded: a hub "
                         "id is not fetched). Fix: pass a local .jsonl/.json/.parquet file, "
                         "optionally with a #N suffix to sample N rows")
    lower = path.lower()
    if lower.endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{option} {path!r} line {lineno} is not valid JSON: {e}") from None
    elif lower.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{option} {path!r} is not valid JSON: {e}. (A file of one "
                                 "object per line should be named .jsonl)") from None
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            lengths = {len(v) for v in data.values()}
            if len(lengths) != 1:
                raise ValueError(f"{option} {path!r}: its columns have different lengths {sorted(lengths)}")
            keys = list(data)
            rows = [dict(zip(keys, values)) for values in zip(*data.values())]
        elif isinstance(data, list):
            rows = data
        else:
            raise ValueError(f"{option} {path!r}: expected a list of objects or an object of "
                             f"column lists, got {type(data).__name__}")
    elif lower.endswith(".parquet"):
        rows = _read_parquet(path)
    else:
        raise ValueError(f"{option} {path!r}: unsupported file type; allowed: .jsonl, .json, .parquet")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{option} {path!r} row {i} is a {type(row).__name__}, not an object")
    if not rows:
        raise ValueError(f"{option} {path!r} has no rows")
    return rows


def _read_parquet(path: str) -> List[Dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        return pq.read_table(path).to_pylist()
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset {path!r}: reading parquet needs pyarrow (or datasets). "
                         "Fix: pip install pyarrow, or convert the file to jsonl") from None
    return list(datasets.Dataset.from_parquet(path))


def sample_indices(num_rows: int, n: Optional[int], seed: int) -> List[int]:
    """ms-swift's `#N` rule: full copies in order, then a seeded draw of distinct rows."""
    if n is None:
        return list(range(num_rows))
    repeats, remain = divmod(n, num_rows)
    idx = list(range(num_rows)) * repeats
    if remain:
        idx += np.random.RandomState(seed).permutation(num_rows)[:remain].tolist()
    return idx


def _to_messages(row: Dict[str, Any], default_system: Optional[str], where: str) -> List[Dict[str, str]]:
    """Chat messages of one row (see the module docstring for the precedence)."""
    prompt = next((row[c] for c in PROMPT_COLUMNS if row.get(c) is not None), None)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        messages = []
        for m in prompt:
            if not (isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: each message must be {{'role': one of {sorted(_ROLES)}, "
                                 f"'content': str}}, got {m!r}")
            messages.append({"role": m["role"], "content": m["content"]})
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]  # the response GRPO is to generate
        if not any(m["role"] == "user" for m in messages):
            raise ValueError(f"{where}: its messages have no user turn: {prompt!r}")
    else:
        raise ValueError(f"{where}: the prompt must be a string or a list of messages, got {prompt!r}")
    if messages[0]["role"] != "system":
        system = row.get("system") or default_system
        if system:
            messages.insert(0, {"role": "system", "content": str(system)})
    return messages


@dataclass
class PromptDataset:
    """Rows of chat messages plus reward columns, indexable by prompt index."""
    messages: List[List[Dict[str, str]]]
    columns: Dict[str, List[Any]] = field(default_factory=dict)   # name -> one value per row
    sources: List[str] = field(default_factory=list)              # file of each row
    images: Optional[List[List[Any]]] = None     # image references per row (vision rows)

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"messages": self.messages[i], **{k: v[i] for k, v in self.columns.items()}}

    def subset(self, indices: Sequence[int]) -> "PromptDataset":
        """The rows `indices`, in that order."""
        return PromptDataset(messages=[self.messages[i] for i in indices],
                             columns={k: [v[i] for i in indices] for k, v in self.columns.items()},
                             sources=[self.sources[i] for i in indices] if self.sources else [],
                             images=[self.images[i] for i in indices]
                             if self.images is not None else None)

    def reward_columns(self, indices: Sequence[int], num_generations: int = 1) -> Dict[str, List[Any]]:
        """Columns for `score`: each prompt's values repeated for its num_generations completions."""
        return {k: [v[i] for i in indices for _ in range(num_generations)]
                for k, v in self.columns.items()}


def load_prompt_dataset(specs: Sequence[str], seed: int = 42, system: Optional[str] = None,
                        columns: Optional[Dict[str, str]] = None,
                        option: str = "--dataset") -> PromptDataset:
    """Load, rename (`columns`), `#N`-sample and convert every file of `--dataset` (or of
    the flag `option` names, e.g. --val_dataset)."""
    messages: List[List[Dict[str, str]]] = []
    extra: List[Dict[str, Any]] = []
    sources: List[str] = []
    images: List[List[Any]] = []
    for spec in specs:
        path, n = parse_dataset_spec(spec, option)
        rows = read_rows(path, option)
        if columns:
            rows = [{columns.get(k, k): v for k, v in row.items()} for row in rows]
        for i, row in enumerate(rows):
            if not any(row.get(c) is not None for c in PROMPT_COLUMNS):
                found = sorted(set().union(*(r.keys() for r in rows)))
                hint = next((c for c in _TEXT_COLUMNS if c in found), found[0] if found else "question")
                raise ValueError(
                    f"{option} {spec!r}: no prompt column in {path!r} (row {i}); expected one of "
                    f"{list(PROMPT_COLUMNS)}, found columns {found}. Fix: rename the prompt's "
                    f"column, e.g. --columns '{{\"{hint}\": \"query\"}}'")
        for i in sample_indices(len(rows), n, seed):
            row, where = rows[i], f"{option} {spec!r} row {i}"
            refs = image_refs(row.get(IMAGES_COLUMN), where)
            messages.append(add_image_tags(_to_messages(row, system, where), len(refs), where))
            images.append(refs)
            extra.append({k: v for k, v in row.items() if k not in _CONSUMED})
            sources.append(path)
    names = sorted(set().union(*(e.keys() for e in extra))) if extra else []
    # Files with different columns: a column missing from a row is None there.
    cols = {name: [e.get(name) for e in extra] for name in names}
    return PromptDataset(messages=messages, columns=cols, sources=sources,
                         images=images if any(images) else None)


def prompt_length(dataset: PromptDataset, tokenizer: Any, render: Callable,
                  vision: Any = None) -> Callable[[int], int]:
    """Tokens of prompt i as the trainer feeds it: its rendered text's, or an image prompt's
    with every image's tokens expanded (`vision`: a data.vision.VisionProcessor)."""
    def length(i: int) -> int:
        images = dataset.images[i] if dataset.images is not None else None
        if images and vision is not None:
            base = os.path.dirname(dataset.sources[i]) if dataset.sources else None
            return len(vision.encode(dataset.messages[i], images, base_dir=base).prompt_ids)
        text = render(tokenizer, dataset.messages[i])
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return length


def drop_long_prompts(dataset: PromptDataset, prompt_length: Callable[[int], int],
                      max_length: int) -> Tuple[PromptDataset, int]:
    """`--truncation_strategy delete`: the dataset without the prompts longer than
    `max_length` tokens (`prompt_length(i)` counts prompt i's tokens, e.g. `prompt_length`
    above), and how many were dropped. Every prompt too long is an error naming the
    options."""
    lengths = [prompt_length(i) for i in range(len(dataset.messages))]
    keep = [i for i, n in enumerate(lengths) if n <= max_length]
    if not keep:
        raise ValueError(f"--max_length {max_length} with --truncation_strategy delete drops every "
                         f"prompt of --dataset (the shortest has {min(lengths)} tokens). Fix: raise "
                         f"--max_length to at least {min(lengths)}, or --truncation_strategy left")
    return dataset.subset(keep), len(lengths) - len(keep)
