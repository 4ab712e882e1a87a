"""The option groups of `megatron rlhf --rlhf_type grpo`, one dataclass per stage.

Every field is one command-line flag with ms-swift's name (flat on the command
line: `--tensor_model_parallel_size 2`), so each name is unique across groups.
`help` metadata is the text `--help` prints; `Literal` annotations are the
valid choices, checked when a group is constructed (`check_choices`).

Defaults follow ms-swift's Megatron GRPO arguments (swift/megatron/argument) and
its GRPO arguments where the Megatron ones have none; the few that are this
project's own say so in their help.
"""
from __future__ import annotations

import re
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, List, Literal, Optional

from .swift_flags import UNSUPPORTED_VALUES


def opt(default: Any = None, help: str = "", *, factory: Any = None,
        none_is_value: bool = False) -> Any:
    """A dataclass field carrying its `--help` text. none_is_value: `--name none` is the
    word "none" (for the option's checks to read), not the None of an unset option."""
    metadata = {"help": help, "none_is_value": none_is_value}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def same_as(group: type, name: str, help: str = "") -> Any:
    """Option `name` of `group` for another command (`megatron rollout`, `megatron export`):
    its default written once; its help unless the command words it for itself."""
    f = next(f for f in fields(group) if f.name == name)
    return opt(f.default, help or f.metadata["help"], none_is_value=f.metadata["none_is_value"],
               factory=None if f.default_factory is MISSING else f.default_factory)


def literal_choices(annotation: Any) -> Optional[tuple]:
    """The allowed values of a `Literal[...]` / `Optional[Literal[...]]` / `List[Literal]`."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return typing.get_args(annotation)
    if origin in (typing.Union, list, List):
        for arg in typing.get_args(annotation):
            choices = literal_choices(arg)
            if choices is not None:
                return choices
    return None


def bad_choice(name: str, value: Any, annotation: Any) -> Optional[str]:
    """The message for a value of a Literal-typed option that is not one of its choices."""
    choices = literal_choices(annotation)
    if choices is None or value is None:
        return None
    for v in value if isinstance(value, list) else [value]:
        if v not in choices:
            shown = ", ".join(str(c) for c in choices)
            feature = UNSUPPORTED_VALUES.get((name, str(v)))
            if feature:
                return (f"--{name} {v!r} is an ms-swift value not supported yet: {feature}; "
                        f"allowed values: {shown}")
            return (f"--{name} {v!r} is not a valid choice; allowed values: {shown}. "
                    f"Fix: pass one of them, e.g. --{name} {choices[0]}")
    return None


def check_choices(obj: Any) -> None:
    """Raise ValueError for any Literal-typed field of `obj` holding another value."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        message = bad_choice(f.name, getattr(obj, f.name), hints[f.name])
        if message:
            raise ValueError(message)


# PEFT / ms-swift names of the linears --target_modules may name (dense families), HF order.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj")


def adapter_covers_tower(target_modules) -> tuple[bool, bool]:
    """Whether a PEFT adapter's target_modules (a regex, as model/lora_peft.py writes for a
    vision-language model) cover Qwen2(.5)-VL's vision tower and its merger: it must match
    one linear of each as PEFT names them on the HF model."""
    if not isinstance(target_modules, str) or target_modules == "all-linear":
        return False, False
    return (bool(re.fullmatch(target_modules, "model.visual.blocks.0.attn.qkv")),
            bool(re.fullmatch(target_modules, "model.visual.merger.mlp.0")))


DEFAULT_NUM_TRAIN_EPOCHS = 3.0
# --lr unset: ms-swift's Megatron default, by --tuner_type (full; lora and lora_llm).
DEFAULT_LR_FULL, DEFAULT_LR_LORA = 1e-5, 1e-4
# The defaults of --scale_rewards and --kl_in_reward for each --advantage_estimator, where
# the user leaves them unset: those of ms-swift's `swift rlhf` GRPO arguments (their
# post-init); its Megatron arguments default to group and false for every estimator, a
# difference kept on purpose (swift_defaults.DIFFERENCES). algorithms/advantages.py applies
# the same ones to direct calls.
DEFAULT_SCALE_REWARDS = {"grpo": "group", "rloo": "none", "reinforce_plus_plus": "batch"}
DEFAULT_KL_IN_REWARD = {"grpo": False, "rloo": True, "reinforce_plus_plus": True}


class _Group:
    def __post_init__(self) -> None:
        check_choices(self)


