"""The training side of a GRPO step: batching rollouts and the Megatron glue."""
from .batch import Sample, collate, micro_batches, split_completion_values
from .engine import (LossOptions, forward_logprobs, megatron_loss_scale, reduce_partials,
                     step_entropy_threshold, train_micro_batches)

__all__ = ["Sample", "collate", "micro_batches", "split_completion_values", "LossOptions",
           "forward_logprobs", "megatron_loss_scale", "reduce_partials", "step_entropy_threshold",
           "train_micro_batches"]
