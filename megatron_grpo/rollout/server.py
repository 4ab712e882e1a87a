"""`megatron rollout`: a vLLM server for server mode, fed weights by the trainer.

    megatron rollout --model DIR --vllm_tensor_parallel_size N --vllm_data_parallel_size M \
        --host 127.0.0.1 --port 8000 [--api_key TOKEN]
    python -m megatron_grpo.rollout.server --model DIR ...      (the same)

It is vLLM's own OpenAI-compatible server (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`, ...: built with vLLM's app factory, so every option of the
API behaves as in `vllm serve`) with routes added for the trainer:

    POST /update_weights/begin            start a weight update (layer-wise reload)
    POST /update_weights/bucket           body: one bucket, safetensors-serialised
    POST /update_weights/finish           finish it; resets the prefix cache
    POST /reset_prefix_cache
    GET  /weight_fingerprints             per-engine fingerprint pieces (verify.py)
    POST /update_adapter/begin            adapter-only LoRA sync (--vllm_enable_lora true):
    POST /update_adapter/bucket           PEFT-named adapter tensors, safetensors-serialised
    POST /update_adapter/finish           body {"peft_config": ...}: register them as a new
                                          adapter (the old one removed); answers its
                                          lora_name, the `model` later requests name
    GET  /adapter_fingerprints            per-engine adapter fingerprints (verify.py)
    POST /generate_images                 image prompts (vision-language models), below

`/v1/completions` takes no images, hence `/generate_images`: JSON `{"prompts":
[{"prompt_token_ids": [...], "images": ["data:image/png;base64,...", ...], "seed": s}],
"sampling": {"n", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty"}}`,
the ids holding one image placeholder per image (vLLM expands it); the answer gives
per prompt the expanded `prompt_token_ids` and the completions (token ids, log-probs,
text, finish reason). PNG keeps the pixels exact. Where torchvision does not import,
the server applies compat's patches before its engine starts (its engine-core process
is forked from this one and inherits them); `--max_pixels` / `MAX_PIXELS` and
`--vllm_limit_mm_per_prompt` become vLLM's `--mm-processor-kwargs` / `--limit-mm-per-prompt`.

The weight routes need `Authorization: Bearer <token>` when a token is set
(`--api_key`, or the MEGATRON_ROLLOUT_API_KEY environment variable); the server
binds 127.0.0.1 unless --host says otherwise. The engine samples with
`logprobs_mode=processed_logprobs`, as the colocated engine does (see colocate.py).

A bucket's bytes are written to a temporary file (in /dev/shm when it exists) that
every vLLM worker process reads: tensors never go through vLLM's RPC encoding. With
vllm_data_parallel_size > 1 vLLM runs one engine per replica behind this one API
server (it balances requests); weight updates go to every engine, and the
fingerprints come back per engine.
"""
# No `from __future__ import annotations` here: FastAPI reads the route signatures.

import asyncio
import json
import os
import shutil
import sys
import tempfile
import uuid
from typing import Optional, Sequence

from ..config.rollout_server import parse_rollout_args
from ..data.vision import is_vision_language, load_image, model_type, resolve_max_pixels
from ..platform.compat import vllm as compat
from .kv_cache import kv_cache_engine_kwargs
from .weights import adapter_name
from .worker_ext import WORKER_EXTENSION

API_KEY_ENV = "MEGATRON_ROLLOUT_API_KEY"


# Sequences one server engine is sized for when --vllm_max_num_seqs is not given: the
# server does not know the trainer's batch; a smaller cache only makes vLLM queue.
SERVER_SEQUENCES = 32


