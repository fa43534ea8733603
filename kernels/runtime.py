"""Host side of the megakernel: parameter tables, scratch buffers, state binding and launches.

`MegakernelRunner(model)` builds (or loads from the cache) the kernels for the model's config and the GPU,
sizes the persistent grid from the occupancy query (one co-resident block per SM, launched cooperatively),
and points the kernel at the model's own bf16 weight tensors (no copy; quantized ones are repacked once into
the kernel's device layout, kernels/quant_weights.py) and at a `SequenceState`'s own caches
(the KV caches, conv windows and fp32 recurrent states are shared with the reference model, so prefill,
snapshots, rollback and the reference fallback need no conversion).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from onestream.worker.draft_vocab import check_draft_vocab
from onestream.worker.errors import ContextLengthError, OnestreamError, UnsupportedModelError
from onestream.worker.kv_cache import DEFAULT_KV_FORMAT, Cache
from onestream.worker.quant.weight import QuantizedEmbedding
from onestream.worker.state import DeltaNetHistory, deltanet_stacks

from .build import BuiltModule, compile_module
from .layout import (
    CTRL_FLAG_ACCEPT,
    CTRL_FLAG_FEEDBACK,
    CTRL_FLAG_KEEP_STATES,
    ERROR_TEXT,
    LAYER_FULL,
    LAYER_LINEAR,
    MAX_TOKENS_PER_LAUNCH,
    MODE_MAIN,
    MODE_MTP,
    G,
    KernelErrorCode,
    L,
    ctrl_slots,
)
from .plan import STATIC_SMEM, KernelPlan, att_partial_floats, scratch_shapes
from .quant_weights import DeviceReader, DeviceWeights
from .tuning import Tuning

DEFAULT_TIMEOUT_S = 2.0
UPLOAD_RING = 32  # pinned control-block uploads in flight before one is reused (launches do not sync)
# Pinned control-block read-backs in flight: a decode that runs one launch ahead has two at a time.
READBACK_RING = 4


class MegakernelError(OnestreamError, RuntimeError):
    """The megakernel reported an error (watchdog, bad input) or cannot run on this model/device."""


@dataclass
class StepResult:
    logits: torch.Tensor  # [T, V] fp32 (the runner's buffer: clone to keep across launches)
    # [T, H] bf16 post-norm hidden, or the MTP layer's normed output (the runner's buffer)
    hidden: torch.Tensor
    tokens: list[int]  # greedy (argmax) token per position; empty when the launch was not read back
    accepted: int = 0  # greedy verify (accept=True): drafts (inputs 1..) equal to the argmax before them
    inputs: list[int] | None = None  # the input tokens as the kernel read them (when read back)


@dataclass
class _Build:
    """The kernels compiled for one number of tokens per launch, and that build's counters (plan.sync)."""

    plan: KernelPlan
    built: BuiltModule
    sync: torch.Tensor


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.data_ptr())


