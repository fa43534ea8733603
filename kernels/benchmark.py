"""Decode benchmark: the megakernel against the reference model (eager and CUDA graph) and transformers.

Every figure comes from CUDA events around work on the GPU of this run; bandwidth ceilings (a device copy
and a pure streaming read) are measured in the same run, and each method's speed is stated as bytes it must
move per token over its time per token, as a share of those ceilings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from onestream.worker.config import ModelConfig
from onestream.worker.kv_cache import DEFAULT_KV_FORMAT, kv_vector_bytes

from .alternate import AlternatedResult, alternate
from .diagnostics import DiagnosticRunner
from .phase_timing import format_breakdown, step_phases, summarise
from .random_model import random_model
from .runtime import MegakernelRunner
from .tuning import Tuning

READ_KERNEL = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n, unsigned* out) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n; i += 8 * stride) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads alive
}
"""


@dataclass
class Ceilings:
    copy_gbs: float  # bytes read + written per second, device-to-device copy
    read_gbs: float  # bytes read per second, 16-byte streaming loads


@dataclass
class MethodResult:
    method: str
    tok_s: float | None
    ms_per_token: float | None
    note: str = ""


@dataclass
class ModelResult:
    name: str
    config: dict[str, Any]
    layers: int
    weight_bytes: int
    state_bytes: int
    context: int
    results: list[MethodResult] = field(default_factory=list)
    kernel: dict[str, Any] = field(default_factory=dict)
    # Timing builds: per-phase rows (PhaseRow fields) of the last timed step, and the same as text.
    breakdowns: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    breakdown_text: dict[str, str] = field(default_factory=dict)

    @property
    def bytes_per_token(self) -> int:
        return self.weight_bytes + self.state_bytes


