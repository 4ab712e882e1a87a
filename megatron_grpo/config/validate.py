"""Checks of a GRPOConfig, all before any model is built.

`finalize(config)` runs at construction: it resolves the defaults that depend on
other options (as ms-swift's `__post_init__` does) and reports every inconsistency
visible from the options alone, each naming the option, the value, what is valid
and the fix, all together in one ConfigError (errors.py).
`validate_world(config, world_size)` holds the checks that need the number of ranks.

Checks record into a `Problems` and go on, so one run reports every mistake; a
check whose inputs were already reported as wrong is skipped (`if p.require(...)`)
rather than adding a consequence of the first mistake.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, NamedTuple, Optional

from megatron_grpo.data.loading import parse_dataset_spec
from megatron_grpo.multi_turn import check_scheduler, env_names, scheduler_names
from megatron_grpo.rewards import registry

from .errors import Problems
from .reward_models import has_reward_models, resolve_reward_models
from .groups import (DEFAULT_KL_IN_REWARD, DEFAULT_LR_FULL, DEFAULT_LR_LORA,
                     DEFAULT_NUM_TRAIN_EPOCHS, DEFAULT_SCALE_REWARDS, LORA_TARGET_MODULES,
                     adapter_covers_tower)
from .hf_model import (BF16_CPU_FLAGS, VLLM_CPU_HEAD_SIZES, cpu_has_bf16, head_dim,
                       json_config, model_max_len, num_experts, vllm_is_cpu_build)
from .parallel import ParallelDims, divisors
from .sizes import parse_size

if TYPE_CHECKING:
    from . import GRPOConfig

logger = logging.getLogger("megatron_grpo.config")

DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")
_REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}
# Options the world-size checks read: a problem with one of them already reported
# makes those checks moot.
WORLD_OPTIONS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size", "micro_batch_size", "global_batch_size",
                 "generation_batch_size", "steps_per_generation", "num_generations",
                 "vllm_tensor_parallel_size", "vllm_mode", "use_vllm")


def _positive(p: Problems, name: str, value, minimum=1) -> bool:
    return p.require(value is not None and value >= minimum,
                     f"--{name} {value!r} is not valid: it must be >= {minimum}. "
                     f"Fix: e.g. --{name} {minimum}")


def valid_num_generations(generation_batch_size: int, dp: int = 1) -> List[int]:
    """Group sizes G >= 2 that split the generation batch into whole groups, dp-evenly."""
    return [g for g in range(2, generation_batch_size + 1)
            if generation_batch_size % g == 0 and (generation_batch_size // g) % dp == 0]


def finalize(cfg: "GRPOConfig", problems: Optional[Problems] = None) -> None:
    """Resolve dependent defaults in place and check the options. Every problem goes into
    `problems`; without it they are raised together as one ConfigError."""
    p = Problems() if problems is None else problems
    for check in (_check_model, _check_teacher, _check_ref_model, _check_model_options,
                  _check_moe, _check_data,
                  _check_training, _check_parallel, _check_batches, _check_loss, _check_rewards,
                  _check_multi_turn, _check_rollout, _check_logging, _check_eval):
        with p.section():
            check(cfg, p)
    if problems is None:
        p.raise_if_any()


def _check_model(cfg: "GRPOConfig", p: Problems) -> None:
    model = cfg.model.model
    if not p.require(bool(model), "--model is required: pass a local Hugging Face model folder "
                                  "(config.json, tokenizer, *.safetensors), e.g. --model ./tiny-qwen2"):
        return
    if not p.require(os.path.isdir(model),
                     f"--model {model!r}: folder not found. Fix: pass an existing local model "
                     "folder (megatron-grpo does not download models)"):
        return
    p.require(os.path.isfile(os.path.join(model, "config.json")),
              f"--model {model!r} has no config.json. Fix: pass a Hugging Face model folder "
              "(config.json + tokenizer + *.safetensors), e.g. one written by tools/make_tiny_model.py")


class TeacherServer(NamedTuple):
    url: str
    tags: tuple      # the --teacher_tag_key values it scores; () for the only teacher


def teacher_servers(value: str) -> List[TeacherServer]:
    """--teacher_model_server: one URL, or a JSON list of {"url", "tags"} (ms-swift's
    format; several teachers need disjoint, non-empty tags). ValueError naming the fix."""
    def url_of(url, where):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"--teacher_model_server {where}: url {url!r} must start with "
                             "http:// or https://. Fix: e.g. http://127.0.0.1:8000")
        return url.rstrip("/")

    text = value.strip()
    if not text.startswith("["):
        return [TeacherServer(url_of(text, "is not a URL or a JSON list"), ())]
    try:
        entries = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--teacher_model_server is not valid JSON ({e}). Fix: "
                         '\'[{"url": "http://t1:8000", "tags": ["math.jsonl"]}, ...]\'') from None
    if not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError("--teacher_model_server: the JSON list needs one object "
                         '{"url": ..., "tags": [...]} per teacher')
    servers, owner = [], {}
    for i, entry in enumerate(entries):
        tags = entry.get("tags") or []
        if not isinstance(tags, list):
            raise ValueError(f"--teacher_model_server teacher {i}: tags {tags!r} must be a list")
        servers.append(TeacherServer(url_of(entry.get("url"), f"teacher {i}"),
                                     tuple(str(t) for t in tags)))
        for tag in servers[-1].tags:
            if tag in owner:
                raise ValueError(f"--teacher_model_server: tag {tag!r} belongs to teachers "
                                 f"{owner[tag]} and {i}; each sample needs one teacher")
            owner[tag] = i
    if len(servers) > 1 and not all(s.tags for s in servers):
        raise ValueError("--teacher_model_server: with several teachers each needs its tags "
                         "(the --teacher_tag_key values, e.g. --dataset entries, it scores)")
    return servers


def route_rows(servers, dataset, tag_key: str, rows: Optional[List[int]] = None) -> List[int]:
    """The teacher (index into `servers`, from teacher_servers) of each row of `dataset` (a
    data.PromptDataset), or of its `rows`: the only one, else the one whose tags hold the
    row's `tag_key` column, or for `dataset` without such a column its --dataset entry.
    ValueError for a row no teacher's tags name."""
    rows = range(len(dataset)) if rows is None else rows
    if len(servers) == 1:
        return [0] * len(rows)
    owner = {tag: i for i, s in enumerate(servers) for tag in s.tags}
    column, what = dataset.columns.get(tag_key), f"column {tag_key!r}"
    if column is None and tag_key == "dataset":
        column, what = dataset.sources, "--dataset entry"
    if column is None:
        raise ValueError(f"--teacher_tag_key {tag_key!r}: the dataset has no such column to "
                         f"route its prompts to the {len(servers)} teachers of "
                         "--teacher_model_server. Fix: a column the rows carry, or `dataset` "
                         "(each row's --dataset entry)")
    for row in rows:
        if str(column[row]) not in owner:
            where = f" of {dataset.sources[row]}" if dataset.sources else ""
            raise ValueError(f"--teacher_model_server: a prompt{where} has {what} "
                             f"{str(column[row])!r}, which no teacher's tags hold "
                             f"({sorted(owner)}). Fix: add it to one teacher's tags")
    return [owner[str(column[row])] for row in rows]


def _check_teacher(cfg: "GRPOConfig", p: Problems) -> None:
    """--teacher_model (on-policy distillation): a local dense text model with the policy's
    vocabulary, or --teacher_model_server; and the options whose meaning needs one
    advantage per completion."""
    teacher, server, g = cfg.model.teacher_model, cfg.model.teacher_model_server, cfg.grpo
    if not cfg.model.has_teacher:
        p.require(not cfg.rollout.offload_teacher_model,
                  "--offload_teacher_model true needs --teacher_model. Fix: drop it")
        return
    which = "--teacher_model" if teacher is not None else "--teacher_model_server"
    for name, bad in (("loss_type", g.loss_type in ("real", "fipo")),
                      ("off_policy_sequence_mask_delta", g.off_policy_sequence_mask_delta is not None)):
        p.require(not bad, f"{which} with --{name} {getattr(g, name)}: it needs one "
                           "advantage per completion, and the teacher's advantages are per token. "
                           f"Fix: drop --{name} (loss types grpo, bnpo, dr_grpo, dapo, cispo, sapo)")
    if not cfg.reward.reward_funcs and not has_reward_models(cfg.reward):
        p.require(not g.dynamic_sample, "--dynamic_sample true needs --reward_funcs (it keeps "
                                        f"groups whose rewards differ); with {which} alone "
                                        "every reward is 0. Fix: add --reward_funcs or drop it")
        p.require(g.scale_rewards != "gdpo", "--scale_rewards gdpo needs --reward_funcs (it "
                                             "normalises each one). Fix: add --reward_funcs or "
                                             "another --scale_rewards")
    if server is not None:
        _check_teacher_server(cfg, p)
        return
    _check_scoring_model(cfg, "teacher_model", "teacher", p)


