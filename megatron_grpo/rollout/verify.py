"""Proof that vLLM holds the trainer's weights: per-tensor fingerprints on both sides.

A fingerprint of a tensor x (HF name, HF layout) hashes the exact bits of its
values: with b_i the float32 bit pattern of element i (i the flat row-major index
in the full HF tensor; bf16/fp16 values widen to float32 exactly; -0.0 counts as
+0.0) and P = 2**31 - 1,

    numel,  h1 = sum b_i w1(i) mod P,  h2 = sum b_i w2(i) mod P,  sum x_i (float64)

where w1, w2 are two fixed integer hashes of i. Integer arithmetic makes the hashes
exact and independent of summation order, so the two sides must agree bit for
bit: any changed bit of any element (one ulp of one weight) and any value in the
wrong place (swapped rows, a transposed matrix, a shifted slice) change them,
except with probability ~2**-62. `sum` is only there to make error messages
readable. All fields add up over disjoint pieces of a tensor, which is what lets
vLLM's sharded, fused parameters be compared with the trainer's full HF tensors:

- trainer side (`StreamFingerprints`): each HF tensor of the weight stream is
  fingerprinted as it passes, bucket by bucket (nothing is kept but the numbers);
- vLLM side (`vllm_fingerprint_pieces`, run inside each vLLM worker): every
  parameter of the model is read back *as the kernels use it* and cut into the HF
  tensors it holds: `qkv_proj` -> q/k/v row blocks, `gate_up_proj` -> gate/up,
  TP shards -> their slice of the HF tensor, vocab padding dropped. On CPU, vLLM
  repacks linear weights for oneDNN and leaves an empty `weight` parameter; those
  are recovered by running the layer's own GEMM on identity rows (exact: each
  output element is one weight times 1.0 plus zeros), so a sync that updated the
  parameter but not the packed copy is caught too;
- `combine_pieces` adds the pieces of each HF tensor over the vLLM TP ranks
  (replicated pieces, e.g. norms or kv heads when kv heads < TP, are counted once
  after checking the replicas agree) and checks the pieces tile the tensor;
- `compare_fingerprints` / `check_weight_sync` raise `WeightSyncError` naming every
  tensor that differs, that vLLM holds but the stream lacked, or the reverse.

vLLM holds weights in its own dtype: when it differs from the stream's, fingerprint
the stream cast to vLLM's dtype (`StreamFingerprints(cast_to=...)`), which is what
vLLM's loader stores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..platform.compat import vllm as compat

FIELDS = ("numel", "h1", "h2", "sum")
EXACT_FIELDS = ("numel", "h1", "h2")
Fingerprint = Dict[str, float]
_P = 2147483647  # 2**31 - 1, prime: products of two residues stay below 2**62
# Elements per chunk: bounds the int64 temporaries, and keeps a chunk's sum of
# residues (< 2**20 * 2**31) far from int64 overflow.
_CHUNK = 1 << 20
_SALTS = ((48271, 16807, 1234567), (69621, 40692, 7654321))


class WeightSyncError(RuntimeError):
    """vLLM does not hold the weights the trainer streamed."""


# --------------------------------------------------------------------------- math
def _index_weights(idx: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """w(i) in [0, P) for int64 flat indices: u = (a i + b (i div P) + c) mod P, w = u^2 + c.

    Squaring makes w non-linear in i, so a shifted copy of a tensor does not hash to
    a simple function of the original. Exact int64 math: every product < 2**62.
    """
    a, b, c = _SALTS[salt]
    u = ((idx % _P) * a + (idx // _P) * b + c) % _P
    return (u * u + c) % _P


def _bits(values: torch.Tensor) -> torch.Tensor:
    """Float32 bit patterns as non-negative int64, -0.0 folded into +0.0."""
    x = values.detach().to(torch.float32) + 0.0  # exact widening; -0.0 + 0.0 = +0.0
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def fingerprint_piece(values: torch.Tensor, full_shape: Sequence[int], dim: int = 0,
                      start: int = 0) -> Fingerprint:
    """Fingerprint of `values` = full_tensor.narrow(dim, start, values.shape[dim]).

    `full_shape` is the HF tensor's shape; flat indices refer to it, so the pieces of
    one tensor add up (mod P) to the fingerprint of the whole. Runs on the values'
    device.
    """
    full_shape = tuple(int(s) for s in full_shape)
    if values.dim() != len(full_shape):
        raise ValueError(f"piece of rank {values.dim()} for a tensor of shape {full_shape}")
    if values.dim() == 0:
        values, full_shape, dim = values.reshape(1), (1,), 0
    size = full_shape[dim]                         # B
    inner = math.prod(full_shape[dim + 1:])        # C
    length = values.shape[dim]
    # [A, L, C] -> rows of C elements; row r is (a, b) = divmod(r, L).
    rows = values.detach().reshape(-1, inner)
    h1 = h2 = 0
    total = 0.0
    rows_per_chunk = max(1, _CHUNK // max(inner, 1))
    cols = torch.arange(inner, dtype=torch.int64, device=rows.device)
    for r0 in range(0, rows.shape[0], rows_per_chunk):
        chunk = rows[r0:r0 + rows_per_chunk]                                          # [R, C]
        r = torch.arange(r0, r0 + chunk.shape[0], dtype=torch.int64, device=rows.device)
        a, b = r // length, r % length
        idx = ((a * size + start + b) * inner)[:, None] + cols[None, :]               # [R, C]
        bits = _bits(chunk) % _P
        h1 = (h1 + int(((bits * _index_weights(idx, 0)) % _P).sum())) % _P
        h2 = (h2 + int(((bits * _index_weights(idx, 1)) % _P).sum())) % _P
        total += chunk.double().sum().item()
    return {"numel": rows.numel(), "h1": h1, "h2": h2, "sum": total}


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """Fingerprint of a whole tensor."""
    return fingerprint_piece(tensor, tensor.shape)


def _add(a: Fingerprint, b: Fingerprint) -> Fingerprint:
    return {"numel": a["numel"] + b["numel"], "h1": (a["h1"] + b["h1"]) % _P,
            "h2": (a["h2"] + b["h2"]) % _P, "sum": a["sum"] + b["sum"]}


# --------------------------------------------------------------------------- trainer side
class StreamFingerprints:
    """Fingerprints of a weight stream, taken as its buckets pass by.

        expected = StreamFingerprints()
        load_weight_stream(engine, expected.watch(buckets))
        check_weight_sync(engine, expected.result)
    """

    def __init__(self, cast_to: Optional[torch.dtype] = None) -> None:
        self.cast_to = cast_to  # vLLM's dtype when it differs from the stream's
        self.result: Dict[str, Fingerprint] = {}
        self.shapes: Dict[str, Tuple[int, ...]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.result:
            raise WeightSyncError(f"the weight stream carries {name!r} twice")
        if self.cast_to is not None:
            tensor = tensor.to(self.cast_to)
        self.result[name] = fingerprint(tensor)
        self.shapes[name] = tuple(tensor.shape)

    def watch(self, buckets: Iterable[Sequence[Tuple[str, torch.Tensor]]]
              ) -> Iterator[Sequence[Tuple[str, torch.Tensor]]]:
        """Yield `buckets` unchanged, fingerprinting every tensor on the way."""
        for bucket in buckets:
            for name, tensor in bucket:
                self.add(name, tensor)
            yield bucket


def fingerprint_state(tensors: Iterable[Tuple[str, torch.Tensor]]) -> Dict[str, Fingerprint]:
    """Fingerprints of (name, tensor) pairs, e.g. an HF checkpoint's tensors."""
    fp = StreamFingerprints()
    for name, tensor in tensors:
        fp.add(name, tensor)
    return fp.result


