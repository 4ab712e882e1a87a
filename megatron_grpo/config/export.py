"""Options of `megatron export` (checkpoint conversion), parsed like `megatron rlhf`'s.

    megatron export --to_mcore true --model HF_DIR --output_dir MCORE_DIR --tensor_model_parallel_size 2
    megatron export --to_hf true --mcore_model RUN_OR_CKPT_DIR --output_dir HF_OUT [--merge_lora false]

The flag syntax, `--config file.yaml`, `--help` and all-problems-at-once errors are those of
the other commands (config/parse.py); the layout flags share their names with `megatron rlhf`. What needs the checkpoint on disk (its folder, the saved layout) is checked
by `convert.check_args` before any process starts.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

from .errors import Problems
from .groups import (LoggingOptions, ModelOptions, ParallelOptions, TrainingOptions, check_choices,
                     opt, same_as)
from .parallel import ParallelDims
from .parse import parse_command
from .sizes import parse_size


@dataclass
class ExportConfig:
    """What to convert, where to, and the parallel layout the conversion runs under."""
    to_mcore: bool = opt(False, "HF safetensors -> a Megatron distributed checkpoint.")
    to_hf: bool = opt(False, "A Megatron checkpoint (a --to_mcore folder, a training "
                             "checkpoint or a run folder) -> HF safetensors.")
    model: Optional[str] = same_as(ModelOptions, "model", "HF checkpoint folder (--to_mcore; "
                                   "with --to_hf of a LoRA run: the base model, if it moved).")
    mcore_model: Optional[str] = opt(None, "Folder written by --to_mcore, a training "
                                           "checkpoint-N, or a run's output_dir (--to_hf).")
    output_dir: Optional[str] = same_as(LoggingOptions, "output_dir", "Where to write (a new or "
                                        "empty folder, unless --overwrite true). Required.")
    tensor_model_parallel_size: int = same_as(ParallelOptions, "tensor_model_parallel_size",
                                              "Tensor parallel size of the conversion.")
    pipeline_model_parallel_size: int = same_as(ParallelOptions, "pipeline_model_parallel_size",
                                                "Pipeline stages of the conversion.")
    virtual_pipeline_model_parallel_size: Optional[int] = same_as(
        ParallelOptions, "virtual_pipeline_model_parallel_size", "Virtual stages per pipeline rank.")
    context_parallel_size: int = same_as(ParallelOptions, "context_parallel_size", "CP shards "
                                         "activations, not weights: the checkpoint is the same.")
    expert_model_parallel_size: int = same_as(ParallelOptions, "expert_model_parallel_size",
                                              "MoE: experts split over this many ranks (the "
                                              "checkpoint is the same).")
    expert_tensor_parallel_size: Optional[int] = same_as(
        ParallelOptions, "expert_tensor_parallel_size", "MoE: each expert split over this many "
                                                        "ranks (None: TP).")
    torch_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = opt(
        None, "Parameter dtype; None: the checkpoint's.")
    test_convert_precision: bool = opt(False, "Run both models on one sample and print max and "
                                              "mean |logit diff|.")
    overwrite: bool = opt(False, "Replace the files of a non-empty --output_dir.")
    max_shard_size: str = opt("5GB", "HF shard size for --to_hf: bytes or a size such as "
                                     "5GB, 200MB, 2GiB.")
    merge_lora: Optional[bool] = same_as(
        TrainingOptions, "merge_lora", "--to_hf of a LoRA training checkpoint: write the merged "
                                       "HF model (W + alpha/r B A); false: the PEFT adapter. "
                                       "None: true, as ms-swift's export.")
    # Set by convert.check_args from the layout and the world size; not an option.
    dims: Optional[ParallelDims] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_choices(self)
        p = Problems()
        p.require(self.to_mcore != self.to_hf,
                  "megatron export: give exactly one of --to_mcore true / --to_hf true")
        p.require(bool(self.output_dir), "--output_dir is required: the folder to write")
        try:
            parse_size(self.max_shard_size, option="--max_shard_size")
        except ValueError as e:
            p.add(str(e))
        p.raise_if_any()

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size, option="--max_shard_size")


def parse_export_args(argv: Optional[Sequence[str]] = None) -> ExportConfig:
    """An ExportConfig from flags (`--config file.yaml` read first); one ConfigError listing
    every problem otherwise. `--help` prints the options and exits."""
    return parse_command(ExportConfig, list(sys.argv[1:] if argv is None else argv),
                         prog="megatron export", group="export")