def vllm_cli_args(cfg, on_cpu: Optional[bool] = None) -> list:
    """`vllm serve` flags for a RolloutServerConfig (on_cpu: None asks vLLM's platform).

    The KV cache is sized in bytes on CPU (kv_cache.py), never as a fraction of the
    NUMA node: `--kv-cache-memory-bytes` unless the user's vLLM conventions apply.
    """
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()

    argv = ["--model", cfg.model, "--host", cfg.host, "--port", str(cfg.port),
            "--tensor-parallel-size", str(cfg.vllm_tensor_parallel_size),
            "--data-parallel-size", str(cfg.vllm_data_parallel_size),
            "--gpu-memory-utilization", str(cfg.vllm_gpu_memory_utilization),
            "--seed", str(cfg.seed), "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", WORKER_EXTENSION,
            "--enable-prefix-caching" if cfg.vllm_enable_prefix_caching
            else "--no-enable-prefix-caching"]
    if cfg.vllm_max_model_len is not None:
        argv += ["--max-model-len", str(cfg.vllm_max_model_len)]
    if cfg.vllm_enforce_eager:
        argv.append("--enforce-eager")
    if cfg.vllm_max_num_seqs is not None:
        argv += ["--max-num-seqs", str(cfg.vllm_max_num_seqs)]
    if cfg.vllm_enable_lora:   # one adapter at a time: each sync replaces it
        argv += ["--enable-lora", "--max-lora-rank", str(cfg.vllm_max_lora_rank),
                 "--max-loras", "1"]
    kv = kv_cache_engine_kwargs(
        cfg.model, on_cpu=on_cpu, size=cfg.vllm_kv_cache_memory,
        sequences=cfg.vllm_max_num_seqs or SERVER_SEQUENCES, max_model_len=cfg.vllm_max_model_len,
        tensor_parallel_size=cfg.vllm_tensor_parallel_size, engine_kwargs=cfg.vllm_engine_kwargs)
    if "kv_cache_memory_bytes" in kv:
        argv += ["--kv-cache-memory-bytes", str(kv["kv_cache_memory_bytes"])]
    if is_vision_language(cfg.model):
        max_pixels = resolve_max_pixels(cfg.max_pixels, cfg.model)
        if max_pixels is not None:
            argv += ["--mm-processor-kwargs", json.dumps({"max_pixels": max_pixels})]
        if cfg.vllm_limit_mm_per_prompt is not None:
            argv += ["--limit-mm-per-prompt", json.dumps(cfg.vllm_limit_mm_per_prompt)]
    return argv


def build_vllm_namespace(cfg):
    """vLLM's serve arguments (its own parser and validation), plus vllm_engine_kwargs."""
    args = compat.parse_serve_args(vllm_cli_args(cfg), prog="megatron rollout")
    for key, value in (cfg.vllm_engine_kwargs or {}).items():
        dest = key.replace("-", "_")
        if not hasattr(args, dest):
            raise ValueError(f"--vllm_engine_kwargs: {key!r} is not a vLLM engine argument")
        setattr(args, dest, value)
    compat.validate_serve_args(args)
    return args


def guard_sampling(app, status: dict) -> None:
    """Answer sampling and scoring requests (vLLM's /v1/ routes, the model list aside, and
    /generate_images) with 503 and the reason while `status["problem"]` says the served
    weights are not a whole update (make_router's). Wraps the app's built middleware stack:
    vLLM has built it by then, and Starlette adds no middleware after that."""
    from fastapi.responses import JSONResponse

    inner = app.middleware_stack or app.build_middleware_stack()

    async def guarded(scope, receive, send):
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if status["problem"] and path.startswith(("/v1/", "/generate")) and path != "/v1/models":
            response = JSONResponse(status_code=503, content={"error": {
                "message": status["problem"], "type": "ServiceUnavailable", "code": 503}})
            await response(scope, receive, send)
            return
        await inner(scope, receive, send)

    app.middleware_stack = guarded


class _RouteContext:
    """What every trainer route shares: the engine client, the token check, the rpc to
    every engine, and the bucket-to-file step of the weight and adapter uploads."""

    def __init__(self, engine, api_key: Optional[str]):
        self.engine = engine
        self.api_key = api_key
        self.shm = "/dev/shm" if os.path.isdir("/dev/shm") else None

    def authorise(self, request) -> None:
        """401 unless the request carries the server's token (when one is set)."""
        from fastapi import HTTPException

        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise HTTPException(status_code=401, detail=(
                "missing or wrong API token for weight updates (Authorization: Bearer); the "
                f"trainer sends ${API_KEY_ENV}: set it to the server's --api_key"))

    async def rpc_all(self, method: str, *args):
        """collective_rpc on every engine (each DP replica); results per engine."""
        return await compat.collective_rpc_all_engines(self.engine, method, *args)

    async def load_file(self, request, method: str):
        """A bucket's bytes into a temporary file every worker reads with `method`."""
        from fastapi import HTTPException

        body = await request.body()
        if not body:
            raise HTTPException(status_code=400, detail="empty bucket")
        # /dev/shm (memory) when it has room: a container's is often 64 MiB, less than a bucket
        room = self.shm is not None and shutil.disk_usage(self.shm).free >= len(body) + (16 << 20)
        fd, path = tempfile.mkstemp(suffix=".safetensors", prefix="mgrpo_bucket_",
                                    dir=self.shm if room else None)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            del body
            counts = await self.rpc_all(method, path)
        finally:
            os.unlink(path)
        return {"ok": True, "tensors": counts[0][0]}