def _check_scoring_model(cfg: "GRPOConfig", option: str, role: str, p: Problems) -> None:
    """A model that scores the policy's samples (--teacher_model, --ref_model): a local
    folder, the policy's vocabulary and tokenizer, its kind (a vision-language policy's
    sees the same images), experts the EP size divides (they are split like the policy's)."""
    path = getattr(cfg.model, option)
    if not p.require(os.path.isfile(os.path.join(path, "config.json")),
                     f"--{option} {path!r}: no config.json there. Fix: pass a local "
                     "Hugging Face model folder (megatron-grpo does not download models)"):
        return
    hf, student = _hf_config(path) or {}, _hf_config(cfg.model.model)
    experts, ep = num_experts(hf), cfg.parallel.expert_model_parallel_size
    p.require(not experts or ep < 1 or experts % ep == 0,
              f"--{option} {path!r} has {experts} experts, which --expert_model_parallel_size "
              f"{ep} does not divide: the {role}'s experts are split like the policy's. Fix: "
              f"an expert parallel size that divides both models' experts")
    if student is None:
        return
    # A vision-language one sees the policy's images: one of the same model type
    # (processor, image tokens, positions); a text model cannot score an image prompt.
    vision = ("vision_config" in student, "vision_config" in hf)
    p.require(vision == (False, False) or (all(vision) and hf.get("model_type") ==
                                           student.get("model_type")),
              f"--{option} {path!r} ({hf.get('model_type')}) for --model "
              f"{cfg.model.model!r} ({student.get('model_type')}): a vision-language "
              f"policy needs a {role} of its own model type, which sees its images, and a "
              f"text policy a text {role}. Fix: a {role} of the policy's model type")
    if p.require(hf.get("vocab_size") == student.get("vocab_size"),
                 f"--{option} {path!r} has vocab_size {hf.get('vocab_size')}, --model "
                 f"{cfg.model.model!r} {student.get('vocab_size')}: the {role} scores the "
                 f"policy's tokens, so both need one vocabulary. Fix: a {role} of the same "
                 "tokenizer family"):
        ours, theirs = _token_ids(cfg.model.model), _token_ids(path)
        # Every token the policy may write must be the same id to it (one with more added
        # tokens, as Qwen3's over Qwen2.5's, is fine).
        differ = [t for t in ours if theirs.get(t) != ours[t]] if ours and theirs else []
        p.require(not differ,
                  f"--{option} {path!r}: its tokenizer gives {len(differ)} of --model's "
                  f"{len(ours or {})} tokens other ids or none (e.g. {differ[:3]}): it would "
                  f"score other tokens than the policy samples. Fix: a {role} of the same "
                  "tokenizer family")


def _check_ref_model(cfg: "GRPOConfig", p: Problems) -> None:
    """--ref_model / --ref_adapters: the KL term's reference, another model than --model's
    start, or one with a PEFT adapter."""
    adapters = cfg.training.ref_adapters
    for option, value in (("ref_model", cfg.model.ref_model),
                          ("ref_adapters", " ".join(adapters) if adapters else None)):
        if value is not None:
            p.require(cfg.grpo.beta != 0,
                      f"--{option} {value!r} with --beta 0: the reference is only the KL "
                      f"term's, which beta 0 turns off. Fix: a --beta above 0, or drop --{option}")
    if cfg.model.ref_model is not None and cfg.grpo.beta != 0:
        _check_scoring_model(cfg, "ref_model", "reference", p)
    if not adapters:
        return
    p.require(len(adapters) == 1, f"--ref_adapters {' '.join(adapters)}: one adapter folder is "
                                  "allowed (as ms-swift)")
    p.require(os.path.isfile(os.path.join(adapters[0], "adapter_config.json")),
              f"--ref_adapters {adapters[0]!r}: no adapter_config.json there; pass a PEFT LoRA "
              "adapter folder (adapter_config.json + adapter_model.safetensors)")
    hf = _hf_config(cfg.model.ref_model or cfg.model.model)
    p.require(hf is None or "vision_config" not in hf,
              f"--ref_adapters with a vision-language model: not supported yet. Fix: drop it")


def _check_teacher_server(cfg: "GRPOConfig", p: Problems) -> None:
    server = cfg.model.teacher_model_server
    if not p.require(cfg.model.teacher_model is None,
                     f"--teacher_model {cfg.model.teacher_model!r} and --teacher_model_server "
                     f"{server!r}: one teacher, local or served. Fix: drop one of them"):
        return
    try:
        teacher_servers(server)
    except ValueError as e:
        p.add(str(e))
    p.require(not cfg.rollout.offload_teacher_model,
              "--offload_teacher_model true needs --teacher_model: a served teacher holds no "
              "memory here. Fix: drop it")
    student = _hf_config(cfg.model.model)
    p.require(student is None or "vision_config" not in student,
              f"--teacher_model_server with the vision-language --model {cfg.model.model!r}: a "
              "served teacher is sent token ids only (/v1/completions), not the images. Fix: "
              "--teacher_model (a local teacher of the policy's model type)")