class MegakernelRunner:
    """The megakernel for one model on one GPU: builds per tokens-per-launch (compiled on first use), the
    parameter tables, the scratch buffers they share, and the launches: main-model steps of 1..8 tokens
    (decode, verify with recorded DeltaNet states and greedy acceptance) and MTP head steps. The test hooks and
    the timing read-back are kernels/diagnostics.py's `DiagnosticRunner`."""

    def __init__(
        self,
        model: Any,
        *,
        tokens_per_launch: int = 1,
        tuning: Tuning | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        kv_cache: str = DEFAULT_KV_FORMAT,
    ) -> None:
        """`kv_cache`: the format of the KV caches of the states it runs (worker/kv_cache.py); its builds read
        that one."""
        embed = model.model.embed_tokens
        quantized = isinstance(embed, QuantizedEmbedding)
        device = embed.raw.device if quantized else embed.weight.device
        dtype = embed.compute_dtype if quantized else embed.weight.dtype
        if device.type != "cuda":
            raise MegakernelError(f"the megakernel runs on a CUDA device; the model is on {device}")
        if dtype != torch.bfloat16:
            raise UnsupportedModelError(f"the megakernel needs bf16 weights; the model is {dtype}")
        self.model = model
        self.config = model.config
        self.device = device
        self.tuning = tuning or Tuning()
        self.kv_cache = kv_cache
        self.props = torch.cuda.get_device_properties(self.device)
        self.smem_limit = _smem_optin(self.props, self.device)
        self.tokens_per_launch = tokens_per_launch
        self.ctrl_slots = ctrl_slots()
        self.timeout_ns = int(timeout_s * 1e9)
        self.has_mtp = bool(self.config.has_mtp) and getattr(model, "mtp", None) is not None
        # The GEMV weights: formats per kind (every build's plan), repacked copies of the quantized ones.
        self.weights = DeviceWeights(model, self._all_layers(), self.has_mtp)
        # The embedding rows: a quantized table's repacked copy (the kernel decodes the rows it reads, as the
        # reference's lookups dequantize theirs into bf16: no bf16 copy of the table), or the bf16 table.
        self._embed = _contig(self.weights.embed_table(), "embedding")
        self._builds: dict[int, _Build] = {}
        # The default build now: shape and resource errors surface here.
        first = self._build(tokens_per_launch)
        self.plan, self.built, self.sync = first.plan, first.built, first.sync
        # The reference's prefill reads the repacked weights back with this build's kernel.
        if self.weights.quantized:
            self.weights.attach_reader(DeviceReader(self.built, self.device))
        self.threads = self.plan.tuning.threads
        self.smem = self.plan.smem_bytes
        self.grid = self.props.multi_processor_count  # one block per SM: the kernel's work split assumes it
        self._params = self._small_params()
        self.buf = self._scratch()
        self.ctrl = torch.zeros(self.ctrl_slots["CTRL_INTS"], dtype=torch.int32, device=self.device)
        self._uploads = [
            torch.zeros(self.ctrl_slots["CTRL_INTS"], dtype=torch.int32).pin_memory()
            for _ in range(UPLOAD_RING)
        ]
        # numpy views of the same pinned memory: host writes through them cost no torch dispatch
        self._uploads_np = [u.numpy() for u in self._uploads]
        self._upload_done: list[Any] = [None] * UPLOAD_RING
        self._upload_next = 0
        # Control-block read-backs land in pinned memory by an asynchronous copy that an event marks done, so
        # reading one neither allocates nor waits for launches queued after it.
        self._readbacks = [
            torch.zeros(self.ctrl_slots["CTRL_INTS"], dtype=torch.int32).pin_memory()
            for _ in range(READBACK_RING)
        ]
        self._readbacks_np = [r.numpy() for r in self._readbacks]
        self._readback_done: list[Any] = [torch.cuda.Event() for _ in range(READBACK_RING)]
        self._readback_next = 0
        self._ahead: tuple[int, int] | None = None  # (id(state), next position) of a decode run ahead
        self._globals = torch.zeros(G.COUNT, dtype=torch.int64, device=self.device)
        rows = self.config.num_hidden_layers + (1 if self.has_mtp else 0)
        self._layers = torch.zeros(rows * L.COUNT, dtype=torch.int64, device=self.device)
        self._bound: tuple | None = None
        self._bound_state: Any = None  # weak reference to the state the tables point at
        self._buffers = 0  # reallocations of the buffers the tables point at (part of the bound key)
        self._hist: torch.Tensor | None = None
        self._att_part: torch.Tensor | None = None  # flash-decoding partials, sized by the largest cache
        self._att_part_chunks = 0
        # Keep-states launches record DeltaNet states here (plan.history_entries per launch: entry j is the state
        # after token j); the DeltaNetHistory handed to the state views these buffers until the next such launch.
        # One stack per kind, [layers, entries, ...] (worker/state.py's deltanet_stacks): a layer's records, what
        # the kernel writes, are its row.
        self._hist_stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._hist_owner: Any = None  # weak reference to the state last given a history in these buffers
        self._timing: torch.Tensor | None = None  # per-block stamps of timing builds (DiagnosticRunner)
        self._streams: dict[int, Any] = {}

    # ---- setup ---------------------------------------------------------------------------------------
    def _plan(self, n_tokens: int) -> KernelPlan:
        """The plan of the build for `n_tokens` tokens per launch (no compile)."""
        plan = KernelPlan(
            self.config,
            self.props.multi_processor_count,
            n_tokens,
            self.tuning,
            smem_limit=self.smem_limit,
            weight_formats=self.weights.weight_formats,
            dn_out_tiled=self.weights.dn_out_tiled,
            embed_format=self.weights.embed_format,
            kv_cache=self.kv_cache,
        )
        if plan.smem_bytes > plan.dynamic_smem_limit:
            raise MegakernelError(
                f"the kernel needs {plan.smem_bytes} bytes of shared memory per block for {n_tokens} token(s) "
                f"per launch besides its static {STATIC_SMEM}; {self.props.name} allows {plan.smem_limit}"
            )
        return plan

    def _build(self, n_tokens: int) -> _Build:
        """The build for `n_tokens` tokens per launch (compiled, or from the in-process / disk cache)."""
        build = self._builds.get(n_tokens)
        if build is not None:
            return build
        plan = self._plan(n_tokens)
        with torch.cuda.device(self.device):
            built = compile_module(plan)
        self._check_resident(built, plan)
        sync = torch.zeros(plan.sync.count, dtype=torch.int64, device=self.device)
        build = self._builds[n_tokens] = _Build(plan, built, sync)
        return build

    def prepare(self, *n_tokens: int, on_step: Callable[[int, int], None] | None = None) -> None:
        """Build the kernels for each of `n_tokens` tokens per launch now rather than at their first launch.

        The compiles run in parallel threads: NVRTC's compile releases the GIL and a build takes seconds to tens
        of seconds, so a fresh card's several builds cost about the longest one. `on_step(done, total)` hears each
        build ready, in the order given."""
        widths = list(dict.fromkeys(n_tokens))
        todo = [n for n in widths if n not in self._builds]
        plans = [self._plan(n) for n in todo]

        def compile_on_device(plan: KernelPlan) -> BuiltModule:
            with torch.cuda.device(self.device):  # the current device is per thread; NVRTC targets its arch
                return compile_module(plan)

        done = len(widths) - len(todo)
        if on_step is not None and done:
            on_step(done, len(widths))
        with ThreadPoolExecutor(max_workers=max(1, min(len(plans), os.cpu_count() or 1))) as pool:
            futures = [pool.submit(compile_on_device, plan) for plan in plans]
            for n, future in zip(todo, futures, strict=True):
                future.result()
                self._build(n)  # the module is in compile_module's cache now: this only checks and binds
                done += 1
                if on_step is not None:
                    on_step(done, len(widths))

    def is_built(self, n_tokens: int) -> bool:
        """Whether a launch of `n_tokens` tokens runs without compiling first."""
        return n_tokens in self._builds

    def _check_resident(self, built: BuiltModule, plan: KernelPlan) -> None:
        import cupy

        for name in ("mk_decode", "mk_phase"):
            built.kernel(name).max_dynamic_shared_size_bytes = plan.smem_bytes
        kernel = built.kernel("mk_decode")
        threads = plan.tuning.threads
        per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, threads, plan.smem_bytes
        )
        if per_sm < 1:
            raise MegakernelError(
                f"mk_decode cannot be resident: {threads} threads x {kernel.num_regs} registers and "
                f"{plan.smem_bytes} bytes of shared memory per block exceed one SM"
            )

    def _small_params(self) -> dict[str, torch.Tensor]:
        """fp32 copies of the small parameters, computed with the reference's own expressions."""
        m = self.model

        def one_plus(w: torch.Tensor) -> torch.Tensor:
            return (1.0 + w.float()).contiguous()

        out: dict[str, torch.Tensor] = {"final_norm": one_plus(m.model.norm.weight)}
        out["inv_freq"] = m.rotary._inv_freq.to(device=self.device, dtype=torch.float32).contiguous()
        for i, layer in enumerate(self._all_layers()):
            out[f"{i}.in_norm"] = one_plus(layer.input_layernorm.weight)
            out[f"{i}.post_norm"] = one_plus(layer.post_attention_layernorm.weight)
            if layer.is_full_attention:
                out[f"{i}.q_norm"] = one_plus(layer.self_attn.q_norm.weight)
                out[f"{i}.k_norm"] = one_plus(layer.self_attn.k_norm.weight)
            else:
                la = layer.linear_attn
                out[f"{i}.neg_a"] = (-la.A_log.float().exp()).contiguous()
                out[f"{i}.dt_bias"] = la.dt_bias.float().contiguous()
        if self.has_mtp:
            mtp = m.mtp
            out["mtp.pre_e"] = one_plus(mtp.pre_fc_norm_embedding.weight)
            out["mtp.pre_h"] = one_plus(mtp.pre_fc_norm_hidden.weight)
            out["mtp.norm"] = one_plus(mtp.norm.weight)
        return out

    def _all_layers(self) -> list[Any]:
        """The model's layers, then the MTP head's layer (the layer table's last row)."""
        layers = list(self.model.model.layers)
        return [*layers, self.model.mtp.layer] if self.has_mtp else layers

    def _scratch(self) -> dict[str, torch.Tensor]:
        """Activation buffers, sized for the most tokens per launch (every build shares them)."""
        shapes = scratch_shapes(self.config, self.plan.tuning.fp32_act)
        return {
            name: torch.zeros(shape, dtype=getattr(torch, dtype), device=self.device)
            for name, (shape, dtype) in shapes.items()
        }

    # ---- binding a sequence state --------------------------------------------------------------------
    def _caches(self, state: Any) -> list[Any]:
        kv_format = getattr(state, "kv_format", DEFAULT_KV_FORMAT)
        if kv_format != self.kv_cache:
            raise MegakernelError(
                f"this runner's kernels read {self.kv_cache} KV caches; the state's are {kv_format} "
                "(make the state with the back end's new_state)"
            )
        caches = [state.kv[i] for i in self.config.full_attention_layers]
        if self.has_mtp and state.mtp_kv is not None:
            caches.append(state.mtp_kv)
        return caches

    def bind(
        self, state: Any, needed: int, keep_tokens: int = 0, *, tokens: int = 1, mtp: bool = False
    ) -> None:
        """Point the tables at `state`'s caches, growing its main-model KV caches (the MTP head's, for an MTP
        launch) to hold `needed` positions, and make room to record `keep_tokens` tokens' DeltaNet states.
        Every cache keeps its own capacity (its per-head stride in the layer table). `tokens`: the launch's
        tokens, whose build must hold the attention chunks of `needed` positions."""
        plan = self._check_chunks(tokens, needed)
        caches = self._caches(state)
        main = [state.kv[i] for i in self.config.full_attention_layers]
        for cache in [state.mtp_kv] if mtp else main:
            cache.reserve(needed)
        self._reserve_history(self._build(keep_tokens).plan.history_entries if keep_tokens else 0)
        capacity = max((cache.capacity for cache in caches), default=state.max_len)
        chunks = plan.att_chunks(capacity)
        if self._att_part_chunks < chunks:
            self._att_part_chunks = chunks
            size = att_partial_floats(self.config, chunks)
            self._att_part = torch.zeros(size, dtype=torch.float32, device=self.device)
            self._buffers += 1
        # What the tables hold that can change under one state object: its KV caches (regrown caches get new
        # tensors, possibly at a freed block's address: `Cache.generation` counts every cache's allocations) and
        # the runner's own buffers (`_buffers` counts their reallocations). The state is held by a weak
        # reference, not its id (a new state can reuse a freed one's id); a state's conv and recurrent tensors
        # are only ever updated in place, so they need no check. Comparing every cache's pointers instead is
        # host time on each launch of the speculative cycle.
        key = (self._buffers, Cache.generation)
        if key == self._bound and self._bound_state is not None and self._bound_state() is state:
            return
        self._write_tables(state, caches)
        self._bound, self._bound_state = key, weakref.ref(state)

    def _check_chunks(self, tokens: int, needed: int) -> KernelPlan:
        """The `tokens` build's plan, if it merges the attention chunks of `needed` positions."""
        plan = self._build(tokens).plan
        if plan.att_chunks(needed) > plan.att_merge_chunks:
            raise ContextLengthError(
                f"megakernel: {needed} positions need {plan.att_chunks(needed)} attention chunks; the "
                f"{tokens}-token build merges at most {plan.att_merge_chunks} "
                f"({plan.att_merge_chunks * plan.tuning.att_chunk} positions)"
            )
        return plan

    def _reserve_history(self, entries: int) -> None:
        if not self.config.linear_attention_layers or entries <= 0:
            return
        have = self._hist_stacks[1].shape[1] if self._hist_stacks is not None else 0
        if have >= entries:
            return
        self._drop_history_owner()
        self._hist_stacks = deltanet_stacks(self.config, torch.bfloat16, self.device, entries)
        self._buffers += 1

    def _drop_history_owner(self) -> None:
        """The state whose DeltaNet history views the record buffers loses it (they are about to be
        overwritten): a rollback into it then fails instead of copying another launch's states."""
        owner = self._hist_owner() if self._hist_owner is not None else None
        hist = owner.history if owner is not None else None
        if (
            hist is not None
            and self._hist_stacks is not None
            and _same_storage(hist.recurrent_stack, self._hist_stacks[1])
        ):
            owner.history = None
        self._hist_owner = None

    def _write_tables(self, state: Any, caches: list) -> None:
        m, c, p, b = self.model, self.config, self._params, self.buf
        g = [0] * G.COUNT
        w = self.weights
        # Each DeltaNet layer's records: its row of the two history stacks (none reserved yet: null pointers).
        hist_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self._hist_stacks is not None:
            conv_rows, rec_rows = (t.unbind(0) for t in self._hist_stacks)
            hist_rows = dict(
                zip(c.linear_attention_layers, zip(conv_rows, rec_rows, strict=True), strict=True)
            )
        g[G.EMBED] = _ptr(self._embed)
        g[G.LM_HEAD] = w.pointer(m.model.embed_tokens if c.tie_word_embeddings else m.lm_head)
        g[G.FINAL_NORM] = _ptr(p["final_norm"])
        g[G.INV_FREQ] = _ptr(p["inv_freq"])
        for slot, name in (
            (G.H, "h"), (G.XBUF, "xbuf"), (G.ZBUF, "zbuf"), (G.BETA, "beta"), (G.GDECAY, "gdecay"),
            (G.CORE, "core"), (G.QKV_ATT, "qkv_att"), (G.ATT_OUT, "att_out"), (G.ACT, "act"),
            (G.LOGITS, "logits"), (G.HIDDEN_OUT, "hidden_out"), (G.ARGKEY, "argkey"),
            (G.MTP_HIDDEN_IN, "mtp_hidden_in"),
        ):  # fmt: skip
            g[slot] = _ptr(b[name])
        g[G.ATT_PART] = _ptr(self._att_part)
        g[G.ATT_CHUNKS] = self._att_part_chunks
        main = [state.kv[i] for i in c.full_attention_layers]
        g[G.KV_CAP] = min((cache.capacity for cache in main), default=state.max_len)
        g[G.TIMEOUT_NS] = self.timeout_ns
        g[G.NUM_LAYERS] = c.num_hidden_layers
        g[G.TOKEN_HIST] = _ptr(self._hist)
        g[G.TIMING] = _ptr(self._timing)
        if self.has_mtp:
            g[G.MTP_FC] = w.pointer(m.mtp.fc)
            g[G.MTP_PRE_E] = _ptr(p["mtp.pre_e"])
            g[G.MTP_PRE_H] = _ptr(p["mtp.pre_h"])
            g[G.MTP_NORM] = _ptr(p["mtp.norm"])

        rows = []
        for i, layer in enumerate(self._all_layers()):
            r = [0] * L.COUNT
            r[L.IN_NORM] = _ptr(p[f"{i}.in_norm"])
            r[L.POST_NORM] = _ptr(p[f"{i}.post_norm"])
            r[L.GATE] = w.pointer(layer.mlp.gate_proj)
            r[L.UP] = w.pointer(layer.mlp.up_proj)
            r[L.DOWN] = w.pointer(layer.mlp.down_proj)
            if layer.is_full_attention:
                sa = layer.self_attn
                r[L.KIND] = LAYER_FULL
                r[L.Q], r[L.K], r[L.V], r[L.O] = (
                    w.pointer(x) for x in (sa.q_proj, sa.k_proj, sa.v_proj, sa.o_proj)
                )
                r[L.QNORM] = _ptr(p[f"{i}.q_norm"])
                r[L.KNORM] = _ptr(p[f"{i}.k_norm"])
                cache = state.kv[i] if i < c.num_hidden_layers else state.mtp_kv
                r[L.KCACHE], r[L.VCACHE] = (
                    _ptr(_contig(cache.k, "KV cache")),
                    _ptr(_contig(cache.v, "KV cache")),
                )
                r[L.KV_CAP] = cache.capacity
                if self.kv_cache == "int8":
                    r[L.KSCALE] = _ptr(_contig(cache.k_scale, "KV cache scales"))
                    r[L.VSCALE] = _ptr(_contig(cache.v_scale, "KV cache scales"))
            else:
                la = layer.linear_attn
                r[L.KIND] = LAYER_LINEAR
                r[L.QKV], r[L.Z], r[L.B], r[L.A] = (
                    w.pointer(x) for x in (la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a)
                )
                r[L.OUT] = w.pointer(la.out_proj)
                r[L.CONV_W] = _ptr(_contig(_bf16(la.conv1d.weight, "conv1d.weight"), "conv1d.weight"))
                r[L.NEG_A] = _ptr(p[f"{i}.neg_a"])
                r[L.DT_BIAS] = _ptr(p[f"{i}.dt_bias"])
                r[L.GNORM_W] = _ptr(_contig(_bf16(la.norm.weight, "linear_attn.norm.weight"), "norm"))
                r[L.CONV_STATE] = _ptr(_contig(_bf16(state.conv[i], "conv state"), "conv state"))
                rec = state.recurrent[i]
                if rec.dtype != torch.float32:
                    raise MegakernelError(f"layer {i}: the recurrent state must be fp32, got {rec.dtype}")
                r[L.REC_STATE] = _ptr(_contig(rec, "recurrent state"))
                hist_conv, hist_rec = hist_rows.get(i, (None, None))
                r[L.HIST_CONV] = _ptr(hist_conv)
                r[L.HIST_REC] = _ptr(hist_rec)
            rows.extend(r)
        self._globals.copy_(torch.tensor(g, dtype=torch.int64))
        self._layers.copy_(torch.tensor(rows, dtype=torch.int64))

    # ---- launches ------------------------------------------------------------------------------------
    def _launch(self, name: str, n_tokens: int, extra: tuple = ()) -> None:
        """Launch kernel `name` of the `n_tokens` build with the table arguments, then `extra`."""
        build = self._build(n_tokens)
        self._launch_raw(build, name, (*self._table_args(build), *extra))

    def _launch_raw(self, build: _Build, name: str, args: tuple, *, smem: int | None = None) -> None:
        import cupy

        kernel = build.built.kernel(name)
        handle = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:  # one CuPy view of each torch stream (creating one per launch costs time)
            stream = self._streams[handle] = cupy.cuda.ExternalStream(handle, self.device.index or 0)
        with stream:
            kernel(
                (self.grid,),
                (self.threads,),
                args,
                shared_mem=build.plan.smem_bytes if smem is None else smem,
            )

    def _table_args(self, build: _Build) -> tuple:
        return (
            np.uint64(_ptr(self._globals)),
            np.uint64(_ptr(self._layers)),
            np.uint64(_ptr(self.ctrl)),
            np.uint64(_ptr(build.sync)),
        )

    def _set_ctrl(
        self,
        pos: int,
        tokens: list[int] | torch.Tensor | None,
        flags: int = 0,
        mode: int = MODE_MAIN,
        head_rows: int = 0,
    ) -> None:
        """Upload position, flags, mode, the lm_head rows to score (0: all) and the input tokens (a host list, or
        ids on the GPU: copied on the device). The error slots are left alone: an error stays set until `reset`,
        so a launch that is not read back cannot hide one."""
        s = self.ctrl_slots
        lo, n_in = s["CTRL_POS"], s["CTRL_TOKEN_IN"]
        i = self._upload_next
        self._upload_next = (i + 1) % UPLOAD_RING
        if self._upload_done[i] is not None:
            self._upload_done[i].synchronize()  # its last copy has long finished (the ring is deep)
        h, hn = self._uploads[i], self._uploads_np[i]
        hn[:] = 0
        hn[s["CTRL_POS"]], hn[s["CTRL_FLAGS"]], hn[s["CTRL_MODE"]] = pos, flags, mode
        hn[s["CTRL_HEAD_ROWS"]] = head_rows
        device_ids = isinstance(tokens, torch.Tensor)
        hi = n_in if device_ids or tokens is None else n_in + len(tokens)
        if tokens is not None and not device_ids:
            hn[n_in:hi] = tokens
        self.ctrl[lo:hi].copy_(h[lo:hi], non_blocking=True)
        event = self._upload_done[i] = self._upload_done[i] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        if device_ids:
            ids = tokens.reshape(-1)
            self.ctrl[n_in : n_in + ids.numel()].copy_(ids.to(torch.int32), non_blocking=True)

    def _read_ctrl(self) -> np.ndarray:
        """The control block as the launches queued so far leave it (waits for them; no allocation)."""
        slot = self._queue_readback()
        return self._readback(slot)

    def _queue_readback(self) -> int:
        """Queue a copy of the control block into a pinned slot behind the launches so far; returns the slot."""
        i = self._readback_next
        self._readback_next = (i + 1) % READBACK_RING
        done = self._readback_done[i]
        done.synchronize()  # the slot's previous copy (read long ago: the ring is deeper than the look-ahead)
        self._readbacks[i].copy_(self.ctrl, non_blocking=True)
        done.record(torch.cuda.current_stream(self.device))
        return i

    def _readback(self, slot: int) -> np.ndarray:
        """Wait for the copy queued into `slot`; its values (a view: read before the slot comes round again)."""
        self._readback_done[slot].synchronize()
        return self._readbacks_np[slot]

    def _check(self, ctrl: Any) -> None:
        s = self.ctrl_slots
        code = int(ctrl[s["CTRL_ERR"]])
        if code == 0:
            return
        info = int(ctrl[s["CTRL_ERR_INFO"]])
        self.reset()
        try:
            what = ERROR_TEXT[KernelErrorCode(code)]
        except (ValueError, KeyError):
            what = f"error code {code}"
        raise MegakernelError(f"megakernel: {what} (info {info}); the sequence state is no longer valid")

    def check(self) -> None:
        """Read the control block back (a synchronisation) and raise if any launch since the last check failed."""
        self._check(self._read_ctrl())

    def reset(self) -> None:
        """Clear the barrier counters, argmax keys and error flag (after an error left them half-way)."""
        for build in self._builds.values():
            build.sync.zero_()
        self.buf["argkey"].zero_()
        self.ctrl.zero_()
        self._ahead = None
        torch.cuda.synchronize(self.device)

    def step(
        self,
        input_ids: torch.Tensor | list[int],
        state: Any,
        *,
        keep_states: bool = False,
        accept: bool = False,
        check: bool = True,
    ) -> StepResult:
        """One launch of the main model: T = len(input_ids) tokens (1..8) at positions `state.length …`;
        advances `state` like `forward_step` does.

        keep_states: record each DeltaNet layer's state after every token but the last and hand the state a
        `DeltaNetHistory` of them, so that `state.rollback(n)` for n < T is a copy. The state before the first token
        is not kept: a verify pass always keeps its first input (the pending token), and those writes (one fp32
        state per layer, 151 MB on the 27B shapes) cost time in every launch. accept: greedy
        verification of inputs 1.. as drafts (`StepResult.accepted`). check=False: no read-back (no
        synchronisation; `tokens` is empty; an error surfaces at the next checked launch or `check()`).
        Ids already on the GPU go to the kernel by a device copy (no host round trip before the launch)."""
        ids = _launch_ids(input_ids, "tokens")
        n = ids.numel()
        if accept and n < 2:
            raise MegakernelError("greedy verification needs the pending token and at least one draft")
        pos = state.check_room(n)
        self.bind(state, pos + n, n if keep_states else 0, tokens=n)
        flags = (CTRL_FLAG_KEEP_STATES if keep_states else 0) | (CTRL_FLAG_ACCEPT if accept else 0)
        if keep_states:
            self._drop_history_owner()
        self._set_ctrl(pos, ids if ids.is_cuda else ids.tolist(), flags)
        self._launch("mk_decode", n)
        self._ahead = None
        # The host's bookkeeping while the launch runs, not after the read-back waits for it.
        state.advance(ids.to(state.device))  # the state's pending ids must all live on one device
        state.history = self._record_history(state, pos, n) if keep_states else None
        tokens, accepted, inputs = [], 0, None
        if check:
            ctrl = self._read_ctrl()
            try:
                self._check(ctrl)
            except MegakernelError:  # a failed launch did not advance the state
                state.length, state.history = pos, None
                state._truncate_tokens(pos)
                raise
            s = self.ctrl_slots
            tokens = ctrl[s["CTRL_TOKEN_OUT"] : s["CTRL_TOKEN_OUT"] + n].tolist()
            inputs = ctrl[s["CTRL_TOKEN_IN"] : s["CTRL_TOKEN_IN"] + n].tolist()
            accepted = int(ctrl[s["CTRL_ACCEPTED"]])
        return StepResult(self.buf["logits"][:n], self.buf["hidden_out"][:n], tokens, accepted, inputs)

    def _record_history(self, state: Any, start: int, n_tokens: int) -> DeltaNetHistory | None:
        entries = self._build(n_tokens).plan.history_entries
        if entries < 1:
            return None  # nothing to roll back to: the only position after the first token is the live one
        assert self._hist_stacks is not None  # reserved for this build's entries by the launch
        conv, rec = self._hist_stacks
        layers = tuple(self.config.linear_attention_layers)
        history = DeltaNetHistory(start + 1, conv[:, :entries], rec[:, :entries], layers)
        self._hist_owner = weakref.ref(state)
        return history

    def mtp_step(self, input_ids: torch.Tensor | list[int], hidden: torch.Tensor, state: Any) -> StepResult:
        """One launch of the MTP head over T pairs (token t[p+1], hidden H[p]) at MTP positions
        `state.mtp_length …`, like the reference's `mtp_step`. Not read back (no synchronisation)."""
        if not self.has_mtp:
            raise MegakernelError("this model has no MTP head")
        ids = _launch_ids(input_ids, "pairs")
        n = ids.numel()
        if tuple(hidden.shape) != (n, self.config.hidden_size):
            raise MegakernelError(
                f"hidden must have shape ({n}, {self.config.hidden_size}), got {tuple(hidden.shape)}"
            )
        pos = state.check_room(n, mtp=True)
        self.bind(state, pos + n, tokens=n, mtp=True)
        self._set_ctrl(pos, ids if ids.is_cuda else ids.tolist(), 0, MODE_MTP)
        self.buf["mtp_hidden_in"][:n].copy_(hidden, non_blocking=True)
        self._launch("mk_decode", n)
        self._ahead = None
        state.mtp_length += n
        return StepResult(self.buf["logits"][:n], self.buf["hidden_out"][:n], [])

    def mtp_chain(
        self,
        input_ids: torch.Tensor | list[int],
        hidden: torch.Tensor,
        state: Any,
        k: int,
        *,
        vocab: int | None = None,
    ) -> torch.Tensor:
        """`k` greedy MTP drafts with no host round trip: one launch over the T pairs (`mtp_step`'s), then
        k - 1 single-pair launches, each fed the previous launch's argmax (the kernel's feedback) and the last
        row of its hidden output. `vocab`: the drafts are the argmax over token ids below it (the lm_head's first
        rows alone are read; a multiple of 8), None the whole vocabulary. Returns the k drafts ([k] int64 on the
        device; nothing is read back). The state's MTP length counts all T + k - 1 positions; the caller drops
        the k - 1 drafts' own."""
        if not self.has_mtp:
            raise MegakernelError("this model has no MTP head")
        if k < 1:
            raise MegakernelError(f"an MTP chain drafts at least one token, got {k}")
        rows = check_draft_vocab(vocab, self.config.vocab_size)
        ids = _launch_ids(input_ids, "pairs")
        n = ids.numel()
        if tuple(hidden.shape) != (n, self.config.hidden_size):
            raise MegakernelError(
                f"hidden must have shape ({n}, {self.config.hidden_size}), got {tuple(hidden.shape)}"
            )
        pos = state.check_room(n + k - 1, mtp=True)
        end = pos + n + k - 1
        self._token_hist(state.max_len)  # indexed by MTP position, below max_len like the main ones
        self.bind(state, end, tokens=n, mtp=True)
        self._check_chunks(1, end)  # the continuation's build too
        self._set_ctrl(pos, ids if ids.is_cuda else ids.tolist(), CTRL_FLAG_FEEDBACK, MODE_MTP, rows)
        self.buf["mtp_hidden_in"][:n].copy_(hidden, non_blocking=True)
        self._launch("mk_decode", n)
        if k > 1:
            build = self._build(1)
            args = self._table_args(build)
            # Nothing from the host between them: each launch's finalize advances the position and feeds its argmax
            # back as the next input, its lm_head phase writes its last hidden row to the MTP input, and the flags,
            # mode and head rows stay.
            for _ in range(1, k):
                self._launch_raw(build, "mk_decode", args)
        self._ahead = None
        state.mtp_length = end
        assert self._hist is not None
        return self._hist[pos + n - 1 : end].to(torch.int64)

    def _token_hist(self, size: int) -> None:
        """The buffer feedback launches write their greedy tokens to (by position), at least `size` long."""
        if self._hist is None or self._hist.numel() < size:
            self._hist = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._buffers += 1  # the tables point at it: rebind

    def greedy_chain(self, first_token: int, state: Any, n: int, *, check: bool = True) -> list[int]:
        """`n` greedy steps as `n` back-to-back launches with no host round trip (each step's argmax feeds the
        next); returns the n generated tokens. One sync at the end. check=False (timing loops): nothing is read
        back and `state` is not advanced, so its caches then hold positions its length does not count; run the
        same positions again or discard the state."""
        if n < 1:
            raise MegakernelError(f"a greedy chain runs at least one step, got {n}")
        pos = state.check_room(n)
        self._token_hist(state.max_len)
        self.bind(state, pos + n)
        self._set_ctrl(pos, [first_token], CTRL_FLAG_FEEDBACK)
        build = self._build(1)
        args = self._table_args(build)
        for _ in range(n):
            self._launch_raw(build, "mk_decode", args)
        self._ahead = None
        if not check:
            return []
        self._check(self._read_ctrl())
        generated = [int(x) for x in self._hist[pos : pos + n].cpu()]
        state.advance(torch.tensor([first_token, *generated[:-1]], dtype=torch.int64, device=state.device))
        state.history = None
        return generated

    def decode_ahead(self, input_ids: torch.Tensor | None, state: Any) -> int:
        """Queue one greedy decode step of `state` without waiting for anything; returns a handle for
        `ahead_token`. `input_ids` ([1], on the GPU) starts a run; None continues one: the input is the token
        the previous step (of this state, at the position before) wrote on the device, so step N + 1 is queued
        before the host has seen token N. Each step's control block is copied to pinned memory behind it."""
        pos = state.check_room(1)
        if input_ids is None:
            if self._ahead != (id(state), pos) or self._hist is None:
                raise MegakernelError("decode_ahead(None) continues a run of this state's previous step only")
            ids = self._hist[pos - 1 : pos].to(torch.int64)  # the fed-back token, for the state's own ids
        else:
            ids = _launch_ids(input_ids, "tokens")
            if ids.numel() != 1 or not ids.is_cuda:
                raise MegakernelError("decode_ahead starts from one token id on the GPU")
        self._token_hist(state.max_len)
        self.bind(state, pos + 1)
        # Feedback: the kernel writes its argmax into the next launch's input slot (and at hist[pos]); a
        # continued step uploads only its position and flags, so the input stays what the device wrote.
        self._set_ctrl(pos, ids if input_ids is not None else None, CTRL_FLAG_FEEDBACK)
        self._launch("mk_decode", 1)
        slot = self._queue_readback()
        state.advance(ids)
        state.history = None
        self._ahead = (id(state), pos + 1)
        return slot

    def ahead_token(self, handle: int) -> int:
        """The greedy token of the `decode_ahead` step `handle` (waits for that step only; raises on an error
        of it or of any launch before it)."""
        ctrl = self._readback(handle)
        self._check(ctrl)
        return int(ctrl[self.ctrl_slots["CTRL_TOKEN_OUT"]])


def _smem_optin(props: Any, device: torch.device) -> int:
    """Opt-in shared memory per block of the GPU (decides whether the GEMV weight ring fits)."""
    value = getattr(props, "shared_memory_per_block_optin", None)
    if value:
        return int(value)
    try:
        import cupy

        return int(cupy.cuda.Device(device.index or 0).attributes["MaxSharedMemoryPerBlockOptin"])
    except Exception:  # unknown: assume the sm_86 limit (the kernel then keeps weights in registers)
        return 99 * 1024


def _launch_ids(input_ids: torch.Tensor | list[int], what: str) -> torch.Tensor:
    """The ids of one launch as a flat tensor (left where they are: GPU ids reach the kernel by a device copy)."""
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.int64)
    ids = ids.reshape(-1)
    if not 1 <= ids.numel() <= MAX_TOKENS_PER_LAUNCH:
        raise MegakernelError(f"a launch takes 1..{MAX_TOKENS_PER_LAUNCH} {what}, got {ids.numel()}")
    return ids


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bf16(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.bfloat16:
        raise UnsupportedModelError(f"megakernel: {what} must be bf16, got {t.dtype}")
    return t


def _contig(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise MegakernelError(f"megakernel: {what} must be contiguous")
    return t
