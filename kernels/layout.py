"""Slot numbers shared by the host and the CUDA sources: parameter tables, control block, phases, errors.

This module is the one definition; `preamble_defines()` turns it into `#define`s that a build's plan
(kernels/plan.py) puts in front of the CUDA source, so the two sides cannot drift apart. What depends on the
build (the shared-memory carve, the counters, the step list, the history length) is the plan's.
"""

from __future__ import annotations

from enum import IntEnum

from onestream.worker.draft_vocab import ALIGN as HEAD_ROWS_ALIGN


class G(IntEnum):
    """Slots of the globals table (u64 each: a device pointer or an integer)."""

    EMBED = 0
    LM_HEAD = 1
    FINAL_NORM = 2  # fp32 (1 + w)
    INV_FREQ = 3  # fp32 [rotary_dim / 2]
    H = 4  # [T, H] residual stream: fp32 (Tuning.fp32_act, the default) or bf16
    XBUF = 5  # bf16 [T, C] DeltaNet conv output (q | k | v)
    ZBUF = 6  # bf16 [T, Hv * dv]
    BETA = 7  # fp32 [T, Hv]
    GDECAY = 8  # fp32 [T, Hv]
    CORE = 9  # bf16 [T, Hv * dv] DeltaNet recurrence output
    QKV_ATT = 10  # bf16 [T, 2 nH hd + 2 nKV hd] attention projections
    ATT_OUT = 11  # bf16 [T, nH hd] gated attention output
    ATT_PART = 12  # fp32 flash-decoding partials
    ACT = 13  # bf16 [T, I] SwiGLU activation
    LOGITS = 14  # fp32 [T, V]
    HIDDEN_OUT = 15  # bf16 [T, H] post-norm hidden
    ARGKEY = 16  # u64 [T] argmax keys
    KV_CAP = 17  # positions every main-model KV cache holds (the least of them: the launch's bounds check)
    TIMEOUT_NS = 18  # barrier watchdog
    NUM_LAYERS = 19
    TOKEN_HIST = 20  # int32 [max_len] or 0: greedy token written at its position
    TIMING = 21  # u64 [steps + 1][grid][TIMING_FIELDS] or 0: per-block stamps (MK_PHASE_TIMING builds)
    ATT_CHUNKS = 22  # flash-decoding chunks per key/value head that ATT_PART has room for
    MTP_FC = 23  # bf16 [H, 2H] MTP fc (0 without an MTP head)
    MTP_PRE_E = 24  # fp32 (1 + w) of pre_fc_norm_embedding
    MTP_PRE_H = 25  # fp32 (1 + w) of pre_fc_norm_hidden
    MTP_NORM = 26  # fp32 (1 + w): the MTP head's final norm (MTP steps use it instead of FINAL_NORM)
    MTP_HIDDEN_IN = 27  # bf16 [T, H]: the hidden half of the MTP step's input pairs
    COUNT = 28


class L(IntEnum):
    """Slots of one layer's row in the layer table."""

    KIND = 0  # LAYER_LINEAR or LAYER_FULL
    IN_NORM = 1  # fp32 (1 + w)
    POST_NORM = 2  # fp32 (1 + w)
    GATE = 3
    UP = 4
    DOWN = 5
    QKV = 6  # in_proj_qkv
    Z = 7
    B = 8
    A = 9
    CONV_W = 10  # bf16 [C, kernel]
    NEG_A = 11  # fp32 -exp(A_log)
    DT_BIAS = 12  # fp32
    GNORM_W = 13  # bf16 plain weight of the gated norm
    OUT = 14  # out_proj
    CONV_STATE = 15  # bf16 [C, kernel - 1] (the reference state's tensor)
    REC_STATE = 16  # fp32 [Hv, dk, dv] (the reference state's tensor)
    Q = 17
    K = 18
    V = 19
    O = 20  # noqa: E741 - the o_proj slot, named like the others (Q, K, V)
    QNORM = 21  # fp32 (1 + w)
    KNORM = 22  # fp32 (1 + w)
    KCACHE = 23  # bf16 or int8 [nKV, capacity, hd] (the reference state's tensor: worker/kv_cache.py)
    VCACHE = 24
    # Keep-states launches: the conv window (bf16 [E, C, kernel - 1]) and the recurrent state (fp32 [E, Hv, dk, dv])
    # after each token but the last: E = KernelPlan.history_entries, T - 1.
    HIST_CONV = 25
    HIST_REC = 26
    KV_CAP = (
        27  # this layer's KV cache capacity: its per-head stride (caches grow separately, so they differ)
    )
    KSCALE = 28  # fp32 [nKV, capacity]: an int8 cache's scale per key vector (0 for bf16 caches)
    VSCALE = 29
    COUNT = 30