def _token_ids(model: str) -> Optional[dict]:
    """token -> id of a model folder's tokenizer.json (its BPE/WordPiece vocabulary, added
    tokens included), or None when it has none to read (e.g. a sentencepiece model file)."""
    path = os.path.join(model, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    vocab = (data.get("model") or {}).get("vocab")
    if not isinstance(vocab, dict):
        return None
    return {**vocab, **{t["content"]: t["id"] for t in data.get("added_tokens") or []}}


# A hub dataset id as ms-swift takes it: `org/name`, optionally `:subset`, never a file name.
_HUB_ID = re.compile(r"^(?:hf::|ms::)?[\w.-]+/[\w.-]+(?::[\w.-]+)?$")


def _dataset_problem(spec: str, path: str, option: str = "dataset") -> Optional[str]:
    """Why `path` (of `--dataset spec`, or of `--{option} spec`) cannot be read, or None."""
    problem = _dataset_file_problem(spec, path)
    return problem if option == "dataset" or problem is None else \
        problem.replace("--dataset ", f"--{option} ", 1)


def _dataset_file_problem(spec: str, path: str) -> Optional[str]:
    if os.path.isfile(path):
        if not path.lower().endswith(DATASET_SUFFIXES):
            return (f"--dataset {spec!r}: unsupported file type; allowed: "
                    f"{', '.join(DATASET_SUFFIXES)}. Fix: convert the file to jsonl")
        return None
    if os.path.isdir(path):
        return (f"--dataset {spec!r} is a folder; pass its data files (.jsonl/.json/.parquet), "
                f"e.g. --dataset {os.path.join(path, 'train.jsonl')}")
    if not path.lower().endswith(DATASET_SUFFIXES) and _HUB_ID.match(path):
        return (f"--dataset {spec!r}: no such local file, and megatron-grpo does not download "
                f"datasets (hub ids are not fetched). Fix: download it yourself (e.g. "
                f"`huggingface-cli download --repo-type dataset {path} --local-dir data/`) and "
                "pass a local .jsonl/.json/.parquet file; a `#N` suffix samples N rows "
                "(data/train.jsonl#1000)")
    if not path.lower().endswith(DATASET_SUFFIXES):
        return (f"--dataset {spec!r}: unsupported file type; allowed: "
                f"{', '.join(DATASET_SUFFIXES)}. Fix: pass a local file of one of these types")
    return f"--dataset {spec!r}: file {path!r} not found. Fix: pass an existing local file"


def _check_data(cfg: "GRPOConfig", p: Problems) -> None:
    data = cfg.data
    p.require(bool(data.dataset), "--dataset is required: one or more .jsonl/.json/.parquet files, "
                                   "e.g. --dataset megatron_grpo/data/builtin/countdown.jsonl")
    for spec in data.dataset:
        try:
            path, _ = parse_dataset_spec(spec)  # raises on a bad #N suffix
        except ValueError as e:
            p.add(str(e))
            continue
        problem = _dataset_problem(spec, path)
        if problem:
            p.add(problem)
    if data.system is not None and data.system.lower().endswith(".txt"):
        # ms-swift: --system may name a .txt file that holds the prompt.
        if p.require(os.path.isfile(data.system), f"--system {data.system!r}: .txt file not found. "
                                                  "Fix: pass an existing file or the prompt text itself"):
            with open(data.system, encoding="utf-8") as f:
                data.system = f.read().strip()
    if data.max_length is not None:
        _positive(p, "max_length", data.max_length)
    check_vision_options(cfg.model.model, data.max_pixels, cfg.rollout.vllm_limit_mm_per_prompt, p)
    _positive(p, "dataset_num_proc", data.dataset_num_proc)
    p.require(data.dataloader_num_workers >= 0,
              f"--dataloader_num_workers {data.dataloader_num_workers} must be >= 0")


def _check_training(cfg: "GRPOConfig", p: Problems) -> None:
    t = cfg.training
    micro_ok = _positive(p, "micro_batch_size", t.micro_batch_size)
    if _positive(p, "global_batch_size", t.global_batch_size) and micro_ok:
        p.require(t.global_batch_size % t.micro_batch_size == 0,
                  f"--global_batch_size {t.global_batch_size} is not a multiple of --micro_batch_size "
                  f"{t.micro_batch_size}. Valid micro_batch_size values: "
                  f"{divisors(t.global_batch_size)}")
    if t.train_iters is not None:
        _positive(p, "train_iters", t.train_iters)
    if t.num_train_epochs is None and t.train_iters is None:
        t.num_train_epochs = DEFAULT_NUM_TRAIN_EPOCHS
    elif t.num_train_epochs is not None and t.train_iters is not None:
        logger.warning("--train_iters %d and --num_train_epochs %g: the run trains %d optimizer "
                       "steps (ms-swift's Megatron GRPO would train %g passes over the prompts "
                       "instead). Fix: drop one of them", t.train_iters, t.num_train_epochs,
                       t.train_iters, t.num_train_epochs)
    if t.num_train_epochs is not None:
        p.require(t.num_train_epochs > 0, f"--num_train_epochs {t.num_train_epochs} must be > 0")
    if t.lr is None:     # ms-swift's: LoRA trains few parameters, from B = 0
        t.lr = DEFAULT_LR_FULL if t.tuner_type == "full" else DEFAULT_LR_LORA
    p.require(t.lr > 0, f"--lr {t.lr} must be > 0. Fix: e.g. --lr 1e-6")
    p.require(0 <= t.min_lr <= t.lr, f"--min_lr {t.min_lr} must be in [0, lr={t.lr}]")
    p.require(t.lr_warmup_iters >= 0, f"--lr_warmup_iters {t.lr_warmup_iters} must be >= 0")
    p.require(not (t.lr_warmup_iters > 0 and t.warmup_ratio is not None),
              f"--lr_warmup_iters {t.lr_warmup_iters} and --warmup_ratio {t.warmup_ratio} are "
              "exclusive. Fix: set only one of them")
    if t.warmup_ratio is not None:
        p.require(0 <= t.warmup_ratio < 1, f"--warmup_ratio {t.warmup_ratio} must be in [0, 1)")
    if t.lr_decay_iters is not None:
        _positive(p, "lr_decay_iters", t.lr_decay_iters)
    p.require(t.clip_grad >= 0, f"--clip_grad {t.clip_grad} must be >= 0 (0 disables clipping)")
    p.require(t.weight_decay >= 0, f"--weight_decay {t.weight_decay} must be >= 0")
    _check_lora(t, p, cfg.model.model)
    _check_recompute(t, p)
    _check_freeze(cfg, p)


def _check_freeze_parameters(cfg: "GRPOConfig", p: Problems) -> None:
    """--freeze_parameters* / --trainable_parameters* (model/freeze.py)."""
    t, par = cfg.training, cfg.parallel
    used = [f"--{name}" for name in ("freeze_parameters", "freeze_parameters_regex",
                                     "trainable_parameters", "trainable_parameters_regex")
            if getattr(t, name)] + (["--freeze_parameters_ratio"]
                                    if t.freeze_parameters_ratio else [])
    if not used:
        return
    p.require(t.tuner_type == "full",
              f"{' '.join(used)} with --tuner_type {t.tuner_type}: they choose what trains in "
              "full-parameter training (LoRA trains its adapters only). Fix: --tuner_type full, "
              "or drop them")
    for name in ("freeze_parameters_regex", "trainable_parameters_regex"):
        if getattr(t, name) is not None:
            try:
                re.compile(getattr(t, name))
            except re.error as e:
                p.add(f"--{name} {getattr(t, name)!r} is not a regular expression: {e}")
    ratio = t.freeze_parameters_ratio
    if p.require(0 <= ratio < 1, f"--freeze_parameters_ratio {ratio} is not valid: it must be in "
                                 "[0, 1). Fix: e.g. --freeze_parameters_ratio 0.5") and ratio:
        p.require(par.pipeline_model_parallel_size == 1 and
                  par.expert_model_parallel_size == 1,
                  f"--freeze_parameters_ratio {ratio} with --pipeline_model_parallel_size "
                  f"{par.pipeline_model_parallel_size} / --expert_model_parallel_size "
                  f"{par.expert_model_parallel_size}: the first share of the parameters is "
                  "counted on one rank's whole model (as ms-swift). Fix: --freeze_parameters "
                  "prefixes, or PP and EP 1")


def _check_freeze(cfg: "GRPOConfig", p: Problems) -> None:
    """--freeze_vit / --freeze_aligner / --freeze_llm (model/vision.py apply_freeze): they
    choose what trains in a vision-language model; the defaults fit every model."""
    _check_freeze_parameters(cfg, p)
    t = cfg.training
    flags = (f"--freeze_vit {str(t.freeze_vit).lower()} --freeze_aligner "
             f"{str(t.freeze_aligner).lower()} --freeze_llm {str(t.freeze_llm).lower()}")
    if t.freeze_vit and t.freeze_aligner and not t.freeze_llm:
        return   # the defaults
    p.require(not (t.freeze_vit and t.freeze_aligner and t.freeze_llm),
              f"{flags} leaves nothing to train. Fix: set one of them false")
    if t.tuner_type == "lora":   # adapters on the tower's / merger's linears (model/lora.py)
        p.require(not t.freeze_llm,
                  f"{flags} with --tuner_type lora: adapters on the vision tower / merger "
                  "alone (none on the language model) are not supported. Fix: --freeze_llm "
                  "false, or --tuner_type full")
        p.require("all-linear" in (t.target_modules or []),
                  f"{flags} with --tuner_type lora --target_modules "
                  f"{' '.join(t.target_modules or [])}: the tower's / merger's adapters follow "
                  "ms-swift's all-linear (its linears are not q_proj ... down_proj). Fix: "
                  "--target_modules all-linear, or keep --freeze_vit / --freeze_aligner true")
    p.require(t.tuner_type != "lora_llm" or not t.freeze_llm,
              f"{flags} with --tuner_type lora_llm: the adapters are on the language model. "
              "Fix: --freeze_llm false, or --tuner_type full")
    hf = _hf_config(cfg.model.model)
    if hf is not None:   # a vision-language config.json has a vision_config
        archs = ", ".join(hf.get("architectures") or []) or hf.get("model_type")
        p.require("vision_config" in hf,
                  f"{flags}: these options choose what trains in a vision-language model; "
                  f"--model {cfg.model.model!r} is text-only ({archs}). Fix: keep the defaults "
                  "(true, true, false)")


def _check_lora(t, p: Problems, model: Optional[str] = None) -> None:
    """The LoRA options (tuner_type lora), one line each."""
    if t.tuner_type not in ("lora", "lora_llm"):
        for name, default in (("adapters", []), ("merge_lora", False)):
            p.require(getattr(t, name) in (default, None),
                      f"--{name} {getattr(t, name)!r} needs --tuner_type lora (it is "
                      f"{t.tuner_type!r}). Fix: add --tuner_type lora")
        return
    if t.merge_lora is None:
        t.merge_lora = True      # ms-swift's: its default follows --save_safetensors (true)
    hf = _hf_config(model)
    if t.tuner_type == "lora_llm" and hf is not None:
        p.require("vision_config" in hf,
                  f"--tuner_type lora_llm with --model {model!r}: lora_llm trains a "
                  "vision-language model's tower beside the adapters; this model is "
                  "text-only. Fix: --tuner_type lora")
    covers = _adapter_tower_targets(t)
    if t.tuner_type == "lora" and covers is not None:   # the adapter's tower adapters
        want = (not t.freeze_vit, not t.freeze_aligner)
        p.require(covers == want,
                  f"--adapters {' '.join(t.adapters)} has adapters on the vision tower: "
                  f"{str(covers[0]).lower()}, on the merger: {str(covers[1]).lower()}; "
                  f"--freeze_vit {str(t.freeze_vit).lower()} --freeze_aligner "
                  f"{str(t.freeze_aligner).lower()} ask for {str(want[0]).lower()} / "
                  f"{str(want[1]).lower()}. Fix: --freeze_vit {str(not covers[0]).lower()} "
                  f"--freeze_aligner {str(not covers[1]).lower()}")
    tower = "visual" in _adapter_modules_to_save(t)
    p.require(not tower or t.tuner_type == "lora_llm",
              f"--adapters {' '.join(t.adapters)} holds a trained vision tower (modules_to_save "
              f"visual: a --tuner_type lora_llm adapter) and --tuner_type is {t.tuner_type!r}. "
              "Fix: --tuner_type lora_llm")
    _positive(p, "lora_rank", t.lora_rank)
    p.require(t.lora_alpha > 0, f"--lora_alpha {t.lora_alpha} must be > 0, e.g. --lora_alpha 32")
    p.require(0 <= t.lora_dropout < 1, f"--lora_dropout {t.lora_dropout} must be in [0, 1)")
    targets = list(t.target_modules or [])
    bad = [m for m in targets if m != "all-linear" and m not in LORA_TARGET_MODULES]
    p.require(bool(targets) and not bad,
              f"--target_modules {' '.join(targets) or '(empty)'}: {bad or 'nothing'} not "
              f"supported; allowed: all-linear or any of {' '.join(LORA_TARGET_MODULES)}")
    bad = [m for m in t.modules_to_save if m.rsplit(".", 1)[-1] not in ("embed_tokens", "lm_head")]
    p.require(not bad, f"--modules_to_save {' '.join(t.modules_to_save)}: {bad} not supported; "
                       "allowed: any of embed_tokens lm_head")
    saved = list(t.modules_to_save) or [m for m in _adapter_modules_to_save(t) if m != "visual"]
    if saved and hf is not None:   # model/lora.py trains Megatron's untied embedding / lm_head
        p.require("vision_config" not in hf and not hf.get("tie_word_embeddings", False),
                  f"--modules_to_save {' '.join(saved)} with --model {model!r}: "
                  + ("a vision-language model" if "vision_config" in hf else
                     "lm_head is tied to embed_tokens (tie_word_embeddings)")
                  + " is not supported; allowed: untied text models. Fix: drop --modules_to_save")
    p.require(len(t.adapters) <= 1,
              f"--adapters {' '.join(t.adapters)}: one adapter folder is allowed")
    for folder in t.adapters:
        p.require(os.path.isfile(os.path.join(folder, "adapter_config.json")),
                  f"--adapters {folder!r}: no adapter_config.json there; pass a PEFT LoRA "
                  "adapter folder (adapter_config.json + adapter_model.safetensors)")


def _check_recompute(t, p: Problems) -> None:
    """Megatron's rules (TransformerConfig), as one line each before anything starts."""
    if t.recompute_granularity == "full":
        p.require(t.recompute_method is not None and t.recompute_num_layers is not None,
                  "--recompute_granularity full needs --recompute_method uniform|block and "
                  "--recompute_num_layers N. Fix: e.g. --recompute_method uniform "
                  "--recompute_num_layers 1")
        if t.recompute_num_layers is not None:
            low = 1 if t.recompute_method == "uniform" else 0
            p.require(t.recompute_num_layers >= low,
                      f"--recompute_num_layers {t.recompute_num_layers} must be >= {low} with "
                      f"--recompute_method {t.recompute_method}")
    else:
        p.require(t.recompute_num_layers is None,
                  f"--recompute_num_layers {t.recompute_num_layers} applies to "
                  f"--recompute_granularity full only (it is {t.recompute_granularity}). Fix: "
                  "drop it, or add --recompute_granularity full --recompute_method uniform")
        p.require(t.recompute_method is None,
                  f"--recompute_method {t.recompute_method} applies to --recompute_granularity "
                  f"full only (it is {t.recompute_granularity}). Fix: drop it, or add "
                  "--recompute_granularity full --recompute_num_layers 1")
    if t.recompute_granularity == "selective":
        p.require(bool(t.recompute_modules),
                  "--recompute_granularity selective needs --recompute_modules (core_attn, mlp, "
                  "layernorm; MoE: moe, shared_experts, moe_act). Fix: e.g. --recompute_modules "
                  "core_attn, or "
                  "--recompute_granularity none")


def _check_model_options(cfg: "GRPOConfig", p: Problems) -> None:
    m, t = cfg.model, cfg.training
    if t.torch_dtype is not None:       # ms-swift's: the dtype of training and sampling
        wanted = t.torch_dtype != "float32"
        p.require(t.bf16 in (None, wanted),
                  f"--torch_dtype {t.torch_dtype} and --bf16 {str(t.bf16).lower()} disagree. "
                  "Fix: pass one of them")
        if t.torch_dtype == "float16":
            logger.warning("--torch_dtype float16: training in bfloat16 (float16 training is not "
                           "supported here; bfloat16 has float32's range)")
        t.bf16 = wanted if t.bf16 is None else t.bf16
    if t.bf16 is None:
        t.bf16 = model_trains_in_bf16(m.model)
    if cfg.training.bf16 and vllm_is_cpu_build() and not cpu_has_bf16():
        logger.warning("--bf16 true on a CPU without bfloat16 instructions (none of %s in "
                       "/proc/cpuinfo): bf16 matmuls are emulated here, slower than float32 "
                       "(tools/bench_dtype.py). Fix: --bf16 false", ", ".join(BF16_CPU_FLAGS))
    p.require(m.load_safetensors is not False,
              "--load_safetensors false (start from a Megatron checkpoint, --mcore_model) is not "
              "supported yet: weights are read from --model's safetensors. Fix: drop it, and "
              "use --resume to continue a run")
    if m.attention_backend in ("flash", "fused"):
        p.require(importlib.util.find_spec("transformer_engine") is not None,
                  f"--attention_backend {m.attention_backend} needs Transformer Engine (GPU), "
                  "which is not installed here. Fix: --attention_backend auto (or local, "
                  "unfused): Megatron's local attention")


def model_trains_in_bf16(model: Optional[str]) -> bool:
    """What `--bf16` unset means (the dtype follows the checkpoint, as in ms-swift): True
    for a model whose config.json (its text part for a vision-language one) names bfloat16
    or float16 as its dtype (ms-swift trains a float16 one in fp16, which is not supported
    here; bf16 has fp16's precision and fp32's range), False for float32 or none named."""
    hf = _hf_config(model)
    if hf is None:
        return False
    name = hf.get("torch_dtype") or hf.get("dtype")
    return str(name).replace("torch.", "") in ("bfloat16", "float16")


def _hf_config(model: Optional[str]) -> Optional[dict]:
    """config.json of --model as the option checks read it (hf_model.json_config: a
    vision-language model's text sizes merged in), or None when there is none to read
    (reported elsewhere)."""
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        return None
    try:
        return json_config(model)
    except (OSError, ValueError):
        return None


def _check_router_replay(cfg: "GRPOConfig", p: Problems) -> None:
    """--router_replay_mode R3 where the rollout's routing can reach the trainer."""
    mode = cfg.model.router_replay_mode
    if mode == "disabled":
        return
    p.require(mode != "R2", "--router_replay_mode R2 (replaying the old policy's routing) is not "
                            "supported yet; allowed values: disabled, R3")
    if mode != "R3":
        return
    r = cfg.rollout
    p.require(r.use_vllm and r.vllm_mode in (None, "colocate"),
              f"--router_replay_mode R3 needs the colocated vLLM engine (--use_vllm true "
              f"--vllm_mode colocate); got --use_vllm {r.use_vllm} --vllm_mode {r.vllm_mode}: "
              "a rollout server does not return routed experts yet")
    p.require(r.multi_turn_scheduler is None and not r.use_gym_env,
              "--router_replay_mode R3 with --multi_turn_scheduler is not supported yet "
              "(single-turn rollouts only)")
    p.require(cfg.training.recompute_granularity != "full",
              "--router_replay_mode R3 with --recompute_granularity full is not supported yet "
              "(a recomputed router would replay the wrong micro-batch's experts). Fix: "
              "--recompute_granularity selective or none")
    p.require(not ({"moe", "shared_experts"} & set(cfg.training.recompute_modules)
                   and cfg.training.recompute_granularity == "selective"),
              "--router_replay_mode R3 with --recompute_modules moe (or --moe_layer_recompute "
              "true) is not supported yet: the recomputed router would not replay the rollout's "
              "experts. Fix: drop moe from --recompute_modules")


MOE_RECOMPUTE_MODULES = ("moe", "moe_act", "shared_experts")


def _check_moe_recompute(cfg: "GRPOConfig", p: Problems, experts: int, hf: dict) -> None:
    """--recompute_modules against the model's layers. Megatron-Core skips `mlp` on an MoE
    layer without a word and accepts `moe`/`shared_experts` on a dense one, where they do
    nothing: say so here instead of training without the recompute that was asked for."""
    t = cfg.training
    p.require(not t.moe_layer_recompute or t.recompute_granularity == "selective",
              f"--moe_layer_recompute true is a selective recompute (--recompute_modules moe), "
              f"but --recompute_granularity {t.recompute_granularity} is not. Fix: "
              "--recompute_granularity selective, or --moe_layer_recompute false")
    p.require(not t.moe_layer_recompute or experts > 0,
              f"--moe_layer_recompute true recomputes mixture-of-experts layers; --model "
              f"{cfg.model.model!r} is dense. Fix: drop it")
    if t.recompute_granularity != "selective":
        return
    asked = ", ".join(t.recompute_modules)
    if not experts:
        for name in MOE_RECOMPUTE_MODULES:
            p.require(name not in t.recompute_modules,
                      f"--recompute_modules {name} recomputes part of a mixture-of-experts layer; "
                      f"--model {cfg.model.model!r} is dense. Fix: mlp (its MLP) or core_attn, "
                      f"instead of {name}")
        return
    p.require("mlp" not in t.recompute_modules,
              f"--recompute_modules {asked}: mlp recomputes a dense MLP, and every layer of this "
              "MoE model is an MoE layer (Megatron would skip it). Fix: moe (the whole MoE layer) "
              "instead of mlp")
    p.require("shared_experts" not in t.recompute_modules
              or int(hf.get("shared_expert_intermediate_size") or 0) > 0,
              f"--recompute_modules {asked}: shared_experts needs a model with a shared expert "
              f"(Qwen2-MoE); {hf.get('model_type')} has none. Fix: moe instead")
    grouped = cfg.model.moe_grouped_gemm
    te = importlib.util.find_spec("transformer_engine") is not None
    p.require("moe_act" not in t.recompute_modules or grouped or (grouped is None and te),
              f"--recompute_modules {asked}: moe_act recomputes the experts' activation inside "
              "grouped GEMM experts (--moe_grouped_gemm, Transformer Engine on a GPU), which "
              + ("is off" if te else "is not installed here") +
              ". Fix: moe (the whole MoE layer) instead of moe_act")


def _check_moe(cfg: "GRPOConfig", p: Problems) -> None:
    """MoE options against the model (config.json) and this machine."""
    m, par = cfg.model, cfg.parallel
    _positive(p, "expert_model_parallel_size", par.expert_model_parallel_size)
    if par.expert_tensor_parallel_size is not None:
        _positive(p, "expert_tensor_parallel_size", par.expert_tensor_parallel_size)
    _check_router_replay(cfg, p)
    hf = _hf_config(m.model)
    if hf is None:
        return
    experts = num_experts(hf)
    p.require(experts or m.router_replay_mode == "disabled",
              f"--router_replay_mode {m.router_replay_mode} needs a mixture-of-experts model; "
              f"--model {m.model!r} is dense. Fix: --router_replay_mode disabled")
    _check_moe_recompute(cfg, p, experts, hf)
    if not experts:
        p.require(par.expert_model_parallel_size == 1 and par.expert_tensor_parallel_size in
                  (None, 1, par.tensor_model_parallel_size),
                  f"--expert_model_parallel_size {par.expert_model_parallel_size} / "
                  f"--expert_tensor_parallel_size {par.expert_tensor_parallel_size} need a "
                  f"mixture-of-experts model; --model {m.model!r} is dense. Fix: drop them")
        return
    t = cfg.training
    if t.tuner_type in ("lora", "lora_llm"):      # model/lora.py: the dense MLP's linears only
        mlp = [x for x in t.target_modules or [] if x in ("all-linear", "gate_proj", "up_proj",
                                                           "down_proj")]
        p.require(not mlp,
                  f"--tuner_type {t.tuner_type} --target_modules {' '.join(t.target_modules)} "
                  f"with the mixture-of-experts model {m.model!r}: LoRA adapters on the experts' "
                  f"linears ({' '.join(mlp)}) are not supported. Fix: --target_modules q_proj "
                  "k_proj v_proj o_proj (the attention's linears)")
    ep = par.expert_model_parallel_size
    p.require(ep < 1 or experts % ep == 0,
              f"--expert_model_parallel_size {ep} does not divide the model's {experts} experts "
              f"(config.json num_experts); valid values: "
              f"{[e for e in divisors(experts)]}")
    p.require(par.tensor_model_parallel_size == 1 or par.sequence_parallel,
              f"--tensor_model_parallel_size {par.tensor_model_parallel_size} with an MoE model "
              "needs sequence parallelism (Megatron's MoE layer trains under TP only with it). "
              "Fix: --sequence_parallel true")
    te = importlib.util.find_spec("transformer_engine") is not None
    for flag in ("moe_grouped_gemm", "moe_permute_fusion"):
        p.require(te or not getattr(m, flag),
                  f"--{flag} true needs Transformer Engine on a GPU, which is not installed "
                  f"here. Fix: --{flag} false")
    p.require(m.moe_aux_loss_coeff >= 0,
              f"--moe_aux_loss_coeff {m.moe_aux_loss_coeff} must be >= 0 (0: no load-balancing loss)")
    p.require(m.moe_expert_capacity_factor is None or m.moe_expert_capacity_factor > 0,
              f"--moe_expert_capacity_factor {m.moe_expert_capacity_factor} must be > 0 (or unset: "
              "no token dropping)")
    p.require(not m.moe_pad_expert_input_to_capacity or m.moe_expert_capacity_factor is not None,
              "--moe_pad_expert_input_to_capacity true needs --moe_expert_capacity_factor")


def _check_parallel(cfg: "GRPOConfig", p: Problems) -> None:
    par = cfg.parallel
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        _positive(p, name, getattr(par, name))
    if par.virtual_pipeline_model_parallel_size is not None:
        _positive(p, "virtual_pipeline_model_parallel_size", par.virtual_pipeline_model_parallel_size)
        p.require(par.pipeline_model_parallel_size > 1,
                  f"--virtual_pipeline_model_parallel_size {par.virtual_pipeline_model_parallel_size} "
                  "needs --pipeline_model_parallel_size > 1. Fix: raise PP or drop the option")
    if par.sequence_parallel and par.tensor_model_parallel_size == 1:
        logger.warning("--sequence_parallel true has no effect with tensor_model_parallel_size 1; "
                       "setting it to false")
        par.sequence_parallel = False


def _check_batches(cfg: "GRPOConfig", p: Problems) -> None:
    """generation_batch_size / steps_per_generation / num_generations, as ms-swift's Megatron GRPO."""
    g, t = cfg.grpo, cfg.training
    _positive(p, "max_completion_length", g.max_completion_length)
    _positive(p, "num_iterations", g.num_iterations)
    # With a teacher each token has its own advantage: a prompt needs no group (ms-swift's
    # opd_rl.sh samples 1 completion each).
    least = 1 if cfg.model.has_teacher else 2
    groups_ok = p.require(g.num_generations >= least,
                          f"--num_generations {g.num_generations} is not valid: GRPO needs at least 2 "
                          "completions per prompt to compare (1 with --teacher_model). Fix: e.g. "
                          "--num_generations 8")
    if not (t.global_batch_size >= 1 and t.micro_batch_size >= 1):
        return                                   # reported by _check_training
    gbs, gen, spg = t.global_batch_size, g.generation_batch_size, g.steps_per_generation
    if gen is not None:
        if not (_positive(p, "generation_batch_size", gen) and p.require(
                gen % gbs == 0,
                f"--generation_batch_size {gen} must be a multiple of --global_batch_size {gbs}; "
                f"valid values: {[gbs * k for k in range(1, 5)]}...")):
            return
        if spg is not None:
            # ms-swift accepts both when they agree: one rollout feeds spg optimizer steps.
            if not (_positive(p, "steps_per_generation", spg) and p.require(
                    gen == gbs * spg,
                    f"--generation_batch_size {gen} and --steps_per_generation {spg} disagree: "
                    f"generation_batch_size must be global_batch_size {gbs} x steps_per_generation "
                    f"{spg} = {gbs * spg}. Fix: set only one of them, or make them agree")):
                return
        g.steps_per_generation = gen // gbs
    else:
        if spg is None:
            g.steps_per_generation = 1
        if not _positive(p, "steps_per_generation", g.steps_per_generation):
            return
        g.generation_batch_size = gbs * g.steps_per_generation
    gen = g.generation_batch_size
    if groups_ok:
        p.require(gen % g.num_generations == 0,
                  f"--num_generations {g.num_generations} does not divide the generation batch of "
                  f"{gen} completions (generation_batch_size, or global_batch_size {gbs} x "
                  f"steps_per_generation {g.steps_per_generation}). Valid num_generations values: "
                  f"{valid_num_generations(gen)}. Fix: pick one, or change the batch sizes")


def _check_loss(cfg: "GRPOConfig", p: Problems) -> None:
    g = cfg.grpo
    p.require(g.beta >= 0, f"--beta {g.beta} must be >= 0 (0 disables the KL term)")
    p.require(0 < g.epsilon < 1, f"--epsilon {g.epsilon} must be in (0, 1). Fix: e.g. --epsilon 0.2")
    if g.epsilon_high is None:
        g.epsilon_high = g.epsilon
    p.require(g.epsilon_high >= g.epsilon,
              f"--epsilon_high {g.epsilon_high} is smaller than --epsilon {g.epsilon}; valid values are "
              f">= {g.epsilon} (clip-higher widens the upper range). Fix: e.g. --epsilon_high 0.28")
    if g.delta is not None:
        p.require(g.delta > 1, f"--delta {g.delta} must be > 1 (it caps the ratio of negative-advantage "
                               f"tokens); recommended > 1 + epsilon_high = {1 + g.epsilon_high}")
    p.require(g.loss_type != "fipo" or cfg.parallel.context_parallel_size == 1,
              "--loss_type fipo is not supported with --context_parallel_size > 1 yet (its future "
              "KL runs along whole completions); use another loss_type or --context_parallel_size 1")
    if g.loss_type == "real":
        _check_real(cfg, p)
    p.require(0 < g.top_entropy_quantile <= 1,
              f"--top_entropy_quantile {g.top_entropy_quantile} must be in (0, 1]; 1.0 keeps all tokens")
    p.require(g.max_resample_times >= 0, f"--max_resample_times {g.max_resample_times} must be >= 0")
    p.require(g.rollout_importance_sampling_threshold > 0,
              f"--rollout_importance_sampling_threshold {g.rollout_importance_sampling_threshold} "
              "must be > 0")
    # ms-swift's estimator-dependent defaults.
    if g.kl_in_reward is None:
        g.kl_in_reward = DEFAULT_KL_IN_REWARD[g.advantage_estimator]
    if g.scale_rewards is None:
        g.scale_rewards = DEFAULT_SCALE_REWARDS[g.advantage_estimator]
    if g.scale_rewards == "gdpo" and g.kl_in_reward:
        # As ms-swift: GDPO normalises each reward function, so a KL penalty on their sum
        # would vanish; the KL goes into the loss instead.
        logger.warning("--scale_rewards gdpo does not support --kl_in_reward true; using "
                       "--kl_in_reward false (the KL penalty goes into the loss)")
        g.kl_in_reward = False


def _check_real(cfg: "GRPOConfig", p: Problems) -> None:
    """REAL's loss compares the completions of one group: each micro-batch must hold whole
    groups, and rewards stay unscaled (ms-swift forces scale_rewards none)."""
    g, mbs = cfg.grpo, cfg.training.micro_batch_size
    p.require(g.num_generations < 1 or mbs % g.num_generations == 0,  # < 1: reported elsewhere
              f"--loss_type real needs whole groups in each micro-batch: --micro_batch_size {mbs} is "
              f"not a multiple of --num_generations {g.num_generations}. Fix: --micro_batch_size "
              f"{g.num_generations * max(1, mbs // g.num_generations)}")
    p.require(g.real_tau > 0, f"--real_tau {g.real_tau} must be > 0")
    for name, off in (("top_entropy_quantile", 1.0), ("rollout_importance_sampling_mode", None),
                      ("importance_sampling_level", "token")):
        p.require(getattr(g, name) == off,
                  f"--loss_type real does not use --{name} (got {getattr(g, name)}): its loss is on "
                  f"whole sequences. Fix: drop --{name}")
    if g.scale_rewards not in (None, "none"):
        logger.warning(f"--loss_type real: --scale_rewards {g.scale_rewards} is ignored; using none "
                       "(REAL does not normalise rewards, as ms-swift)")
    g.scale_rewards = "none"


def _check_rewards(cfg: "GRPOConfig", p: Problems) -> None:
    r, g = cfg.reward, cfg.grpo
    for path in r.external_plugins:
        p.require(os.path.isfile(path), f"--external_plugins {path!r}: file not found. "
                                        "Fix: pass an existing .py file")
    registry.load_plugins(r.external_plugins)
    ro = cfg.rollout
    if ro.use_gym_env is None:       # ms-swift: --gym_env implies --use_gym_env
        ro.use_gym_env = ro.gym_env is not None
    if ro.use_gym_env and "gym_reward" not in r.reward_funcs:
        # ms-swift: the environment's total reward is one more reward column.
        r.reward_funcs = [*r.reward_funcs, "gym_reward"]
    names = registry.registered_names()
    p.require(bool(r.reward_funcs) or has_reward_models(r) or cfg.model.has_teacher,
              f"--reward_funcs is required (unless --reward_model scores or --teacher_model "
              f"distils): one or more of {names}. Fix: e.g. --reward_funcs accuracy format")
    for name in r.reward_funcs:
        p.require(name in names, f"--reward_funcs {name!r} is not a registered reward function; "
                                 f"registered: {names}. Fix: pick one, or register it in a plugin "
                                 "file passed with --external_plugins")
    resolve_reward_models(r, bool(cfg.training.bf16), p)
    if r.cosine_max_len is None:
        r.cosine_max_len = g.max_completion_length
    _positive(p, "cosine_max_len", r.cosine_max_len)
    _positive(p, "repetition_n_grams", r.repetition_n_grams)
    p.require(r.repetition_max_penalty <= 0,
              f"--repetition_max_penalty {r.repetition_max_penalty} must be <= 0 (it is a penalty)")
    if r.soft_max_length is None:
        r.soft_max_length = g.max_completion_length
    if "soft_overlong" in r.reward_funcs:
        p.require(r.soft_cache_length is not None,
                  "--reward_funcs soft_overlong needs --soft_cache_length (the punished band below "
                  f"soft_max_length={r.soft_max_length}). Fix: e.g. --soft_cache_length "
                  f"{max(1, r.soft_max_length // 4)}")
    if r.soft_cache_length is not None:
        p.require(0 < r.soft_cache_length < r.soft_max_length,
                  f"--soft_cache_length {r.soft_cache_length} must be in (0, soft_max_length="
                  f"{r.soft_max_length}). Fix: e.g. --soft_cache_length {max(1, r.soft_max_length // 4)}")


def check_vllm_memory(v, p: Problems) -> None:
    """The vLLM memory options (`megatron rlhf`'s rollout group and `megatron rollout`)."""
    p.require(0 < v.vllm_gpu_memory_utilization <= 1,
              f"--vllm_gpu_memory_utilization {v.vllm_gpu_memory_utilization} must be in (0, 1]")
    try:
        parse_size(v.vllm_kv_cache_memory)
    except ValueError as e:
        p.add(str(e))
    p.require(v.vllm_kv_cache_memory is None
              or (v.vllm_engine_kwargs or {}).get("kv_cache_memory_bytes") is None,
              f"--vllm_kv_cache_memory {v.vllm_kv_cache_memory} and kv_cache_memory_bytes in "
              "--vllm_engine_kwargs both size the KV cache. Fix: set only one of them")


def check_vision_options(model: Optional[str], max_pixels: Optional[int],
                         limits: Optional[dict], p: Problems) -> None:
    """--max_pixels (or MAX_PIXELS) and --vllm_limit_mm_per_prompt (vision-language models;
    shared with `megatron rollout`)."""
    if max_pixels is not None or os.environ.get("MAX_PIXELS", "").strip():
        from megatron_grpo.data.vision import resolve_max_pixels

        try:
            resolve_max_pixels(max_pixels, model if model and os.path.isdir(model) else None)
        except ValueError as e:
            p.add(str(e))
    if limits is not None:
        p.require(isinstance(limits, dict) and set(limits) <= {"image"} and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limits.values()),
            f"--vllm_limit_mm_per_prompt {limits!r} is not valid: a JSON object of modality -> "
            "most items per prompt (>= 0); allowed modalities: image (videos are not supported). "
            "Fix: e.g. --vllm_limit_mm_per_prompt '{\"image\": 2}'")