@dataclass
class ModelOptions(_Group):
    """The model to train."""
    model: Optional[str] = opt(None, "Local Hugging Face model folder (config.json, tokenizer, "
                                     "*.safetensors). Required.")
    load_safetensors: Optional[bool] = opt(
        None, "ms-swift 3.x: read the weights from --model's safetensors. They always are here, "
              "so true (or unset) is accepted and false (start from a Megatron checkpoint) is "
              "refused.")
    attention_backend: Literal["flash", "fused", "unfused", "local", "auto"] = opt(
        "auto", "Megatron's attention implementation. With Transformer Engine (GPU): passed to "
                "TransformerConfig.attention_backend (flash, fused, unfused: Transformer "
                "Engine's kernels; auto: it picks). Without it (CPU): local, unfused and auto "
                "all run Megatron's local attention; flash and fused are refused. ms-swift's "
                "default is flash; auto picks flash where it is installed.")
    # MoE (Qwen2-MoE / Qwen3-MoE); the experts' sizes and the router's top-k come from
    # config.json (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob).
    moe_aux_loss_coeff: float = opt(
        0.0, "MoE: weight of the load-balancing loss added to the training loss (Megatron's "
             "aux loss, per micro-batch); > 0 also logs it as `load_balancing_loss`. 0: off.")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss",
                                            "none"] = opt(
        "aux_loss", "MoE: which load-balancing loss --moe_aux_loss_coeff weighs (none: no loss, "
                    "as --moe_aux_loss_coeff 0).")
    moe_z_loss_coeff: Optional[float] = opt(
        None, "MoE: weight of the router z-loss (mean logsumexp(router logits)^2), logged as "
              "`z_loss`. Unset: off.")
    moe_expert_capacity_factor: Optional[float] = opt(
        None, "MoE: an expert takes at most factor x (tokens x top-k / experts) tokens per "
              "micro-batch; the rest are dropped. Unset: no dropping.")
    moe_pad_expert_input_to_capacity: bool = opt(
        False, "MoE: pad every expert's input to its capacity (needs --moe_expert_capacity_factor).")
    moe_token_drop_policy: Literal["probs", "position"] = opt(
        "probs", "MoE: with a capacity, drop the tokens of lowest routing probability (probs) or "
                 "the last ones (position).")
    moe_token_dispatcher_type: Literal["alltoall"] = opt(
        "alltoall", "MoE: how tokens reach their experts across expert-parallel ranks (all-to-all "
                    "runs on gloo and NCCL; Megatron's allgather dispatcher refuses the variable "
                    "sequence lengths of GRPO batches).")
    moe_grouped_gemm: Optional[bool] = opt(
        None, "MoE: all local experts in one grouped GEMM (Transformer Engine, GPU). Unset: on "
              "where Transformer Engine is installed, else off; true without it is refused.")
    moe_permute_fusion: bool = opt(
        False, "MoE: fused token permutation kernels (Transformer Engine, GPU only).")
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = opt(
        "fp32", "MoE: dtype of the router's logits and of the weighted sum of expert outputs.")
    router_replay_mode: Literal["disabled", "R2", "R3"] = opt(
        "disabled", "MoE routing replay (ms-swift's values). R3 (rollout routing replay): vLLM "
                    "returns the experts each MoE layer routed every token to while sampling, "
                    "and the old-log-prob, reference and training forwards route those tokens "
                    "to the same experts (gate weights from the trainer's own router). Colocated "
                    "vLLM, single-turn rollouts, vLLM prefix caching off. R2 (replaying the old "
                    "policy's routing) is not supported yet. disabled: each router picks its own.")
    teacher_model: Optional[str] = opt(
        None, "On-policy distillation (ms-swift's OPD-RL): a local Hugging Face folder of a model "
              "with --model's vocabulary (a vision-language policy: one of its model type, "
              "fed the same images), loaded frozen in the same TP/PP/CP(/EP) layout. "
              "Each sampled token's advantage gets --teacher_kl_coef x (teacher - old log-prob "
              "of that token); logged as teacher_kl (k3: it should fall). --reward_funcs becomes "
              "optional (none: pure distillation). With LoRA, --teacher_model = --model is the "
              "base with the adapters off (no second model).")
    ref_model: Optional[str] = opt(
        None, "The reference policy of the KL term (--beta > 0): a local Hugging Face folder "
              "of a model with --model's vocabulary (a vision-language policy: one of its "
              "model type), loaded frozen in the same TP/PP/CP(/EP) layout. Unset (or "
              "--model): --model's start (under LoRA: the policy with its adapters off).")
    teacher_model_server: Optional[str] = opt(
        None, "On-policy distillation with the teacher behind a vLLM OpenAI server instead of "
              "--teacher_model (`megatron rollout --model TEACHER` or `vllm serve TEACHER`, "
              "sharing --model's tokenizer): a URL, or a JSON list of teachers "
              "'[{\"url\": \"http://t1:8000\", \"tags\": [\"math.jsonl\"]}, ...]', each "
              "sample scored by the one whose tags hold its --teacher_tag_key. The sampled tokens "
              "are scored through /v1/completions' prompt_logprobs, which vLLM computes at "
              "temperature 1. Text models only.")
    teacher_tag_key: str = opt(
        "dataset", "Multi-teacher --teacher_model_server: the dataset column whose value picks "
                   "a sample's teacher; `dataset` (when no such column) is the --dataset entry "
                   "the row came from, as written (without #N).")

    @property
    def has_teacher(self) -> bool:
        """On-policy distillation: --teacher_model or --teacher_model_server."""
        return self.teacher_model is not None or self.teacher_model_server is not None


@dataclass
class DataOptions(_Group):
    """Prompts and how they become chat messages."""
    dataset: List[str] = opt(help="One or more local .jsonl/.json/.parquet files. A `#N` suffix "
                                  "(`data.jsonl#100`) samples N rows with the seed; N larger than "
                                  "the file repeats it (ms-swift's rule). Required.", factory=list)
    system: Optional[str] = opt(None, "Default system prompt, or the path of a .txt file holding it. "
                                      "A row's own system message/column takes priority (ms-swift).")
    columns: Optional[Dict[str, str]] = opt(None, "Rename dataset columns before use, as JSON: "
                                                  "'{\"question\": \"query\", \"answer\": \"solution\"}'.")
    max_length: Optional[int] = opt(None, "Maximum prompt length in tokens (see truncation_strategy); "
                                          "multi-turn: of the whole trajectory (a longer one is "
                                          "cut and marked truncated). None: no limit beyond "
                                          "vllm_max_model_len.")
    truncation_strategy: Literal["left", "delete"] = opt(
        "left", "Prompts longer than max_length: left cuts them from the left (keeping the "
                "question's end), delete drops them from the dataset at start-up (ms-swift's GRPO).")
    dataset_shuffle: bool = opt(True, "Shuffle the prompt order each epoch (seeded by --seed).")
    max_pixels: Optional[int] = opt(
        None, "Vision-language models: the most pixels (height x width) an image keeps; larger "
              "ones are resized down, by the trainer's processor and vLLM's alike. None: the "
              "MAX_PIXELS environment variable (ms-swift's), else the model's "
              "preprocessor_config.json.")
    enable_thinking: Optional[bool] = opt(
        None, "Passed to the chat template as enable_thinking (Qwen3-style hybrid thinking). "
              "None: ms-swift's default, false for templates that read enable_thinking (an "
              "empty think block opens the answer), nothing passed to the others.")
    dataset_num_proc: int = opt(1, "Accepted for ms-swift scripts; no effect here: prompts are "
                                   "read and rendered in the main process.")
    load_from_cache_file: bool = opt(False, "Accepted for ms-swift scripts; no effect here: "
                                            "there is no preprocessing cache.")
    dataloader_num_workers: int = opt(4, "Accepted for ms-swift scripts; no effect here: prompts "
                                         "are sampled by index, without a torch DataLoader.")
    dataloader_pin_memory: bool = opt(True, "Accepted; no effect here (no torch DataLoader).")
    dataloader_persistent_workers: bool = opt(False, "Accepted; no effect here (no torch "
                                                     "DataLoader).")
    dataloader_prefetch_factor: int = opt(2, "Accepted; no effect here (no torch DataLoader).")


