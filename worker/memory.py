"""Device memory of one card by our own numbers: weights by stored type, the KV caches, the DeltaNet states and
their rollback history, the MTP head, and the workspaces a step needs, for a config, a format and a context.

`serve` states with it what fits a card; the numbers follow what `worker/state.py` allocates and what the
reference back end's step holds at its peak (docs/design.md, "Memory").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .checkpoints.base import PLAIN, Checkpoint
from .config import ModelConfig
from .errors import MemoryBudgetError
from .kv_cache import DEFAULT_KV_FORMAT, KV_CHUNK, kv_vector_bytes
from .layout import expected_tensor_shapes
from .quant.weight import SLAB_ELEMENTS
from .sequence import MAX_TOKENS_PER_CALL

log = logging.getLogger(__name__)

GIB = 1 << 30
DTYPE_TYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def stored_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` stored as `type_name` (a GGML type name: F32, BF16, Q4_K, ...)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    numel = 1
    for d in shape:
        numel *= d
    return numel // block * size


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a card's device needs, by part."""

    context: int
    weights_by_type: dict[str, int]
    mtp_weights: int  # part of the weights: the MTP head's own tensors
    kv_cache: int  # main model's full-attention layers at `context` tokens
    mtp_kv_cache: int
    deltanet_state: int  # conv windows and fp32 recurrent states of one sequence
    rollback_history: int  # the states a verify step keeps per position for rollback
    workspace: int  # the largest transient of a step (dequantized matrix, logits, prefill activations)
    parts: dict[str, int] = field(default_factory=dict)
    dequantized_copies: int = 0  # a small model's quantized weights kept dequantized too (loading.py)
    kernel_buffers: int = 0  # the megakernel runner's own (megakernel_buffers): activations, recorded states

    @property
    def weights(self) -> int:
        return sum(self.weights_by_type.values())

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.kv_cache
            + self.mtp_kv_cache
            + self.deltanet_state
            + self.rollback_history
            + self.workspace
            + self.dequantized_copies
            + self.kernel_buffers
        )

    def fits(self, device_bytes: int) -> bool:
        return self.total <= device_bytes

    def format(self) -> str:
        types = ", ".join(
            f"{t} {b / GIB:.2f}" for t, b in sorted(self.weights_by_type.items(), key=lambda i: -i[1])
        )
        copies = (
            f" + their dequantized copies {self.dequantized_copies / GIB:.2f}"
            if self.dequantized_copies
            else ""
        )
        return (
            f"{self.total / GIB:.2f} GiB at {self.context} tokens: weights {self.weights / GIB:.2f} ({types}; "
            f"MTP head {self.mtp_weights / GIB:.2f}){copies}, KV {self.kv_cache / GIB:.2f} + MTP KV "
            f"{self.mtp_kv_cache / GIB:.2f}, DeltaNet state {self.deltanet_state / GIB:.3f} + rollback "
            f"{self.rollback_history / GIB:.3f}, workspace {self.workspace / GIB:.2f}"
            + (f", megakernel buffers {self.kernel_buffers / GIB:.2f}" if self.kernel_buffers else "")
        )