def events_time(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs, CUDA events around each."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def measure_ceilings(nbytes: int = 4 << 30) -> Ceilings:
    import cupy

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()  # never time zeros
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = events_time(lambda: dst.copy_(src), 10)
    kernel = cupy.RawKernel(READ_KERNEL, "stream_read")
    out = cupy.zeros(1, dtype=cupy.uint32)
    n = nbytes // 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def read() -> None:
        with stream:
            kernel((sms * 8,), (256,), (np.uint64(src.data_ptr()), np.int64(n), out))

    read()
    read_s = events_time(read, 10)
    return Ceilings(copy_gbs=2 * nbytes / copy_s / 1e9, read_gbs=nbytes / read_s / 1e9)


# ---- methods ------------------------------------------------------------------------------------------
@torch.no_grad()
def prefilled(
    model: Any, context: int, max_len: int, *, seed: int, mtp: bool = False
) -> tuple[Any, int, torch.Tensor]:
    """A state holding `context` random tokens (the MTP head's cache too when `mtp`), with room for `max_len`
    positions reserved so that nothing reallocates inside a timed or captured step; returns it, the greedy next
    token and the last post-norm hidden [1, H]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (context,), device="cuda", generator=g)
    state = model.new_state(max_len)
    out = model.forward_step(prompt, state, logits="last")
    if mtp:  # pairs (t[p+1], H[p]), as decoding leaves the MTP cache: drafts attend over the whole context
        model.mtp_step(prompt[1:], out.hidden[:-1], state, logits="last")
    for cache in [*state.kv.values(), *([state.mtp_kv] if mtp else [])]:
        cache.reserve(max_len)
    return state, int(out.logits[-1].argmax()), out.hidden[-1:].contiguous()


def bench_megakernel(runner: MegakernelRunner, model: Any, context: int, steps: int) -> list[MethodResult]:
    state, first, _ = prefilled(model, context, context + 4 * steps + 8, seed=1)
    runner.greedy_chain(first, state, 4)  # warm-up (module load, tables)
    token = state.token_ids[-1]

    def chain() -> None:
        runner.greedy_chain(token, state, steps, check=False)

    # `steps` back-to-back launches, each step's argmax fed to the next on the device; median of 3 chains.
    t = events_time(chain, 3) / steps
    runner._check(runner.ctrl.cpu())
    out = [MethodResult("megakernel (device-chained greedy)", 1 / t, t * 1e3)]
    state2, first2, _ = prefilled(model, context, context + steps + 8, seed=2)
    ids = torch.tensor([first2], device="cuda")
    runner.step(ids, state2)
    start = time.perf_counter()
    for _ in range(steps):
        res = runner.step(ids, state2)
        ids = torch.tensor(res.tokens, device="cuda")
    torch.cuda.synchronize()
    t2 = (time.perf_counter() - start) / steps
    out.append(MethodResult("megakernel (one step per call, host sync)", 1 / t2, t2 * 1e3))
    return out


def _failed(error: str) -> Callable[[], float]:
    def run() -> float:
        raise RuntimeError(error)

    return run


def alternated_builds(
    model: Any, tunings: dict[str, Tuning], *, context: int, steps: int, rounds: int
) -> list[AlternatedResult]:
    """Each build's device-chained greedy decode, one chain of `steps` launches per round, builds alternating
    (kernels/alternate.py); every build decodes the same positions of the same prefilled state."""
    state, first, _ = prefilled(model, context, context + steps + 8, seed=1)
    timers: dict[str, Callable[[], float]] = {}
    runners: list[MegakernelRunner] = []
    for label, tuning in tunings.items():
        try:
            runner = DiagnosticRunner(model, tuning=tuning)
            own = state.clone()
            runner.greedy_chain(first, own, 2)  # warm-up: module load, tables
        except Exception as e:
            timers[label] = _failed(f"{type(e).__name__}: {e}"[:300])
            continue
        runners.append(runner)

        def timer(runner: MegakernelRunner = runner, own: Any = own) -> float:
            token = own.token_ids[-1]
            seconds = events_time(lambda: runner.greedy_chain(token, own, steps, check=False), 1)
            runner.check()
            return 1e3 * seconds / steps

        timers[label] = timer
    return alternate(timers, rounds)


@torch.no_grad()
def bench_reference_eager(model: Any, context: int, steps: int) -> MethodResult:
    state, first, _ = prefilled(model, context, context + steps + 8, seed=3)
    ids = torch.tensor([first], device="cuda")
    model.forward_step(ids, state)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        out = model.forward_step(ids, state)
        ids = out.logits[0].argmax().reshape(1)
    torch.cuda.synchronize()
    t = (time.perf_counter() - start) / steps
    return MethodResult("reference eager", 1 / t, t * 1e3)


@torch.no_grad()
def bench_reference_graph(model: Any, context: int, steps: int) -> MethodResult:
    """One decode step captured in a CUDA graph at a fixed position, replayed (same work per replay)."""
    try:
        state, first, _ = prefilled(model, context, context + 64, seed=4)
        ids = torch.tensor([first], device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on the capture stream
                model.forward_step(ids, state)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.forward_step(ids, state)
        graph.replay()
        t = events_time(lambda: [graph.replay() for _ in range(steps)], 3) / steps
        return MethodResult("reference in a CUDA graph", 1 / t, t * 1e3)
    except Exception as e:
        return MethodResult("reference in a CUDA graph", None, None, f"failed: {type(e).__name__}: {e}"[:200])


@torch.no_grad()
def bench_transformers(model: Any, config: ModelConfig, context: int, steps: int) -> MethodResult:
    """transformers' Qwen3_5ForCausalLM sharing the same weight tensors, greedy `generate`."""
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        hf_cfg = Qwen3_5TextConfig(
            **{k: v for k, v in config.to_hf_text_dict().items() if k != "architectures"}
        )
        with torch.device("meta"):  # no second copy of the weights: ours are assigned below
            hf = Qwen3_5ForCausalLM(hf_cfg)
        hf.load_state_dict(model.state_dict(), strict=False, assign=True)
        if config.tie_word_embeddings:
            hf.lm_head.weight = hf.model.embed_tokens.weight
        _materialise_rotary(hf)
        left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
        if left:
            return MethodResult("transformers generate", None, None, f"tensors not loaded: {left[:3]}")
        hf.eval()
        torch.cuda.empty_cache()
        prompt = torch.randint(0, config.vocab_size, (1, context), device="cuda")

        def gen(n: int) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        gen(2)
        short, long = gen(2), gen(2 + steps)
        t = (long - short) / steps
        return MethodResult("transformers generate", 1 / t, t * 1e3)
    except Exception as e:
        return MethodResult("transformers generate", None, None, f"failed: {type(e).__name__}: {e}"[:200])


def _materialise_rotary(module: torch.nn.Module) -> None:
    """Rebuild on the GPU the rotary-embedding modules whose (non-persistent) buffers are still on meta."""
    for name, child in list(module.named_children()):
        if any(b.is_meta for b in child.buffers(recurse=False)) and hasattr(child, "config"):
            setattr(module, name, type(child)(child.config).to("cuda"))  # built on the host, then moved
        else:
            _materialise_rotary(child)


def module_weight_bytes(module: Any) -> int:
    """Bytes a GEMV streams for one layer's weight: its blocks when block-quantized, its tensor otherwise."""
    from .quant_weights import gemv_module

    module = gemv_module(module)
    qtype, shape = getattr(module, "qtype", None), getattr(module, "shape", None)
    if qtype is not None and shape is not None:
        return qtype.nbytes(tuple(shape))
    return module.weight.numel() * module.weight.element_size()


def weight_bytes(model: Any) -> int:
    """Bytes of weights a decode step streams: every layer matrix, the lm_head, one embedding row."""
    total = 0
    for layer in model.model.layers:
        mods = [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
        if layer.is_full_attention:
            sa = layer.self_attn
            mods += [sa.q_proj, sa.k_proj, sa.v_proj, sa.o_proj]
        else:
            la = layer.linear_attn
            mods += [la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a, la.out_proj]
        total += sum(module_weight_bytes(m) for m in mods)
    return total + lm_head_bytes(model) + model.config.hidden_size * 2


def lm_head_bytes(model: Any) -> int:
    head = model.model.embed_tokens if model.config.tie_word_embeddings else model.lm_head
    return module_weight_bytes(head)


def _state_bytes(c: ModelConfig, context: int, kv_format: str = DEFAULT_KV_FORMAT) -> int:
    """DeltaNet recurrent state read and written, conv windows, and the KV cache (of `kv_format`) read at
    `context`."""
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.linear_qkv_dim * (c.linear_conv_kernel_dim - 1) * 2
    kv = 2 * c.num_key_value_heads * kv_vector_bytes(kv_format, c.head_dim) * context
    return len(c.linear_attention_layers) * 2 * (rec + conv) + len(c.full_attention_layers) * kv


def bench_model(
    name: str,
    config: ModelConfig,
    *,
    context: int,
    steps: int,
    ref_steps: int,
    hf: bool,
    tunings: dict[str, Tuning] | None = None,
    model: Any = None,
) -> ModelResult:
    model = model if model is not None else random_model(config, seed=7)
    tunings = tunings or {"default": Tuning()}
    result: ModelResult | None = None
    for label, tuning in tunings.items():
        suffix = "" if label == "default" else f" [{label}]"
        try:
            runner = DiagnosticRunner(model, tuning=tuning)
        except Exception as e:
            runner, error = None, f"failed: {type(e).__name__}: {e}"[:300]
        if result is None:
            result = ModelResult(
                name,
                {
                    "hidden": config.hidden_size,
                    "vocab": config.vocab_size,
                    "layers": config.num_hidden_layers,
                },
                config.num_hidden_layers,
                weight_bytes(model),
                _state_bytes(config, context),
                context,
                kernel=runner.describe() if runner is not None else {},
            )
        if runner is None:
            result.results.append(MethodResult("megakernel" + suffix, None, None, error))
            continue
        try:
            timed = bench_megakernel(runner, model, context, steps)
            for r in timed:
                r.method += suffix
                result.results.append(r)
                # As it goes, so that a run cut short by its time limit still reports what it measured.
                print(
                    f"  [{name}] {r.method}: {r.tok_s:.1f} tok/s, {r.ms_per_token:.3f} ms/token", flush=True
                )
            if tuning.phase_timing:  # the stamps of the last launch above
                rows = summarise(runner.phase_stamps(), step_phases(config), runner.gemv_stamps())
                result.breakdowns[label] = [dataclasses.asdict(r) for r in rows]
                result.breakdown_text[label] = format_breakdown(rows, timed[0].ms_per_token)
        except Exception as e:
            result.results.append(
                MethodResult("megakernel" + suffix, None, None, f"failed: {type(e).__name__}: {e}"[:300])
            )
        del runner
    assert result is not None
    result.results.append(bench_reference_eager(model, context, ref_steps))
    result.results.append(bench_reference_graph(model, context, ref_steps))
    if hf:
        result.results.append(bench_transformers(model, config, context, ref_steps))
    return result


def format_results(ceil: Ceilings, models: list[ModelResult], device: str) -> str:
    lines = [
        f"device: {device}",
        f"measured ceilings: copy {ceil.copy_gbs:.0f} GB/s (read+write), streaming read {ceil.read_gbs:.0f} GB/s",
    ]
    for m in models:
        floor_read = m.bytes_per_token / (ceil.read_gbs * 1e9)
        floor_copy = m.bytes_per_token / (ceil.copy_gbs * 1e9)
        lines.append("")
        lines.append(
            f"== {m.name}: {m.layers} layers, {m.bytes_per_token / 1e9:.3f} GB per token "
            f"(weights {m.weight_bytes / 1e9:.3f} + state/KV {m.state_bytes / 1e9:.4f}), context {m.context}; "
            f"floor {1 / floor_read:.1f} tok/s at the read ceiling, {1 / floor_copy:.1f} at the copy ceiling"
        )
        if m.kernel:
            lines.append(f"   kernel: {m.kernel}")
        lines.append(
            f"   {'method':48s} {'tok/s':>9s} {'ms/tok':>8s} {'GB/s':>8s} {'%copy':>6s} {'%read':>6s}"
        )
        for r in m.results:
            if r.tok_s is None:
                lines.append(f"   {r.method:48s} {'-':>9s} {'-':>8s}  {r.note}")
                continue
            gbs = m.bytes_per_token * r.tok_s / 1e9
            lines.append(
                f"   {r.method:48s} {r.tok_s:9.1f} {r.ms_per_token:8.3f} {gbs:8.0f} "
                f"{100 * gbs / ceil.copy_gbs:6.1f} {100 * gbs / ceil.read_gbs:6.1f}"
            )
        for label, text in m.breakdown_text.items():
            lines.append(f"   [{label}]")
            lines.append(text)
    return "\n".join(lines)


def as_json(ceil: Ceilings, models: list[ModelResult]) -> dict[str, Any]:
    models_json = []
    for m in models:
        d = dataclasses.asdict(m)
        d.pop("breakdown_text")
        models_json.append(d)
    return {"ceilings": dataclasses.asdict(ceil), "models": models_json}