@dataclass
class TrainingOptions(_Group):
    """Batches, schedule and optimizer (Megatron's names)."""
    micro_batch_size: int = opt(1, "Completions per forward/backward pass on one rank.")
    global_batch_size: int = opt(16, "Completions per optimizer step over all data-parallel ranks "
                                     "(micro_batch_size x dp x gradient accumulation).")
    num_train_epochs: Optional[float] = opt(
        None, f"Passes over the prompts when --train_iters is not set; None: "
              f"{DEFAULT_NUM_TRAIN_EPOCHS:g} (transformers' default; ms-swift's Megatron arguments "
              "need one of the two). Given with --train_iters, train_iters decides here (in "
              "ms-swift num_train_epochs does), with a warning.")
    train_iters: Optional[int] = opt(None, "Total optimizer steps; overrides num_train_epochs.")
    lr: Optional[float] = opt(None, "Peak learning rate. None: 1e-5 for full-parameter "
                                    "training, 1e-4 for LoRA (tuner_type lora, lora_llm), as "
                                    "ms-swift.")
    min_lr: float = opt(0.0, "Learning rate floor of the decay.")
    lr_warmup_iters: int = opt(0, "Linear warm-up steps. Exclusive with warmup_ratio.")
    warmup_ratio: Optional[float] = opt(None, "Warm-up as a fraction of the total steps "
                                              "(Megatron's lr_warmup_fraction, also accepted).")
    lr_decay_style: Literal["cosine", "linear", "constant"] = opt("cosine", "Learning-rate decay.")
    lr_decay_iters: Optional[int] = opt(None, "Steps of the decay; None: the total steps.")
    weight_decay: float = opt(0.1, "AdamW weight decay.")
    clip_grad: float = opt(1.0, "Global gradient-norm clipping; 0 disables it.")
    adam_beta1: float = opt(0.9, "Adam beta1.")
    adam_beta2: float = opt(0.95, "Adam beta2.")
    adam_eps: float = opt(1e-8, "Adam epsilon.")
    bf16: Optional[bool] = opt(None, "Train in bfloat16 (and sample in it when vLLM is "
                                     "colocated). None: from the model's config.json dtype: true "
                                     "for bfloat16 (as ms-swift) and for float16 (ms-swift trains "
                                     "those in fp16, which is not supported here), false for "
                                     "float32.")
    torch_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = opt(
        None, "ms-swift's dtype of training and sampling: bfloat16 is --bf16 true, float32 "
              "--bf16 false; float16 trains in bfloat16 (float16 training is not supported "
              "here), with a warning. None: --bf16 decides.")
    seed: int = opt(42, "Seed of python, numpy, torch, the data order and vLLM sampling.")
    recompute_granularity: Literal["selective", "full", "none"] = opt(
        "selective", "Megatron's activation recomputation: selective recomputes the "
                     "recompute_modules of every layer in backward, full recomputes whole layers "
                     "(needs recompute_method and recompute_num_layers), none saves every "
                     "activation. Gradients are the same; memory is traded for compute.")
    recompute_method: Optional[Literal["uniform", "block"]] = opt(
        None, "full recompute: uniform checkpoints groups of recompute_num_layers layers; block "
              "recomputes the first recompute_num_layers layers of each pipeline stage.")
    recompute_num_layers: Optional[int] = opt(
        None, "full recompute: layers per group (uniform) or per stage (block).")
    recompute_modules: List[Literal["core_attn", "mlp", "layernorm", "moe", "moe_act",
                                    "shared_experts"]] = opt(
        help="selective recompute: the parts of each layer to recompute (ms-swift's default "
             "core_attn). mlp: a dense model's MLP. MoE models: moe (the whole MoE layer: "
             "router, token dispatch and experts), shared_experts (Qwen2-MoE's shared expert), "
             "moe_act (the experts' activation; needs --moe_grouped_gemm, GPU only).",
        factory=lambda: ["core_attn"])
    moe_layer_recompute: bool = opt(
        False, "MoE: recompute each whole MoE layer (router, token dispatch, experts) in "
               "backward; ms-swift's flag for --recompute_modules moe (Megatron's newer "
               "spelling), added to them. Needs --recompute_granularity selective.")
    padding_free: bool = opt(
        False, "Pack each micro-batch's completions one after the other without padding "
               "(Megatron's packed sequences, THD with cu_seqlens): no compute on pad tokens; "
               "the same loss and gradients as padded micro-batches, under TP, PP and CP. "
               "ms-swift defaults to true; false here until the Transformer Engine (GPU) path "
               "has run on a GPU (on CPU the project's own attention keeps sequences apart).")
    tuner_type: Literal["full", "lora", "lora_llm"] = opt(
        "full", "full: train every parameter; lora: freeze the model and train LoRA adapters "
                "on its linears (tensor-parallel, the reference policy is the base with adapters "
                "off); lora_llm (vision-language models): LoRA on the language model and the "
                "vision tower and merger trained in full (saved with the adapters, synced to "
                "vLLM; the reference keeps the trained tower, as in ms-swift). ms-swift's old "
                "name --train_type is accepted too.")
    freeze_vit: bool = opt(True, "Vision-language models: keep the vision tower (without its "
                                 "merger) frozen; false trains it (full-parameter training; "
                                 "with --tuner_type lora: LoRA adapters on its linears, as "
                                 "ms-swift).")
    freeze_aligner: bool = opt(True, "Vision-language models: keep the merger (aligner: vision "
                                     "features -> language embeddings) frozen (false with "
                                     "--tuner_type lora: adapters on its linears).")
    freeze_llm: bool = opt(False, "Vision-language models: keep the language model frozen "
                                  "(train only what freeze_vit / freeze_aligner leave on).")
    freeze_parameters: List[str] = opt(
        help="--tuner_type full: freeze every parameter whose Megatron name starts with one of "
             "these prefixes (embedding, decoder.layers.3, output_layer, ...: "
             "model/freeze.py; a decoder layer has its index in the whole model on every "
             "pipeline stage).", factory=list)
    freeze_parameters_regex: Optional[str] = opt(
        None, "--tuner_type full: freeze every parameter whose name this regex matches "
              "(re.search).")
    freeze_parameters_ratio: float = opt(
        0.0, "--tuner_type full: freeze the first share (0 <= R < 1) of the parameters' "
             "values, in model order (not with pipeline or expert parallelism).")
    trainable_parameters: List[str] = opt(
        help="--tuner_type full: train again the parameters whose names start with these "
             "prefixes, after the freeze options.", factory=list)
    trainable_parameters_regex: Optional[str] = opt(
        None, "--tuner_type full: train again the parameters whose names this regex matches.")
    lora_rank: int = opt(8, "LoRA rank r (tuner_type lora).")
    lora_alpha: float = opt(32, "LoRA alpha: adapters are scaled by alpha / r (alpha / sqrt(r) "
                                "with use_rslora).")
    lora_dropout: float = opt(0.05, "Dropout on the adapters' input, in [0, 1).")
    target_modules: List[str] = opt(
        help="Linears that get adapters: all-linear, or PEFT names among q_proj k_proj v_proj "
             "o_proj gate_proj up_proj down_proj.", factory=lambda: ["all-linear"])
    use_rslora: bool = opt(False, "Rank-stabilised LoRA: scale alpha / sqrt(r) instead of "
                                  "alpha / r.")
    modules_to_save: List[str] = opt(
        help="Modules trained in full beside the adapters: embed_tokens and/or lm_head "
             "(untied models; not with vllm_enable_lora).", factory=list)
    adapters: List[str] = opt(
        help="A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) to "
             "start from; its r, alpha, target modules and rslora replace the lora_* options.",
        factory=list)
    ref_adapters: List[str] = opt(
        help="A PEFT LoRA adapter folder on the KL term's reference (--beta > 0): the reference "
             "is --ref_model (or --model) with it, as ms-swift's --adapters sft --ref_adapters "
             "sft starts from an SFT adapter and keeps it as the reference. Text models.",
        factory=list)
    merge_lora: Optional[bool] = opt(
        None, "tuner_type lora: final_hf/ holds the merged model (W + alpha/r B A); false: "
              "the PEFT adapter. None: true, as ms-swift (its default follows "
              "--save_safetensors, which is always true here).")
    dry_run: bool = opt(False, "Check everything that can be checked without starting a process "
                               "(options, the model's config.json against the parallel sizes, the "
                               "dataset, batch sizes, the world size from NPROC_PER_NODE x NNODES), "
                               "print the plan (parallel sizes, vLLM engines, prompts and "
                               "completions per rollout and per step, the memory plan) and exit "
                               "(this project's option).")
    check_memory: bool = opt(True, "Refuse to start when the memory plan (printed at the start; "
                                   "every line with --dry_run true) exceeds what this machine has "
                                   "available (MemAvailable, a cgroup limit), naming the options "
                                   "that would make it fit. false: start anyway (this project's "
                                   "option).")