class Phase(IntEnum):
    DN_IN = 0
    DN_REC = 1
    DN_OUT = 2
    ATT_IN = 3
    ATT = 4
    ATT_OUT = 5
    MLP_IN = 6
    MLP_DOWN = 7
    LM_HEAD = 8
    FINALIZE = 9
    MTP_FC = 10  # the MTP head's input: fc(cat(norm(embedding), norm(hidden)))


LAYER_LINEAR = 0
LAYER_FULL = 1


class KernelErrorCode(IntEnum):
    NONE = 0
    BARRIER_TIMEOUT = 1
    ABORTED = 2
    BAD_TOKEN = 3
    CONTEXT = 4
    SMEM = 5
    BARRIER_BROKEN = 6
    BAD_MODE = 7
    ATTENTION_CHUNKS = 8
    HEAD_ROWS = 9


ERROR_TEXT = {
    KernelErrorCode.BARRIER_TIMEOUT: "a grid barrier timed out (watchdog)",
    KernelErrorCode.ABORTED: "the step was aborted",
    KernelErrorCode.BAD_TOKEN: "an input token id is outside the vocabulary",
    KernelErrorCode.CONTEXT: "the position is outside the KV cache",
    KernelErrorCode.SMEM: "the launch gave less dynamic shared memory than the kernel needs",
    KernelErrorCode.BARRIER_BROKEN: "a block left a grid barrier before every block arrived",
    KernelErrorCode.BAD_MODE: "an unknown step mode, or an MTP step on a model without an MTP head",
    KernelErrorCode.ATTENTION_CHUNKS: "the context has more attention chunks than this build's merge holds",
    KernelErrorCode.HEAD_ROWS: (
        f"the lm_head rows to score are not a positive multiple of {HEAD_ROWS_ALIGN} within the vocabulary"
    ),
}


MAX_TOKENS_PER_LAUNCH = 8
# Stamps per (phase, block) of a timing build: phase start, end, GEMV stream start, last round's stream end.
TIMING_FIELDS = 4


def ctrl_slots() -> dict[str, int]:
    """The int32 control block, one layout for every tokens-per-launch build (their runners share one block):
    position, error, error info, flags, mode, accepted drafts, lm_head rows, input tokens, greedy tokens."""
    n = MAX_TOKENS_PER_LAUNCH
    return {  # the host uploads [CTRL_POS, CTRL_TOKEN_OUT) per launch; the error slots stay set until a reset
        "CTRL_ERR": 0,
        "CTRL_ERR_INFO": 1,
        "CTRL_POS": 2,
        "CTRL_FLAGS": 3,
        "CTRL_MODE": 4,
        "CTRL_ACCEPTED": 5,
        "CTRL_HEAD_ROWS": 6,  # the lm_head rows (token ids 0..) the step scores; 0: the whole vocabulary
        "CTRL_TOKEN_IN": 7,
        "CTRL_TOKEN_OUT": 7 + n,
        "CTRL_INTS": 7 + 2 * n,
    }


CTRL_FLAG_FEEDBACK = 1  # the greedy token of a step becomes the next step's input (no host round trip)
CTRL_FLAG_KEEP_STATES = 2  # record each DeltaNet layer's state after every token but the last (HIST_*)
CTRL_FLAG_ACCEPT = 4  # greedy verify: count the inputs 1.. that equal the argmax before them (CTRL_ACCEPTED)
MODE_MAIN = 0  # the main model's step
MODE_MTP = 1  # the MTP head's step (its layer is the layer table's row num_hidden_layers)


def preamble_defines() -> dict[str, int]:
    defines: dict[str, int] = {}
    defines.update({f"G_{s.name}": int(s) for s in G})
    defines.update({f"L_{s.name}": int(s) for s in L})
    defines.update({f"PH_{s.name}": int(s) for s in Phase})
    defines.update({f"MK_ERR_{s.name}": int(s) for s in KernelErrorCode if s})
    defines.update(ctrl_slots())
    defines["CTRL_FLAG_FEEDBACK"] = CTRL_FLAG_FEEDBACK
    defines["CTRL_FLAG_KEEP_STATES"] = CTRL_FLAG_KEEP_STATES
    defines["CTRL_FLAG_ACCEPT"] = CTRL_FLAG_ACCEPT
    defines["HEAD_ROWS_ALIGN"] = HEAD_ROWS_ALIGN
    defines["MODE_MTP"] = MODE_MTP
    defines["LAYER_LINEAR"] = LAYER_LINEAR
    defines["LAYER_FULL"] = LAYER_FULL
    defines["MK_TIMING_FIELDS"] = TIMING_FIELDS
    return defines