def check_vllm_model(model: Optional[str], max_model_len: Optional[int], p: Problems) -> None:
    """What vLLM refuses about the model, found before any engine starts:
    --vllm_max_model_len beyond the model's context length (vLLM refuses it at engine
    start unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which it honours), and on vLLM-CPU a head
    size its attention kernels lack (found only at the first generate otherwise)."""
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        return
    try:
        size = head_dim(model)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        size = None                   # an unusual config: vLLM decides
    if size is not None and size not in VLLM_CPU_HEAD_SIZES and vllm_is_cpu_build():
        p.add(f"--model {model}: head size {size} is not supported by vLLM-CPU's attention "
              f"(supported: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}). Fix: a model whose "
              "hidden_size / num_attention_heads (or head_dim) is one of these, e.g. "
              "tools/make_tiny_model.py --hidden_size 128 with 4 heads")
    if max_model_len is None or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1":
        return
    try:
        limit = model_max_len(model)
    except (ValueError, OSError):
        return                        # no context length named: vLLM decides
    p.require(max_model_len <= limit,
              f"--vllm_max_model_len {max_model_len} is longer than the model's context length "
              f"{limit} (max_position_embeddings in {model}/config.json). Fix: "
              f"--vllm_max_model_len {limit} or less (or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
              "if the model's positions extend further)")