def make_router(engine, api_key: Optional[str], app_state=None):
    """The trainer's routes, bound to vLLM's engine client (`app_state`: the OpenAI
    app's state, where adapter-only LoRA sync registers each new adapter's name).

    `router.weights_problem` says why the served weights are not a whole update (None:
    they are); `guard_sampling` answers sampling requests 503 meanwhile."""
    from fastapi import APIRouter

    router = APIRouter()
    router.weights_problem = status = {"problem": None, "failed": False}
    ctx = _RouteContext(engine, api_key)
    _add_weight_routes(router, ctx, status)
    _add_adapter_routes(router, ctx, app_state)
    _add_cache_and_image_routes(router, ctx)
    return router


def _add_weight_routes(router, ctx: _RouteContext, status: dict) -> None:
    """/update_weights/{begin,bucket,finish} and /weight_fingerprints. A bucket that fails,
    or a finish that says the trainer gave up, leaves `status` naming the problem until a
    whole update arrives: the served weights are then a mix of two versions."""
    from fastapi import HTTPException, Request, Response

    @router.post("/update_weights/begin")
    async def begin(request: Request):
        ctx.authorise(request)
        status.update(problem="a weight update is in progress", failed=False)
        await ctx.rpc_all("mg_begin_weight_update")
        return {"ok": True}

    @router.post("/update_weights/bucket")
    async def bucket(request: Request):
        ctx.authorise(request)
        try:
            return await ctx.load_file(request, "mg_load_weights_file")
        except Exception as e:
            status.update(problem=f"a weight update failed part-way ({type(e).__name__}: "
                                  f"{e}); the served weights are incomplete until a whole "
                                  "update arrives", failed=True)
            raise

    @router.post("/update_weights/finish")
    async def finish(request: Request):
        ctx.authorise(request)
        body = await request.body()
        complete = json.loads(body).get("complete", True) if body else True
        await ctx.rpc_all("mg_finish_weight_update")    # out of buffered reload, whatever came
        if not complete and not status["failed"]:
            status.update(problem="the trainer abandoned a weight update part-way; the "
                                  "served weights are incomplete until a whole update "
                                  "arrives (a run's start, or its resume, sends one)",
                          failed=True)
        if status["failed"]:
            if complete:
                raise HTTPException(status_code=409, detail=status["problem"])
            return {"ok": True, "complete": False}
        status.update(problem=None)
        await ctx.engine.reset_prefix_cache()
        # Cached vision-tower outputs are stale too (ColocateEngine.reset_prefix_cache);
        # text models have an empty encoder cache.
        await ctx.engine.reset_encoder_cache()
        return {"ok": True}

    @router.get("/weight_fingerprints")
    async def weight_fingerprints(request: Request):
        ctx.authorise(request)
        per_engine = await ctx.rpc_all("mg_fingerprint_pieces")
        # [engine][worker][piece] -> [engine][piece]. Plain json: a garbage weight may
        # fingerprint as NaN, which is evidence to report, not an encoding error.
        body = {"engines": [[p for worker in workers for p in worker] for workers in per_engine]}
        return Response(json.dumps(body, allow_nan=True), media_type="application/json")


def _add_adapter_routes(router, ctx: _RouteContext, app_state) -> None:
    """/update_adapter/{begin,bucket,finish} and /adapter_fingerprints: adapter-only LoRA
    sync. Each finish registers the adapter under a new name in the OpenAI app's state
    (the old one removed), the `model` that later requests name."""
    from fastapi import Request, Response

    adapter = {"version": 0, "name": None}     # the adapter requests run with

    @router.post("/update_adapter/begin")
    async def adapter_begin(request: Request):
        ctx.authorise(request)
        await ctx.rpc_all("mg_begin_adapter_update")
        return {"ok": True}

    @router.post("/update_adapter/bucket")
    async def adapter_bucket(request: Request):
        ctx.authorise(request)
        return await ctx.load_file(request, "mg_load_adapter_file")

    @router.post("/update_adapter/finish")
    async def adapter_finish(request: Request):
        ctx.authorise(request)
        body = await request.json()
        version = adapter["version"] + 1
        name = adapter_name(version)
        await ctx.rpc_all("mg_finish_adapter_update", version, body["peft_config"])
        compat.register_served_lora(app_state, compat.lora_request(name, version),
                                    previous=adapter["name"])
        adapter.update(version=version, name=name)
        await ctx.engine.reset_prefix_cache()
        return {"ok": True, "lora_name": name}

    @router.get("/adapter_fingerprints")
    async def adapter_fingerprints(request: Request):
        ctx.authorise(request)
        per_engine = await ctx.rpc_all("mg_adapter_fingerprints")
        return Response(json.dumps({"engines": per_engine}, allow_nan=True),
                        media_type="application/json")


