"""The trainer's client of a `megatron rollout` server (server mode).

    client = RolloutClient(vllm_server_host="127.0.0.1", vllm_server_port=8000)
    client.wait_until_ready()                 # retries with backoff, up to the timeout
    completions = client.generate(prompt_token_ids, num_generations=8, temperature=0.9)
    load_weight_stream(client, bridge_buckets)        # weights.py, as in colocate mode
    check_weight_sync(client, expected)               # verify.py

Same interface as ColocateEngine (generate, score, the weight-update calls), plain
HTTP with the standard library. Failures are RolloutServerError with the URL and
what to do: a server that never comes up fails after `vllm_server_timeout`
seconds; a server that dies mid-request fails that request at once (the socket
closes), and `request_timeout` bounds a request to a server that hangs.
"""
from __future__ import annotations

import dataclasses
import functools
import http.client
import json
import os
import random
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..data.vision import png_base64
from .colocate import Completion, SamplingOptions
from .server import API_KEY_ENV


class RolloutServerError(RuntimeError):
    """The rollout server is unreachable, gone, or refused a request."""


# What vLLM's OpenAI routes answer (HTTP 400) when a response holds NaN: a NaN log-prob
# (JSON has no NaN; a -inf one is written as -9999.0 instead). Only a model with
# non-finite logits gives one: its weights are broken.
NON_FINITE_JSON = "Out of range float values are not JSON compliant"
NON_FINITE_HELP = (" (a NaN log-prob: the served model produced non-finite logits. Its weights "
                   "are broken: a diverged update (see grad_norm and loss) or an incomplete "
                   "weight sync (--check_weight_sync true names the tensors))")


def server_urls(host: Union[str, Sequence[str]] = "127.0.0.1",
                port: Union[int, Sequence[int]] = 8000,
                base_url: Union[None, str, Sequence[str]] = None) -> List[str]:
    """The rollout servers' base URLs: `base_url` (one or several), else one per host, the
    port given once for all or one per host (ms-swift's vllm_server_host/_port lists)."""
    if base_url:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"vllm_server_base_url={url!r} must start with http:// or https://")
        return [url.rstrip("/") for url in urls]
    hosts = [host] if isinstance(host, str) else list(host)
    ports = [port] if isinstance(port, int) else [int(p) for p in port]
    if len(ports) not in (1, len(hosts)):
        raise ValueError(f"vllm_server_port {ports}: give one port, or one per host ({hosts})")
    for p in ports:
        if not 0 < int(p) < 65536:
            raise ValueError(f"vllm_server_port={p} is not a port (1-65535)")
    return [f"http://{h}:{int(ports[0] if len(ports) == 1 else ports[k])}"
            for k, h in enumerate(hosts)]