@dataclass
class ParallelOptions(_Group):
    """Megatron parallel degrees; data parallel is the rest of the world size."""
    tensor_model_parallel_size: int = opt(1, "Tensor parallel size (TP).")
    pipeline_model_parallel_size: int = opt(1, "Pipeline parallel size (PP).")
    virtual_pipeline_model_parallel_size: Optional[int] = opt(
        None, "Virtual pipeline stages per PP rank (interleaved schedule); needs PP > 1. "
              "ms-swift's num_virtual_stages_per_pipeline_rank is accepted too.")
    context_parallel_size: int = opt(1, "Context parallel size (CP).")
    sequence_parallel: bool = opt(False, "Megatron sequence parallelism; only with TP > 1 "
                                         "(required when an MoE model trains with TP > 1).")
    expert_model_parallel_size: int = opt(
        1, "MoE: expert parallel size (EP): each rank of an EP group holds num_experts / EP "
           "experts of every layer.")
    expert_tensor_parallel_size: Optional[int] = opt(
        1, "MoE: expert tensor parallel size (ETP): each expert split over ETP ranks. Default 1, "
           "as ms-swift's (whose MoE scripts rely on it); Megatron-LM's default is the TP size.")
    use_distributed_optimizer: bool = opt(True, "Shard optimizer state over data-parallel ranks.")