# --------------------------------------------------------------------------- vLLM side
@dataclass
class _Piece:
    """Local rows/cols [local_start, local_start + length) along `dim` of a vLLM
    parameter hold HF tensor `name` (shape `full_shape`) from `start` on."""
    name: str
    full_shape: Tuple[int, ...]
    dim: int
    local_start: int
    start: int
    length: int


def _probe_gemm(module: torch.nn.Module, param: torch.Tensor, in_f: int) -> torch.Tensor:
    """The matrix a CPU-packed linear computes with, [out_local, in_f].

    vLLM-CPU packs linear weights into oneDNN / sgl-kernel buffers after loading.
    Feeding identity rows through the layer's own GEMM returns the packed matrix
    exactly (each output is 1.0 * w plus exact zeros), so what is checked is what
    the kernels use, not a parameter they may no longer read.
    """
    gemm = compat.packed_gemm(module)
    cols = []
    block = max(1, min(in_f, 256))
    for k0 in range(0, in_f, block):
        k1 = min(in_f, k0 + block)
        eye = torch.zeros(k1 - k0, in_f, dtype=param.dtype)
        eye[torch.arange(k1 - k0), torch.arange(k0, k1)] = 1
        cols.append(gemm(eye, param, None).t())                               # [out, k1-k0]
    return torch.cat(cols, dim=1)


