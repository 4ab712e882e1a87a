"""rollout/engine.py: both samplers implement the RolloutEngine Protocol, signatures included.

The trainer calls every Protocol member without probing (no hasattr / getattr with a
default), so a missing or differently-shaped method would fail only at run time in the
mode that lacks it. Checked on the classes (no vLLM engine or server needed), on a
RolloutClient instance (runtime_checkable isinstance) and, in test_rollout_colocate.py,
on a live ColocateEngine.
"""
from __future__ import annotations

import inspect

import pytest

from megatron_grpo.rollout import ColocateEngine, RolloutClient, RolloutEngine

MEMBERS = [name for name in dir(RolloutEngine)
           if not name.startswith("_") and callable(getattr(RolloutEngine, name))]


def _shape(fn) -> list:
    """(name, kind, has default) of each parameter: what a caller depends on."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values()]


def test_protocol_lists_what_the_trainer_calls():
    assert set(MEMBERS) == {"generate", "generate_turns", "score", "begin_weight_update", "load_bucket",
                            "finish_weight_update", "reset_prefix_cache",
                            "weight_fingerprints", "begin_adapter_update",
                            "load_adapter_bucket", "finish_adapter_update",
                            "adapter_fingerprints", "sleep", "wake_up", "close"}
    assert "tp_size" in RolloutEngine.__annotations__


@pytest.mark.parametrize("cls", [ColocateEngine, RolloutClient])
@pytest.mark.parametrize("name", MEMBERS)
def test_method_signature_matches_the_protocol(cls, name):
    method = cls.__dict__.get(name)
    assert method is not None and callable(method), f"{cls.__name__} lacks {name}()"
    assert _shape(method) == _shape(getattr(RolloutEngine, name)), \
        f"{cls.__name__}.{name}{inspect.signature(method)} != " \
        f"RolloutEngine.{name}{inspect.signature(getattr(RolloutEngine, name))}"


def test_client_is_a_rollout_engine():
    client = RolloutClient(vllm_server_port=8000)
    assert isinstance(client, RolloutEngine)
    assert client.tp_size == 1
    client.sleep(1), client.wake_up(), client.wake_up(["weights"]), client.close()   # no-ops
    # A live ColocateEngine is checked in test_rollout_colocate.py (it needs vLLM).


def test_an_incomplete_engine_is_not_a_rollout_engine():
    class NoClose(RolloutClient):
        close = None

    assert not isinstance(NoClose(vllm_server_port=8000), RolloutEngine)


def test_a_stream_that_fails_part_way_finishes_as_incomplete():
    """load_weight_stream always leaves buffered reload (finish_weight_update), and says
    whether the whole stream arrived: a server then refuses to sample from a mix of old and
    new weights (test_rollout_server.py). A stand-in engine records the calls."""
    import torch

    from megatron_grpo.rollout.weights import load_weight_stream

    class Recorder:
        def __init__(self):
            self.calls = []

        def begin_weight_update(self):
            self.calls.append("begin")

        def load_bucket(self, bucket):
            self.calls.append("bucket")

        def finish_weight_update(self, complete=True):
            self.calls.append(("finish", complete))

        def reset_prefix_cache(self):
            self.calls.append("reset")

    def stream(fail):
        yield [("a", torch.ones(2))]
        if fail:
            raise RuntimeError("the export died")
        yield [("b", torch.ones(2))]

    engine = Recorder()
    assert load_weight_stream(engine, stream(False))["tensors"] == 2
    assert engine.calls == ["begin", "bucket", "bucket", ("finish", True), "reset"]
    engine = Recorder()
    with pytest.raises(RuntimeError, match="the export died"):
        load_weight_stream(engine, stream(True))
    assert engine.calls == ["begin", "bucket", ("finish", False)]