def _add_cache_and_image_routes(router, ctx: _RouteContext) -> None:
    """/reset_prefix_cache and /generate_images (image prompts: /v1/completions takes no
    images)."""
    from fastapi import Request, Response

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        ctx.authorise(request)
        await ctx.engine.reset_prefix_cache()
        return {"ok": True}

    @router.post("/generate_images")
    async def generate_images(request: Request):
        # Plain json: a NaN log-prob (a broken model) reaches the trainer, which names it,
        # instead of failing the encoding (FastAPI's JSON refuses NaN).
        body = await _generate_images(ctx.engine, await request.json())
        return Response(json.dumps(body, allow_nan=True), media_type="application/json")


async def _generate_images(engine, body: dict) -> dict:
    """Sample image prompts through the engine client (AsyncLLM.generate), all at once."""
    from fastapi import HTTPException
    from vllm import SamplingParams

    try:
        s = body["sampling"]
        params = [SamplingParams(n=int(s["n"]), max_tokens=int(s["max_tokens"]),
                                 temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                                 top_k=int(s["top_k"]), seed=p.get("seed"), logprobs=0,
                                 repetition_penalty=float(s["repetition_penalty"]))
                  for p in body["prompts"]]
        for one_params in params:     # one output with all n completions
            compat.final_output_only(one_params)
        prompts = [{"prompt_token_ids": [int(t) for t in p["prompt_token_ids"]],
                    "multi_modal_data": {"image": [load_image(i) for i in p["images"]]}}
                   if p.get("images") else {"prompt_token_ids": [int(t) for t in p["prompt_token_ids"]]}
                   for p in body["prompts"]]
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise HTTPException(status_code=400, detail=f"bad /generate_images request: {e}")

    async def one(prompt, k):
        final = None
        async for out in engine.generate(prompt, params[k], f"mg-images-{uuid.uuid4().hex}-{k}"):
            final = out
        return {"prompt_token_ids": list(final.prompt_token_ids), "completions": [
            {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": [float(lp[t].logprob) for lp, t in zip(c.logprobs or [], c.token_ids)]}
            for c in final.outputs]}

    return {"outputs": await asyncio.gather(*(one(p, k) for k, p in enumerate(prompts)))}


def compile_nothing() -> None:
    """An eager server's engine processes compile nothing, as the colocated engine
    (colocate.py): vLLM torch.compiles its sampler's token-rank helper
    (`batched_count_greater_than`) whatever --enforce-eager says, an inductor compile of
    seconds (C++ builds in child interpreters) in the first request, for a
    `(x >= v).sum(-1)` whose eager result is the same integers. The engine core and its
    workers are other processes: vLLM-CPU spawns them, and a spawned process reads
    torch's TORCH_COMPILE_DISABLE=1 when it imports torch (vLLM honours it too: no
    compilation); a forked one inherits this process's "force_eager" stance."""
    import torch

    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    torch.compiler.set_stance("force_eager")


async def serve(cfg) -> None:
    """Start vLLM's engine and API server with the trainer's routes; run until stopped."""
    if cfg.vllm_enforce_eager:
        compile_nothing()
    if is_vision_language(cfg.model):
        compat.image_models_without_torchvision(model_type(cfg.model))
    args = build_vllm_namespace(cfg)
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
    # Bind first: a port already in use fails before minutes of engine start-up.
    sock = compat.bind_server_socket(args)
    async with compat.engine_client(args) as engine:
        app = await compat.build_openai_app(args, engine)
        router = make_router(engine, api_key, app.state)
        app.include_router(router)
        guard_sampling(app, router.weights_problem)
        shutdown = await compat.serve_app(app, sock, args)
    try:
        await shutdown
    finally:
        sock.close()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of `megatron rollout` (argv: its flags, without the sub-command)."""
    cfg = parse_rollout_args(argv)
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"megatron rollout: listening on {cfg.host}:{cfg.port}, reachable from the "
              "network" + ("" if cfg.api_key or os.environ.get(API_KEY_ENV)
                           else "; weight updates are unguarded: set --api_key"), file=sys.stderr)
    import uvloop

    uvloop.run(serve(cfg))


if __name__ == "__main__":
    main()