def _effective_weight(module: torch.nn.Module, param: torch.Tensor) -> Tuple[torch.Tensor, str]:
    """The weight the layer computes with, and a problem message ('' if none).

    Linear layers on vLLM-CPU leave an empty `weight` after packing: probe the GEMM.
    Embeddings / LM heads keep `weight` for the lookup *and* pack a copy for the
    logits GEMM: both are used, so they must agree.
    """
    if compat.packed_gemm(module) is None:
        return param, ""
    if param.numel() == 0:
        in_f = getattr(module, "input_size_per_partition", None) or module.input_size
        return _probe_gemm(module, param, in_f), ""  # (MoE router gates are replicated)
    if param.dim() == 2:
        packed = _probe_gemm(module, param, param.shape[1])
        if not torch.equal(packed, param[:packed.shape[0]]):
            return param, ("the packed copy vLLM-CPU keeps of this weight for its GEMM (the "
                           "LM head's logits) differs from the parameter: stale after an update")
    return param, ""


def _packed_names(model: torch.nn.Module) -> Dict[str, List[str]]:
    """vLLM's fused module name -> the HF modules fused into it, in order."""
    mapping = dict(getattr(model, "packed_modules_mapping", {}) or {})
    mapping.setdefault("qkv_proj", ["q_proj", "k_proj", "v_proj"])
    mapping.setdefault("gate_up_proj", ["gate_proj", "up_proj"])
    return mapping


def _pieces_of(module_name: str, module: torch.nn.Module, pname: str, param: torch.Tensor,
               packed: Dict[str, List[str]]) -> List[_Piece]:
    """Which HF tensors (and which slices of them) the vLLM parameter holds."""
    layers = compat.parallel_layer_classes()

    prefix, _, leaf = module_name.rpartition(".")
    prefix = prefix + "." if prefix else ""
    hf = f"{module_name}.{pname}"
    tp_size = getattr(module, "tp_size", 1)
    tp_rank = getattr(module, "tp_rank", 0)
    if isinstance(module, layers.qkv):
        names = packed.get(leaf, ["q_proj", "k_proj", "v_proj"])
        hs, vhs = module.head_size, module.v_head_size
        nq, nkv = module.num_heads, module.num_kv_heads              # per rank
        kv_rank = tp_rank // module.num_kv_head_replicas
        hidden = () if pname == "bias" else (module.input_size,)
        tq, tkv = module.total_num_heads, max(module.total_num_kv_heads, 1)
        if len(names) == 1:   # one HF tensor [q; k; v] (a vision tower's `attn.qkv`)
            full = (tq * hs + tkv * hs + tkv * vhs, *hidden)
            name = f"{prefix}{names[0]}.{pname}"
            return [_Piece(name, full, 0, 0, tp_rank * nq * hs, nq * hs),
                    _Piece(name, full, 0, nq * hs, tq * hs + kv_rank * nkv * hs, nkv * hs),
                    _Piece(name, full, 0, nq * hs + nkv * hs,
                           tq * hs + tkv * hs + kv_rank * nkv * vhs, nkv * vhs)]
        q, k, v = names
        return [
            _Piece(f"{prefix}{q}.{pname}", (tq * hs, *hidden), 0, 0, tp_rank * nq * hs, nq * hs),
            _Piece(f"{prefix}{k}.{pname}", (tkv * hs, *hidden), 0, nq * hs, kv_rank * nkv * hs,
                   nkv * hs),
            _Piece(f"{prefix}{v}.{pname}", (tkv * vhs, *hidden), 0, nq * hs + nkv * hs,
                   kv_rank * nkv * vhs, nkv * vhs),
        ]
    if isinstance(module, layers.merged):
        names = packed.get(leaf) or [f"{leaf}_{i}" for i in range(len(module.output_sizes))]
        hidden = () if pname == "bias" else (module.input_size,)
        pieces, local = [], 0
        for name, total in zip(names, module.output_sizes):
            size = total // tp_size
            pieces.append(_Piece(f"{prefix}{name}.{pname}", (total, *hidden), 0, local,
                                 tp_rank * size, size))
            local += size
        return pieces
    if isinstance(module, layers.row) and pname == "weight":
        size = module.input_size_per_partition
        return [_Piece(hf, (module.output_size, module.input_size), 1, 0, tp_rank * size, size)]
    if isinstance(module, layers.column):
        size = module.output_size_per_partition
        hidden = () if pname == "bias" else (module.input_size,)
        return [_Piece(hf, (module.output_size, *hidden), 0, 0, tp_rank * size, size)]
    if isinstance(module, layers.vocab) and pname == "weight":
        idx = module.shard_indices
        size = idx.org_vocab_end_index - idx.org_vocab_start_index
        # Rows past `size` are vLLM's vocab padding: not part of the HF tensor.
        return [_Piece(hf, (module.org_vocab_size, module.embedding_dim), 0, 0,
                       idx.org_vocab_start_index, size)]
    # Norms, replicated linears, RowParallel biases: the whole HF tensor on every rank.
    return [_Piece(hf, tuple(param.shape), 0, 0, 0, param.shape[0] if param.dim() else 1)]


