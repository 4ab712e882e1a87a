"""model/freeze.py: ms-swift's --freeze_parameters* / --trainable_parameters* rules on
stand-ins of Megatron model chunks (the names and `layer_number`s a GPTModel has; the real
model: tests/test_trainer_e2e.py, a run at PP=2 whose final weights are compared)."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_grpo.model.freeze import check_and_summarise, freeze_parameters


class _Layer(torch.nn.Module):
    def __init__(self, layer_number):
        super().__init__()
        self.layer_number = layer_number          # Megatron's: 1-based, in the whole model
        self.self_attention = torch.nn.Linear(4, 4, bias=False)     # 16 values
        self.mlp = torch.nn.Linear(4, 2, bias=False)                # 8 values


class _Stage(torch.nn.Module):
    """A GPTModel's parameters on one pipeline stage: `layers` its global layer numbers."""

    def __init__(self, layers, first=False, last=False, tied=False):
        super().__init__()
        self.config = types.SimpleNamespace(num_moe_experts=None)
        self.share_embeddings_and_output_weights = tied
        if first:
            self.embedding = torch.nn.Module()
            self.embedding.word_embeddings = torch.nn.Embedding(10, 4)   # 40 values
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(_Layer(n) for n in layers)
        if last:
            self.output_layer = torch.nn.Linear(4, 10, bias=False)      # 40 values


def _frozen(chunks):
    return sorted(n for c in chunks for n, p in c.named_parameters() if not p.requires_grad)


def test_prefixes_name_layers_by_their_index_in_the_whole_model():
    """The second of two pipeline stages holds layers 2 and 3 as its local 0 and 1: the
    prefix decoder.layers.2 freezes its local layer 0; the regex and trainable rules run
    after, in ms-swift's order."""
    stage = _Stage([3, 4], last=True)
    result = freeze_parameters([stage], prefixes=["decoder.layers.2"],
                               regex=r"output_layer", trainable=["decoder.layers.2.mlp"])
    assert _frozen([stage]) == ["decoder.layers.0.self_attention.weight", "output_layer.weight"]
    assert result["matched"] == {"decoder.layers.2", "output_layer", "decoder.layers.2.mlp"}
    assert (result["frozen"], result["total"]) == (16 + 40, 2 * 24 + 40)
    assert result["names"][0] == "decoder.layers.2.self_attention.weight"


def test_ratio_freezes_the_first_share_and_tp_shards_count_whole():
    """--freeze_parameters_ratio: the first parameters in model order up to the share of all
    values (ms-swift's cut); a tensor-parallel shard counts as the whole tensor."""
    stage = _Stage([1, 2], first=True, last=True)          # 40 + 2 x 24 + 40 = 128
    freeze_parameters([stage], ratio=0.5)                  # 64: the embedding and layer 1
    assert _frozen([stage]) == ["decoder.layers.0.mlp.weight",
                                "decoder.layers.0.self_attention.weight",
                                "embedding.word_embeddings.weight"]
    stage = _Stage([1, 2], first=True, last=True)
    stage.embedding.word_embeddings.weight.tensor_model_parallel = True    # 40 x TP 2 = 80
    result = freeze_parameters([stage], ratio=0.5, tp=2)  # 84 of 168: the embedding only
    assert _frozen([stage]) == ["embedding.word_embeddings.weight"]
    assert (result["frozen"], result["total"]) == (80, 168)


def test_tied_embeddings_freeze_both_copies():
    """With one matrix for input and output (its second copy on the last stage under pipeline
    parallelism), a rule naming either freezes each stage's copy."""
    first, last = _Stage([1], first=True, tied=True), _Stage([2], last=True, tied=True)
    for stage in (first, last):
        freeze_parameters([stage], prefixes=["embedding"])
    assert _frozen([first]) == ["embedding.word_embeddings.weight"]
    assert _frozen([last]) == ["output_layer.weight"]
    untied = _Stage([2], last=True)
    assert freeze_parameters([untied], prefixes=["embedding"])["matched"] == set()
    assert _frozen([untied]) == []


def test_checks_across_ranks():
    """A rule that named nothing on any stage fails, showing names; so does freezing all."""
    stages = [_Stage([1], first=True), _Stage([2], last=True)]
    results = [freeze_parameters([s], prefixes=["output_layer"]) for s in stages]
    assert check_and_summarise(results, {"freeze_parameters": ["output_layer"]}) == \
        "frozen: 40 of 128 parameter values (31.2 %) by --freeze_parameters"
    results = [freeze_parameters([s], prefixes=["decoder.layer.1"]) for s in stages]
    with pytest.raises(ValueError, match=r"--freeze_parameters 'decoder.layer.1' names no "
                                         r"parameter of the model. Its names look like "
                                         r"embedding.word_embeddings.weight, decoder.layers.0"):
        check_and_summarise(results, {"freeze_parameters": ["decoder.layer.1"]})
    results = [freeze_parameters([s], regex=".") for s in stages]
    with pytest.raises(ValueError, match="every parameter is frozen, nothing would train"):
        check_and_summarise(results, {"freeze_parameters_regex": ["."]})
