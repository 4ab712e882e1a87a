"""A generative reward model: a served LLM grades each completion from 0 to 10.

    megatron rollout --model JUDGE_DIR --port 8001          # or: vllm serve JUDGE_DIR
    MGRPO_JUDGE_URL=http://127.0.0.1:8001 megatron rlhf ... \
        --reward_model JUDGE_DIR --reward_model_plugin llm_judge \
        --external_plugins examples/plugins/llm_judge.py

ms-swift's reward-model plugin contract (megatron_grpo.rewards.DefaultRMPlugin): the
class is built with the reward model folder's model and tokenizer (`load_model = False`:
the judge runs behind its server, so its weights are not loaded here) and called with
one dict per completion (`messages`, the conversation with the completion last, and the
dataset's columns). For each it asks the OpenAI-compatible server's
`/v1/chat/completions` (temperature 0, 16 tokens) to grade the assistant's last answer
and reads the first number of the reply, 0-10, as grade / 10. A reply without one
scores None (that completion is not weighted by this reward).

Server: `MGRPO_JUDGE_URL` (default http://127.0.0.1:8000); model name `MGRPO_JUDGE_MODEL`
(default: the first of the server's /v1/models). Timeout and retries: each request waits
at most `MGRPO_JUDGE_TIMEOUT` seconds (default 30); a connection error, a timeout or an
HTTP 5xx is retried twice, after 1 s and then 2 s; after the third failure the scoring
fails with the URL and the last error (the run stops with it: a guessed reward would
train the policy on noise). 8 requests in flight at a time.
"""
from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from megatron_grpo.rewards import DefaultRMPlugin, rm_plugins

PROMPT = ("Grade the assistant's last answer in this conversation from 0 (useless) to 10 "
          "(perfect). Reply with the grade only.\n\n{conversation}")
RETRY_DELAYS = (1.0, 2.0)


class LLMJudge(DefaultRMPlugin):
    load_model = False

    def __init__(self, model, template):
        super().__init__(model, template)
        self.url = os.environ.get("MGRPO_JUDGE_URL", "http://127.0.0.1:8000").rstrip("/")
        self.timeout = float(os.environ.get("MGRPO_JUDGE_TIMEOUT", "30"))
        self.model_name = os.environ.get("MGRPO_JUDGE_MODEL") or None

    def _request(self, path: str, body=None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        last = None
        for delay in (*RETRY_DELAYS, None):
            try:
                req = urllib.request.Request(self.url + path, data=data,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise RuntimeError(f"judge {self.url}{path}: HTTP {e.code}: "
                                       f"{e.read()[:200]!r}") from e
                last = e
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = e
            if delay is not None:
                time.sleep(delay)
        raise RuntimeError(f"judge {self.url}{path} failed 3 times (timeout {self.timeout} s): "
                           f"{last}")

    def _grade(self, messages) -> float | None:
        conversation = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        reply = self._request("/v1/chat/completions", {
            "model": self.model_name, "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": PROMPT.format(conversation=conversation)}]})
        text = reply["choices"][0]["message"]["content"] or ""
        found = re.search(r"\d+(\.\d+)?", text)
        return None if found is None else min(max(float(found.group()), 0.0), 10.0) / 10

    def __call__(self, inputs):
        if self.model_name is None:
            self.model_name = self._request("/v1/models")["data"][0]["id"]
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda x: self._grade(x["messages"]), inputs))


rm_plugins["llm_judge"] = LLMJudge
