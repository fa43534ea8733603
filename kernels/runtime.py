"""Host side of the megakernel: parameter tables, scratch buffers, state binding and launches.

`MegakernelRunner(model)` builds (or loads from the cache) the kernels for the model's config and the GPU,
sizes the persistent grid from the occupancy query (one co-resident block per SM, launched cooperatively),
and points the kernel at the model's own weight tensors (no copy) and at a `SequenceState`'s own caches
(the KV caches, conv windows and fp32 recurrent states are shared with the reference model, so prefill,
snapshots, rollback and the reference fallback need no conversion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from onestream.worker.errors import OnestreamError, UnsupportedModelError

from .build import BuiltModule, KernelSpec, Tuning, compile_module
from .layout import (
    CTRL_FLAG_FEEDBACK,
    ERROR_TEXT,
    LAYER_FULL,
    LAYER_LINEAR,
    G,
    KernelErrorCode,
    L,
    ctrl_slots,
)

DEFAULT_TIMEOUT_S = 2.0


class MegakernelError(OnestreamError, RuntimeError):
    """The megakernel reported an error (watchdog, bad input) or cannot run on this model/device."""


@dataclass
class StepResult:
    logits: torch.Tensor  # [T, V] fp32 (the runner's buffer: clone to keep across steps)
    hidden: torch.Tensor  # [T, H] bf16 post-norm hidden (the runner's buffer)
    tokens: list[int]  # greedy (argmax) token per position


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.data_ptr())


class MegakernelRunner:
    def __init__(
        self,
        model: Any,
        *,
        tokens_per_launch: int = 1,
        tuning: Tuning | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        embed = model.model.embed_tokens.weight
        if embed.device.type != "cuda":
            raise MegakernelError(f"the megakernel runs on a CUDA device; the model is on {embed.device}")
        if embed.dtype != torch.bfloat16:
            raise UnsupportedModelError(f"the megakernel needs bf16 weights; the model is {embed.dtype}")
        self.model = model
        self.config = model.config
        self.device = embed.device
        props = torch.cuda.get_device_properties(self.device)
        self.spec = KernelSpec(
            self.config,
            props.multi_processor_count,
            tokens_per_launch,
            tuning or Tuning(),
            smem_limit=_smem_optin(props, self.device),
        )
        self.tokens_per_launch = tokens_per_launch
        self.ctrl_slots = ctrl_slots(tokens_per_launch)
        self.timeout_ns = int(timeout_s * 1e9)
        with torch.cuda.device(self.device):
            self.built: BuiltModule = compile_module(self.spec)
        self.threads = self.spec.tuning.threads
        self.smem = self.spec.smem_bytes
        limit = self.spec.smem_limit
        if self.smem > limit:
            raise MegakernelError(
                f"the kernel needs {self.smem} bytes of shared memory per block for {tokens_per_launch} token(s) "
                f"per launch; {props.name} allows {limit}"
            )
        self.grid = self._grid_size(props.multi_processor_count)
        self._params = self._small_params()
        self.buf = self._scratch()
        self.ctrl = torch.zeros(self.ctrl_slots["CTRL_INTS"], dtype=torch.int32, device=self.device)
        # Barrier counter, attention arrival counters, one ticket counter per phase slot of a step (Tuning.dynamic).
        sync_len = 1 + self.config.num_key_value_heads + 5 * self.config.num_hidden_layers + 1
        self.sync = torch.zeros(sync_len, dtype=torch.int64, device=self.device)
        self._ctrl_host = torch.zeros(self.ctrl_slots["CTRL_INTS"], dtype=torch.int32).pin_memory()
        self._globals = torch.zeros(G.COUNT, dtype=torch.int64, device=self.device)
        self._layers = torch.zeros(
            self.config.num_hidden_layers * L.COUNT, dtype=torch.int64, device=self.device
        )
        self._bound: tuple | None = None
        self._hist: torch.Tensor | None = None
        # Debug builds (Tuning.phase_timing): per (phase of the step, block) start and end stamps, ns.
        self._timing: torch.Tensor | None = None
        if self.spec.tuning.phase_timing:
            steps = 5 * self.config.num_hidden_layers + 2
            self._timing = torch.zeros((steps, self.grid, 2), dtype=torch.int64, device=self.device)
        self._streams: dict[int, Any] = {}

    # ---- setup ---------------------------------------------------------------------------------------
    def _grid_size(self, num_sms: int) -> int:
        import cupy

        for name in ("mk_decode", "mk_phase"):
            kernel = self.built.kernel(name)
            kernel.max_dynamic_shared_size_bytes = self.smem
        kernel = self.built.kernel("mk_decode")
        per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, self.threads, self.smem
        )
        if per_sm < 1:
            raise MegakernelError(
                f"mk_decode cannot be resident: {self.threads} threads x {kernel.num_regs} registers and "
                f"{self.smem} bytes of shared memory per block exceed one SM"
            )
        return num_sms  # one block per SM: the kernel's work split assumes it (more would also be resident)

    def _small_params(self) -> dict[str, torch.Tensor]:
        """fp32 copies of the small parameters, computed with the reference's own expressions."""
        m = self.model
        out: dict[str, torch.Tensor] = {"final_norm": (1.0 + m.model.norm.weight.float()).contiguous()}
        out["inv_freq"] = m.rotary._inv_freq.to(device=self.device, dtype=torch.float32).contiguous()
        for i, layer in enumerate(m.model.layers):
            out[f"{i}.in_norm"] = (1.0 + layer.input_layernorm.weight.float()).contiguous()
            out[f"{i}.post_norm"] = (1.0 + layer.post_attention_layernorm.weight.float()).contiguous()
            if layer.is_full_attention:
                out[f"{i}.q_norm"] = (1.0 + layer.self_attn.q_norm.weight.float()).contiguous()
                out[f"{i}.k_norm"] = (1.0 + layer.self_attn.k_norm.weight.float()).contiguous()
            else:
                la = layer.linear_attn
                out[f"{i}.neg_a"] = (-la.A_log.float().exp()).contiguous()
                out[f"{i}.dt_bias"] = la.dt_bias.float().contiguous()
        return out

    def _scratch(self) -> dict[str, torch.Tensor]:
        c, nt, dev = self.config, self.tokens_per_launch, self.device
        bf, f32 = torch.bfloat16, torch.float32
        att_in_rows = (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        pairs = c.num_attention_heads // c.num_key_value_heads * nt
        part = c.num_key_value_heads * self.spec.att_max_chunks(self.grid) * pairs * (c.head_dim + 2)
        shapes = {
            "h": ((nt, c.hidden_size), f32 if self.spec.tuning.fp32_act else bf),  # the residual stream
            "xbuf": ((nt, c.linear_qkv_dim), bf),
            "zbuf": ((nt, c.linear_value_dim), bf),
            "beta": ((nt, c.linear_num_value_heads), f32),
            "gdecay": ((nt, c.linear_num_value_heads), f32),
            "core": ((nt, c.linear_value_dim), bf),
            "qkv_att": ((nt, att_in_rows), bf),
            "att_out": ((nt, c.num_attention_heads * c.head_dim), bf),
            "att_part": ((part,), f32),
            "act": ((nt, c.intermediate_size), bf),
            "logits": ((nt, c.vocab_size), f32),
            "hidden_out": ((nt, c.hidden_size), bf),
            "argkey": ((nt,), torch.int64),
        }
        return {name: torch.zeros(shape, dtype=dtype, device=dev) for name, (shape, dtype) in shapes.items()}

    # ---- binding a sequence state --------------------------------------------------------------------
    def _reserve(self, state: Any, needed: int) -> None:
        for cache in state.kv.values():
            cache.reserve(needed)

    def bind(self, state: Any, needed: int) -> None:
        """Point the tables at `state`'s caches, growing its KV caches to hold `needed` positions."""
        self._reserve(state, needed)
        caches = [state.kv[i] for i in self.config.full_attention_layers]
        # Everything the tables hold that belongs to the state: a new state object can reuse a freed one's id,
        # and the caching allocator can hand a regrown cache or a new state tensor a freed block's address.
        key = (
            id(state),
            tuple((_ptr(c.k), _ptr(c.v), c.capacity) for c in caches),
            tuple(
                (_ptr(state.conv[i]), _ptr(state.recurrent[i])) for i in self.config.linear_attention_layers
            ),
            self._hist_ptr(),
        )
        if key == self._bound:
            return
        self._write_tables(state, caches)
        self._bound = key

    def _hist_ptr(self) -> int:
        return _ptr(self._hist)

    def _write_tables(self, state: Any, caches: list) -> None:
        m, c, p, b = self.model, self.config, self._params, self.buf
        g = [0] * G.COUNT
        g[G.EMBED] = _ptr(m.model.embed_tokens.weight)
        g[G.LM_HEAD] = _ptr(m.lm_head_weight)
        g[G.FINAL_NORM] = _ptr(p["final_norm"])
        g[G.INV_FREQ] = _ptr(p["inv_freq"])
        for slot, name in (
            (G.H, "h"), (G.XBUF, "xbuf"), (G.ZBUF, "zbuf"), (G.BETA, "beta"), (G.GDECAY, "gdecay"),
            (G.CORE, "core"), (G.QKV_ATT, "qkv_att"), (G.ATT_OUT, "att_out"), (G.ATT_PART, "att_part"),
            (G.ACT, "act"), (G.LOGITS, "logits"), (G.HIDDEN_OUT, "hidden_out"), (G.ARGKEY, "argkey"),
        ):  # fmt: skip
            g[slot] = _ptr(b[name])
        g[G.KV_CAP] = min((cache.capacity for cache in caches), default=state.max_len)
        g[G.TIMEOUT_NS] = self.timeout_ns
        g[G.NUM_LAYERS] = c.num_hidden_layers
        g[G.TOKEN_HIST] = self._hist_ptr()
        g[G.TIMING] = _ptr(self._timing)

        rows = []
        for i, layer in enumerate(m.model.layers):
            r = [0] * L.COUNT
            r[L.IN_NORM] = _ptr(p[f"{i}.in_norm"])
            r[L.POST_NORM] = _ptr(p[f"{i}.post_norm"])
            r[L.GATE] = _ptr(_weight(layer.mlp.gate_proj))
            r[L.UP] = _ptr(_weight(layer.mlp.up_proj))
            r[L.DOWN] = _ptr(_weight(layer.mlp.down_proj))
            if layer.is_full_attention:
                sa = layer.self_attn
                r[L.KIND] = LAYER_FULL
                r[L.Q], r[L.K], r[L.V], r[L.O] = (
                    _ptr(_weight(x)) for x in (sa.q_proj, sa.k_proj, sa.v_proj, sa.o_proj)
                )
                r[L.QNORM] = _ptr(p[f"{i}.q_norm"])
                r[L.KNORM] = _ptr(p[f"{i}.k_norm"])
                cache = state.kv[i]
                r[L.KCACHE], r[L.VCACHE] = (
                    _ptr(_contig(cache.k, "KV cache")),
                    _ptr(_contig(cache.v, "KV cache")),
                )
            else:
                la = layer.linear_attn
                r[L.KIND] = LAYER_LINEAR
                r[L.QKV], r[L.Z], r[L.B], r[L.A] = (
                    _ptr(_weight(x)) for x in (la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a)
                )
                r[L.OUT] = _ptr(_weight(la.out_proj))
                r[L.CONV_W] = _ptr(_contig(_bf16(la.conv1d.weight, "conv1d.weight"), "conv1d.weight"))
                r[L.NEG_A] = _ptr(p[f"{i}.neg_a"])
                r[L.DT_BIAS] = _ptr(p[f"{i}.dt_bias"])
                r[L.GNORM_W] = _ptr(_contig(_bf16(la.norm.weight, "linear_attn.norm.weight"), "norm"))
                r[L.CONV_STATE] = _ptr(_contig(_bf16(state.conv[i], "conv state"), "conv state"))
                rec = state.recurrent[i]
                if rec.dtype != torch.float32:
                    raise MegakernelError(f"layer {i}: the recurrent state must be fp32, got {rec.dtype}")
                r[L.REC_STATE] = _ptr(_contig(rec, "recurrent state"))
            rows.extend(r)
        self._globals.copy_(torch.tensor(g, dtype=torch.int64))
        self._layers.copy_(torch.tensor(rows, dtype=torch.int64))

    # ---- launches ------------------------------------------------------------------------------------
    def _launch(self, name: str, args: tuple, *, smem: int | None = None) -> None:
        import cupy

        kernel = self.built.kernel(name)
        handle = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:  # one CuPy view of each torch stream (creating one per launch costs time)
            stream = self._streams[handle] = cupy.cuda.ExternalStream(handle, self.device.index or 0)
        with stream:
            kernel((self.grid,), (self.threads,), args, shared_mem=self.smem if smem is None else smem)

    def _table_args(self) -> tuple:
        return (
            np.uint64(_ptr(self._globals)),
            np.uint64(_ptr(self._layers)),
            np.uint64(_ptr(self.ctrl)),
            np.uint64(_ptr(self.sync)),
        )

    def _set_ctrl(self, pos: int, tokens: list[int] | None, flags: int = 0) -> None:
        """Position, cleared error, flags and (if given) the input tokens, in one host-to-device copy."""
        s = self.ctrl_slots
        h = self._ctrl_host
        h.zero_()
        h[s["CTRL_POS"]], h[s["CTRL_FLAGS"]] = pos, flags
        n = s["CTRL_TOKEN_IN"]
        if tokens is not None:
            h[n : n + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            n += len(tokens)
        self.ctrl[:n].copy_(h[:n], non_blocking=True)

    def _check(self, ctrl: torch.Tensor) -> None:
        code = int(ctrl[1])
        if code == 0:
            return
        info = int(ctrl[2])
        self.reset()
        try:
            what = ERROR_TEXT[KernelErrorCode(code)]
        except (ValueError, KeyError):
            what = f"error code {code}"
        raise MegakernelError(f"megakernel: {what} (info {info}); the sequence state is no longer valid")

    def reset(self) -> None:
        """Clear the barrier counters, argmax keys and error flag (after an error left them half-way)."""
        self.sync.zero_()
        self.buf["argkey"].zero_()
        self.ctrl.zero_()
        torch.cuda.synchronize(self.device)

    def step(self, input_ids: torch.Tensor | list[int], state: Any) -> StepResult:
        """One launch: tokens at positions `state.length …`; advances `state` like `forward_step` does.

        Ids already on the GPU go to the kernel by a device copy (no host round trip before the launch)."""
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.int64)
        ids = ids.reshape(-1)
        if ids.numel() != self.tokens_per_launch:
            raise MegakernelError(
                f"this runner takes {self.tokens_per_launch} token(s) per launch, got {ids.numel()}"
            )
        pos = state.check_room(ids.numel())
        self.bind(state, pos + ids.numel())
        self._set_ctrl(pos, None)
        slot = self.ctrl_slots["CTRL_TOKEN_IN"]
        self.ctrl[slot : slot + ids.numel()].copy_(ids.to(torch.int32), non_blocking=True)
        self._launch("mk_decode", self._table_args())
        ctrl = self.ctrl.cpu()
        self._check(ctrl)
        out = self.ctrl_slots["CTRL_TOKEN_OUT"]
        greedy = [int(x) for x in ctrl[out : out + self.tokens_per_launch]]
        state.advance(ids.to(state.device))  # the state's pending ids must all live on one device
        state.history = None
        return StepResult(self.buf["logits"], self.buf["hidden_out"], greedy)

    def greedy_chain(self, first_token: int, state: Any, n: int, *, check: bool = True) -> list[int]:
        """`n` greedy steps as `n` back-to-back launches with no host round trip (each step's argmax feeds the
        next); returns the n generated tokens. One sync at the end."""
        if self.tokens_per_launch != 1:
            raise MegakernelError("greedy chains run one token per launch")
        pos = state.check_room(n)
        if self._hist is None or self._hist.numel() < state.max_len:
            self._hist = torch.zeros(state.max_len, dtype=torch.int32, device=self.device)
        self.bind(state, pos + n)
        self._set_ctrl(pos, [first_token], CTRL_FLAG_FEEDBACK)
        args = self._table_args()
        for _ in range(n):
            self._launch("mk_decode", args)
        if not check:
            return []
        ctrl = self.ctrl.cpu()
        self._check(ctrl)
        generated = [int(x) for x in self._hist[pos : pos + n].cpu()]
        state.advance(torch.tensor([first_token, *generated[:-1]], dtype=torch.int64, device=state.device))
        state.history = None
        return generated

    def run_phase(self, phase: int, layer: int, state: Any, pos: int, tokens: list[int]) -> None:
        """Launch one phase alone (the per-phase tests); raises on a kernel-reported error."""
        self.bind(state, pos + self.tokens_per_launch)
        self._set_ctrl(pos, tokens)
        self._launch("mk_phase", (*self._table_args(), np.int32(phase), np.int32(layer)))
        self._check(self.ctrl.cpu())

    def barrier_test(self, rounds: int, skip_block: int, timeout_s: float) -> tuple[int, list[int]]:
        """Run the barrier alone; returns (error code, arrivals per round)."""
        arrivals = torch.zeros(rounds, dtype=torch.int32, device=self.device)
        self.reset()
        self._launch(
            "mk_barrier_test",
            (
                np.uint64(_ptr(self.ctrl)),
                np.uint64(_ptr(self.sync)),
                np.uint64(_ptr(arrivals)),
                np.int32(rounds),
                np.int32(skip_block),
                np.int64(int(timeout_s * 1e9)),
            ),
            smem=0,
        )
        ctrl = self.ctrl.cpu()
        code = int(ctrl[1])
        self.reset()
        return code, [int(x) for x in arrivals.cpu()]

    def phase_stamps(self) -> np.ndarray:
        """The last launch's per-phase stamps, [phases of a step, grid, (start, end)] in ns (timing builds)."""
        if self._timing is None:
            raise MegakernelError("phase stamps need a runner built with Tuning(phase_timing=True)")
        torch.cuda.synchronize(self.device)
        return self._timing.cpu().numpy()

    def describe(self) -> dict[str, Any]:
        res = self.built.resources("mk_decode")
        return {
            "grid": self.grid,
            "threads": self.threads,
            "smem_bytes": self.smem,
            "compile_s": round(self.built.compile_s, 2),
            "dn_split": self.spec.dn_split,
            "variant": self.spec.tuning.variant,
            "stages": self.spec.stages,
            "fp32_act": self.spec.tuning.fp32_act,
            "fp32_gemv_in": self.spec.tuning.fp32_gemv_in,
            "dynamic": self.spec.tuning.dynamic,
            "smem_limit": self.spec.smem_limit,
            **res,
        }


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


def _weight(module: Any) -> torch.Tensor:
    return _contig(_bf16(module.weight, "weight"), "weight")


def _bf16(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.bfloat16:
        raise UnsupportedModelError(f"megakernel: {what} must be bf16, got {t.dtype}")
    return t


def _contig(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise MegakernelError(f"megakernel: {what} must be contiguous")
    return t
