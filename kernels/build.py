"""Build the decode megakernel for one model config: compile-time constants, source assembly, compilation.

The CUDA sources (kernels/*.cu, *.cuh) take every shape as a compile-time constant. `KernelSpec` turns a
`ModelConfig` (plus tokens per launch and tuning knobs) into `-D` constants; `assemble_source` inlines the
headers into one self-contained text (so the compile cache key covers every line); `compile_module` builds it
with NVRTC through CuPy for the GPU present, and CuPy keeps the binary in its on-disk cache
(`$CUPY_CACHE_DIR`, default `~/.cupy/kernel_cache`), so later runs skip compilation. `nvcc_compile` builds
the same text with nvcc (the compile-only test and the register/spill report use it).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from onestream.worker.config import ModelConfig
from onestream.worker.errors import UnsupportedModelError

from .layout import MAX_TOKENS_PER_LAUNCH, preamble_defines

CUDA_DIR = Path(__file__).resolve().parent
MAIN_SOURCE = "megakernel.cu"
# Weight-ring depth where shared memory allows (2 x 8 loads x 384 threads x 16 B = 96 KB): 2 streams faster than
# 3 at every tokens-per-launch (docs/benchmarks.md).
AUTO_STAGES = 2
# Tuning.smem_prefer: the 196 KB carveout less the 1 KB reserved per block and the static block state.
SMEM_PREFER = 196 * 1024 - 1024 - 512
# What going over smem_prefer costs, in GEMV breaks: a break costs about 1.1 us and the smaller L1 about
# 0.12 ms per step.
SMEM_OVER_BREAKS = 100
STAGE_FALLBACKS = (AUTO_STAGES, 0)  # tried in order when shared memory is short (many tokens per launch)
MIN_PART_ROWS = 256  # GEMV partial-sum rows per round are halved down to this before the ring is shrunk
WINDOW_STEP = (
    2048  # staged-input window widths tried: the widest input, then multiples of this (a whole chunk)
)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


FP32_ACT_ENV = "ONESTREAM_MK_FP32_ACT"
GEMV_ENV = "ONESTREAM_MK_GEMV"


def tuning_from_env(environ: Mapping[str, str] | None = None, **fields: Any) -> Tuning:
    """The Tuning an operator's $ONESTREAM_MK_* settings select, with `fields` set over them. Read at the edge (the
    back-end creation, the CLI commands), never in a Tuning default: $ONESTREAM_MK_FP32_ACT "0" (or "false")
    selects the bf16 numerics, $ONESTREAM_MK_GEMV "tensor" the tensor-core GEMV (for deployments that decode
    speculatively nearly always: plain and verify launches then share that summation order). A value outside
    those raises ValueError naming the variable."""
    env = os.environ if environ is None else environ
    fp32_act = env.get(FP32_ACT_ENV, "1").strip().lower()
    if fp32_act not in ("0", "1", "true", "false", ""):
        raise ValueError(f"{FP32_ACT_ENV} must be 0 or 1, got {fp32_act!r}")
    gemv = env.get(GEMV_ENV, "scalar").strip().lower()
    if gemv not in ("scalar", "tensor", ""):
        raise ValueError(f"{GEMV_ENV} must be scalar or tensor, got {gemv!r}")
    chosen: dict[str, Any] = {
        "fp32_act": fp32_act not in ("0", "false"),
        "mma": gemv == "tensor",
    }
    return Tuning(**{**chosen, **fields})


@dataclass(frozen=True)
class Tuning:
    """Knobs that change speed, never results (reduction orders do not depend on them, except threads, umax,
    att_chunk, mma and mma_sub), and the activation precision `fp32_act`, which does."""

    threads: int = 384  # one block per SM, 12 warps: 168 registers each keep the GEMV loop free of spills
    umax: int = 8  # 16-byte loads per lane per GEMV item
    part_rows: int = 4096  # rows per GEMV round (shared-memory partials)
    # Widest staged GEMV input window per token (None: the widest that fits). A narrower window only adds passes
    # over K (tests use it to cross many pass breaks); the kernel takes at least the hidden size.
    max_window: int | None = None
    # Dynamic shared memory the fit stays within unless that costs more than SMEM_OVER_BREAKS breaks (0: no
    # preference). On sm_90 a block at or below it leaves the SM the 196 KB carveout (after the 1 KB the
    # runtime reserves per block and the static block state), so 60 KB of L1 instead of 28, which the weight
    # stream measured faster with.
    smem_prefer: int = SMEM_PREFER
    att_pairs: int = 3  # (query head, token) pairs per attention item at most (fewer while the grid has room)
    # Positions per flash-decoding chunk. Fixed (not derived from the context length) so that a token's attention
    # sums the same chunks in the same order whichever launch runs it: a verify pass of T tokens then gives
    # bit-identical results to T single steps.
    att_chunk: int = 128
    # Weight bytes of the next GEMV that the blocks idle during a DeltaNet / attention phase pull into L2, per
    # block share (split over the idle blocks, so that most of the output projection is in L2 when the busy
    # blocks finish).
    pf_idle_bytes: int = 192 * 1024
    # GEMV weights through a shared-memory ring of this many items per warp (cp.async; sm_80+), 0 = the register
    # double buffer; None = AUTO_STAGES (2) where the GPU's shared memory holds the ring (sm_90), else 0.
    stages: int | None = None
    phase_timing: bool = False  # compile in per-block globaltimer stamps per phase (debug builds only)
    # Numerics (changes results): True keeps the residual stream and the logits in fp32 and rounds the other
    # intermediates to bf16 once, where they are stored (closer to the fp32 reference); False rounds every
    # value the bf16 reference keeps in bf16.
    fp32_act: bool = True
    # GEMV on the tensor cores (mma.sync, items of 8 rows, so the cost of a load barely grows with the tokens per
    # launch) instead of the scalar FMA path. Off by default: slower at T = 1, faster from T = 2 on (docs/
    # benchmarks.md); plain and speculative decoding must share one summation order, so a deployment picks one
    # for both. Changes results (another summation order), the same way for every tokens-per-launch build.
    mma: bool = False
    mma_sub: int = 2  # tensor-core items per chunk (rows keep one partial sum per chunk)

    def __post_init__(self) -> None:
        if self.max_window is not None and (self.max_window <= 0 or self.max_window % 8):
            raise ValueError(f"max_window must be a positive multiple of 8, got {self.max_window}")
        if self.smem_prefer < 0:
            raise ValueError(f"smem_prefer must be >= 0, got {self.smem_prefer}")
        if self.mma and self.umax != 8 and self.stages != 0:
            raise ValueError(
                f"the tensor-core GEMV's weight ring keeps an item's 8 rows one per plane: umax must be 8, got "
                f"{self.umax} (or stages=0)"
            )
        if self.mma_sub < 1:
            raise ValueError(f"mma_sub must be at least 1, got {self.mma_sub}")


@dataclass(frozen=True)
class KernelSpec:
    config: ModelConfig
    num_sms: int
    tokens_per_launch: int = 1
    tuning: Tuning = field(default_factory=Tuning)
    smem_limit: int = 99 * 1024  # opt-in shared memory per block of the target GPU (sm_86 99 KB, sm_90 227)

    def __post_init__(self) -> None:
        check_supported(self.config, self.tokens_per_launch, self.tuning)

    @property
    def stages(self) -> int:
        """Items per warp in flight through the shared-memory weight ring (0: register double buffer)."""
        return self._fitted[1]

    @property
    def window(self) -> int:
        """Input values per token staged in shared memory (MK_XW): the widest GEMV input where it fits, else
        a narrower window that the wide phases cross in passes (results do not change)."""
        return self._fitted[2]

    def _ring_bytes(self, stages: int) -> int:
        return stages * self.tuning.umax * self.tuning.threads * 16

    @property
    def part_rows(self) -> int:
        """GEMV partial-sum rows per round: the tuning's, halved
        while shared memory is short. It sets only how many rows a round takes, never a reduction order."""
        return self._fitted[0]

    @cached_property  # every launch reads smem_bytes: the search below costs about 0.4 ms of Python
    def _fitted(self) -> tuple[int, int, int]:
        """(partial-sum rows, ring stages, window) that fit shared memory: the deepest ring that fits at all,
        then the (window, rows) pair whose GEMV phases break least often into rounds and passes (each break
        waits for the whole block, and a pass break re-stages the input), widest window first on ties; a fit above
        Tuning.smem_prefer counts SMEM_OVER_BREAKS more breaks."""
        top = self.tuning.part_rows
        options = (self.tuning.stages,) if self.tuning.stages is not None else STAGE_FALLBACKS
        windows = self._windows()
        least = self._least_part_rows()
        if top < least:
            raise UnsupportedModelError(
                f"megakernel: part_rows={top} leaves a GEMV round less than one {gemv_item_rows(self.tuning)}-row "
                f"item of the widest input; it needs at least {least}"
            )
        for stages in options:
            fits = []
            for window in windows:
                rows = top
                while rows >= least:
                    smem = self._smem(rows, stages, window)
                    if self._scratch_fits(rows) and smem <= self.smem_limit:
                        over = smem > self.tuning.smem_prefer
                        score = self._breaks(rows, window) + (SMEM_OVER_BREAKS if over else 0)
                        fits.append((score, -window, -rows))
                    rows //= 2
            if fits:
                _, window, rows = min(fits)
                return -rows, stages, -window
        if not self._scratch_fits(top):
            raise UnsupportedModelError(
                f"megakernel: part_rows={top} leaves the attention / DeltaNet phases' scratch (the partial-sum "
                "buffers) too small for these shapes"
            )
        return top, options[-1], windows[-1]  # does not fit: the runner reports the shortfall

    def _breaks(self, part_rows: int, window: int) -> int:
        """Rounds x passes per step of a block's share of every GEMV phase (mirrors gemv.cuh's gemv_plan)."""
        t = self.tuning
        item_rows = gemv_item_rows(t)
        total = 0
        for k, rows, count in self._gemv_phases():
            nk = gemv_chunks(k, t)
            per_round = max(item_rows, part_rows // nk // item_rows * item_rows)
            per_pass = max(1, window // gemv_chunk_width_of(k, t))
            share = -(-rows // self.num_sms)
            rounds = -(-share // per_round)
            passes = -(-nk // per_pass)
            total += count * rounds * passes
        return total

    def _gemv_phases(self) -> list[tuple[int, int, int]]:
        """(input width, rows, phases per step) of every weight-streaming phase (the MTP fc: none per step)."""
        c = self.config
        n_full = len(c.full_attention_layers)
        n_lin = c.num_hidden_layers - n_full
        dn_in = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + 2 * c.linear_value_dim
            + 2 * c.linear_num_value_heads
        )
        att_in = 2 * c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim
        return [
            (c.hidden_size, dn_in, n_lin),
            (c.linear_value_dim, c.hidden_size, n_lin),
            (c.hidden_size, att_in, n_full),
            (c.num_attention_heads * c.head_dim, c.hidden_size, n_full),
            (c.hidden_size, 2 * c.intermediate_size, c.num_hidden_layers),
            (c.intermediate_size, c.hidden_size, c.num_hidden_layers),
            (c.hidden_size, c.vocab_size, 1),
            (2 * c.hidden_size, c.hidden_size, 0),
        ]

    def _least_part_rows(self) -> int:
        """Fewest partial-sum rows per token: MIN_PART_ROWS, or more where a round of the widest input would
        hold less than one item's rows (tensor-core items: 8 rows of many chunks each)."""
        need = max(
            gemv_chunks(k, self.tuning) * gemv_item_rows(self.tuning) for k, _, _ in self._gemv_phases()
        )
        rows = MIN_PART_ROWS
        while rows < need:
            rows *= 2
        return rows

    def _windows(self) -> list[int]:
        """Window widths to try, widest first: the widest input, multiples of WINDOW_STEP, the hidden size (the
        narrowest the kernel takes: a hidden row and a whole GEMV chunk must fit); none wider than max_window
        (the narrowest where max_window is below it)."""
        c = self.config
        kmax = max(k for k, _, _ in self._gemv_phases())
        least = max(c.hidden_size, min(gemv_chunk_width(self.tuning), kmax))
        steps = range(kmax // WINDOW_STEP * WINDOW_STEP, least - 1, -WINDOW_STEP)
        out = sorted({kmax, *(w for w in steps if least <= w < kmax), -(-least // 8) * 8}, reverse=True)
        cap = self.tuning.max_window
        return out if cap is None else [w for w in out if w <= cap] or out[-1:]

    def _scratch_fits(self, rows: int) -> bool:
        """The attention and DeltaNet phases borrow the partial-sum buffers (static_asserts in phases.cuh)."""
        c, t, nt = self.config, self.tuning, self.tokens_per_launch
        warps = t.threads // 32
        att = 2 * self.att_pairs * c.head_dim + 2 * warps * self.att_pairs + nt * c.head_dim
        dn_sw = c.linear_value_head_dim // max(1, self.dn_split)
        dn = 2 * nt * c.linear_key_head_dim + t.threads + dn_sw + nt * dn_sw + 2 * nt
        return att <= 2 * nt * rows and dn <= nt * rows

    @property
    def dn_split(self) -> int:
        """Column slices per DeltaNet value head: as many work items as the grid has blocks, slices >= 16
        columns, each slice width dividing the block size."""
        return dn_split(self.config, self.num_sms, self.tuning.threads)

    @property
    def att_pairs(self) -> int:
        c = self.config
        pairs = c.num_attention_heads // c.num_key_value_heads * self.tokens_per_launch
        return max(1, min(self.tuning.att_pairs, pairs))

    def defines(self) -> dict[str, int | float]:
        c, t = self.config, self.tuning
        shapes: dict[str, int | float] = {
            "MK_H": c.hidden_size,
            "MK_NH": c.num_attention_heads,
            "MK_KVH": c.num_key_value_heads,
            "MK_HD": c.head_dim,
            "MK_ROT": c.rotary_dim,
            "MK_I": c.intermediate_size,
            "MK_HK": c.linear_num_key_heads,
            "MK_HV": c.linear_num_value_heads,
            "MK_DK": c.linear_key_head_dim,
            "MK_DV": c.linear_value_head_dim,
            "MK_CONVK": c.linear_conv_kernel_dim,
            "MK_V": c.vocab_size,
            "MK_EPS": float(c.rms_norm_eps),
            "MK_NT": self.tokens_per_launch,
            "MK_THREADS": t.threads,
            "MK_UMAX": t.umax,
            "MK_PART_ROWS": self.part_rows,
            "MK_XW": self.window,
            "MK_DN_SPLIT": self.dn_split,
            "MK_ATT_PAIRS": self.att_pairs,
            "MK_ATT_CHUNK": t.att_chunk,
            "MK_PF_IDLE_BYTES": t.pf_idle_bytes,
            "MK_STAGES": self.stages,
            "MK_FP32_ACT": int(t.fp32_act),
            "MK_MMA": int(t.mma),
            "MK_MMA_SUB": t.mma_sub,
        }
        if t.phase_timing:
            shapes["MK_PHASE_TIMING"] = 1
        return {**preamble_defines(), **shapes}

    # ---- sizes the host must match ------------------------------------------------------------------
    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block (the kernel checks it gets at least this: MK_SMEM_BYTES)."""
        rows, stages, window = self._fitted
        return self._smem(rows, stages, window)

    def _smem(self, part_rows: int, stages: int, window: int) -> int:
        nt = self.tokens_per_launch
        elem = 2  # bf16 inputs
        pad = 64 // elem if nt > 1 else 0  # gemv.cuh MK_XLD: tokens' rows in different banks
        xs = (nt * (window + pad) * elem + 15) // 16 * 16
        red = max(64, -(-nt * (self.tuning.threads // 32) // 4) * 4)  # phases.cuh RED_FLOATS
        align = 128  # phases.cuh SMEM_ALIGN: the carve starts at a 128-byte boundary
        return align + xs + 2 * nt * part_rows * 4 + red * 4 + self._ring_bytes(stages)

    @property
    def att_merge_chunks(self) -> int:
        """Flash-decoding chunks of one (query head, token) pair that the attention merge holds (its factors and
        denominator live in the partial-sum buffers: phases.cuh MK_ATT_MERGE_CHUNKS); longer contexts are refused."""
        return 2 * self.tokens_per_launch * self.part_rows - 1

    def att_chunks(self, capacity: int) -> int:
        """Flash-decoding chunks per key/value head for a KV cache of `capacity` positions."""
        return max(1, -(-capacity // self.tuning.att_chunk))


def gemv_item_rows(tuning: Tuning) -> int:
    """Rows one GEMV item multiplies: 8 on the tensor cores (the mma's n), else 1."""
    return 8 if tuning.mma else 1


def _lanes_and_sub(tuning: Tuning) -> tuple[int, int]:
    """gemv.cuh's GEMV_KL (lanes along K per row) and GEMV_SUB (items per chunk)."""
    return (4, tuning.mma_sub) if tuning.mma else (32, 1)


def gemv_chunk_width(tuning: Tuning) -> int:
    """Input elements of a whole GEMV chunk at most (gemv.cuh: MK_UMAX loads of 8 per lane, per sub-item)."""
    lanes, sub = _lanes_and_sub(tuning)
    return tuning.umax * lanes * sub * 8


def gemv_chunks(k: int, tuning: Tuning) -> int:
    """Chunks (partial sums) per row of a GEMV over k inputs: gemv.cuh's gemv_plan."""
    lanes, sub = _lanes_and_sub(tuning)
    loads = -(-(k // 8) // lanes)
    return -(-loads // (tuning.umax * sub))


def gemv_chunk_width_of(k: int, tuning: Tuning) -> int:
    """Input elements of one chunk of a GEMV over k inputs (its loads per lane shrink to fit k)."""
    lanes, sub = _lanes_and_sub(tuning)
    loads = -(-(k // 8) // lanes)
    per_lane = -(-loads // (gemv_chunks(k, tuning) * sub))
    return per_lane * lanes * sub * 8


def dn_split(config: ModelConfig, num_sms: int, threads: int) -> int:
    dv, hv = config.linear_value_head_dim, config.linear_num_value_heads

    def fits(split: int) -> bool:
        return dv % split == 0 and threads % (dv // split) == 0

    split = 1
    while split <= dv and not fits(split):
        split *= 2
    if split > dv:
        return 0
    while fits(split * 2) and dv // (split * 2) >= 16 and hv * split * 2 <= num_sms:
        split *= 2
    return split


def check_supported(config: ModelConfig, tokens_per_launch: int, tuning: Tuning) -> None:
    """Raise `UnsupportedModelError` naming the dimension the kernel cannot handle."""
    c = config
    problems = []
    for name, value in (
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("linear value width (heads x dim)", c.linear_value_dim),
        ("attention width (heads x head_dim)", c.num_attention_heads * c.head_dim),
    ):
        if value % 8:
            problems.append(f"{name}={value} is not a multiple of 8 (16-byte bf16 loads)")
    if c.head_dim % 8 or c.head_dim > 256:
        problems.append(f"head_dim={c.head_dim} must be a multiple of 8 and at most 256")
    if c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
        problems.append(f"rotary dims {c.rotary_dim} must be even and within head_dim")
    if dn_split(c, 1 << 30, tuning.threads) == 0:
        problems.append(
            f"linear_value_head_dim={c.linear_value_head_dim} has no power-of-two slice dividing the block size "
            f"{tuning.threads}"
        )
    if not 1 <= tokens_per_launch <= MAX_TOKENS_PER_LAUNCH:
        problems.append(f"tokens per launch must be 1..{MAX_TOKENS_PER_LAUNCH}, got {tokens_per_launch}")
    if c.linear_conv_kernel_dim < 2:
        problems.append(f"linear_conv_kernel_dim={c.linear_conv_kernel_dim} must be at least 2")
    if problems:
        raise UnsupportedModelError("megakernel: " + "; ".join(problems))


def _define_text(name: str, value: int | float) -> str:
    if isinstance(value, float):
        return f"#define {name} {value!r}f"
    return f"#define {name} {int(value)}"


def assemble_source(spec: KernelSpec) -> str:
    """One self-contained CUDA text: the constants, then megakernel.cu with its headers inlined once each."""
    lines = [f"// onestream megakernel, generated for {spec.config.model_type}; do not edit"]
    lines += [_define_text(k, v) for k, v in spec.defines().items()]
    seen: set[str] = set()

    def inline(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        path = CUDA_DIR / name
        for line in path.read_text().splitlines():
            m = _INCLUDE.match(line)
            if m:
                inline(m.group(1))
            elif line.strip() != "#pragma once":
                lines.append(line)

    inline(MAIN_SOURCE)
    return "\n".join(lines) + "\n"


@dataclass
class BuiltModule:
    module: Any  # cupy.RawModule
    spec: KernelSpec
    compile_s: float
    kernels: dict[str, Any] = dataclasses.field(default_factory=dict)

    def kernel(self, name: str) -> Any:
        if name not in self.kernels:
            self.kernels[name] = self.module.get_function(name)
        return self.kernels[name]

    def resources(self, name: str = "mk_decode") -> dict[str, int]:
        k = self.kernel(name)
        return {"registers": int(k.num_regs), "local_bytes": int(k.local_size_bytes)}


_MODULES: dict[tuple, BuiltModule] = {}


def compile_module(spec: KernelSpec) -> BuiltModule:
    """Compile (or fetch from the in-process and on-disk caches) the kernels for the current CUDA device."""
    key = (spec.config, spec.num_sms, spec.tokens_per_launch, spec.tuning, spec.smem_limit)
    if key in _MODULES:
        return _MODULES[key]
    import cupy

    source = assemble_source(spec)
    start = time.perf_counter()
    module = cupy.RawModule(code=source, options=("--std=c++17",), enable_cooperative_groups=True)
    module.compile()
    built = BuiltModule(module, spec, time.perf_counter() - start)
    _MODULES[key] = built
    return built


def nvcc_compile(spec: KernelSpec, arch: str, *, ptxas_verbose: bool = True, nvcc: str | None = None) -> str:
    """Compile the assembled source with nvcc for `arch` (e.g. "sm_90"); return the compiler's messages.

    Raises `RuntimeError` with the compiler output if the build fails.
    """
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "megakernel_generated.cu"
        src.write_text(assemble_source(spec))
        cmd = [
            nvcc,
            f"-arch={arch}",
            "--std=c++17",
            "-ftz=true",
            "-c",
            str(src),
            "-o",
            str(Path(tmp) / "mk.o"),
        ]
        if ptxas_verbose:
            cmd += ["-Xptxas", "-v"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        out = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{out}")
        return out


def ptxas_report(messages: str) -> dict[str, dict[str, int]]:
    """Registers, spill stores/loads and stack frame per kernel or device function, from `-Xptxas -v`.

    A function compiled for several kernels appears once per kernel: its entry keeps the largest figures.
    """
    report: dict[str, dict[str, int]] = {}
    current = None
    for line in messages.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = m.group(1)
            report.setdefault(current, {})
            continue
        if current is None:
            continue
        entry = report[current]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            for key, value in zip(
                ("stack", "spill_stores", "spill_loads"), map(int, m.groups()), strict=True
            ):
                entry[key] = max(entry.get(key, 0), value)
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entry["registers"] = max(entry.get("registers", 0), int(m.group(1)))
    return report
