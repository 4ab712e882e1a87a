"""How one Megatron parameter's TP shard is cut out of its Hugging Face tensor(s).

A layout answers, for TP rank `r` of `tp`, which blocks of which HF tensors make up
the rank's shard: a list of `Piece`s. Everything else (reading slices on load,
gathering on export, de-duplicating kv replicas, vocab padding) follows from the
pieces, so a layout is pure arithmetic, testable without any process group.

    piece = Piece(hf=1, axis=0, hf_start=32, hf_stop=48, shard_start=64, shard_stop=80)
    # shard rows [64, 80) == rows [32, 48) of the unit's second HF tensor (k_proj)

Layouts here: `Replicated` (norms), `Split(axis)` (column-parallel axis 0,
row-parallel axis 1; `padded` for the vocab), `QKV` (fused per query group) and
`GateUp` (fused SwiGLU input). Shapes are in HF terms, resolved from `ModelDims`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ModelDims:
    """The sizes layouts need; `from_config` derives them from Megatron's config + ModelArgs."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int           # HF num_key_value_heads
    query_groups: int       # Megatron num_query_groups (== tp when kv_heads < tp: replicas)
    head_dim: int
    vocab: int              # HF rows of embed_tokens / lm_head
    padded_vocab: int       # Megatron rows (divisible by tp)
    layers: int
    tp: int                 # of expert parameters: the expert tensor parallel size (for_experts)
    experts: int = 0        # routed experts per layer (MoE)
    moe_ffn: int = 0        # intermediate size of one routed expert
    shared_ffn: int = 0     # intermediate size of the shared expert (Qwen2-MoE)
    etp: int = 1            # expert tensor parallel size

    @classmethod
    def from_config(cls, config, args) -> "ModelDims":
        hf = args.hf_config
        heads = config.num_attention_heads
        experts = getattr(config, "num_moe_experts", None) or 0
        return cls(hidden=config.hidden_size, ffn=config.ffn_hidden_size, heads=heads,
                   kv_heads=hf.get("num_key_value_heads") or heads,
                   query_groups=config.num_query_groups or heads, head_dim=config.kv_channels,
                   vocab=args.vocab_size, padded_vocab=args.padded_vocab_size,
                   layers=config.num_layers, tp=config.tensor_model_parallel_size,
                   experts=experts, moe_ffn=(config.moe_ffn_hidden_size or 0) if experts else 0,
                   shared_ffn=getattr(config, "moe_shared_expert_intermediate_size", None) or 0,
                   etp=(getattr(config, "expert_tensor_parallel_size", None)
                        or config.tensor_model_parallel_size))

    def for_experts(self) -> "ModelDims":
        """These dims as routed-expert layouts see them: split by ETP instead of TP."""
        return dataclasses.replace(self, tp=self.etp)

    @property
    def one(self) -> int:   # e.g. the shared expert's gate [1, hidden]
        return 1

    # Named sizes that rules use in their HF shapes.
    @property
    def q_out(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_out(self) -> int:
        return self.kv_heads * self.head_dim

    def size(self, name: str) -> int:
        return getattr(self, name)


class Piece(NamedTuple):
    """Shard block [shard_start, shard_stop) along `axis` == HF tensor `hf`'s block
    [hf_start, hf_stop) along the same axis (all of the other axis). axis None: the
    whole tensor (replicated)."""

    hf: int
    axis: int | None
    hf_start: int
    hf_stop: int
    shard_start: int
    shard_stop: int


class Layout:
    """Base class: `pieces(rank, dims, hf_shapes)` and `shard_shape(dims, hf_shapes)`."""

    num_hf = 1           # HF tensors one Megatron parameter is made of
    tp_split = True      # False: every TP rank holds the full tensor

    def pieces(self, rank: int, dims: ModelDims, hf_shapes) -> list[Piece]:
        raise NotImplementedError

    def shard_shape(self, dims: ModelDims, hf_shapes) -> tuple[int, ...]:
        raise NotImplementedError


class Replicated(Layout):
    """The same full tensor on every TP rank (layer norms, q/k norms)."""

    tp_split = False

    def pieces(self, rank, dims, hf_shapes):
        n = hf_shapes[0][0]
        return [Piece(0, None, 0, n, 0, n)]

    def shard_shape(self, dims, hf_shapes):
        return tuple(hf_shapes[0])


@dataclass(frozen=True)
class Split(Layout):
    """Even split along `axis` (0: column-parallel, 1: row-parallel).

    padded: the Megatron tensor has `dims.padded_vocab` rows along axis 0 (the HF one
    `dims.vocab`); the rows past the HF vocab hold no HF data (zero on load, trimmed on
    export).
    """

    axis: int
    padded: bool = False

    def _full(self, dims, hf_shapes) -> int:
        return dims.padded_vocab if self.padded else hf_shapes[0][self.axis]

    def pieces(self, rank, dims, hf_shapes):
        n = hf_shapes[0][self.axis]
        per = self._full(dims, hf_shapes) // dims.tp
        start, stop = rank * per, min((rank + 1) * per, n)
        if start >= stop:  # a rank holding only vocab padding
            return []
        return [Piece(0, self.axis, start, stop, 0, stop - start)]

    def shard_shape(self, dims, hf_shapes):
        shape = list(hf_shapes[0])
        shape[self.axis] = self._full(dims, hf_shapes) // dims.tp
        return tuple(shape)


class QKV(Layout):
    """Megatron's fused `linear_qkv` (weight [rows, hidden] or bias [rows]).

    Rows are grouped per query group g: [q heads of g (q_per_group * head_dim), k (head_dim),
    v (head_dim)]; TP rank r holds groups [r * G/tp, (r+1) * G/tp). With fewer HF kv heads
    than TP ranks, Megatron runs with G = tp groups and group g uses HF kv head
    g // (G / kv_heads): each kv head is replicated on G / kv_heads ranks.
    HF tensors: (q_proj [heads*d, ...], k_proj [kv*d, ...], v_proj [kv*d, ...]).
    """

    num_hf = 3

    def pieces(self, rank, dims, hf_shapes):
        d, groups = dims.head_dim, dims.query_groups
        q_per_group = dims.heads // groups
        replicas = max(groups // dims.kv_heads, 1)  # ranks sharing one HF kv head
        local = groups // dims.tp
        out, row = [], 0
        for g in range(rank * local, (rank + 1) * local):
            kv = g // replicas
            q0 = g * q_per_group * d
            out.append(Piece(0, 0, q0, q0 + q_per_group * d, row, row + q_per_group * d))
            row += q_per_group * d
            out.append(Piece(1, 0, kv * d, (kv + 1) * d, row, row + d))
            row += d
            out.append(Piece(2, 0, kv * d, (kv + 1) * d, row, row + d))
            row += d
        return out

    def shard_shape(self, dims, hf_shapes):
        q_per_group = dims.heads // dims.query_groups
        rows = dims.query_groups // dims.tp * (q_per_group + 2) * dims.head_dim
        return (rows,) + tuple(hf_shapes[0][1:])


class GateUp(Layout):
    """Megatron's fused `linear_fc1`: TP rank r holds [gate rows of r; up rows of r].
    HF tensors: (gate_proj [ffn, hidden], up_proj [ffn, hidden])."""

    num_hf = 2

    def pieces(self, rank, dims, hf_shapes):
        per = hf_shapes[0][0] // dims.tp
        start = rank * per
        return [Piece(0, 0, start, start + per, 0, per),
                Piece(1, 0, start, start + per, per, 2 * per)]

    def shard_shape(self, dims, hf_shapes):
        return (2 * hf_shapes[0][0] // dims.tp,) + tuple(hf_shapes[0][1:])


REPLICATED = Replicated()
COLUMN = Split(axis=0)
ROW = Split(axis=1)
VOCAB = Split(axis=0, padded=True)
FUSED_QKV = QKV()
FUSED_GATE_UP = GateUp()


def export_pieces(layout: Layout, j: int, dims: ModelDims, hf_shapes) -> list[tuple[int, Piece]]:
    """(tp rank, piece) pairs that rebuild HF tensor `j` exactly once, in HF order.

    Replicas (kv heads held by several ranks) are taken from the lowest rank; a plan
    that leaves a gap or overlaps partially is a layout bug and raises.
    """
    if not layout.tp_split:
        return [(0, layout.pieces(0, dims, hf_shapes)[0])]
    chosen: dict[tuple[int, int], tuple[int, Piece]] = {}
    for rank in range(dims.tp):
        for piece in layout.pieces(rank, dims, hf_shapes):
            if piece.hf == j:
                chosen.setdefault((piece.hf_start, piece.hf_stop), (rank, piece))
    ordered = [chosen[k] for k in sorted(chosen)]
    axis = ordered[0][1].axis if ordered else 0
    expect = 0
    for _, piece in ordered:
        if piece.hf_start != expect:
            raise RuntimeError(f"layout {type(layout).__name__} does not tile HF tensor {j}: "
                               f"block at {piece.hf_start}, expected {expect}")
        expect = piece.hf_stop
    if expect != hf_shapes[j][axis]:
        raise RuntimeError(f"layout {type(layout).__name__} covers {expect} of "
                           f"{hf_shapes[j][axis]} along axis {axis} of HF tensor {j}")
    return ordered