@dataclass
class GRPOOptions(_Group):
    """The algorithm: generation batch, advantages and the policy loss."""
    rlhf_type: Literal["grpo"] = opt("grpo", "RLHF algorithm; only grpo is implemented.")
    num_generations: int = opt(8, "Completions sampled per prompt (the group size G), at least 2.")
    generation_batch_size: Optional[int] = opt(
        None, "Completions per rollout; a multiple of global_batch_size. Exclusive with "
              "steps_per_generation. Default: global_batch_size x steps_per_generation.")
    steps_per_generation: Optional[int] = opt(
        None, "Optimizer steps per rollout. Exclusive with generation_batch_size. Default 1.")
    max_completion_length: int = opt(512, "Maximum tokens generated per completion.")
    num_iterations: int = opt(1, "Optimisation passes over each rollout (mu in the GRPO paper).")
    beta: float = opt(0.04, "KL coefficient; 0 loads no reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = opt(
        "k3", "KL estimator against the reference model (this project's option; ms-swift uses k3).")
    epsilon: float = opt(0.2, "Lower clip range of the importance ratio: 1 - epsilon.")
    epsilon_high: Optional[float] = opt(None, "Upper clip range: 1 + epsilon_high (DAPO clip-higher). "
                                              "None: equal to epsilon.")
    delta: Optional[float] = opt(None, "Two-sided GRPO: clip the ratio of negative-advantage tokens "
                                       "at delta (> 1 + epsilon_high recommended). None: off.")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "fipo", "real"] = opt(
        "grpo", "Loss aggregation: grpo (per-sequence mean), bnpo (token mean per batch), dr_grpo "
                "(sum / (batch x max_completion_length)), dapo (token mean over the generation "
                "batch, as ms-swift and TRL count it: with steps_per_generation > 1 each step's "
                "share), cispo, "
                "sapo (soft gate, normalised as grpo), fipo (future-KL weighted, normalised as dapo), "
                "real (REAL: a loss on the groups' sequence scores, mean over groups; micro-batches "
                "hold whole groups, scale_rewards none).")
    tau_pos: float = opt(1.0, "sapo: gate temperature for positive advantages (> 0).")
    tau_neg: float = opt(1.05, "sapo: gate temperature for negative advantages (> 0; > tau_pos "
                               "constrains negative updates more).")
    real_tau: float = opt(0.5, "real: temperature of the sequence scores (> 0).")
    fipo_decay_rate: float = opt(32.0, "fipo: half-life in tokens of the future-KL discount "
                                       "(gamma = 2 ** (-1 / fipo_decay_rate)).")
    fipo_clip_range: Optional[float] = opt(0.2, "fipo: clip the influence weight to 1 +- this; "
                                                "None or 0: no clip.")
    fipo_clip_high_only: bool = opt(True, "fipo: clip the influence weight to [1, 1 + fipo_clip_range].")
    fipo_safety_threshold: Optional[float] = opt(4.0, "fipo: tokens with advantage < 0 and ratio above "
                                                      "this get an influence weight in [0.8, 1]. None: off.")
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = opt(
        "token", "Importance ratio per token, per sequence (GSPO) or sequence_token (GSPO-token).")
    scale_rewards: Optional[Literal["group", "batch", "none", "gdpo"]] = opt(
        None, "Advantage scaling: std of the group, of the batch, none, or gdpo (per reward "
              "function). None: group for grpo, none for rloo, batch for reinforce_plus_plus.")
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = opt(
        "grpo", "Advantage baseline: group mean, leave-one-out, or REINFORCE++.")
    kl_in_reward: Optional[bool] = opt(None, "Put the KL penalty into the reward instead of the loss. "
                                             "None: false for grpo, true for rloo/reinforce_plus_plus.")
    top_entropy_quantile: float = opt(1.0, "Train only on the tokens whose entropy is in this top "
                                           "quantile (1.0: all tokens).")
    log_entropy: bool = opt(False, "Log entropy/entropy_mean|entropy_max|entropy_min.")
    dynamic_sample: bool = opt(False, "DAPO dynamic sampling: resample groups whose rewards all agree.")
    max_resample_times: int = opt(3, "Resampling rounds of dynamic_sample.")
    overlong_filter: bool = opt(False, "Mask truncated completions out of the loss (DAPO).")
    rollout_importance_sampling_mode: Optional[Literal["token_truncate", "token_mask",
                                                       "sequence_truncate", "sequence_mask"]] = opt(
        None, "Correct the vLLM/trainer mismatch with importance weights. None: off.")
    rollout_importance_sampling_threshold: float = opt(2.0, "Truncation/mask threshold of the "
                                                            "rollout importance weights.")
    off_policy_sequence_mask_delta: Optional[float] = opt(
        None, "Drop a completion from the loss when its mean log-ratio (rollout, else old, minus "
              "current log-probs) exceeds this and its advantage is negative (DeepSeek-V3.2). "
              "None: off.")
    log_rollout_offpolicy_metrics: bool = opt(False, "Log rollout_correction/* even without "
                                                     "rollout_importance_sampling_mode.")
    teacher_kl_coef: float = opt(1.0, "Weight of the teacher's per-token log-ratio in the "
                                      "advantage (--teacher_model, --teacher_model_server).")