def _expert_pieces(module_name: str, module: torch.nn.Module) -> List[dict]:
    """Pieces of a routed-experts layer (MoE): local expert j of w13 [E_local, 2I', H]
    holds rows [0, I) = gate_proj and [I', I' + I) = up_proj of its global expert (its TP
    slice of them; I' >= I is vLLM's padded size), w2 [E_local, H, I'] columns [0, I) its
    down_proj slice. Read back in checkpoint layout from what the kernel uses."""
    lay = compat.routed_experts_layout(module)
    w13, w2 = compat.routed_expert_weights(module)
    inter, padded = lay.intermediate, w13.shape[1] // 2
    full_i = inter * lay.tp_size
    hidden = w13.shape[2]
    prefix = module_name.split(".experts")[0] + ".experts."
    start = lay.tp_rank * inter
    out = []
    for j, e in enumerate(lay.experts):
        parts = ((f"{prefix}{e}.gate_proj.weight", w13[j, :inter], (full_i, hidden), 0),
                 (f"{prefix}{e}.up_proj.weight", w13[j, padded:padded + inter], (full_i, hidden), 0),
                 (f"{prefix}{e}.down_proj.weight", w2[j, :, :inter], (hidden, full_i), 1))
        for name, values, shape, dim in parts:
            fp = fingerprint_piece(values, shape, dim, start)
            out.append(dict(name=name, full_shape=list(shape), dim=dim, start=start,
                            length=inter, **fp))
    return out


@torch.no_grad()
def vllm_fingerprint_pieces(model: torch.nn.Module) -> List[dict]:
    """Fingerprints of the HF slices held by this vLLM worker's parameters.

    Runs inside the worker. Returns plain dicts (name, full_shape, dim, start, length,
    and the FIELDS) so they travel through any RPC.
    """
    packed = _packed_names(model)
    out = []
    seen = set()
    for module_name, module in model.named_modules():
        if compat.is_routed_experts(module):
            out += _expert_pieces(module_name, module)
            continue
        for pname, param in module.named_parameters(recurse=False):
            value, problem = (_effective_weight(module, param) if pname == "weight"
                              else (param, ""))
            tied = id(param) in seen  # e.g. lm_head.weight is embed_tokens.weight
            seen.add(id(param))
            # A LoRA-enabled vLLM wraps each linear (`qkv_proj.base_layer`): the HF names
            # are those of the wrapper.
            hf_module = module_name.removesuffix(".base_layer")
            for piece in _pieces_of(hf_module, module, pname, value, packed):
                if problem:
                    out.append(dict(name=piece.name, error=problem))
                if tied:
                    continue  # its values were fingerprinted under the first owner's name
                local = value if value.dim() == 0 else value.narrow(piece.dim, piece.local_start,
                                                                     piece.length)
                fp = fingerprint_piece(local, piece.full_shape, piece.dim, piece.start)
                out.append(dict(name=piece.name, full_shape=list(piece.full_shape), dim=piece.dim,
                                start=piece.start, length=piece.length, **fp))
    return out


