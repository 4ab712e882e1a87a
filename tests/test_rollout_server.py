"""Server mode: `python -m megatron_grpo.rollout.server` (what `megatron rollout` runs)
in a subprocess, driven by RolloutClient as the trainer drives it.

One server start for the file (a Qwen3-shaped model). With SERVER_DP=2 (two
engines behind one API server) weight updates must reach both engines and the
fingerprint check covers each. Log-probs are compared with HF transformers in
float32 on a saved copy of the streamed weights (tolerance ATOL, see
test_rollout_colocate.py). The last test kills the server mid-generation.
"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import pytest
import torch

from megatron_grpo.rollout.buckets import (iter_safetensors_buckets, perturb_buckets,
                                           safetensors_index, save_hf_copy)
from megatron_grpo.rollout.client import RolloutClient, RolloutServerError
from megatron_grpo.rollout.verify import StreamFingerprints, WeightSyncError, check_weight_sync
from megatron_grpo.rollout.weights import load_weight_stream
from tests.harness import free_port, rollout_server
from tests.test_rollout_colocate import (ATOL, COMPLETIONS, PROMPTS, TEMPERATURE, hf_logprobs,
                                         max_diff, needs_vllm, tiny_vllm_model)

TOKEN = "s3cret"
# vllm_data_parallel_size of the server. 2 (two engines behind one API server on
# CPU) also covers weight updates and checks per replica, and passes, but starts
# ~55 s slower on a 2-core machine: MGRPO_TEST_SERVER_DP=2 runs it.
SERVER_DP = int(os.environ.get("MGRPO_TEST_SERVER_DP", "1"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_server")
    base = tiny_vllm_model(root / "base", family="qwen3", head_dim=32)  # q/k norms
    # Where an inductor compile in the server's engine processes would write its code
    # (an eager server compiles nothing: server.py `compile_nothing`).
    env = pytest.MonkeyPatch()
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    try:
        with rollout_server(base, root / "server.log", "--vllm_data_parallel_size",
                            str(SERVER_DP), "--vllm_max_model_len", "256",
                            "--vllm_enforce_eager", "true",
                            "--vllm_engine_kwargs", '{"dtype": "float32"}', "--api_key", TOKEN,
                            "--seed", "0") as proc:
            env.undo()
            yield dict(base=base, root=root, port=proc.port, proc=proc)
    finally:
        env.undo()


def _client(server, **kwargs) -> RolloutClient:
    return RolloutClient(vllm_server_port=server["port"], vllm_server_timeout=300,
                         api_key=TOKEN, temperature=TEMPERATURE, num_generations=2,
                         max_completion_length=6, **kwargs)


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_server_syncs_generates_and_verifies(server):
    client = _client(server)
    base = server["base"]

    gen = client.generate(PROMPTS)
    assert [c.prompt_index for c in gen] == [0, 0, 1, 1, 2, 2]
    for c in gen:
        assert len(c.logprobs) == len(c.token_ids) and 1 <= len(c.token_ids) <= 6
        assert c.truncated == (c.finish_reason == "length")
    ref = hf_logprobs(base, [PROMPTS[c.prompt_index] for c in gen], [c.token_ids for c in gen],
                      TEMPERATURE)
    assert max_diff([c.logprobs for c in gen], ref) < ATOL
    # The eager server sampled without compiling anything (before the fix, vLLM's sampler
    # helper left ~36 files of inductor code and C++ builds here).
    compiled = [p for p in (server["root"] / "inductor").rglob("*") if p.is_file()]
    assert compiled == [], f"torch.compile ran in an enforce_eager server: {compiled[:3]}"

    # A changed model, streamed in 3 buckets to both engines, then checked on each.
    expected = StreamFingerprints()
    stream = perturb_buckets(iter_safetensors_buckets(base, num_buckets=3), seed=1)
    stats = load_weight_stream(client, expected.watch(stream))
    n_tensors = len(safetensors_index(base))
    assert stats["buckets"] == 3 and stats["tensors"] == n_tensors
    assert len(client.weight_fingerprints()) == SERVER_DP  # one list per DP engine
    assert check_weight_sync(client, expected.result) == n_tensors
    changed = save_hf_copy(base, server["root"] / "perturbed1",
                           perturb_buckets(iter_safetensors_buckets(base), seed=1))
    ref = hf_logprobs(changed, PROMPTS, COMPLETIONS)
    # Several requests: the API server spreads them over both engines.
    for _ in range(2):
        assert max_diff(client.score(PROMPTS, COMPLETIONS), ref) < ATOL

    # One tensor left out of the trainer's record: named, for each engine. vLLM gets the
    # whole stream all the same: a tensor really left out of a sync holds uninitialised
    # memory (vLLM's layer-wise reload allocates the layer afresh), often NaN, and the
    # next tests would sample from that model (NaN log-probs: HTTP 400 from vLLM's JSON).
    where = (lambda e: f"vLLM engine {e}: ") if SERVER_DP > 1 else (lambda e: "")
    left_out = "model.layers.0.mlp.gate_proj.weight"
    expected = StreamFingerprints()
    stream = list(perturb_buckets(iter_safetensors_buckets(base, num_buckets=2), seed=2))
    for _ in expected.watch([(n, t) for n, t in b if n != left_out] for b in stream):
        pass
    load_weight_stream(client, stream)
    with pytest.raises(WeightSyncError) as err:
        check_weight_sync(client, expected.result)
    for engine in range(SERVER_DP):
        assert (f"{where(engine)}{left_out}: held by vLLM but absent from the "
                "trainer's stream") in str(err.value)
    assert f"{SERVER_DP} problem(s)" in str(err.value)

    # A broken model: vLLM's JSON cannot carry its NaN log-probs, and the client says what
    # that means. Then the whole model again. NaN only in the final norm: keys and values
    # stay finite (NaN inside the layers left the next 1-2 requests failing on CPU even
    # after a correct re-sync: stale NaN in the engine, not weights).
    load_weight_stream(client, [[(n, torch.full_like(t, float("nan")) if n == "model.norm.weight"
                                  else t) for n, t in b] for b in stream])
    with pytest.raises(RolloutServerError, match="HTTP 400: .*a NaN log-prob: the served model "
                                                 "produced non-finite logits"):
        client.generate(PROMPTS)
    load_weight_stream(client, stream)

    # The weight routes want the token; the OpenAI routes work as in `vllm serve`.
    intruder = RolloutClient(vllm_server_port=server["port"])
    intruder.api_key = None
    with pytest.raises(RolloutServerError, match="HTTP 401"):
        intruder.begin_weight_update()
    req = urllib.request.Request(
        f"http://127.0.0.1:{server['port']}/v1/chat/completions", method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": client.model, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "What is 2 + 3?"}]}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        answer = json.loads(resp.read())
    assert answer["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_two_servers_sample_as_one(server):
    """Several servers (ms-swift's lists of hosts and ports) as one sampler: a weight update
    goes to each (every engine's fingerprints checked), each call's prompts are spread
    over both, the completions and scores come back in prompt order."""
    base = server["base"]
    with rollout_server(base, server["root"] / "server2.log", "--vllm_max_model_len", "256",
                        "--vllm_enforce_eager", "true", "--vllm_engine_kwargs",
                        '{"dtype": "float32"}', "--api_key", TOKEN, "--seed", "0") as second:
        _two_servers(base, [server["port"], second.port])


def _two_servers(base, ports):
    client = RolloutClient(vllm_server_host=["127.0.0.1", "localhost"], vllm_server_port=ports,
                           vllm_server_timeout=300, api_key=TOKEN, temperature=TEMPERATURE,
                           num_generations=2, max_completion_length=6, seed=4)
    client.wait_until_ready()
    used = []
    post = client._post_json
    client._post_json = lambda path, payload, server=0: used.append((path, server)) or \
        post(path, payload, server)
    expected = StreamFingerprints()        # the base weights again (earlier tests changed them)
    load_weight_stream(client, expected.watch(iter_safetensors_buckets(base, num_buckets=2)))
    assert len(client.weight_fingerprints()) == SERVER_DP + 1
    assert check_weight_sync(client, expected.result) == len(safetensors_index(base))
    gen = client.generate(PROMPTS)
    assert [c.prompt_index for c in gen] == [0, 0, 1, 1, 2, 2]
    ref = hf_logprobs(base, [PROMPTS[c.prompt_index] for c in gen], [c.token_ids for c in gen],
                      TEMPERATURE)
    assert max_diff([c.logprobs for c in gen], ref) < ATOL
    assert max_diff(client.score(PROMPTS, COMPLETIONS), hf_logprobs(base, PROMPTS, COMPLETIONS)) \
        < ATOL
    assert sorted(used) == [("/v1/completions", 0)] * 2 + [("/v1/completions", 1)] * 3


def test_client_spreads_calls_over_servers():
    """Which server each request goes to (a stand-in for /v1/completions): contiguous
    shares of a call's prompts, trajectory i of a multi-turn call on server i mod n."""
    from megatron_grpo.rollout.colocate import Completion

    client = RolloutClient(vllm_server_base_url=["http://a:1", "http://b:2", "http://c:3"],
                           num_generations=1, seed=None)
    client._model, sent = "tiny", []

    def completions(prompts, opts, seed, server=0):
        sent.append((server, [p[0] for p in prompts]))
        return [Completion(i, [p[0]], "x", False, [-1.0], "stop") for i, p in enumerate(prompts)]

    client._completions = completions
    out = client.generate([[k] for k in range(7)])
    assert sent == [(0, [0, 1]), (1, [2, 3]), (2, [4, 5, 6])]
    assert [(c.prompt_index, c.token_ids[0]) for c in out] == [(k, k) for k in range(7)]
    sent.clear()
    client.generate([[9]])                     # one prompt: one server
    assert sent == [(2, [9])]
    sent.clear()
    client.generate_turns([[k] for k in range(4)], lambda i, c: None)
    assert sorted(sent) == [(0, [0]), (0, [3]), (1, [1]), (2, [2])]


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_server_multi_turn_trajectories_are_token_exact(server):
    """Multi-turn through the client (server mode): each turn samples from the exact ids so
    far, so the server's own scoring of the whole trajectory (prompt log-probs, temperature
    1) gives back the rollout log-probs of every model token."""
    from transformers import AutoTokenizer

    from megatron_grpo.multi_turn import RolloutInferRequest, build_scheduler
    from megatron_grpo.rollout.trajectory import run_trajectories

    client = RolloutClient(vllm_server_port=server["port"], vllm_server_timeout=300,
                           api_key=TOKEN, temperature=1.0, max_completion_length=6)
    client.wait_until_ready()
    tok = AutoTokenizer.from_pretrained(str(server["base"]))
    sched = build_scheduler("gym_scheduler", max_turns=3, tokenizer=tok, gym_env="guess_number")
    reqs = [RolloutInferRequest([], data_dict={"env_config": {"seed": i}}) for i in range(3)]
    ts = run_trajectories(client, tok, sched, reqs, max_length=200)   # the server's 256 - 6
    assert max(t.num_turns for t in ts) > 1
    scored = client.score([t.prompt_ids for t in ts], [t.completion_ids for t in ts])
    for t, lp in zip(ts, scored):
        model = [x for x, m in zip(lp, t.loss_mask) if m]
        assert len(model) == len(t.logprobs) == sum(t.loss_mask)
        assert (sum(t.loss_mask) < len(t.loss_mask)) == (t.num_turns > 1)   # env tokens: 0
        assert max_diff([t.logprobs], [model]) < ATOL


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_seeded_client_samples_each_prompt_with_its_own_noise(server):
    """A seeded client (the trainer's: --seed) sends each prompt with its own seed, new at
    every call: one seed for the batch gave sample k of every prompt the same random
    numbers (vLLM seeds sample k of a request with seed + k), so a prompt drawn twice got
    the same completions, at every step."""
    client = RolloutClient(vllm_server_port=server["port"], vllm_server_timeout=300,
                           api_key=TOKEN, temperature=1.0, num_generations=2,
                           max_completion_length=6, seed=3)
    same = [PROMPTS[0]] * 3
    first, second = client.generate(same), client.generate(same)
    assert [c.prompt_index for c in first] == [0, 0, 1, 1, 2, 2]
    samples = [tuple(c.token_ids) for c in first + second]
    assert len(set(samples)) == len(samples), samples


def test_client_generate_seeds_every_prompt_and_call():
    """The requests of a seeded generate (a stand-in for /v1/completions): one per prompt,
    each with its own seed, none repeated by the next call; the completions come back in
    prompt order with their prompt's index. Without a seed: one request for the batch."""
    from megatron_grpo.rollout.colocate import Completion

    sent = []

    def completions(prompts, opts, seed, server=0):
        sent.append((prompts, seed))
        return [Completion(i // opts.num_generations, [len(sent)], "x", False, None)
                for i in range(len(prompts) * opts.num_generations)]

    client = RolloutClient(vllm_server_port=8000, seed=5, num_generations=2)
    client._completions = completions
    prompts = [[1], [2], [3]]
    out = client.generate(prompts) + client.generate(prompts)
    assert sorted(p for p, _ in sent) == [[[1]], [[1]], [[2]], [[2]], [[3]], [[3]]]
    assert len({seed for _, seed in sent}) == 6 and None not in {seed for _, seed in sent}
    assert [c.prompt_index for c in out] == [0, 0, 1, 1, 2, 2] * 2
    sent.clear()
    client.seed = None
    assert [c.prompt_index for c in client.generate(prompts)] == [0, 0, 1, 1, 2, 2]
    assert sent == [(prompts, None)]


def test_client_turns_never_wait_for_each_other():
    """generate_turns sends each trajectory's turn as its own request, at once: here the
    server (a stand-in for /v1/completions) holds trajectory 1's first turn until
    trajectory 0's second turn has arrived, which a round barrier would never send (its
    wait would run out). next_turn runs in the caller's thread; every request has its
    own seed (the trajectories of a group share a prompt)."""
    from megatron_grpo.rollout.colocate import Completion

    client = RolloutClient(vllm_server_port=8000, seed=5, max_completion_length=3)
    sent, arrived = [], threading.Event()

    def completions(prompts, opts, seed, server=0):
        [p] = prompts
        assert opts.num_generations == 1 and opts.max_completion_length == 3
        sent.append((p, seed))
        if p == [1, 10]:
            arrived.set()
        if p == [2]:
            assert arrived.wait(120), "trajectory 0's second turn was never sent"
        return [Completion(0, [10], "x", False, [-0.5], "stop")]

    client._completions, client._model = completions, "tiny"
    threads, turns = set(), {0: 0, 1: 0}

    def next_turn(i, c):
        threads.add(threading.current_thread())
        turns[i] += 1
        assert c.prompt_index == i and c.token_ids == [10]
        return None if turns[i] == (3 if i == 0 else 2) else [i + 1] + [10] * turns[i]

    client.generate_turns([[1], [2]], next_turn)
    assert turns == {0: 3, 1: 2} and threads == {threading.main_thread()}
    assert [p for p, _ in sent].index([1, 10]) < [p for p, _ in sent].index([2, 10])
    assert len({seed for _, seed in sent}) == len(sent) == 5


def test_nan_logprob_answer_says_what_it_means():
    """vLLM's /v1/completions cannot write a NaN log-prob (JSON has none) and answers 400
    (seen in CI when a test sampled from a model holding uninitialised weights): the
    client's error says it is a NaN log-prob from broken weights. A stand-in server gives
    vLLM's answer."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.dumps({"error": {"message": "Out of range float values are not JSON "
                                         "compliant", "type": "BadRequestError", "code": 400}})
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = RolloutClient(vllm_server_port=httpd.server_address[1])
        client._model = "tiny"
        with pytest.raises(RolloutServerError, match=r"HTTP 400: .*Out of range float.*a NaN "
                                                     r"log-prob: the served model produced "
                                                     r"non-finite logits.*check_weight_sync"):
            client.generate([[1, 2]])
    finally:
        httpd.shutdown()


def test_unreachable_server_fails_after_timeout():
    client = RolloutClient(vllm_server_port=free_port(), vllm_server_timeout=2)
    start = time.monotonic()
    with pytest.raises(RolloutServerError, match=r"no rollout server answered at "
                                                 r"http://127\.0\.0\.1:\d+ within "
                                                 r"vllm_server_timeout=2s"):
        client.wait_until_ready()
    assert 2 <= time.monotonic() - start < 8
    with pytest.raises(RolloutServerError, match="Connection refused"):
        client.generate([[1, 2]])
    with pytest.raises(ValueError, match="vllm_server_base_url='localhost:8000' must start"):
        RolloutClient(vllm_server_base_url="localhost:8000")
    # base_url overrides host and port.
    assert RolloutClient(vllm_server_host="10.0.0.1", vllm_server_port=1,
                         vllm_server_base_url="http://127.0.0.1:9/").base_url == "http://127.0.0.1:9"


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_killed_server_fails_the_client_quickly(server):
    client = _client(server)
    client.wait_until_ready()
    failure = {}

    def long_generation():
        try:
            # ~60k tokens: minutes of work on CPU, so the kill lands mid-generation.
            client.generate([[5, 6, 7]] * 32, num_generations=8, max_completion_length=240)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            failure["error"] = e

    worker = threading.Thread(target=long_generation, daemon=True)
    worker.start()
    time.sleep(1.0)
    killed_at = time.monotonic()
    server["proc"].kill()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the client hung after the server died"
    assert time.monotonic() - killed_at < 15
    assert isinstance(failure.get("error"), RolloutServerError), failure
    assert "still running there?" in str(failure["error"])
    # Later calls fail at once too.
    with pytest.raises(RolloutServerError, match="failed"):
        client.generate([[1, 2]])


@pytest.mark.parametrize("free, in_shm", [(1 << 40, True), (1 << 20, False)])
def test_bucket_goes_to_dev_shm_only_where_it_fits(monkeypatch, free, in_shm):
    """The server hands a bucket to its workers through a file: in /dev/shm when that has
    room for it (a container's is often 64 MiB), else in the temporary directory (a
    stand-in for the workers' rpc records where the file was and that it was whole)."""
    import shutil
    import tempfile

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from megatron_grpo.platform.compat import vllm as compat
    from megatron_grpo.rollout import server as server_module

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    seen = []

    async def rpc(engine, method, path):
        with open(path, "rb") as f:
            seen.append((method, os.path.dirname(path), len(f.read())))
        return [[7]]

    real_usage = shutil.disk_usage
    monkeypatch.setattr(compat, "collective_rpc_all_engines", rpc)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=free)
                        if p == "/dev/shm" else real_usage(p))
    app = FastAPI()
    app.include_router(server_module.make_router(engine=None, api_key=None))
    body = b"x" * (2 << 20)
    r = TestClient(app).post("/update_weights/bucket", content=body)
    assert r.status_code == 200 and r.json() == {"ok": True, "tensors": 7}
    [(method, where, size)] = seen
    assert size == len(body)
    assert where == ("/dev/shm" if in_shm else tempfile.gettempdir()), where


def test_server_refuses_to_sample_from_an_incomplete_update(monkeypatch):
    """A weight update that failed part-way (a bucket the workers could not load, or a
    trainer that gave up mid-stream) leaves the served weights a mix: sampling answers 503
    with the reason until a whole update arrives (stand-ins for the workers' rpc and for
    vLLM's /v1/completions behind the real router and guard)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from megatron_grpo.platform.compat import vllm as compat
    from megatron_grpo.rollout import server as server_module

    fail = {"bucket": False}

    async def rpc(engine, method, *args):
        if method == "mg_load_weights_file" and fail["bucket"]:
            raise RuntimeError("worker out of memory")
        return [[1]]

    class Engine:
        async def reset_prefix_cache(self):
            pass

        async def reset_encoder_cache(self):
            pass

    monkeypatch.setattr(compat, "collective_rpc_all_engines", rpc)
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        return {"choices": []}

    router = server_module.make_router(Engine(), api_key=None)
    app.include_router(router)
    server_module.guard_sampling(app, router.weights_problem)
    http = TestClient(app, raise_server_exceptions=False)

    def sample():
        return http.post("/v1/completions", json={})

    def update(bucket_fails, complete=True):
        fail["bucket"] = bucket_fails
        assert http.post("/update_weights/begin").status_code == 200
        assert sample().status_code == 503          # mid-update: nobody samples
        r = http.post("/update_weights/bucket", content=b"x")
        return r.status_code, http.post("/update_weights/finish", json={"complete": complete})

    assert sample().status_code == 200
    code, finish = update(bucket_fails=True, complete=False)       # what the client sends
    assert code == 500 and finish.status_code == 200 and finish.json()["complete"] is False
    r = sample()
    assert r.status_code == 503 and "failed part-way (RuntimeError: worker out of memory)" in \
        r.json()["error"]["message"]
    code, finish = update(bucket_fails=True, complete=True)        # finish cannot hide it
    assert finish.status_code == 409 and sample().status_code == 503
    code, finish = update(bucket_fails=False, complete=False)      # the trainer gave up
    assert finish.status_code == 200 and "abandoned" in sample().json()["error"]["message"]
    code, finish = update(bucket_fails=False)                      # a whole update
    assert (code, finish.status_code) == (200, 200) and sample().status_code == 200
    assert http.get("/v1/models").status_code == 404               # (not guarded; absent here)