@dataclass
class RewardOptions(_Group):
    """Reward functions (see megatron_grpo.rewards) and their parameters."""
    reward_funcs: List[str] = opt(help="Reward function names: accuracy, format, react_format, cosine, "
                                       "repetition, soft_overlong, math, countdown, or one registered "
                                       "by a plugin.",
                                  factory=list)
    reward_weights: Optional[List[float]] = opt(None, "One weight per reward function, then one "
                                                      "per --reward_model (ms-swift's order); "
                                                      "default 1 each.")
    reward_model: List[str] = opt(
        help="Output reward models: local Hugging Face folders of sequence classifiers with one "
             "label (...ForSequenceClassification). Each completion is scored by the head at "
             "the last token of the conversation as the reward model's own chat template "
             "renders it (the completion as the assistant's turn), in the training dtype, "
             "each rank its own completions. Metrics rewards/<folder name>/mean|std.",
        factory=list)
    reward_model_batch_size: int = opt(8, "Conversations per reward-model forward (ours).")
    reward_model_plugin: List[str] = opt(
        help="A plugin per --reward_model, by position (ms-swift's): default (the classifier's "
             "score) or a class registered in megatron_grpo.rewards.rm_plugins by a file of "
             "--external_plugins, built with the folder's model and tokenizer and called with "
             "one dict per completion (messages and the dataset's columns), e.g. a generative "
             "judge (examples/plugins/llm_judge.py).",
        factory=list)
    reward_config: Optional[str] = opt(None, "A YAML file holding reward_models: (ms-swift's GRPO "
                                             "guides' reward_config.yaml).")
    reward_models: Optional[List[Dict[str, Any]]] = opt(
        None, "Reward models as the guides list them, each {name, path, weight} (optional "
              "batch_size, dtype bfloat16|float16|float32): in the run's YAML config, or on the "
              "command line one JSON object per model. Named models keep their weight; "
              "--reward_weights covers --reward_funcs and --reward_model only.")
    external_plugins: List[str] = opt(help="Python files imported before the reward names are "
                                           "resolved; they call register_reward(\"name\").",
                                      factory=list)
    cosine_min_len_value_wrong: float = opt(-0.5, "cosine: reward of a wrong answer of length 0.")
    cosine_max_len_value_wrong: float = opt(0.0, "cosine: reward of a wrong answer at cosine_max_len.")
    cosine_min_len_value_correct: float = opt(1.0, "cosine: reward of a right answer of length 0.")
    cosine_max_len_value_correct: float = opt(0.5, "cosine: reward of a right answer at cosine_max_len.")
    cosine_max_len: Optional[int] = opt(None, "cosine: the length scale; None: max_completion_length.")
    repetition_n_grams: int = opt(3, "repetition: n-gram size.")
    repetition_max_penalty: float = opt(-1.0, "repetition: penalty when every n-gram repeats (<= 0).")
    soft_max_length: Optional[int] = opt(None, "soft_overlong: L_max; None: max_completion_length.")
    soft_cache_length: Optional[int] = opt(None, "soft_overlong: L_cache, the punished band below "
                                                 "soft_max_length. Required by soft_overlong.")