# --------------------------------------------------------------------------- comparison
def _differs(a: Fingerprint, b: Fingerprint) -> List[str]:
    """Fields in which two fingerprints differ (exact: integers)."""
    return [f for f in EXACT_FIELDS if a[f] != b[f]]


def combine_pieces(pieces: Iterable[dict]
                   ) -> Tuple[Dict[str, Fingerprint], List[str]]:
    """Per-HF-tensor fingerprints from the pieces of all vLLM workers.

    Returns (fingerprints, problems): problems name tensors whose pieces do not tile
    the tensor or whose replicas on different TP ranks disagree.
    """
    by_region: Dict[Tuple, dict] = {}
    problems = []
    for p in pieces:
        if "error" in p:
            problems.append(f"{p['name']}: {p['error']}")
            continue
        key = (p["name"], p["dim"], p["start"], p["length"])
        if key in by_region:
            bad = _differs(by_region[key], p)
            if bad:
                problems.append(f"{p['name']}: replicas on vLLM TP ranks differ ({', '.join(bad)}) "
                                f"in slice dim={p['dim']} [{p['start']}, {p['start'] + p['length']})")
            continue
        by_region[key] = p
    result: Dict[str, Fingerprint] = {}
    spans: Dict[str, List[Tuple[int, int, int, int]]] = {}
    for (name, dim, start, length), p in by_region.items():
        fp = {k: p[k] for k in FIELDS}
        result[name] = _add(result[name], fp) if name in result else fp
        spans.setdefault(name, []).append((dim, start, length, p["full_shape"][dim]))
    for name, parts in spans.items():
        dims = {d for d, *_ in parts}
        parts.sort(key=lambda s: s[1])
        pos, ok = 0, len(dims) == 1
        for _, start, length, _ in parts:
            ok &= start == pos
            pos = start + length
        ok &= pos == parts[0][3]
        if not ok:
            problems.append(f"{name}: vLLM's slices do not tile the HF tensor: "
                            f"{[(d, s, s + n) for d, s, n, _ in parts]}")
    return result, problems


def compare_fingerprints(expected: Dict[str, Fingerprint], held: Dict[str, Fingerprint],
                         aliases: Optional[Dict[str, str]] = None
                         ) -> List[str]:
    """Messages for every tensor that differs, is missing on one side, or is extra.

    `aliases` maps a streamed name vLLM does not keep to the name it shares storage
    with (tied embeddings: lm_head.weight -> model.embed_tokens.weight).
    """
    aliases = aliases or {}
    problems = []
    for name in sorted(expected):
        target = name if name in held else aliases.get(name)
        if target not in held:
            problems.append(f"{name}: sent by the trainer but vLLM holds no such tensor")
            continue
        bad = _differs(expected[name], held[target])
        if bad:
            e, h = expected[name], held[target]
            if "numel" in bad:
                detail = f"numel trainer={e['numel']} vllm={h['numel']}"
            else:
                detail = f"bits differ; sum trainer={e['sum']:.9g} vllm={h['sum']:.9g}"
            problems.append(f"{name}: differs in vLLM ({detail})")
    for name in sorted(set(held) - set(expected)):
        problems.append(f"{name}: held by vLLM but absent from the trainer's stream (not updated)")
    return problems