def _check_multi_turn(cfg: "GRPOConfig", p: Problems) -> None:
    """--multi_turn_scheduler / --max_turns / --gym_env (plugins are loaded by _check_rewards)."""
    v = cfg.rollout
    if v.use_gym_env and v.multi_turn_scheduler is None:
        v.multi_turn_scheduler = "gym_scheduler"
    if v.max_turns is not None:
        _positive(p, "max_turns", v.max_turns)
    if v.multi_turn_scheduler is None:
        return
    names = scheduler_names()
    if not p.require(v.multi_turn_scheduler in names,
              f"--multi_turn_scheduler {v.multi_turn_scheduler!r} is not a registered scheduler; "
              f"registered: {names}. Fix: pick one, or register it in a plugin file passed with "
              "--external_plugins (multi_turns['name'] = cls)"):
        return
    try:
        check_scheduler(v.multi_turn_scheduler)
    except ValueError as e:
        p.add(str(e))
    p.require(v.max_turns is not None or cfg.data.max_length is not None,
              f"--multi_turn_scheduler {v.multi_turn_scheduler} without --max_turns or --max_length "
              "leaves trajectories unbounded. Fix: e.g. --max_turns 4")
    length, turn = cfg.data.max_length, cfg.grpo.max_completion_length
    if v.vllm_max_model_len is not None:
        # Each turn samples from the whole trajectory so far (at most max_length tokens).
        p.require(length is not None and length + turn <= v.vllm_max_model_len,
                  f"--max_length {length} with --max_completion_length {turn} does not fit "
                  f"--vllm_max_model_len {v.vllm_max_model_len}: a multi-turn trajectory of up "
                  "to max_length tokens samples one more turn. Fix: --max_length "
                  f"{max(1, v.vllm_max_model_len - turn)} or less")
    if v.gym_env is not None:
        p.require(v.gym_env in env_names(),
                  f"--gym_env {v.gym_env!r} is not a registered environment; registered: "
                  f"{env_names()}. Fix: pick one, or register it in a plugin file passed with "
                  "--external_plugins (envs['name'] = cls)")