@dataclass
class RolloutOptions(_Group):
    """Sampling with vLLM, weight sync, and memory hand-over around it."""
    use_vllm: bool = opt(True, "Sample with vLLM (required: megatron-grpo has no other sampler).")
    vllm_mode: Optional[Literal["colocate", "server"]] = opt(
        None, "colocate: an engine inside the training ranks; server: a `megatron rollout` server. "
              "None: colocate (ms-swift requires it set).")
    vllm_tensor_parallel_size: int = opt(1, "vLLM tensor parallel size (colocate: must divide the "
                                            "world size).")
    vllm_data_parallel_size: int = opt(1, "vLLM data parallel size (`megatron rollout`).")
    vllm_gpu_memory_utilization: float = opt(0.9, "Fraction of GPU memory vLLM may take. Not used "
                                                  "to size the KV cache on CPU (see "
                                                  "vllm_kv_cache_memory).")
    vllm_kv_cache_memory: Optional[str] = opt(
        None, "KV cache size per vLLM worker: bytes or a size such as 512MiB, 2GiB. None: on CPU "
              "computed from the run (completions in flight x max model length x the model's KV "
              "bytes per token, x1.25, >= 64MiB); on GPU from vllm_gpu_memory_utilization. "
              "kv_cache_memory_bytes in vllm_engine_kwargs or VLLM_CPU_KVCACHE_SPACE win.")
    vllm_max_model_len: Optional[int] = opt(None, "vLLM context length; None: the model's.")
    vllm_enforce_eager: bool = opt(False, "Disable CUDA graphs in vLLM.")
    vllm_enable_prefix_caching: bool = opt(True, "vLLM automatic prefix caching.")
    vllm_max_num_seqs: Optional[int] = opt(
        None, "vLLM max concurrent sequences. None: colocate: the completions one engine "
              "samples per rollout (vllm_tensor_parallel_size x generation_batch_size / world "
              "size), as ms-swift; server: the server's.")
    vllm_engine_kwargs: Optional[Dict[str, Any]] = opt(None, "Extra vLLM engine arguments as JSON.")
    vllm_limit_mm_per_prompt: Optional[Dict[str, int]] = opt(
        None, "Vision-language models: the most images per prompt vLLM accepts, as JSON, e.g. "
              "'{\"image\": 2}' (videos are not supported). None: vLLM's default.")
    vllm_server_host: Optional[List[str]] = opt(None, "Host(s) of the rollout server(s); several "
                                                      "sample as one (each call's prompts spread "
                                                      "over them, every weight sync sent to "
                                                      "each). None in server mode: 127.0.0.1.")
    vllm_server_port: List[int] = opt(help="Port(s) of the rollout server(s), one per host or one "
                                           "for all.", factory=lambda: [8000])
    vllm_server_base_url: Optional[List[str]] = opt(None, "Base URL(s) of the server(s), e.g. "
                                                          "http://127.0.0.1:8000; overrides host/port.")
    vllm_server_timeout: float = opt(240.0, "Seconds to wait for the server to come up.")
    temperature: float = opt(0.9, "Sampling temperature (also divides the training logits).")
    top_p: float = opt(1.0, "Nucleus sampling; 1.0 keeps every token (ms-swift's default).")
    top_k: int = opt(-1, "Top-k sampling; -1 (or 0) keeps every token (ms-swift's default).")
    repetition_penalty: float = opt(1.0, "vLLM repetition penalty.")
    move_model_batches: Optional[int] = opt(None, "Split each weight sync into this many buckets.")
    check_weight_sync: bool = opt(False, "After each sync, compare per-tensor fingerprints in vLLM "
                                         "with the trainer's export (this project's option); with "
                                         "vllm_enable_lora, those of the adapter.")
    vllm_enable_lora: bool = opt(
        False, "tuner_type lora: vLLM keeps the base weights it loaded at start and each sync "
               "sends only the LoRA adapter (PEFT tensors), which vLLM applies itself; false: "
               "each sync sends the merged weights W + alpha/r B A.")
    vllm_max_lora_rank: Optional[int] = opt(
        None, "With vllm_enable_lora: the largest adapter rank vLLM reserves room for (one of "
              "vLLM's 1 8 16 32 64 128 256 320 512, >= the adapter's rank). None: the smallest "
              "of those >= the adapter's rank (this project's option in `megatron rlhf`; "
              "ms-swift's in `swift rollout`).")
    sleep_level: Literal[0, 1, 2] = opt(0, "vLLM sleep while training: 0 none, 1 free KV cache and "
                                           "offload weights, 2 free both. Forced to 0 in server mode.")
    offload_model: bool = opt(False, "Move Megatron's parameters to CPU during generation.")
    offload_optimizer: bool = opt(False, "Move the optimizer state to CPU during generation.")
    offload_bridge: bool = opt(False, "Stage the exported HF weights in CPU memory during a sync.")
    offload_teacher_model: bool = opt(False, "With --teacher_model: keep the teacher's parameters "
                                             "in CPU memory except while it scores a rollout.")
    multi_turn_scheduler: Optional[str] = opt(
        None, "Multi-turn rollouts: the scheduler that continues each trajectory after a model "
              "turn (built in: calculator, gym_scheduler; more with --external_plugins, "
              "multi_turns['name'] = cls as in ms-swift). None: one completion per sample.")
    loss_scale: Literal["default", "last_round"] = opt(
        "default", "Multi-turn: which model tokens train. default: all of them (the trajectory "
                   "is token-exact, as ms-swift's with a scheduler that returns "
                   "response_token_ids, whose mask ms-swift keeps whatever --loss_scale says); "
                   "last_round: those of the last model message only (ms-swift's mask for "
                   "schedulers that return text).")
    vllm_server_pass_dataset: bool = opt(
        False, "Accepted for ms-swift scripts; no effect here: the multi-turn scheduler runs in "
               "the trainer (server mode too) and always sees each row's dataset columns.")
    completion_length_limit_scope: Literal["per_round", "total"] = opt(
        "per_round", "Multi-turn: --max_completion_length caps each model turn (per_round), or "
                     "everything after the prompt, the scheduler's spans included (total: the "
                     "trajectory is cut there and marked truncated; colocated and server mode).")
    max_turns: Optional[int] = opt(None, "Multi-turn: model turns per trajectory at most. "
                                         "max_completion_length caps each turn, max_length the "
                                         "whole trajectory.")
    use_gym_env: Optional[bool] = opt(
        None, "Gym environments: the scheduler's rollout_infos['total_reward'] becomes one more "
              "reward column, gym_reward (add its weight to --reward_weights); with no "
              "--multi_turn_scheduler, gym_scheduler. None: true when --gym_env is given.")
    gym_env: Optional[str] = opt(None, "The environment of gym_scheduler (built in: guess_number; "
                                       "more with --external_plugins, envs['name'] = cls); a "
                                       "dataset row's env_config['name'] overrides it.")


@dataclass
class EvalOptions(_Group):
    """Evaluation on held-out prompts (train/evaluate.py), as Megatron-SWIFT's GRPO."""
    eval_steps: Optional[int] = opt(
        None, "Evaluate every N optimizer steps, and after the last one, when there is a "
              "validation set (--val_dataset or --split_dataset_ratio): the current weights "
              "sample num_generations_eval completions per held-out prompt, the reward functions "
              "score them, eval/* metrics are logged. None: save_steps (ms-swift). Without a "
              "validation set nothing is evaluated (a warning). ms-swift 3.x's --eval_interval "
              "is accepted too.")
    eval_iters: int = opt(
        -1, "Size of each evaluation: -1 the whole validation set, the same prompts every time; "
            "N > 0 N batches of global_batch_size completions (global_batch_size / "
            "num_generations_eval prompts each), continuing through the validation set from one "
            "evaluation to the next (ms-swift's); 0 no evaluation.")
    val_dataset: List[str] = opt(help="Validation prompts: local .jsonl/.json/.parquet files read "
                                      "like --dataset (#N suffix, --columns, --system). Takes "
                                      "precedence over split_dataset_ratio (ms-swift).",
                                 factory=list)
    split_dataset_ratio: float = opt(
        0.0, "Hold out this fraction of --dataset's distinct prompts (at least one) as the "
             "validation set, in [0, 1): drawn with --seed (the last ones with --dataset_shuffle "
             "false). Held-out prompts are never trained on. 0: no split.")
    val_dataset_shuffle: bool = opt(False, "Shuffle --val_dataset's rows with --seed when it is "
                                           "loaded (ms-swift's option; the order matters with "
                                           "eval_iters > 0).")
    num_generations_eval: Optional[int] = opt(None, "Completions per validation prompt. None: "
                                                    "num_generations.")


