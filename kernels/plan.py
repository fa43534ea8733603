"""One plan per megakernel build: the host-side description that the CUDA sources, the runner and the
timing read-back all read, so that no number is computed on both sides.

`KernelPlan(config, num_sms, tokens_per_launch, tuning, smem_limit)` fits the shared memory (partial-sum rows,
weight-ring depth, staged-input window), lays out the dynamic shared memory region by region, the counters
(the grid barrier, the attention arrival counters) and the history buffers, lists the phases of a launch
(`steps`), bounds the attention merge and the mixer phases' scratch, and keeps the storage formats of each weight
matrix kind (bf16, or GGUF block formats in kernels/quant_layout.py's device layout). `defines()` turns it into
the `-D` constants the CUDA sources take; their static_asserts check the values against what the code relies on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import NamedTuple

from onestream.worker.config import ModelConfig
from onestream.worker.errors import ContextLengthError, UnsupportedModelError
from onestream.worker.kv_cache import DEFAULT_KV_FORMAT, KV_FORMATS
from onestream.worker.quant import QuantType

from .layout import (
    LAYER_FULL,
    LAYER_LINEAR,
    MAX_TOKENS_PER_LAUNCH,
    MODE_MAIN,
    MODE_MTP,
    Phase,
    preamble_defines,
)
from .quant_layout import FORMAT_CODES, row_layout
from .tuning import Tuning

# Weight-ring depth where shared memory allows (2 x 8 loads x 384 threads x 16 B = 96 KB): 2 streams faster than
# 3 at every tokens-per-launch (docs/benchmarks.md).
AUTO_STAGES = 2
# What going over smem_prefer costs, in GEMV breaks: a break costs about 1.1 us and the smaller L1 about
# 0.12 ms per step.
SMEM_OVER_BREAKS = 100
STAGE_FALLBACKS = (AUTO_STAGES, 0)  # tried in order when shared memory is short (many tokens per launch)
STATIC_SMEM = 256  # the kernels' static shared memory at most (the block state: ptxas reports 240 bytes)
MIN_PART_ROWS = 256  # GEMV partial-sum rows per round are halved down to this before the ring is shrunk
WINDOW_STEP = (
    2048  # staged-input window widths tried: the widest input, then multiples of this (a whole chunk)
)
SMEM_ALIGN = 128  # the carve starts at a 128-byte boundary: ring slots off it split each cp.async in two
# Levels of the attention fold over a step's splits (phases.cuh att_fold): at most 2^this splits per key/value head.
# With Tuning.att_split_log it bounds the chunks a build attends over (KernelPlan.att_merge_chunks).
ATT_FOLD_LEVELS = 8
# Accumulators a chunk's warps merge their outputs into (warp w into w % this, in warp order; the block sums them):
# one block barrier per this many warps instead of one per warp. Changes results (the merge's order). Four time as
# six do and leave the attention scratch room for six pairs an item (KernelPlan.att_pairs) on sm_86 and sm_90.
ATT_MERGE_ACCS = 4
# Attention items' (query head, token) pairs at most where the tuning leaves them to the plan (KernelPlan.att_pairs).
ATT_PAIRS = 3
QUANT_STEP_ATT_PAIRS = 6

# The phases of one layer by kind, and those after the last layer: the step list of every launch.
LAYER_PHASES = {
    LAYER_LINEAR: (Phase.DN_IN, Phase.DN_REC, Phase.DN_OUT, Phase.MLP_IN, Phase.MLP_DOWN),
    LAYER_FULL: (Phase.ATT_IN, Phase.ATT, Phase.ATT_OUT, Phase.MLP_IN, Phase.MLP_DOWN),
}
# Phases per layer, the same for both kinds (megakernel.cu's schedule relies on it).
LAYER_STEPS = len(LAYER_PHASES[LAYER_LINEAR])
FINAL_PHASES = (Phase.LM_HEAD, Phase.FINALIZE)


class WeightFormat(Enum):
    """How a weight matrix is stored for the GEMV: bf16 rows, or GGUF blocks in kernels/quant_layout.py's device
    layout (the value is the GGUF type's name in lower case)."""

    BF16 = "bf16"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"

    @property
    def quant_type(self) -> QuantType | None:
        return None if self is WeightFormat.BF16 else QuantType[self.name]


# The kernel's format codes (gemv_quant.cuh QF_*): MK_WFMT_<KIND> is the mask of a kind's quantized codes.
WEIGHT_FORMAT_CODES = {
    WeightFormat.BF16: 0,
    **{WeightFormat(qt.name.lower()): code for qt, code in FORMAT_CODES.items()},
}
# The weight matrix kinds the GEMV streams, one format each: DeltaNet in/out projections, attention in/out
# projections, MLP gate+up and down, the lm_head, the MTP fc.
WEIGHT_KINDS = ("dn_in", "dn_out", "att_in", "att_out", "mlp_in", "mlp_down", "lm_head", "mtp_fc")


class Step(NamedTuple):
    phase: Phase
    layer: int  # layer table row (the MTP layer: num_hidden_layers); 0 for the final phases


class SyncLayout(NamedTuple):
    """Slots of a build's int64 counter buffer."""

    barrier: int  # the grid barrier (monotonic; a multiple of the grid between launches)
    # The first attention arrival counter: a (key/value head, pass) has arrivals + head * (query heads per key/value
    # head x T) + pass.
    arrivals: int
    count: int  # counters in all


class AttSplit(NamedTuple):
    """How one step's attention is cut into work items (phases.cuh `att_split` computes the same on the device)."""

    pairs: int  # (query head, token) pairs per item
    passes: int  # passes of `pairs` over a key/value head's pairs
    log: int  # a split holds 2^log chunks (the last one fewer)
    splits: int  # splits per key/value head
    items: int  # work items: key/value heads x splits x passes


def att_split(
    config: ModelConfig, tokens: int, positions: int, blocks: int, tuning: Tuning, att_pairs: int
) -> AttSplit:
    """The attention items of a step over `positions` keys (the launch's tokens included) on `blocks` blocks: while
    one chunk per item fits the grid, items of one chunk and the fewest pairs (at most `att_pairs`) that still fit
    it; past that, splits of 2^k chunks with the k whose busiest block attends over the fewest chunks (the larger k
    on ties: fewer items, a shorter fold), at most 2^ATT_FOLD_LEVELS splits. Results do not depend on it: every
    split is a subtree of the one tree over the chunks (phases.cuh)."""
    kvh = config.num_key_value_heads
    pairs = config.num_attention_heads // kvh * tokens
    chunks = max(1, -(-positions // tuning.att_chunk))
    fit = max(1, blocks // (kvh * chunks))
    per_item = min(att_pairs, -(-pairs // fit))
    passes = -(-pairs // per_item)
    if kvh * chunks * passes <= blocks and chunks <= 1 << ATT_FOLD_LEVELS:
        return AttSplit(per_item, passes, 0, chunks, kvh * chunks * passes)
    best: tuple[int, int, int] | None = None
    for k in range(tuning.att_split_log + 1):
        splits = -(-chunks // (1 << k))
        if splits > 1 << ATT_FOLD_LEVELS:
            continue
        load = -(-(kvh * passes * splits) // blocks) << k
        if best is None or load <= best[0]:
            best = (load, k, splits)
    if best is None:
        raise ContextLengthError(
            f"megakernel: {positions} positions need {chunks} attention chunks; the build attends over at most "
            f"{1 << (tuning.att_split_log + ATT_FOLD_LEVELS)}"
        )
    _, k, splits = best
    return AttSplit(per_item, passes, k, splits, kvh * splits * passes)


class SmemCarve(NamedTuple):
    """Byte offsets of the dynamic shared-memory regions from the aligned start (the ring is at 0)."""

    xs: int  # staged GEMV input, [T][MK_XLD] bf16
    part: int  # GEMV partial sums (T x part_rows floats); the DeltaNet scratch
    rowval: int  # GEMV row values of a round (the same size); with part, the attention scratch
    red: int  # block reductions
    xsum: int  # quantized GEMV: the staged window's sums over each 16 inputs, per token (empty without)
    end: int
    total: int  # bytes a launch must give: the alignment slack and the regions


def launch_steps(config: ModelConfig, mode: int = MODE_MAIN) -> list[Step]:
    """The phases of one launch, in order: a main-model step runs every layer's LAYER_STEPS phases (its kind's),
    then the final ones; an MTP step the MTP fc, the MTP layer (a full-attention layer on table row
    num_hidden_layers), then the final ones. megakernel.cu's `schedule` maps a step to the same pair from the
    plan's MK_*_PHASE_* defines."""
    if mode == MODE_MTP:
        mtp = config.num_hidden_layers
        return [
            Step(Phase.MTP_FC, mtp),
            *(Step(p, mtp) for p in LAYER_PHASES[LAYER_FULL]),
            *(Step(p, mtp) for p in FINAL_PHASES),
        ]
    full = set(config.full_attention_layers)
    out = [
        Step(p, layer)
        for layer in range(config.num_hidden_layers)
        for p in LAYER_PHASES[LAYER_FULL if layer in full else LAYER_LINEAR]
    ]
    return out + [Step(p, 0) for p in FINAL_PHASES]


@dataclass(frozen=True)
class KernelPlan:
    """Everything one build of the megakernel is laid out by: made from the model config, the tokens per launch
    T, the tuning and the target GPU; the CUDA sources read it as defines (`defines`), and the runner, the
    timing read-back and the shared-memory fit read the same object. It is immutable, so what it derives is
    worked out once (`cached_property`): every launch reads `smem_bytes`."""

    config: ModelConfig
    num_sms: int
    tokens_per_launch: int = 1
    tuning: Tuning = field(default_factory=Tuning)
    smem_limit: int = 99 * 1024  # opt-in shared memory per block of the target GPU (sm_86 99 KB, sm_90 227)
    # The storage formats of the weight matrix kinds the GEMV streams (WEIGHT_KINDS): (kind, format) pairs, a kind
    # named once per format its tensors use (a Q4_K_M file mixes Q4_K and Q6_K within a kind); a kind not named is
    # bf16. Keep it sorted (`weight_formats_of` makes one) so that equal plans compare and hash equal.
    weight_formats: tuple[tuple[str, WeightFormat], ...] = ()
    # ssm_out's columns hold the value heads in llama.cpp's tiled order (a GGUF with fewer key than value heads):
    # the DeltaNet output phase stages its input in that order (model.cuh MK_DN_OUT_HEAD).
    dn_out_tiled: bool = False
    # The embedding table's rows as the kernel reads them: bf16, or a block-quantized table in the device layout
    # (the model's own repacked copy: embed.cuh decodes the rows a phase reads).
    embed_format: WeightFormat = WeightFormat.BF16
    # The KV caches' format (worker/kv_cache.py KV_FORMATS): "auto" (the model's bf16) or "int8" (levels and an
    # fp32 scale per head vector; MK_KV_I8).
    kv_cache: str = DEFAULT_KV_FORMAT

    def __post_init__(self) -> None:
        check_supported(self.config, self.tokens_per_launch, self.tuning)
        if self.kv_cache not in KV_FORMATS:
            raise UnsupportedModelError(
                f"megakernel: KV cache format must be one of {', '.join(KV_FORMATS)}, got {self.kv_cache!r}"
            )
        if self.embed_format is not WeightFormat.BF16:
            if self.tuning.mma:
                raise UnsupportedModelError(
                    f"megakernel: a {self.embed_format.value} embedding table needs the quantized decoding "
                    "(the tensor-core build streams bf16 only)"
                )
            assert self.embed_format.quant_type is not None
            row_layout(self.embed_format.quant_type, self.config.hidden_size)  # whole blocks per row
        for kind, fmt in self.weight_formats:
            if kind not in WEIGHT_KINDS:
                raise UnsupportedModelError(
                    f"megakernel: unknown weight kind {kind!r} (one of {WEIGHT_KINDS})"
                )
            if fmt is not WeightFormat.BF16 and self.tuning.mma:
                raise UnsupportedModelError(
                    f"megakernel: {kind} weights in {fmt.value} run on the scalar GEMV; the tensor-core GEMV "
                    "(Tuning.mma) streams bf16 only"
                )

    def formats_of(self, kind: str) -> frozenset[WeightFormat]:
        """The formats of `kind`'s tensors: those the plan names, else bf16."""
        return frozenset(f for k, f in self.weight_formats if k == kind) or frozenset({WeightFormat.BF16})

    @cached_property
    def streams_bf16(self) -> bool:
        """Whether a phase of this model streams bf16 weights (else the bf16 GEMV and its ring are not built)."""
        kinds = [k for k in WEIGHT_KINDS if k != "mtp_fc" or self.config.has_mtp]
        return any(WeightFormat.BF16 in self.formats_of(k) for k in kinds)

    def quant_mask(self, kind: str) -> int:
        """MK_WFMT_<KIND>: the mask of the kind's quantized format codes (0: bf16 only)."""
        return sum(1 << WEIGHT_FORMAT_CODES[f] for f in self.formats_of(kind) if f is not WeightFormat.BF16)

    def steps(self, mode: int = MODE_MAIN) -> list[Step]:
        """The phases of one launch of this build, in order (`launch_steps`)."""
        return launch_steps(self.config, mode)

    # ---- counters, history ----------------------------------------------------------------------------
    @property
    def sync(self) -> SyncLayout:
        """The int64 counters of a build: the grid barrier, then one attention arrival counter per key/value
        head and pass of its (query head, token) pairs (at most one pass per pair)."""
        c = self.config
        pairs = c.num_attention_heads // c.num_key_value_heads * self.tokens_per_launch
        return SyncLayout(barrier=0, arrivals=1, count=1 + c.num_key_value_heads * pairs)

    @property
    def history_entries(self) -> int:
        """DeltaNet states a keep-states launch records per layer: after every token but the last (the live state
        holds that one, and the state before the first token, the pending one, is never rolled back to)."""
        return self.tokens_per_launch - 1

    @cached_property
    def quant_rows(self) -> int:
        """Rows per item of the quantized GEMV (MK_QROWS): the tuning's, else 4 up to 2 tokens per launch; up to 4
        tokens, 4 where such items stream through the weight ring and 2 where they would be held in registers (the
        register path's loop spills with 4 rows of 4 tokens' sums: the sm_86 build); beyond, 2 where such items
        stream through the ring (a Q4_K_M verify of 5 to 8 tokens measured 1.6-1.8x faster than with 1-row items
        in registers, docs/benchmarks.md) and 1 where they would not (the per-row sums of every token stay in
        registers)."""
        if self.tuning.qrows is not None:
            return self.tuning.qrows
        nt = self.tokens_per_launch
        if nt <= 2:
            return 4
        rows = 4 if nt <= 4 else 2
        ringed = replace(self, tuning=replace(self.tuning, qrows=rows))
        if ringed.stages > 0:
            return rows
        return 2 if nt <= 4 else 1

    @cached_property
    def quant_slot_planes(self) -> int:
        """Ring planes of the largest quantized item of the build (quant_slot_planes over its formats)."""
        units = self.tuning.qunits * self.quant_rows
        codes = [code for code in WEIGHT_FORMAT_CODES.values() if code and self.quant_union >> code & 1]
        return max((quant_slot_planes(code, units) for code in codes), default=0)

    @cached_property
    def quant_union(self) -> int:
        """MK_QFMTS: the union of the weight kinds' quantized format codes and the embedding's (0: bf16 only)."""
        union = 0
        for kind in WEIGHT_KINDS:
            union |= self.quant_mask(kind)
        if self.embed_format is not WeightFormat.BF16:
            union |= 1 << WEIGHT_FORMAT_CODES[self.embed_format]
        return union

    @cached_property
    def ring_planes(self) -> int:
        """16-byte vectors per thread in one slot of the weight ring (MK_RING_PLANES): the bf16 GEMV's item of
        umax loads, or the quantized GEMV's largest item (quant_slot_planes), whichever the build streams is
        larger."""
        bf16 = self.tuning.umax if self.streams_bf16 else 0
        return max(bf16, self.quant_slot_planes)

    @property
    def stages(self) -> int:
        """Items per warp in flight through the shared-memory weight ring (0: register double buffer)."""
        return self._fitted[1]

    @property
    def window(self) -> int:
        """Input values per token staged in shared memory (MK_XW): the widest GEMV input where it fits, else
        a narrower window that the wide phases cross in passes (results do not change)."""
        return self._fitted[2]

    @property
    def dynamic_smem_limit(self) -> int:
        """The opt-in limit less the kernels' static shared memory, which a launch adds to the carve."""
        return self.smem_limit - STATIC_SMEM

    @property
    def part_rows(self) -> int:
        """GEMV partial-sum rows per round: the tuning's, halved
        while shared memory is short. It sets only how many rows a round takes, never a reduction order."""
        return self._fitted[0]

    @cached_property
    def _fitted(self) -> tuple[int, int, int]:
        """(partial-sum rows, ring stages, window) that fit shared memory: the deepest ring that fits at all,
        then the (window, rows) pair whose GEMV phases break least often into rounds and passes (each break
        waits for the whole block, and a pass break re-stages the input), widest window first on ties; a fit above
        Tuning.smem_prefer counts SMEM_OVER_BREAKS more breaks."""
        top = self.tuning.part_rows
        options = (self.tuning.stages,) if self.tuning.stages is not None else STAGE_FALLBACKS
        units = self.tuning.qunits * self.quant_rows
        if self.tuning.stages is None and not self.streams_bf16 and self.quant_slot_planes > 2 * units:
            # Q8_0 and Q5_K items take more than 2 ring vectors per unit: a ring that size crowds out the window and
            # L1, and a Q8_0 model measured slower with it than with the register double buffer (docs/benchmarks.md).
            options = (0,)
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
                    smem = self._carve(rows, stages, window).total
                    if self._scratch_fits(rows) and smem <= self.dynamic_smem_limit:
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
        """Window widths to try, widest first: the widest input, multiples of WINDOW_STEP, the narrowest the
        kernel takes (a hidden row in the lm_head's whole chunks, and a whole GEMV chunk); none wider than max_window
        (the narrowest where max_window is below it)."""
        c = self.config
        phases = self._gemv_phases()
        kmax = max(k for k, _, _ in phases)
        least = max(c.hidden_size, min(gemv_chunk_width(self.tuning), kmax), self._hidden_pass_width)
        for kind, (k, _, _) in zip(WEIGHT_KINDS, phases, strict=True):
            if self.quant_mask(kind):  # a quantized chunk (whole units) must fit the window too
                least = max(least, min(k, quant_chunk_width(k, self.tuning.qunits)))
        steps = range(kmax // WINDOW_STEP * WINDOW_STEP, least - 1, -WINDOW_STEP)
        out = sorted({kmax, *(w for w in steps if least <= w < kmax), -(-least // 8) * 8}, reverse=True)
        cap = self.tuning.max_window
        return out if cap is None else [w for w in out if w <= cap] or out[-1:]

    @property
    def _hidden_pass_width(self) -> int:
        """The window that stages a hidden row for the lm_head in one pass, whatever its tensors' format: the lm_head
        phase copies the staged row out as the MTP's input (megakernel.cu), so its first pass must hold all of
        it. A pass holds whole chunks, and a row's chunks can reach past its end."""
        h, t = self.config.hidden_size, self.tuning
        widths = []
        for f in self.formats_of("lm_head"):
            if f is WeightFormat.BF16:
                widths.append(gemv_chunks(h, t) * gemv_chunk_width_of(h, t))
            else:
                width = quant_chunk_width(h, t.qunits)
                widths.append(-(-h // width) * width)
        return max(widths)

    def _scratch_fits(self, rows: int) -> bool:
        """Whether the attention and DeltaNet phases' scratch fits the partial-sum buffers they borrow."""
        att, dn = self.scratch_floats
        return att <= 2 * self.tokens_per_launch * rows and dn <= self.tokens_per_launch * rows

    @property
    def scratch_floats(self) -> tuple[int, int]:
        """Floats of shared-memory scratch of the attention phase (in the partial sums and row values) and of the
        DeltaNet recurrence (in the partial sums): phases.cuh lays them out in these sizes."""
        c, t, nt = self.config, self.tuning, self.tokens_per_launch
        warps = t.threads // 32
        accs = min(ATT_MERGE_ACCS, warps)  # the chunk merge's accumulators, beside the queries
        att = (
            (1 + accs) * self.att_pairs * c.head_dim
            + 2 * warps * self.att_pairs
            + nt * c.head_dim
            + 2 * (t.att_split_log + 1) * self.att_pairs  # the split tree's (max, sum) per level and pair
        )
        dn_sw = c.linear_value_head_dim // max(1, self.dn_split)
        dn = 2 * nt * c.linear_key_head_dim + t.threads + dn_sw + nt * dn_sw + 2 * nt
        return att, dn

    @property
    def dn_split(self) -> int:
        """Column slices per DeltaNet value head: as many work items as the grid has blocks, slices >= 16
        columns, each slice width dividing the block size."""
        return dn_split(self.config, self.num_sms, self.tuning.threads)

    @property
    def att_pairs(self) -> int:
        """(query head, token) pairs per attention item at most: the tuning's, else six in a one-token launch that
        streams quantized weights and three otherwise. Six timed faster in the quantized step and slower in the
        bf16 one (docs/benchmarks.md, session 38), and their attention loop spills beyond four tokens."""
        c = self.config
        pairs = c.num_attention_heads // c.num_key_value_heads * self.tokens_per_launch
        chosen = self.tuning.att_pairs
        if chosen is None:
            chosen = QUANT_STEP_ATT_PAIRS if self.tokens_per_launch == 1 and self.quant_union else ATT_PAIRS
        return max(1, min(chosen, pairs))

    def defines(self) -> dict[str, int | float]:
        """The plan as the CUDA sources read it: shapes, tuning, the fitted sizes, the shared-memory carve, the
        step structure, the counter layout and the limits (their static_asserts check these values)."""
        c, t = self.config, self.tuning
        carve, sync = self.carve, self.sync
        att_scratch, dn_scratch = self.scratch_floats
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
            "MK_RING_PLANES": self.ring_planes,
            "MK_FP32_ACT": int(t.fp32_act),
            "MK_MMA": int(t.mma),
            "MK_MMA_SUB": t.mma_sub,
            "MK_SMEM_ALIGN": SMEM_ALIGN,
            "MK_SMEM_XS": carve.xs,
            "MK_SMEM_PART": carve.part,
            "MK_SMEM_ROWVAL": carve.rowval,
            "MK_SMEM_RED": carve.red,
            "MK_SMEM_END": carve.end,
            "MK_SMEM_BYTES": carve.total,
            "MK_ATT_SCRATCH_FLOATS": att_scratch,
            "MK_DN_SCRATCH_FLOATS": dn_scratch,
            "MK_ATT_MERGE_CHUNKS": self.att_merge_chunks,
            "MK_ATT_SPLIT_LOG": t.att_split_log,
            "MK_ATT_GROUP": t.att_group,
            "MK_ATT_FOLD_LEVELS": ATT_FOLD_LEVELS,
            "MK_ATT_MACC": min(ATT_MERGE_ACCS, t.threads // 32),
            "MK_HIST_ENTRIES": self.history_entries,
            "MK_SYNC_BARRIER": sync.barrier,
            "MK_SYNC_ARRIVALS": sync.arrivals,
            "MK_SYNC_COUNT": sync.count,
            "MK_LAYER_STEPS": LAYER_STEPS,
            "MK_FINAL_STEPS": len(FINAL_PHASES),
        }
        for kind, name in ((LAYER_LINEAR, "LINEAR"), (LAYER_FULL, "FULL")):
            for k, phase in enumerate(LAYER_PHASES[kind]):
                shapes[f"MK_{name}_PHASE_{k}"] = int(phase)
        for k, phase in enumerate(FINAL_PHASES):
            shapes[f"MK_FINAL_PHASE_{k}"] = int(phase)
        for kind in WEIGHT_KINDS:
            shapes[f"MK_WFMT_{kind.upper()}"] = self.quant_mask(kind)
        if self.embed_format is not WeightFormat.BF16:  # left out for bf16 rows: those plans keep their PTX
            assert self.embed_format.quant_type is not None
            # The rows are decoded by the quantized GEMV's helpers.
            shapes["MK_EFMT"] = WEIGHT_FORMAT_CODES[self.embed_format]
            shapes["MK_EMBED_STRIDE"] = row_layout(self.embed_format.quant_type, self.config.hidden_size)[1]
        union = self.quant_union
        if union:  # bf16-only plans keep their defines (and their PTX)
            shapes["MK_QFMTS"] = union
            shapes["MK_QUMAX"] = t.qunits
            shapes["MK_QROWS"] = self.quant_rows
            shapes["MK_SMEM_XSUM"] = carve.xsum
            shapes["MK_XSW"] = quant_sum_width(self.window, t.qint8)
            if t.qint8:
                shapes["MK_QI8"] = 1
        if not self.streams_bf16:
            shapes["MK_GEMV_BF16"] = 0
        if (
            self.kv_cache == "int8"
        ):  # left out for bf16 caches: those plans keep their defines (and their PTX)
            shapes["MK_KV_I8"] = 1
        if self.dn_out_tiled:  # left out otherwise: plans in HF order keep their defines (and their PTX)
            shapes["MK_DN_OUT_TILED"] = 1
        if t.phase_timing:
            shapes["MK_PHASE_TIMING"] = 1
        return {**preamble_defines(), **shapes}

    # ---- shared memory ------------------------------------------------------------------------------------
    @cached_property
    def carve(self) -> SmemCarve:
        """The dynamic shared memory of a block, region by region (phases.cuh `carve_smem` reads the offsets)."""
        rows, stages, window = self._fitted
        return self._carve(rows, stages, window)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block (the kernel checks it gets at least this)."""
        return self.carve.total

    def _carve(self, part_rows: int, stages: int, window: int) -> SmemCarve:
        """Regions from the 128-byte aligned start: the weight ring (first: cp.async slots stay aligned), the
        staged input (MK_NT rows of MK_XLD bf16; rows 64 bytes apart beyond the window when several tokens are
        staged, so that they start in different banks), the partial sums and the row values of one round, and
        the block reductions (a multiple of 4 floats, at least one per token and warp)."""
        nt, t = self.tokens_per_launch, self.tuning
        ring = stages * self.ring_planes * t.threads * 16
        xld = window + (64 // 2 if nt > 1 else 0)
        part_bytes = nt * part_rows * 4
        red_floats = max(64, -(-nt * (t.threads // 32) // 4) * 4)
        xs = ring
        part = xs + -(-nt * xld * 2 // 16) * 16
        rowval = part + part_bytes
        red = rowval + part_bytes
        xsum = red + red_floats * 4
        sums = quant_sum_width(window, self.tuning.qint8)
        end = xsum + (-(-nt * sums * 4 // 16) * 16 if self._quantized else 0)
        return SmemCarve(xs=xs, part=part, rowval=rowval, red=red, xsum=xsum, end=end, total=SMEM_ALIGN + end)

    @cached_property
    def _quantized(self) -> bool:
        """Whether the build compiles the quantized decoding (MK_QFMTS: a GEMV's formats, the embedding's)."""
        return self.embed_format is not WeightFormat.BF16 or any(
            f is not WeightFormat.BF16 for _, f in self.weight_formats
        )

    @property
    def att_merge_chunks(self) -> int:
        """Flash-decoding chunks a step attends over at most: splits of 2^att_split_log chunks, 2^ATT_FOLD_LEVELS
        splits; longer contexts are refused."""
        return 1 << (self.tuning.att_split_log + ATT_FOLD_LEVELS)

    def att_split(self, positions: int, blocks: int | None = None) -> AttSplit:
        """The attention items of a step over `positions` keys on `blocks` blocks (the plan's GPU: one per SM)."""
        return att_split(
            self.config,
            self.tokens_per_launch,
            positions,
            self.num_sms if blocks is None else blocks,
            self.tuning,
            self.att_pairs,
        )

    def att_chunks(self, capacity: int) -> int:
        """Flash-decoding chunks per key/value head for a KV cache of `capacity` positions."""
        return max(1, -(-capacity // self.tuning.att_chunk))


def scratch_shapes(config: ModelConfig, fp32_act: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """The runner's activation buffers, sized for the most tokens per launch (every build shares them): name ->
    (shape, dtype name). worker/memory.py counts them for the megakernel's share of a card."""
    c, nt = config, MAX_TOKENS_PER_LAUNCH
    att_in_rows = (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return {
        "h": ((nt, c.hidden_size), "float32" if fp32_act else "bfloat16"),  # the residual stream
        "xbuf": ((nt, c.linear_qkv_dim), "bfloat16"),
        "zbuf": ((nt, c.linear_value_dim), "bfloat16"),
        "beta": ((nt, c.linear_num_value_heads), "float32"),
        "gdecay": ((nt, c.linear_num_value_heads), "float32"),
        "core": ((nt, c.linear_value_dim), "bfloat16"),
        "qkv_att": ((nt, att_in_rows), "bfloat16"),
        "att_out": ((nt, c.num_attention_heads * c.head_dim), "bfloat16"),
        "act": ((nt, c.intermediate_size), "bfloat16"),
        "logits": ((nt, c.vocab_size), "float32"),
        "hidden_out": ((nt, c.hidden_size), "bfloat16"),
        "mtp_hidden_in": ((nt, c.hidden_size), "bfloat16"),
        "argkey": ((nt,), "int64"),
    }


def att_partial_floats(config: ModelConfig, chunks: int) -> int:
    """fp32 flash-decoding partials (max, sum, output per (query head, token) pair and chunk) for `chunks` chunks."""
    c = config
    pairs = c.num_attention_heads // c.num_key_value_heads * MAX_TOKENS_PER_LAUNCH
    return c.num_key_value_heads * chunks * pairs * (c.head_dim + 2)


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


# Formats whose 8 consecutive units share one 16-byte vector of scales in the ring (gemv_quant.cuh QSlot), and
# those whose unit takes one vector (its payload) besides.
_SHARED_SCALES = {
    WeightFormat.Q4_K,
    WeightFormat.Q5_K,
    WeightFormat.Q8_0,
    WeightFormat.Q4_0,
    WeightFormat.Q6_K,
}
_ONE_VECTOR = {WeightFormat.Q4_K, WeightFormat.Q4_0, WeightFormat.Q6_K}


def quant_slot_planes(code: int, units: int) -> int:
    """Ring planes (16-byte vectors per thread) of a quantized item of `units` units per lane in the format of this
    code (MK_QFMTS codes): the units' vectors (Q6_K: and its 8-byte high bits, two units per plane), then the
    shared scales, 4 vectors per unit and warp (Q6_K: 5, its super-blocks' d besides). Mirrors gemv_quant.cuh
    QSlot::planes, which checks that a ring slot holds the item."""
    fmt = next(f for f, c in WEIGHT_FORMAT_CODES.items() if c == code)
    q6k = fmt is WeightFormat.Q6_K
    shared = -(-units * (5 if q6k else 4) // 32) if fmt in _SHARED_SCALES else 0
    high = -(-units // 2) if q6k else 0
    return units * (1 if fmt in _ONE_VECTOR else 2) + high + shared


def quant_chunk_width(k: int, units: int) -> int:
    """Input elements of a chunk of the quantized GEMV over k inputs with at most `units` units per lane and row
    of an item (Tuning.qunits; gemv_quant.cuh qplan)."""
    lanes_per_row = -(-(k // 32) // 32)
    chunks = -(-lanes_per_row // units)
    return -(-lanes_per_row // chunks) * 32 * 32


def quant_sum_width(window: int, qint8: bool = False) -> int:
    """Floats per token of the quantized GEMV's input sums: per 32-input unit of the window two (the sums of its
    halves, read as one float2), or with the integer GEMV (Tuning.qint8) four (its scale and three sums), a
    multiple of 4 either way."""
    return -(-window // 64) * 4 if not qint8 else -(-window // 32) * 4


def weight_formats_of(kinds: dict[str, set[WeightFormat]]) -> tuple[tuple[str, WeightFormat], ...]:
    """KernelPlan.weight_formats for the formats each kind's tensors use (sorted: one value per set of formats)."""
    pairs = {(k, f) for k, fs in kinds.items() for f in fs if f is not WeightFormat.BF16}
    return tuple(sorted(pairs, key=lambda p: (p[0], p[1].value)))


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
