"""The knobs of one megakernel build, and where an operator's environment settings become one.

`Tuning` holds speed knobs (they never change results, except where a field says so) and the two numerics
choices a shipped build makes: the activation precision and the GEMV. A Tuning never reads the environment:
`tuning_from_env` resolves $ONESTREAM_MK_* at the edge (the back-end creation, the CLI commands).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Tuning.smem_prefer: the 196 KB carveout less the 1 KB reserved per block and the static block state.
SMEM_PREFER = 196 * 1024 - 1024 - 512

FP32_ACT_ENV = "ONESTREAM_MK_FP32_ACT"
GEMV_ENV = "ONESTREAM_MK_GEMV"


def tuning_from_env(
    environ: Mapping[str, str] | None = None, *, speculative: bool = False, **fields: Any
) -> Tuning:
    """The Tuning an operator's $ONESTREAM_MK_* settings select, with `fields` set over them. Read at the edge (the
    back-end creation, the CLI commands), never in a Tuning default: $ONESTREAM_MK_FP32_ACT "0" (or "false")
    selects the bf16 numerics; $ONESTREAM_MK_GEMV "scalar" or "tensor" the GEMV, and "auto" (the default) the one
    whose cost is least for the engine's launches: the tensor cores where the engine verifies drafts
    (`speculative`: its cycle of verify and drafts costs less there, docs/benchmarks.md, while the scalar GEMV's
    single step is the faster one), the scalar GEMV otherwise. Plain and verify launches share one summation order
    either way. A value outside those raises ValueError naming the variable."""
    env = os.environ if environ is None else environ
    fp32_act = env.get(FP32_ACT_ENV, "1").strip().lower()
    if fp32_act not in ("0", "1", "true", "false", ""):
        raise ValueError(f"{FP32_ACT_ENV} must be 0 or 1, got {fp32_act!r}")
    gemv = env.get(GEMV_ENV, "auto").strip().lower() or "auto"
    if gemv not in ("auto", "scalar", "tensor"):
        raise ValueError(f"{GEMV_ENV} must be auto, scalar or tensor, got {gemv!r}")
    chosen: dict[str, Any] = {
        "fp32_act": fp32_act not in ("0", "false"),
        "mma": gemv == "tensor" or (gemv == "auto" and speculative),
    }
    return Tuning(**{**chosen, **fields})


@dataclass(frozen=True)
class Tuning:
    """Knobs that change speed, never results (reduction orders do not depend on them, except threads, umax,
    att_chunk, att_group, mma, mma_sub and qunits), and the activation precision `fp32_act`, which does."""

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
    # (query head, token) pairs per attention item at most (fewer while the grid has room); None: the plan's choice
    # by weights and tokens per launch (KernelPlan.att_pairs).
    att_pairs: int | None = None
    # Positions per flash-decoding chunk. Fixed (not derived from the context length) so that a token's attention
    # sums the same chunks in the same order whichever launch runs it: a verify pass of T tokens then gives
    # bit-identical results to T single steps.
    att_chunk: int = 512
    # Splits of the attention keys over blocks hold at most 2^att_split_log chunks (each block's tree stack has that
    # many levels plus one); the plan picks a split per step from the context and the grid (plan.att_split). Never
    # changes results: a split is a subtree of one fixed tree over the chunks.
    att_split_log: int = 5
    # Consecutive positions a warp takes per step of the attention loop (4 or 8): 32 / att_group lanes share a key's
    # score, so it sets the butterfly depth, the redundancy of the softmax exps and the loads in flight per warp.
    # Changes results (the order a chunk's keys are summed in), the same way for every launch of a build.
    att_group: int = 4
    # Weight bytes of the next GEMV that the blocks idle during a DeltaNet / attention phase pull into L2, per
    # block share (split over the idle blocks, so that most of the output projection is in L2 when the busy
    # blocks finish).
    pf_idle_bytes: int = 192 * 1024
    # GEMV weights through a shared-memory ring of this many items per warp (cp.async; sm_80+), 0 = the register
    # double buffer; None = AUTO_STAGES (2) where the GPU's shared memory holds the ring (sm_90), else 0, and 0 for
    # models whose quantized units take more than 2 ring vectors with their shared scales (Q8_0, Q5_K: plan.py
    # KernelPlan._fitted).
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
    # Quantized GEMV: 32-element units per lane and row of an item (a chunk of a row is 32 qunits units: sets
    # where its partial sums break, so it changes results), and rows per item (1, 2 or 4: the lane reads each
    # staged input once for all of them; never changes results; None: KernelPlan.quant_rows by tokens per launch).
    qunits: int = 1
    qrows: int | None = None
    # Quantized GEMV arithmetic (changes results, the same way for every tokens-per-launch build): True quantizes
    # each staged input unit to two int8 planes (x = d (256 q1 + q2): 15 bits of the unit's largest input) and
    # multiplies the levels with dp4a in exact integers; False multiplies them in fp32 FMAs.
    qint8: bool = True

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
        if not 0 <= self.att_split_log <= 10:
            raise ValueError(f"att_split_log must be 0..10, got {self.att_split_log}")
        if self.att_pairs is not None and self.att_pairs < 1:
            raise ValueError(f"att_pairs must be at least 1, got {self.att_pairs}")
        if self.att_group not in (4, 8):
            raise ValueError(f"att_group must be 4 or 8, got {self.att_group}")
        if self.mma_sub < 1:
            raise ValueError(f"mma_sub must be at least 1, got {self.mma_sub}")
        if self.qunits < 1:
            raise ValueError(f"qunits must be at least 1, got {self.qunits}")
        if self.qrows not in (None, 1, 2, 4):
            raise ValueError(f"qrows must be 1, 2 or 4 (or None), got {self.qrows}")