class RolloutClient:
    """HTTP client of the rollout servers (a rollout.engine.RolloutEngine): one, or several
    as one sampler (ms-swift's lists of hosts). With several, each call's prompts are
    spread over them in contiguous shares (a multi-turn call: trajectory i on server
    i mod n), and every weight or adapter update goes to each of them."""

    # Every rank talks to the server on its own: no rank has to join another's generate().
    tp_size = 1
    # Requests generate_turns keeps in flight at once (one thread each).
    max_concurrent_requests = 256

    def __init__(self, vllm_server_host: Union[str, Sequence[str]] = "127.0.0.1",
                 vllm_server_port: Union[int, Sequence[int]] = 8000,
                 vllm_server_base_url: Union[None, str, Sequence[str]] = None,
                 vllm_server_timeout: float = 240.0,
                 api_key: Optional[str] = None, request_timeout: float = 1800.0,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 repetition_penalty: float = 1.0, max_completion_length: int = 512,
                 num_generations: int = 1, seed: Optional[int] = None,
                 logprobs: bool = True, role: str = "rollout server",
                 option: str = "vllm_server_host/vllm_server_port (or vllm_server_base_url)"
                 ) -> None:
        # role, option: what the errors call the server and the option that names it (the
        # sampler's, or --teacher_model_server's: rollout/teacher.py)
        self.role, self.option = role, option
        self.base_urls = server_urls(vllm_server_host, vllm_server_port, vllm_server_base_url)
        self.base_url = self.base_urls[0]
        if vllm_server_timeout <= 0:
            raise ValueError(f"vllm_server_timeout={vllm_server_timeout} must be > 0 seconds")
        self.timeout = float(vllm_server_timeout)
        self.request_timeout = float(request_timeout)
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self.sampling = SamplingOptions(temperature, top_p, top_k, repetition_penalty,
                                        max_completion_length, num_generations, logprobs)
        self.seed = seed
        self._model: Optional[str] = None
        # Per server, the synced adapter's name there (adapter-only LoRA sync), else None.
        self.lora_names: List[Optional[str]] = [None] * len(self.base_urls)
        self._calls = 0       # generate and generate_turns calls (request seeds)

    @property
    def lora_name(self) -> Optional[str]:
        """The synced adapter's name on the first server."""
        return self.lora_names[0]

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, path: str, body: Optional[bytes] = None,
                 content_type: str = "application/json", timeout: Optional[float] = None,
                 server: int = 0) -> Any:
        headers = {"Content-Type": content_type}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_urls[server] + path
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as resp:
                data = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if NON_FINITE_JSON in detail:
                detail += NON_FINITE_HELP
            raise RolloutServerError(f"{self.role} {url} answered HTTP {e.code}: {detail}") \
                from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError,
                socket.timeout, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RolloutServerError(
                f"{self.role} {url} failed: {type(reason).__name__}: {reason}. Is "
                "`megatron rollout` still running there? (it may have crashed or been stopped)"
            ) from None
        return json.loads(data) if data else None

    def _post_json(self, path: str, payload: Dict[str, Any], server: int = 0) -> Any:
        return self._request("POST", path, json.dumps(payload).encode(), server=server)

    def _on_every_server(self, method: str, path: str, body: Optional[bytes] = b"",
                         content_type: str = "application/json") -> List[Any]:
        """The same request to every server, at once; their answers in server order."""
        return self._at_once([functools.partial(self._request, method, path, body,
                                                content_type, server=s)
                              for s in range(len(self.base_urls))])

    def _at_once(self, calls: List[Callable[[], Any]]) -> List[Any]:
        """Run `calls` (requests) concurrently; their results, in call order."""
        if len(calls) == 1:
            return [calls[0]()]
        with ThreadPoolExecutor(max_workers=min(len(calls), self.max_concurrent_requests),
                                thread_name_prefix="rollout-request") as pool:
            return list(pool.map(lambda call: call(), calls))

    def _shares(self, n: int) -> List[Tuple[int, int, int]]:
        """(server, lo, hi): n items in contiguous shares, one per server, empty ones left out."""
        k = len(self.base_urls)
        return [(s, s * n // k, (s + 1) * n // k) for s in range(k)
                if (s + 1) * n // k > s * n // k]

    def wait_until_ready(self) -> None:
        """Poll each server's /health with exponential backoff until it answers 200, for at
        most `vllm_server_timeout` seconds in all (a server start takes minutes on big
        models)."""
        deadline = time.monotonic() + self.timeout
        for server in range(len(self.base_urls)):
            self._wait_for(server, deadline)

    def _wait_for(self, server: int, deadline: float) -> None:
        delay, last = 0.25, None
        while True:
            remaining = deadline - time.monotonic()
            try:
                self._request("GET", "/health", timeout=max(0.5, min(5.0, remaining)),
                              server=server)
                return
            except RolloutServerError as e:
                last = e
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RolloutServerError(
                    f"no {self.role} answered at {self.base_urls[server]} within "
                    f"vllm_server_timeout={self.timeout:g}s (last error: {last}). Start one with "
                    f"`megatron rollout --model DIR --host H --port P` and point {self.option} "
                    "at it")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 5.0)

    def model_card(self, server: int = 0) -> dict:
        """vLLM's /v1/models entry of the served model (id, max_model_len, ...)."""
        return self._request("GET", "/v1/models", server=server)["data"][0]

    @property
    def model(self) -> str:
        """The served model's name (vLLM's /v1/models)."""
        if self._model is None:
            self._model = self.model_card()["id"]
        return self._model

    # ------------------------------------------------------------------ sampling
    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 images: Optional[Sequence[Sequence[Any]]] = None, **overrides) -> List[Completion]:
        """Sample `num_generations` completions per prompt through /v1/completions, or,
        with `images` (per prompt, its PIL images; see ColocateEngine.generate), through
        the server's /generate_images, the images sent as PNG."""
        opts = SamplingOptions(**{**self.sampling.__dict__, **overrides})
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        if not prompts:
            return []
        self._calls += 1
        if images is not None:
            if len(images) != len(prompts):
                raise ValueError(f"generate: {len(prompts)} prompts but {len(images)} image lists")
            calls = [functools.partial(self._generate_images, prompts[lo:hi], images[lo:hi],
                                       opts, lo, server)
                     for server, lo, hi in self._shares(len(prompts))]
            return [c for part in self._at_once(calls) for c in part]
        if self.seed is None:         # the servers' own random streams: a request per server
            calls = [(lo, prompts[lo:hi], None, server)
                     for server, lo, hi in self._shares(len(prompts))]
        else:
            # A request per prompt, each with its own seed (as generate_turns' per chain):
            # vLLM gives sample k of a request seed + k, so one seed for the whole batch
            # would draw the same random numbers for every prompt, at every step.
            calls = [(k, [prompts[k]], self._turn_seed(k, 0), server)
                     for server, lo, hi in self._shares(len(prompts)) for k in range(lo, hi)]
        parts = self._at_once([functools.partial(self._offset, first, batch, opts, seed, server)
                               for first, batch, seed, server in calls])
        return [c for part in parts for c in part]

    def _offset(self, first: int, prompts: List[List[int]], opts: SamplingOptions,
                seed: Optional[int], server: int) -> List[Completion]:
        return [dataclasses.replace(c, prompt_index=first + c.prompt_index)
                for c in self._completions(prompts, opts, seed, server)]

    def _generate_images(self, prompts: List[List[int]], images, opts: SamplingOptions,
                         first: int, server: int) -> List[Completion]:
        # A seed per prompt (as generate_turns' per chain): one for all would draw the
        # same random numbers for every prompt.
        out = self._post_json("/generate_images", dict(
            prompts=[{"prompt_token_ids": p, "images": [png_base64(i) for i in imgs],
                      "seed": self._turn_seed(first + k, 0)}
                     for k, (p, imgs) in enumerate(zip(prompts, images))],
            sampling=dict(n=opts.num_generations, max_tokens=opts.max_completion_length,
                          temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k,
                          repetition_penalty=opts.repetition_penalty)), server=server)
        result = []
        for i, (entry, imgs) in enumerate(zip(out["outputs"], images)):
            for c in entry["completions"]:
                result.append(Completion(
                    prompt_index=first + i, token_ids=list(c["token_ids"]), text=c["text"],
                    truncated=c["finish_reason"] == "length",
                    logprobs=list(c["logprobs"]) if opts.logprobs else None,
                    finish_reason=c["finish_reason"],
                    prompt_token_ids=list(entry["prompt_token_ids"]) if imgs else None))
        return result

    def _completions(self, prompts: List[List[int]], opts: SamplingOptions,
                     seed: Optional[int], server: int = 0) -> List[Completion]:
        """One /v1/completions request to `server`: opts.num_generations completions per
        prompt."""
        payload = dict(model=self.lora_names[server] or self.model, prompt=prompts,
                       n=opts.num_generations,
                       max_tokens=opts.max_completion_length, temperature=opts.temperature,
                       top_p=opts.top_p, top_k=opts.top_k,
                       repetition_penalty=opts.repetition_penalty,
                       logprobs=0 if opts.logprobs else None,
                       return_token_ids=True, skip_special_tokens=True)
        if seed is not None:
            payload["seed"] = seed
        out = self._post_json("/v1/completions", payload, server)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        # OpenAI order: choice index = prompt index * n + sample index.
        result = []
        for choice in choices:
            token_ids = list(choice["token_ids"])
            logprobs = ([float(x) for x in choice["logprobs"]["token_logprobs"]]
                        if opts.logprobs else None)
            result.append(Completion(
                prompt_index=choice["index"] // opts.num_generations, token_ids=token_ids,
                text=choice["text"], truncated=choice["finish_reason"] == "length",
                logprobs=logprobs, finish_reason=choice["finish_reason"]))
        return result

    def generate_turns(self, prompt_token_ids: Sequence[Sequence[int]],
                       next_turn: Callable[[int, Completion], Optional[Sequence[int]]],
                       **overrides) -> None:
        """Continuous batching across turns: every chain's turn is its own request, all in
        flight at once (a thread each, up to `max_concurrent_requests`; the server's engine
        batches them). When prompt i's completion c comes back, `next_turn(i, c)` runs in
        this thread and its answer (i's next prompt, or None: finished) is sent at once,
        whatever the other requests are doing.

        Seeds: with a client seed, each request gets its own, drawn from (seed, rank, call,
        chain, turn): the chains of a group often share their prompt, and one seed for all
        would sample them alike."""
        # A trajectory carries its turns' log-probs (trajectory.py): always asked for.
        opts = SamplingOptions(**{**self.sampling.__dict__, **overrides, "num_generations": 1,
                                  "logprobs": True})
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        if not prompts:
            return
        self.model      # asked once here, not by every thread
        self._calls += 1
        turns = [0] * len(prompts)
        pool = ThreadPoolExecutor(max_workers=min(len(prompts), self.max_concurrent_requests),
                                  thread_name_prefix="rollout-turn")

        def submit(i: int, ids: List[int]):
            turns[i] += 1
            return pool.submit(self._completions, [ids], opts, self._turn_seed(i, turns[i]),
                               i % len(self.base_urls))

        running = {submit(i, p): i for i, p in enumerate(prompts)}
        try:
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=running.get):
                    i = running.pop(future)
                    [c] = future.result()
                    c.prompt_index = i
                    ids = next_turn(i, c)
                    if ids is not None:
                        running[submit(i, [int(t) for t in ids])] = i
        finally:
            # On an error, requests still in flight are not waited for.
            pool.shutdown(wait=not running, cancel_futures=True)

    def _turn_seed(self, chain: int, turn: int) -> Optional[int]:
        if self.seed is None:
            return None
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return random.Random(f"{self.seed}:{rank}:{self._calls}:{chain}:{turn}").randrange(2**31)

    def score(self, prompt_ids: Sequence[Sequence[int]],
              completion_ids: Sequence[Sequence[int]]) -> List[List[float]]:
        """Per-token log-probs (temperature 1) of each completion given its prompt."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        full = [[int(t) for t in p] + [int(t) for t in c] for p, c in zip(prompt_ids, completion_ids)]
        if not full:
            return []

        def scored(server: int, lo: int, hi: int) -> List[List[float]]:
            out = self._post_json("/v1/completions", dict(
                model=self.lora_names[server] or self.model, prompt=full[lo:hi], max_tokens=1,
                temperature=0.0, prompt_logprobs=0), server)
            choices = sorted(out["choices"], key=lambda c: c["index"])
            return [[float(choice["prompt_logprobs"][pos][str(ids[pos])]["logprob"])
                     for pos in range(len(p), len(ids))]   # one per position; the first None
                    for choice, ids, p in zip(choices, full[lo:hi], prompt_ids[lo:hi])]

        parts = self._at_once([functools.partial(scored, *share)
                               for share in self._shares(len(full))])
        return [row for part in parts for row in part]

    # ------------------------------------------------------------------ weights (weights.py)
    def begin_weight_update(self) -> None:
        self._on_every_server("POST", "/update_weights/begin")

    def load_bucket(self, bucket: Sequence) -> None:
        self._on_every_server("POST", "/update_weights/bucket", _serialise(bucket),
                              content_type="application/octet-stream")

    def finish_weight_update(self, complete: bool = True) -> None:
        self._on_every_server("POST", "/update_weights/finish",
                              json.dumps({"complete": bool(complete)}).encode())

    def reset_prefix_cache(self) -> None:
        self._on_every_server("POST", "/reset_prefix_cache")

    def begin_adapter_update(self) -> None:
        self._on_every_server("POST", "/update_adapter/begin")

    def load_adapter_bucket(self, bucket: Sequence) -> None:
        self._on_every_server("POST", "/update_adapter/bucket", _serialise(bucket),
                              content_type="application/octet-stream")

    def finish_adapter_update(self, peft_config: dict) -> str:
        """Each server registers the adapter under a new name, which later requests to it
        use (`lora_names`); returns the first server's."""
        body = json.dumps({"peft_config": dict(peft_config)}).encode()
        answers = self._on_every_server("POST", "/update_adapter/finish", body)
        self.lora_names = [a["lora_name"] for a in answers]
        return self.lora_names[0]

    def adapter_fingerprints(self) -> List[dict]:
        """Per vLLM engine (every server's), its workers' adapter fingerprints."""
        return [e for a in self._on_every_server("GET", "/adapter_fingerprints", None)
                for e in a["engines"]]

    def sleep(self, level: int) -> None:
        """Server mode never sleeps (the server has its own devices): a no-op."""

    def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """See sleep()."""

    def weight_fingerprints(self) -> List[List[dict]]:
        """Fingerprint pieces, one list per vLLM engine (every server's data-parallel
        replicas)."""
        return [e for a in self._on_every_server("GET", "/weight_fingerprints", None)
                for e in a["engines"]]

    def close(self) -> None:
        """Nothing to release (each request opens its own connection); the server
        outlives the run."""


def _serialise(bucket: Sequence) -> bytes:
    """A bucket of (name, tensor) as safetensors bytes (CPU copies)."""
    from safetensors.torch import save

    tensors, seen = {}, set()
    for name, t in bucket:
        t = t.detach().contiguous()
        if t.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t.cpu()
    return save(tensors)
