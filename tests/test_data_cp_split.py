"""Context-parallel data split: Megatron's load-balanced layout, padding, validity, inverse."""
import pytest
import torch

from megatron_grpo.data.cp_split import (local_positions, padded_length, shard_batch,
                                         split_for_cp, unsplit)


def _expected_layout(s, cp, rank):
    """Written from the definition: pad to 2*cp chunks, rank r gets chunks r and 2cp-1-r."""
    n = 2 * cp
    padded = ((s + n - 1) // n) * n
    c = padded // n
    return [p for chunk in (rank, n - 1 - rank) for p in range(chunk * c, chunk * c + c)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("s", [1, 7, 8, 13])
def test_round_trip_and_layout(cp, s):
    b = 3
    x = torch.randn(b, s, 5)
    padded = padded_length(s, cp)
    assert padded % (2 * cp if cp > 1 else 1) == 0 and s <= padded < s + 2 * cp
    shards = [split_for_cp(x, cp, r, dim=1, pad_value=-1.0) for r in range(cp)]
    for r, shard in enumerate(shards):
        assert shard.shape == (b, padded // cp, 5)
        if cp > 1:
            want = _expected_layout(s, cp, r)
            assert local_positions(padded, cp, r).tolist() == want
            for j, p in enumerate(want):
                expect = x[:, p] if p < s else torch.full((b, 5), -1.0)
                assert torch.equal(shard[:, j], expect)
    # Every position is held by exactly one rank.
    allpos = torch.cat([local_positions(padded, cp, r) for r in range(cp)])
    assert sorted(allpos.tolist()) == list(range(padded))
    assert torch.equal(unsplit(shards, seq_len=s), x)
    assert unsplit(shards).shape == (b, padded, 5)


def test_shard_batch_masks_padding_and_keeps_per_sequence_values():
    cp, b, s = 2, 2, 6                     # padded to 8: positions 6, 7 are padding
    ids = torch.arange(b * s).view(b, s) + 100
    pos = torch.arange(s).expand(b, s)
    loss_mask = torch.ones(b, s)
    adv = torch.tensor([0.5, -1.0])       # per sequence: passed through
    lengths = torch.tensor([6, 4])
    shards = [shard_batch({"input_ids": ids, "position_ids": pos, "loss_mask": loss_mask,
                           "advantages": adv, "ref_logps": None}, cp, r, lengths=lengths,
                          pad_values={"input_ids": 7})
              for r in range(cp)]
    # rank 0 holds chunks 0 and 3: positions [0, 1, 6, 7]; rank 1: [2, 3, 4, 5].
    assert shards[0].positions.tolist() == [0, 1, 6, 7]
    assert shards[0]["input_ids"][0].tolist() == [100, 101, 7, 7]
    assert shards[0]["position_ids"][1].tolist() == [0, 1, 6, 7]
    assert shards[0]["loss_mask"][0].tolist() == [1, 1, 0, 0]
    assert shards[0].valid.tolist() == [[True, True, False, False]] * 2
    assert shards[1].valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert shards[1]["advantages"] is adv and shards[1]["ref_logps"] is None
    assert shards[0].padded_len == 8 and shards[0].seq_len == 6
    assert torch.equal(unsplit([sh["input_ids"] for sh in shards], seq_len=s), ids)


def test_sequence_parallel_padding():
    # Under sequence parallelism each rank's S/cp tokens are split again across TP.
    assert padded_length(13, 2, sp_size=2) == 16 and padded_length(17, 2, sp_size=2) == 24
    assert padded_length(13, 1, sp_size=2) == 14
    shard = shard_batch({"input_ids": torch.zeros(1, 17)}, 2, 1, sp_size=2)
    assert shard["input_ids"].shape == (1, 12) and shard.padded_len == 24


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="context_parallel_size"):
        padded_length(8, 0)
    with pytest.raises(ValueError, match="cp_rank 2 is out of range"):
        split_for_cp(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        local_positions(6, 2, 0)
    with pytest.raises(ValueError, match="'labels' has shape"):
        shard_batch({"input_ids": torch.zeros(2, 5), "labels": torch.zeros(2, 4)}, 2, 0)
