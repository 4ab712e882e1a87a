"""Fused kernels: vocab-parallel log-prob and entropy from hidden states.

`vocab_parallel_logprobs` is the entry point; it runs chunked torch code on CPU (and wherever
Triton is absent) and the Triton per-tile kernels on CUDA (`triton_logprob.py`, imported only
when a CUDA tensor asks for it).
"""
from .logprob import (BACKENDS, DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNK_VOCAB,
                      vocab_parallel_logprobs)

__all__ = ["vocab_parallel_logprobs", "BACKENDS", "DEFAULT_CHUNK_TOKENS", "DEFAULT_CHUNK_VOCAB"]
