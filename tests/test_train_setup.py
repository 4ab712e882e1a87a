"""train/setup.py: what the run's options hand to the sampler."""
import dataclasses

from megatron_grpo.config import parse_rlhf_args
from megatron_grpo.rollout.client import RolloutClient
from megatron_grpo.train.setup import build_sampler, engine_settings
from tests.test_config_parse import base, model_dir  # noqa: F401  (fixture)


def test_server_client_samples_with_every_sampling_option(model_dir, monkeypatch):  # noqa: F811
    """Server mode samples with the same options as a colocated engine (one source,
    EngineSettings.sampling): --repetition_penalty used to stay 1.0 in the client."""
    monkeypatch.setattr(RolloutClient, "wait_until_ready", lambda self: None)  # no server here
    cfg = parse_rlhf_args(base(model_dir, "--vllm_mode", "server", "--vllm_server_port", "8123",
                               "--repetition_penalty", "1.3", "--temperature", "0.7",
                               "--top_p", "0.8", "--top_k", "5", "--max_completion_length", "33",
                               "--num_generations", "4", "--seed", "11"))
    client = build_sampler(cfg)
    assert isinstance(client, RolloutClient) and client.base_url == "http://127.0.0.1:8123"
    assert client.sampling == engine_settings(cfg).sampling()
    assert dataclasses.asdict(client.sampling) == dict(
        temperature=0.7, top_p=0.8, top_k=5, repetition_penalty=1.3, max_completion_length=33,
        num_generations=4, logprobs=False)
    assert client.seed == 11


def test_a_frozen_vision_tower_is_synced_when_vllm_loses_it(model_dir):  # noqa: F811
    """A vision-language model's frozen tower stays out of the syncs (vLLM holds it from its
    start), except at sleep level 2, which drops vLLM's parameters (buffers are kept):
    then every sync streams it, or vLLM would encode images with whatever is left."""
    from megatron_grpo.train.setup import vision_sync_include

    tower, text = "visual.blocks.0.attn.qkv.weight", "model.layers.0.mlp.up_proj.weight"
    keep = vision_sync_include(parse_rlhf_args(base(model_dir, "--sleep_level", "1")))
    assert keep(text) and not keep(tower)
    assert vision_sync_include(parse_rlhf_args(base(model_dir, "--sleep_level", "2"))) is None