@dataclass
class LoggingOptions(_Group):
    """Outputs: metrics, completions, checkpoints, resume."""
    output_dir: Optional[str] = opt(None, "Where metrics, completions, checkpoints and the final "
                                          "model go. None: megatron_output/<model folder name>. "
                                          "Megatron's --save is accepted too.")
    save_steps: int = opt(500, "Checkpoint every N optimizer steps (and at the end).")
    save_total_limit: Optional[int] = opt(None, "Keep at most N checkpoints; None: all.")
    logging_steps: int = opt(5, "Print a line of metrics every N steps (on a terminal, the "
                                "progress bar shows them at every step); metrics.jsonl and "
                                "tensorboard/wandb/swanlab get every step (as Megatron's "
                                "tensorboard at its default tensorboard_log_interval 1).")
    log_completions: bool = opt(False, "Write prompts, completions and rewards to completions.jsonl.")
    log_level: Literal["debug", "info", "warning", "error"] = opt(
        "warning", "What reaches the console. warning: the plan, the progress (a bar on a "
                   "terminal, else a line every logging_steps), warnings and the result; "
                   "the output of the libraries (vLLM, Megatron-Core, torch, gloo) goes to "
                   "output_dir/logs/ (launcher.log, rank-N.log). error: the same without "
                   "this package's warnings (they stay in the logs). info: everything on "
                   "the console as the libraries print it; debug: also vLLM's debug lines.")
    save_safetensors: bool = opt(True, "The trained model is written as HF safetensors "
                                       "(final_hf/), always: false is refused.")
    report_to: Optional[List[Literal["tensorboard", "wandb", "swanlab", "none"]]] = opt(
        None, "Metric sinks besides metrics.jsonl (always written); none: no other. Default: "
              "tensorboard as in ms-swift (in output_dir/runs), or metrics.jsonl only with a "
              "warning when the tensorboard package is missing. A sink named here must be installed.")
    wandb_project: str = opt("megatron-swift", "wandb project (--report_to wandb); "
                                               "ms-swift's default.")
    wandb_exp_name: Optional[str] = opt(None, "wandb run name. None: output_dir's name.")
    swanlab_project: str = opt("megatron-swift", "swanlab project (--report_to swanlab); "
                                                 "ms-swift's default.")
    swanlab_exp_name: Optional[str] = opt(None, "swanlab experiment name. None: output_dir's "
                                                "name.")
    resume: Optional[str] = opt(None, "A checkpoint folder to continue from; true/auto (or unset): "
                                      "the newest checkpoint in output_dir if there is one; "
                                      "false (or none): a new run even where output_dir holds "
                                      "checkpoints.", none_is_value=True)
    no_save_optim: bool = opt(False, "Checkpoints hold no optimizer state (Adam moments): smaller and "
                                     "faster to write. A --resume from one restarts the optimizer "
                                     "state, with a warning; the step, LR schedule and data order "
                                     "continue.")
    no_save_rng: bool = opt(False, "Checkpoints hold no RNG states. A --resume from one goes on with "
                                   "the generators as they are (other dropout masks and sampling "
                                   "seeds than an uninterrupted run), with a warning.")
    dist_ckpt_optim_fully_reshardable: bool = opt(
        False, "The distributed optimizer's checkpoint state in canonical per-parameter tensors, "
               "loadable under another TP/PP/EP layout. Its save all-gathers the whole optimizer "
               "state (12 bytes a parameter) onto every rank first. false (ms-swift's and "
               "Megatron-LM's default): each rank writes its own flat piece, nothing gathered; "
               "a resume then keeps TP/PP/EP (DP may change).")
    distrib_optim_fully_reshardable_mem_efficient: bool = opt(
        False, "With --dist_ckpt_optim_fully_reshardable true: gather the optimizer state onto "
               "data-parallel rank 0 only (over gloo), not onto every rank: 12 bytes a "
               "parameter more on one rank of each DP group instead of all of them.")
    finetune: bool = opt(False, "With --resume PATH (a checkpoint-N folder): load its weights only "
                                "and start a new run from them at step 0 (new optimizer state, LR "
                                "schedule, RNG and data order), as ms-swift's --finetune true with "
                                "--mcore_model. ms-swift's default true matters there only when a "
                                "Megatron checkpoint is loaded; here --resume continues a run "
                                "unless --finetune true is given. Without --resume PATH it has no "
                                "effect; with --resume auto it is refused.")


# The groups of GRPOConfig in the order --help prints them.
GROUPS = {
    "model": ModelOptions,
    "data": DataOptions,
    "training": TrainingOptions,
    "parallel": ParallelOptions,
    "grpo": GRPOOptions,
    "reward": RewardOptions,
    "rollout": RolloutOptions,
    "evaluation": EvalOptions,
    "logging": LoggingOptions,
}

# Other spellings users bring from ms-swift / Megatron-LM, mapped onto ours.
ALIASES = {
    "learning_rate": "lr",
    "max_grad_norm": "clip_grad",
    "lr_warmup_fraction": "warmup_ratio",
    "save": "output_dir",
    "save_interval": "save_steps",
    "log_interval": "logging_steps",
    "max_epochs": "num_train_epochs",
    "num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size",
    "train_type": "tuner_type",
    "custom_register_path": "external_plugins",     # ms-swift 3.x
    "num_workers": "dataloader_num_workers",        # ms-swift 3.x (Megatron-LM)
    "eval_interval": "eval_steps",                  # ms-swift 3.x (Megatron-LM)
}