def device_memory(
    config: ModelConfig,
    weight_types: Mapping[str, str],
    context: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    spec_k: int = 2,
    dequantizes: bool = True,
    prefill_tokens: int | None = None,
    dequantize_once: bool = False,
    megakernel: bool = False,
    delta_rule: str = "torch",
    kv_format: str = DEFAULT_KV_FORMAT,
) -> MemoryPlan:
    """The plan for `config` with each tensor (our names) stored as `weight_types[name]` (GGML type names),
    serving one sequence of up to `context` tokens in compute `dtype` with `spec_k` drafts per cycle.
    `dequantizes`: the back end dequantizes a block-quantized matrix into `dtype` before using it (the
    reference back end), so the largest such matrix is part of the workspace; with `dequantize_once` it keeps
    every such matrix dequantized beside its blocks instead (a small model, `loading.dequantizes_once`).
    `prefill_tokens`: the piece of the fast prefill path (worker/prefill/), or None for the reference path's
    pieces. `megakernel`: the decode megakernel's runner too (`megakernel_buffers`); its verify records the
    DeltaNet states in its own buffers, which then are the rollback history. `delta_rule`: the fast prefill's
    delta-rule kernel (worker/prefill/deltanet.py: "fla" or "torch"), whose transients differ. `kv_format`: the KV
    caches' (worker/kv_cache.py: the model's dtype, or int8 with a scale per head vector)."""
    shapes = expected_tensor_shapes(config)
    missing = sorted(set(shapes) - set(weight_types))
    if missing:
        raise ValueError(f"no stored type for {missing[:4]}")
    by_type: dict[str, int] = {}
    mtp_weights = 0
    largest_dequantized = 0
    all_dequantized = 0
    elem = torch.empty((), dtype=dtype).element_size()
    plain = set(DTYPE_TYPE_NAMES.values())
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    for name, shape in shapes.items():
        type_name = weight_types[name]
        nbytes = stored_bytes(type_name, shape)
        by_type[type_name] = by_type.get(type_name, 0) + nbytes
        if name.startswith("mtp."):
            mtp_weights += nbytes
        if type_name not in plain:
            numel = 1
            for d in shape:
                numel *= d
            all_dequantized += numel * elem
            per_call = numel
            if name == head:  # the logits dequantize a slab of rows at a time (quant.weight.linear_in_slabs)
                per_call = min(numel, max(1, SLAB_ELEMENTS // shape[-1]) * shape[-1])
            elif name == "model.embed_tokens.weight":  # lookups dequantize their rows only
                per_call = 0
            largest_dequantized = max(largest_dequantized, per_call * elem)

    kv_position = 2 * config.num_key_value_heads * kv_vector_bytes(kv_format, config.head_dim, elem)
    kv_per_layer = kv_position * context
    kv_cache = kv_per_layer * len(config.full_attention_layers)
    mtp_kv = kv_per_layer if config.has_mtp else 0
    # a cache growing past its capacity holds the old and the new storage of one layer for a moment; an int8
    # cache also hands attention one layer's keys and values dequantized to the compute dtype
    kv_growth = kv_position * max(context // 2, KV_CHUNK)
    if kv_format != DEFAULT_KV_FORMAT:
        kv_growth += 2 * config.num_key_value_heads * config.head_dim * context * elem
    conv = config.linear_qkv_dim * (config.linear_conv_kernel_dim - 1) * elem
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    linear_layers = len(config.linear_attention_layers)
    deltanet = (conv + recurrent) * linear_layers
    verify_tokens = spec_k + 1
    rollback = (verify_tokens + 1) * (conv + recurrent) * linear_layers if spec_k else 0
    chunk = prefill_tokens or MAX_TOKENS_PER_CALL
    wide = max(
        2 * config.num_attention_heads * config.head_dim, config.linear_qkv_dim, config.intermediate_size
    )
    prefill = chunk * (4 * config.hidden_size + 3 * wide) * elem
    if prefill_tokens is None:  # the reference path's masked attention materialises its fp32 scores
        prefill += chunk * chunk * 4 * config.num_attention_heads
    else:
        prefill += fast_prefill_workspace(config, chunk, context, elem, delta_rule)
    logits = verify_tokens * config.vocab_size * 4
    per_call = dequantizes and not dequantize_once
    workspace = (largest_dequantized if per_call else 0) + max(prefill, logits) + kv_growth
    kernel = megakernel_buffers(config, weight_types, context, spec_k) if megakernel else {}
    if kernel:
        rollback = kernel.pop("history")
    return MemoryPlan(
        context=context,
        weights_by_type=by_type,
        mtp_weights=mtp_weights,
        kv_cache=kv_cache,
        mtp_kv_cache=mtp_kv,
        deltanet_state=deltanet,
        rollback_history=rollback,
        workspace=workspace,
        dequantized_copies=all_dequantized if dequantizes and dequantize_once else 0,
        kernel_buffers=sum(kernel.values()),
        parts={
            "prefill_activations": prefill,
            "verify_logits": logits,
            "largest_dequantized": largest_dequantized,
            **{f"megakernel_{name}": n for name, n in kernel.items()},
        },
    )


def megakernel_buffers(
    config: ModelConfig, weight_types: Mapping[str, str], context: int, spec_k: int
) -> dict[str, int]:
    """What the megakernel runner (kernels/runtime.py) holds beside the model and the sequence state: the DeltaNet
    states a verify of spec_k + 1 tokens records, one per token but the last (`history`), and its activation
    buffers and flash-decoding partials for `context` positions (`scratch`). Its repacked weights are the model's
    only copy of the quantized ones (the reference reads them), the same bytes with each row padded to 16; the
    embedding table is among them when quantized (the kernel decodes the rows it reads, kernels/embed.cuh: no bf16
    copy of the table)."""
    from onestream.kernels.plan import att_partial_floats, scratch_shapes
    from onestream.kernels.tuning import Tuning

    def nbytes(shape: tuple[int, ...], dtype: str) -> int:
        numel = 1
        for d in shape:
            numel *= d
        return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()

    conv = nbytes((config.linear_qkv_dim, config.linear_conv_kernel_dim - 1), "bfloat16")
    recurrent = nbytes(
        (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim), "float32"
    )
    history = spec_k * (conv + recurrent) * len(config.linear_attention_layers)
    tuning = Tuning()
    scratch = sum(nbytes(shape, dtype) for shape, dtype in scratch_shapes(config, tuning.fp32_act).values())
    scratch += 4 * att_partial_floats(config, max(1, -(-context // tuning.att_chunk)))
    return {"history": history, "scratch": scratch}


def fast_prefill_workspace(
    config: ModelConfig, piece: int, context: int, elem: int, delta_rule: str = "torch"
) -> int:
    """What the fast prefill holds beyond the projections at its peak: the delta rule's transients
    (`torch_delta_rule_bytes` or `fla_delta_rule_bytes`, by the kernel in use) or the attention's key/value
    heads expanded over the context, whichever is larger (they are not alive together)."""
    if delta_rule not in DELTA_RULES:
        raise ValueError(f"delta_rule must be one of {DELTA_RULES}, got {delta_rule!r}")
    if delta_rule == "fla":
        delta = fla_delta_rule_bytes(config, piece, elem)
    else:
        delta = torch_delta_rule_bytes(config, piece)
    attention = 2 * config.num_attention_heads * context * config.head_dim * elem
    return max(delta, attention)


DELTA_RULES = ("fla", "torch")


def torch_delta_rule_bytes(config: ModelConfig, piece: int) -> int:
    """The torch delta rule's fp32 tensors over one piece (deltanet.chunk_gated_delta_rule_torch): q, k, v per
    value head, the solve's right-hand side and solution, the writes, the states at every chunk start, three
    [C, C] matrices per chunk and head."""
    from .prefill.deltanet import DEFAULT_CHUNK

    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    chunks = -(-piece // DEFAULT_CHUNK)
    per_token = hv * (2 * dk + dv + 2 * (dk + dv) + dv)
    return 4 * (piece * per_token + (chunks + 1) * hv * dk * dv + 3 * chunks * hv * DEFAULT_CHUNK**2)


# flash-linear-attention's chunk length: deltanet.py calls its chunk_gated_delta_rule without one, so its default.
FLA_CHUNK = 64


def fla_delta_rule_bytes(config: ModelConfig, piece: int, elem: int) -> int:
    """What flash-linear-attention's `chunk_gated_delta_rule` (its Triton path, as deltanet.py calls it) holds at
    its peak, while its output kernel runs, over one piece of `piece` tokens in a model dtype of `elem` bytes.

    All of it is alive then: the copies its input guard makes of q, k and v (the torch form's are column slices of
    the conv output; the Triton form writes them apart, and this stays an upper bound), q and k l2-normalised in the model dtype with their fp32 inverse norms, the fp32
    chunk-local cumulative log decay per value head, the solved [T, Hv, C] WY matrix, w [T, Hv, dk] and u
    [T, Hv, dv], the states at every chunk start [T / C, Hv, dk, dv] and the new values, the output [T, Hv, dv]
    (all in the model dtype), and the fp32 final state. g and beta arrive contiguous, the initial state too."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    chunks = -(-piece // FLA_CHUNK)
    per_token = (
        elem * (2 * 2 * hk * dk + hv * dv)  # q, k: copies and normalised; v: its copy
        + 4 * (2 * hk + hv)  # the inverse norms of q and k, the cumulative decay
        + elem * hv * FLA_CHUNK  # the WY matrix
        + elem * hv * (dk + 3 * dv)  # w; u, the new values, the output
    )
    states = chunks * hv * dk * dv * elem + hv * dk * dv * 4
    return piece * per_token + states


def checkpoint_weight_types(checkpoint: Checkpoint, dtype: torch.dtype) -> dict[str, str]:
    """The type each of a checkpoint's tensors has on the device when loaded in compute `dtype`."""
    from .layout import parameter_dtype

    return {
        name: DTYPE_TYPE_NAMES[parameter_dtype(name, dtype)] if kind == PLAIN else kind
        for name, kind in checkpoint.stored_types().items()
    }


def preset_weight_types(config: ModelConfig, preset: str) -> dict[str, str]:
    """The GGML type a llama.cpp preset stores each of our tensors in."""
    from .checkpoints.gguf_layout import tensor_place
    from .checkpoints.quantize import preset_chooser

    choose = preset_chooser(preset, config)
    types = {}
    for name, shape in expected_tensor_shapes(config).items():
        place = tensor_place(name, config)
        gguf_shape = (shape[0], shape[-1]) if place.squeeze else shape
        types[name] = choose(place.gguf_name, gguf_shape, place.block).name
    return types


def dtype_weight_types(config: ModelConfig, dtype: torch.dtype) -> dict[str, str]:
    """Every tensor in one plain dtype (a bf16 checkpoint as loaded), the DeltaNet decay in fp32."""
    from .layout import parameter_dtype

    return {name: DTYPE_TYPE_NAMES[parameter_dtype(name, dtype)] for name in expected_tensor_shapes(config)}


def fit_report(
    checkpoint: Checkpoint,
    *,
    dtype: torch.dtype,
    context: int | None = None,
    spec_k: int = 2,
    device_bytes: int | None = None,
    prefill_tokens: int | None = None,
    megakernel: bool = False,
    fast_prefill: bool = False,
    delta_rule: str = "torch",
    kv_format: str = DEFAULT_KV_FORMAT,
) -> str:
    """One line for `serve`: what a card needs for this model, format and context, and whether it fits
    (`prefill_tokens`: the fast prefill path's piece as the operator set it; `fast_prefill` without one: the
    piece the engine will choose for `device_bytes`, `choose_prefill_piece`; `megakernel`: its runner's
    buffers too; `delta_rule`: the fast prefill's kernel; `kv_format`: the KV caches')."""
    from .loading import dequantizes_once

    config = checkpoint.config
    context = min(context or config.max_position_embeddings, config.max_position_embeddings)
    types = checkpoint_weight_types(checkpoint, dtype)

    def plan_for(piece: int | None) -> MemoryPlan:
        return device_memory(
            config,
            types,
            context,
            dtype=dtype,
            spec_k=spec_k,
            prefill_tokens=piece,
            dequantize_once=dequantizes_once(config, dtype),
            megakernel=megakernel,
            delta_rule=delta_rule,
            kv_format=kv_format,
        )

    chosen = ""
    if fast_prefill and prefill_tokens is None:
        try:
            prefill_tokens = choose_prefill_piece(plan_for, device_bytes)
            chosen = f"; prefill pieces of {prefill_tokens} tokens"
        except MemoryBudgetError:  # the verdict below says it does not fit, at the shortest piece
            prefill_tokens = MIN_PIECE_TOKENS
            chosen = f"; even prefill pieces of {MIN_PIECE_TOKENS} tokens are too long"
    plan = plan_for(prefill_tokens)
    line = f"{checkpoint.name} [{checkpoint.format.label}] needs {plan.format()}"
    if device_bytes is not None:
        verdict = "fits" if plan.fits(device_bytes) else "does NOT fit"
        line += f"; {verdict} a card of {device_bytes / GIB:.1f} GiB"
        if prefill_tokens is not None and not plan.fits(device_bytes) and not chosen:
            smaller = largest_fitting_piece(plan_for, prefill_tokens, device_bytes)
            if smaller is not None:
                from .prefill.runner import PIECE_ENV

                line += f" (with ${PIECE_ENV}={smaller} it fits)"
    return line + chosen


MIN_PIECE_TOKENS = 512  # shorter prefill pieces leave the GEMMs far from the matrix peak


def largest_fitting_piece(plan_for: Callable[[int], MemoryPlan], start: int, device_bytes: int) -> int | None:
    """The longest fast-prefill piece, `start` halved until it is, whose plan fits `device_bytes`; None when
    even MIN_PIECE_TOKENS does not (the weights, caches and states alone are too large)."""
    piece = start
    while piece >= MIN_PIECE_TOKENS:
        if plan_for(piece).fits(device_bytes):
            return piece
        piece //= 2
    return None


def choose_prefill_piece(
    plan_for: Callable[[int], MemoryPlan],
    budget: int | None,
    *,
    operator: int | None = None,
    start: int | None = None,
) -> int:
    """The fast prefill's piece, in one place for the engine, `serve`'s fit line and the tools: the operator's
    (`operator`, $ONESTREAM_PREFILL_TOKENS) when set, whatever the budget; else, with no budget, `start` (the
    default piece); else the longest of `start`, `start` / 2, ... whose plan fits `budget` bytes. Raises
    MemoryBudgetError, naming the numbers, when even MIN_PIECE_TOKENS does not fit."""
    from .prefill.runner import DEFAULT_PIECE_TOKENS, PIECE_ENV

    if operator is not None:
        return operator
    start = DEFAULT_PIECE_TOKENS if start is None else start
    if budget is None:
        return start
    piece = largest_fitting_piece(plan_for, start, budget)
    if piece is None:
        need = plan_for(MIN_PIECE_TOKENS)
        raise MemoryBudgetError(
            f"a memory budget of {budget / 1e9:.2f} GB ({budget / GIB:.2f} GiB) cannot hold this model: even with "
            f"prefill pieces of {MIN_PIECE_TOKENS} tokens it needs {need.total / 1e9:.2f} GB ({need.format()}); "
            f"a shorter context, a smaller format or a larger card would fit (${PIECE_ENV} sets the piece "
            "regardless)"
        )
    return piece


def device_budget(device: torch.device) -> int:
    """Bytes this process's allocator may hold on a CUDA `device`: what it holds already (the loaded weights,
    its cache) and what the device has free. The rest (the CUDA context and modules, other processes) is not
    the engine's to plan with."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def fit_prefill_pieces(
    backend: Any,
    weight_types: Mapping[str, str],
    context: int,
    *,
    drafts: int,
    budget: int | None = None,
) -> int | None:
    """Set `backend.prefill_tokens` to the piece `choose_prefill_piece` gives its card: the operator's when set,
    else the longest whose plan (this back end's path: its delta-rule kernel, the megakernel's buffers, `drafts`
    per verify, `context` positions) fits `budget`, by default what its device has for this process
    (`device_budget`). Returns the piece; None for a back end without the fast prefill (its pieces bound the
    reference path's scores, not memory)."""
    from .loading import dequantizes_once
    from .prefill.runner import operator_piece_tokens

    fast = getattr(backend, "fast_prefill", None)
    if fast is None:
        return None
    config: ModelConfig = backend.config
    dtype: torch.dtype = backend.dtype

    def plan_for(piece: int) -> MemoryPlan:
        return device_memory(
            config,
            weight_types,
            context,
            dtype=dtype,
            spec_k=drafts,
            prefill_tokens=piece,
            dequantize_once=dequantizes_once(config, dtype),
            megakernel=getattr(backend, "name", None) == "megakernel",
            delta_rule=fast.delta_rule.name,
            kv_format=getattr(backend, "kv_format", DEFAULT_KV_FORMAT),
        )

    operator = operator_piece_tokens()
    if budget is None and backend.device.type == "cuda":
        budget = device_budget(backend.device)
    piece = choose_prefill_piece(plan_for, budget, operator=operator)
    plan = plan_for(piece)
    if budget is not None and not plan.fits(budget):  # only the operator's piece gets here
        log.warning(
            "prefill pieces of %d tokens (the operator's) need %.2f GB, over the memory budget of %.2f GB",
            piece,
            plan.total / 1e9,
            budget / 1e9,
        )
    else:
        log.info(
            "prefill pieces of %d tokens: %s%s",
            piece,
            plan.format(),
            "" if budget is None else f", within a budget of {budget / GIB:.2f} GiB",
        )
    backend.prefill_tokens = piece
    return piece