# The ranks vLLM can reserve for LoRA adapters (vllm.config.lora.MaxLoRARanks, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _adapter_config(t) -> Optional[dict]:
    """The first --adapters folder's adapter_config.json (PEFT's); None without --adapters or
    when it is not a readable JSON object (reported by _check_lora)."""
    if not t.adapters:
        return None
    try:
        with open(os.path.join(t.adapters[0], "adapter_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _adapter_rank(t) -> Optional[int]:
    """The LoRA rank the run trains: --adapters' r when one is given, else --lora_rank."""
    if not t.adapters:
        return t.lora_rank
    try:
        return int(_adapter_config(t)["r"])
    except (KeyError, TypeError, ValueError):
        return None                       # reported by _check_lora


def _adapter_modules_to_save(t) -> list:
    """--adapters' modules_to_save, [] when none or unreadable."""
    try:
        return list((_adapter_config(t) or {}).get("modules_to_save") or [])
    except TypeError:
        return []


def _adapter_tower_targets(t) -> Optional[tuple]:
    """(vision tower, merger): whether --adapters' target_modules cover their linears
    (model/lora_peft.py writes a regex for them); None when no adapter is readable."""
    config = _adapter_config(t)
    if config is None:
        return None
    try:
        return adapter_covers_tower(config.get("target_modules"))
    except re.error:
        return None


def _check_vllm_lora(cfg: "GRPOConfig", p: Problems) -> None:
    """--vllm_enable_lora / --vllm_max_lora_rank: what vLLM's LoRA would refuse, now."""
    v, t = cfg.rollout, cfg.training
    if not v.vllm_enable_lora:
        p.require(v.vllm_max_lora_rank is None,
                  f"--vllm_max_lora_rank {v.vllm_max_lora_rank} needs --vllm_enable_lora true. "
                  "Fix: add --vllm_enable_lora true, or drop --vllm_max_lora_rank")
        return
    if not p.require(t.tuner_type != "lora_llm",
                     "--vllm_enable_lora true with --tuner_type lora_llm: vLLM's LoRA adapters "
                     "cannot carry the vision tower trained in full (ms-swift refuses it too). "
                     "Fix: --vllm_enable_lora false (merged sync)"):
        return
    if not p.require(t.tuner_type == "lora",
                     f"--vllm_enable_lora true needs --tuner_type lora (it is {t.tuner_type!r}): "
                     "there is no adapter to send. Fix: add --tuner_type lora, or drop "
                     "--vllm_enable_lora"):
        return
    p.require(v.sleep_level != 2,
              "--sleep_level 2 with --vllm_enable_lora true: level 2 discards vLLM's weights "
              "while it sleeps, and adapter-only sync never sends the base weights again; "
              "allowed: --sleep_level 0 or 1 (or --vllm_enable_lora false)")
    saved = list(t.modules_to_save) or _adapter_modules_to_save(t)
    p.require(not saved,
              f"--modules_to_save {' '.join(saved)} with --vllm_enable_lora true: vLLM's LoRA "
              "adapters cannot carry fully trained embed_tokens / lm_head; allowed: no "
              "modules_to_save. Fix: --vllm_enable_lora false (merged sync), or drop "
              "--modules_to_save")
    rank = _adapter_rank(t)
    if v.vllm_max_lora_rank is None and rank is not None:
        fits = [r for r in VLLM_LORA_RANKS if r >= rank]
        v.vllm_max_lora_rank = fits[0] if fits else VLLM_LORA_RANKS[-1]
    if not p.require(v.vllm_max_lora_rank in VLLM_LORA_RANKS,
                     f"--vllm_max_lora_rank {v.vllm_max_lora_rank} is not a rank vLLM can "
                     f"reserve; allowed: {' '.join(map(str, VLLM_LORA_RANKS))}"):
        return
    if rank is not None:
        p.require(rank <= v.vllm_max_lora_rank,
                  f"--vllm_max_lora_rank {v.vllm_max_lora_rank} is below the adapter's rank "
                  f"{rank} (--lora_rank or --adapters' r); vLLM would refuse the adapter. Fix: "
                  f"--vllm_max_lora_rank {min(r for r in VLLM_LORA_RANKS if r >= rank)}"
                  if rank <= VLLM_LORA_RANKS[-1] else
                  f"--lora_rank {rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]} "
                  "(--vllm_enable_lora true). Fix: a smaller --lora_rank, or --vllm_enable_lora "
                  "false (merged sync)")
    model = cfg.model.model
    if model and os.path.isfile(os.path.join(model, "config.json")):
        try:
            experts = num_experts(json_config(model))
        except (OSError, ValueError, TypeError):
            experts = 0
        p.require(experts == 0,
                  f"--vllm_enable_lora true with the mixture-of-experts model {model}: adapter-"
                  "only sync into vLLM's LoRA layers is not supported for MoE models here; "
                  "allowed: dense models. Fix: --vllm_enable_lora false (merged sync)")


def _check_rollout(cfg: "GRPOConfig", p: Problems) -> None:
    v = cfg.rollout
    if not v.use_vllm:
        p.require(v.vllm_mode is None,
                  f"--vllm_mode {v.vllm_mode} is set but --use_vllm is false; valid vllm_mode values "
                  "need use_vllm true. Fix: add --use_vllm true, or drop --vllm_mode")
        p.add("--use_vllm false is not supported: megatron-grpo samples rollouts with "
              "vLLM only. Fix: --use_vllm true --vllm_mode colocate (or server)")
    if v.vllm_mode is None:
        v.vllm_mode = "colocate"
    _positive(p, "vllm_tensor_parallel_size", v.vllm_tensor_parallel_size)
    _positive(p, "vllm_data_parallel_size", v.vllm_data_parallel_size)
    check_vllm_memory(v, p)
    if v.use_vllm:
        check_vllm_model(cfg.model.model, v.vllm_max_model_len, p)
    if v.vllm_max_model_len is not None:
        p.require(v.vllm_max_model_len > cfg.grpo.max_completion_length,
                  f"--vllm_max_model_len {v.vllm_max_model_len} leaves no room for a prompt with "
                  f"--max_completion_length {cfg.grpo.max_completion_length}. Fix: raise "
                  "vllm_max_model_len or lower max_completion_length")
    if v.vllm_max_num_seqs is not None:
        _positive(p, "vllm_max_num_seqs", v.vllm_max_num_seqs)
    p.require(v.temperature > 0, f"--temperature {v.temperature} must be > 0")
    p.require(0 < v.top_p <= 1, f"--top_p {v.top_p} must be in (0, 1]")
    if p.require(v.top_k >= -1, f"--top_k {v.top_k} is not valid: -1 or 0 disable it, or a positive k"):
        if v.top_k == 0:
            v.top_k = -1      # both mean "no top-k" (vLLM's convention); the engines take -1
    p.require(v.repetition_penalty > 0, f"--repetition_penalty {v.repetition_penalty} must be > 0")
    if v.move_model_batches is not None:
        _positive(p, "move_model_batches", v.move_model_batches)
    if v.vllm_mode == "server":
        if v.sleep_level != 0:
            # ms-swift: the server owns its memory; the trainer has no engine to put to sleep.
            logger.warning("--sleep_level %s has no effect with --vllm_mode server; setting it to 0",
                           v.sleep_level)
            v.sleep_level = 0
        p.require(v.vllm_server_timeout > 0, f"--vllm_server_timeout {v.vllm_server_timeout} must be > 0")
        if v.vllm_server_base_url is None:
            if v.vllm_server_host is None:
                v.vllm_server_host = ["127.0.0.1"]
            hosts, ports = v.vllm_server_host, v.vllm_server_port
            p.require(len(ports) in (1, len(hosts)),
                      f"--vllm_server_port {' '.join(map(str, ports))} must give one port, or "
                      f"one per host ({len(hosts)} hosts: {' '.join(hosts)})")
            for port in ports:
                p.require(0 < port < 65536, f"--vllm_server_port {port} is not a valid port (1-65535)")
        else:
            for url in v.vllm_server_base_url:
                p.require(url.startswith(("http://", "https://")),
                          f"--vllm_server_base_url {url!r} must start with http:// or https://")
    _check_vllm_lora(cfg, p)     # after sleep_level is settled for server mode


def _check_report_to(log, p: Problems) -> None:
    """None (not given): tensorboard, as ms-swift, or metrics.jsonl alone with a warning when
    the package is missing (it is in the dev extra only). `none`: no extra sink. A sink asked
    for by name must be installed."""
    if log.report_to is None:
        if importlib.util.find_spec("tensorboard") is not None:
            log.report_to = ["tensorboard"]
        else:
            logger.warning("--report_to defaults to tensorboard, but the tensorboard package is "
                           "not installed: writing metrics.jsonl only (pip install tensorboard, "
                           "or pass --report_to none to silence this)")
            log.report_to = []
        return
    if "none" in log.report_to:
        p.require(log.report_to == ["none"],
                  f"--report_to {' '.join(log.report_to)}: none cannot be combined with other "
                  "sinks. Fix: --report_to none, or list the sinks without none")
        log.report_to = []
        return
    for sink in log.report_to:
        package = _REPORT_PACKAGES[sink]
        p.require(importlib.util.find_spec(package) is not None,
                  f"--report_to {sink} needs the {package} package, which is not installed. Fix: "
                  f"pip install {package}, or drop {sink} from --report_to (metrics.jsonl is always "
                  "written)")


def _check_logging(cfg: "GRPOConfig", p: Problems) -> None:
    log = cfg.logging
    p.require(log.save_safetensors,
              "--save_safetensors false (Megatron-format weights only) is not supported: the "
              "trained model is always written as HF safetensors in output_dir/final_hf, and "
              "checkpoint-N/ holds the Megatron state to resume from. Fix: drop it")
    if log.output_dir is None and cfg.model.model:
        # Megatron-SWIFT's default save folder.
        name = os.path.basename(os.path.normpath(cfg.model.model))
        log.output_dir = os.path.join("megatron_output", name)
    _positive(p, "save_steps", log.save_steps)
    _positive(p, "logging_steps", log.logging_steps)
    if log.save_total_limit is not None:
        _positive(p, "save_total_limit", log.save_total_limit)
    _check_report_to(log, p)
    if log.resume is not None:
        word = log.resume.strip().lower()
        if word in ("true", "auto", "1", "yes"):
            log.resume = "auto"
        elif word in ("false", "none", "null", "0", "no", ""):
            log.resume = "false"      # a new run even where output_dir holds checkpoints
        elif p.require(os.path.isdir(log.resume),
                       f"--resume {log.resume!r}: checkpoint folder not found. Valid values: a "
                       "checkpoint folder, true/auto (newest checkpoint in output_dir), or false"):
            # checkpoint.py's META_FILE, in a checkpoint-N folder or in an output_dir's ones
            p.require(glob.glob(os.path.join(glob.escape(log.resume), "checkpoint.json")) or
                      glob.glob(os.path.join(glob.escape(log.resume), "checkpoint-*",
                                             "checkpoint.json")),
                      f"--resume {log.resume!r} holds no complete checkpoint: it is neither a "
                      "checkpoint-N folder (with checkpoint.json) nor an output_dir holding "
                      "one. Fix: pass a checkpoint folder or the output_dir of an earlier run")
    if log.finetune and log.resume in (None, "false"):
        log.finetune = False    # ms-swift scripts pass it by default: no checkpoint, no effect
    p.require(not (log.finetune and log.resume == "auto"),
              "--finetune true with --resume auto: --finetune starts a new run from the weights of "
              "one checkpoint, --resume auto continues the run in output_dir. Fix: pass --resume "
              "PATH (a checkpoint-N folder) to fine-tune from it, or drop --finetune to continue")


def _check_eval(cfg: "GRPOConfig", p: Problems) -> None:
    """--eval_steps / --eval_iters with a validation set, as ms-swift's Megatron arguments."""
    e, g, t = cfg.evaluation, cfg.grpo, cfg.training
    ratio_ok = p.require(0 <= e.split_dataset_ratio < 1,
                         f"--split_dataset_ratio {e.split_dataset_ratio} is not valid: it must be in "
                         "[0, 1) (the fraction of --dataset's prompts held out for evaluation). "
                         "Fix: e.g. --split_dataset_ratio 0.05, or --val_dataset FILE")
    for spec in e.val_dataset:
        try:
            path, _ = parse_dataset_spec(spec, option="--val_dataset")
        except ValueError as err:
            p.add(str(err))
            continue
        problem = _dataset_problem(spec, path, option="val_dataset")
        if problem:
            p.add(problem)
    if e.val_dataset and e.split_dataset_ratio > 0:
        # ms-swift: a --val_dataset replaces the split.
        logger.warning("--split_dataset_ratio %s has no effect with --val_dataset (it is the "
                       "validation set); setting it to 0", e.split_dataset_ratio)
        e.split_dataset_ratio = 0.0
    steps_ok = e.eval_steps is None or _positive(p, "eval_steps", e.eval_steps)
    p.require(e.eval_iters >= -1,
              f"--eval_iters {e.eval_iters} is not valid: -1 (the whole validation set), 0 (no "
              "evaluation) or a number of batches >= 1")
    if e.num_generations_eval is None:
        e.num_generations_eval = g.num_generations
    elif _positive(p, "num_generations_eval", e.num_generations_eval) and e.eval_iters > 0:
        p.require(e.num_generations_eval <= t.global_batch_size,
                  f"--num_generations_eval {e.num_generations_eval} is larger than "
                  f"--global_batch_size {t.global_batch_size}: with --eval_iters {e.eval_iters} an "
                  "evaluation batch is global_batch_size completions, so not one whole prompt. "
                  "Fix: lower num_generations_eval, or --eval_iters -1 (the whole validation set)")
    has_val = bool(e.val_dataset) or (ratio_ok and e.split_dataset_ratio > 0)
    if e.eval_steps is not None and steps_ok and not has_val and e.eval_iters != 0:
        # ms-swift runs such a script without evaluating (its examples pass --eval_steps alone).
        logger.warning("--eval_steps %s: no validation set, so nothing is evaluated. To evaluate, "
                       "add --val_dataset FILE or --split_dataset_ratio R (e.g. 0.05)", e.eval_steps)
    if e.eval_steps is None:
        e.eval_steps = cfg.logging.save_steps      # ms-swift's default


@dataclass
class WorldPlan:
    """Sizes derived from the config and the world size."""
    world_size: int
    dims: ParallelDims             # the degrees, checked against the world size
    dp: int                        # data-parallel ranks = world / (TP x PP x CP)
    num_microbatches: int          # per rank per optimizer step
    num_rollout_prompts: int       # prompts per rollout, all ranks
    prompts_per_dp_rank: int       # whole groups each DP rank trains on per rollout
    num_vllm_engines: int          # colocate: world / vllm TP; server: 0


def validate_world(cfg: "GRPOConfig", world_size: int,
                   problems: Optional[Problems] = None) -> Optional[WorldPlan]:
    """Checks that need the world size; returns the derived sizes. Every problem goes into
    `problems` (then the result is None when there is one); without it they are raised
    together as one ConfigError."""
    p = Problems() if problems is None else problems
    before = len(p.messages)
    plan = None
    with p.section():
        plan = _world_plan(cfg, world_size, p)
    if problems is None:
        p.raise_if_any()
    return plan if len(p.messages) == before else None


def _world_plan(cfg: "GRPOConfig", world_size: int, p: Problems) -> WorldPlan:
    par, t, g, v = cfg.parallel, cfg.training, cfg.grpo, cfg.rollout
    try:
        dims = ParallelDims.from_options(par, world_size)
    except ValueError as e:
        p.require(False, str(e))
        return None
    dp = dims.dp
    per_step = t.micro_batch_size * dp
    p.require(t.global_batch_size % per_step == 0,
              f"--global_batch_size {t.global_batch_size} is not divisible by micro_batch_size "
              f"{t.micro_batch_size} x data-parallel size {dp} = {per_step}. Valid global_batch_size "
              f"values: multiples of {per_step} ({[per_step * k for k in range(1, 5)]}...). Fix: "
              "change global_batch_size, micro_batch_size or the parallel sizes")
    num_prompts = g.generation_batch_size // g.num_generations
    p.require(num_prompts % dp == 0,
              f"--num_generations {g.num_generations}: the {num_prompts} prompts of a rollout "
              f"(generation_batch_size {g.generation_batch_size} / num_generations) do not split "
              f"evenly over {dp} data-parallel ranks. Valid num_generations values: "
              f"{valid_num_generations(g.generation_batch_size, dp)}. Fix: pick one, or change "
              "generation_batch_size/steps_per_generation")
    engines = 0
    if v.vllm_mode == "colocate":
        vtp = v.vllm_tensor_parallel_size
        if p.require(world_size % vtp == 0,
                     f"--vllm_tensor_parallel_size {vtp} does not divide the world size "
                     f"{world_size}; valid values: {divisors(world_size)}"):
            engines = world_size // vtp
            p.require(num_prompts % engines == 0,
                      f"the {num_prompts} prompts of a rollout do not split evenly over {engines} "
                      f"colocated vLLM engines (world size {world_size} / vllm_tensor_parallel_size "
                      f"{vtp}). Fix: make generation_batch_size / num_generations a multiple of "
                      f"{engines}, or raise vllm_tensor_parallel_size")
    return WorldPlan(world_size=world_size, dims=dims, dp=dp,
                     num_microbatches=t.global_batch_size // per_step,
                     num_rollout_prompts=num_prompts, prompts_per_dp_rank=num_prompts // dp,
                     num_vllm_engines=engines)