def check_weight_sync(engine, expected: Dict[str, Fingerprint],
                      vllm_aliases: Sequence[Tuple[str, str]] = (),
                      include: Optional[Callable[[str], bool]] = None) -> int:
    """Raise WeightSyncError naming every tensor vLLM does not hold as the trainer sent it.

    `engine` is a ColocateEngine or a RolloutClient: anything whose
    `weight_fingerprints()` returns fingerprint pieces per vLLM engine (one list
    per data-parallel replica, each covering that replica's TP group). Every
    replica must hold every tensor. Returns the number of tensors checked.
    vllm_aliases: (vLLM prefix, HF prefix) renames of vLLM's names (the family
    mapping's, e.g. a vision-language model's `language_model.model.` -> `model.`);
    include: the sync's filter (export_hf_weights): a tensor it leaves out (a frozen
    vision tower) is not expected in the stream, vLLM holds it from the checkpoint.
    """
    if not expected:
        raise WeightSyncError("no expected fingerprints: the weight stream was empty")
    per_engine = engine.weight_fingerprints()
    problems = []
    for i, pieces in enumerate(per_engine):
        held, found = combine_pieces(pieces)
        held = {_renamed(n, vllm_aliases): fp for n, fp in held.items()}
        if include is not None:
            held = {n: fp for n, fp in held.items() if n in expected or include(n)}
        aliases = {}
        if "lm_head.weight" not in held and "model.embed_tokens.weight" in held:
            aliases["lm_head.weight"] = "model.embed_tokens.weight"  # tied embeddings
        found += compare_fingerprints(expected, held, aliases)
        where = f"vLLM engine {i}: " if len(per_engine) > 1 else ""
        problems += [where + p for p in found]
    if problems:
        raise WeightSyncError(f"vLLM does not hold the trainer's weights ({len(problems)} "
                              "problem(s)):\n  " + "\n  ".join(problems))
    return len(expected)


def _renamed(name: str, aliases: Sequence[Tuple[str, str]]) -> str:
    for prefix, hf in aliases:
        if name.startswith(prefix):
            return hf + name[len(prefix):]
    return name


# --------------------------------------------------------------------------- LoRA adapters
class AdapterFingerprints:
    """Fingerprints of an adapter-only stream (PEFT names) as vLLM will hold it.

    vLLM folds the adapter's scale into B when it registers an adapter
    (`lora_b *= scale`, in its LoRA dtype), so the expected B is the streamed B times
    `scale`, computed the same way (one IEEE multiply per element: the same bits on
    any device); A is compared as sent.

        expected = AdapterFingerprints(settings.scale)
        info = load_adapter_stream(engine, expected.watch(adapter_buckets), config)
        check_adapter_sync(engine, expected, lora_id)
    """

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)
        self.stream = StreamFingerprints()
        self.dtypes: set = set()

    @property
    def result(self) -> Dict[str, Fingerprint]:
        return self.stream.result

    def watch(self, buckets):
        for bucket in buckets:
            for name, tensor in bucket:
                self.dtypes.add(str(tensor.dtype))
                if name.endswith("lora_B.weight") and self.scale != 1:
                    tensor = tensor.clone()
                    tensor *= self.scale
                self.stream.add(name, tensor)
            yield bucket


def check_adapter_sync(engine, expected: AdapterFingerprints, lora_id: int,
                       vllm_aliases: Sequence[Tuple[str, str]] = ()) -> int:
    """Raise WeightSyncError unless every vLLM worker holds exactly one adapter, `lora_id`,
    active in its LoRA slots, whose tensors are bit for bit the trainer's (A, and scale * B
    as vLLM stores it), and whose slots (what the kernels read) hold them too. Returns the
    number of tensors checked. vllm_aliases: as check_weight_sync's, under PEFT's
    `base_model.model.` (a VL model's `...language_model.model.layers` -> `...model.layers`)."""
    peft = "base_model.model."
    aliases = [(peft + v, peft + h) for v, h in vllm_aliases]
    if not expected.result:
        raise WeightSyncError("no expected fingerprints: the adapter stream was empty")
    problems = []
    for i, workers in enumerate(engine.adapter_fingerprints()):
        for w, held in enumerate(workers):
            where = f"vLLM engine {i} worker {w}: "
            if held["ids"] != [lora_id] or held["active"] != [lora_id]:
                problems.append(f"{where}holds adapters {held['ids']} (active: {held['active']})"
                                f"; expected only the one just synced, {lora_id}")
            problems += [where + p for p in held.get("slot_problems", [])]
            if held["dtypes"] and set(held["dtypes"]) != expected.dtypes:
                problems.append(f"{where}holds the adapter in {held['dtypes']}, the trainer "
                                f"sent {sorted(expected.dtypes)}")
            tensors = {_renamed(n, aliases): fp for n, fp in held["tensors"].items()}
            problems += [where + p for p in compare_fingerprints(expected.result, tensors)]
    if problems:
        raise WeightSyncError(f"vLLM does not hold the trainer's LoRA adapter ({len(problems)} "
                              "problem(s)):\n  " + "\n  ".join(problems))
    return len(expected.result)
