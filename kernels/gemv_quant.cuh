// The GEMV over block-quantized weights (compiled only into builds whose plan names quantized formats).
//
// Weights are in the device layout of kernels/quant_layout.py: per row, planes of 32-element units (nibbles, high
// bits, scales) one after another. A weight slot of the parameter tables holds the tensor's device
// pointer with its format code (QF_*, quant_layout.FORMAT_CODES) in the top byte; bf16 tensors have code 0, and
// a GEMV's segments are either all bf16 (the engine of gemv.cuh) or all quantized (this one; the host refuses a
// mix, and gate/up pairs of different formats).
//
// An item is MK_QROWS rows by one chunk of MK_QUMAX units per lane and row at most (the scalar path's geometry with
// 32-element units instead of 8-element vectors): lane l reads units (chunk * u + j) * 32 + l of each row, so each
// load instruction of a warp reads 32 consecutive units of a plane. Each unit's four 8-element groups are slotted
// by q_slot_xor (the lanes' staged inputs, 64 bytes apart, would otherwise share shared-memory banks). The lane
// extracts a unit's levels once for all MK_NT tokens, reads and converts each token's staged inputs once for all
// the item's rows, and multiplies (q_unit_dot: the scales are applied per unit, with the inputs' sums); a row's
// sums do not depend on the other rows of its item, nor a token's on the other tokens. Items stream through the
// shared-memory weight ring where the build has one (MK_STAGES > 0: cp.async, MK_STAGES - 1 items ahead, slots
// sized per format by QSlot, the first issued before the phase), else they are double-buffered in registers;
// either way the lane multiplies the same bytes, so the results are the same. Partials, rounds, passes over K
// windows and the row sums are those of gemv_run, so results do not depend on MK_XW, MK_QROWS or on which block
// computes a row.
//
// The block's rows are walked one segment at a time; one copy of the loop serves every format of the build (the
// format is the segment's, a block-uniform run-time value: a copy per format made ptxas spill).
#pragma once
#include "common.cuh"

#define QF_BF16 0
#define QF_Q4_K 1
#define QF_Q5_K 2
#define QF_Q6_K 3
#define QF_Q8_0 4
#define QF_Q4_0 5
#define QF_Q5_0 6
#define QF_Q5_1 7
#define QF_TAG_SHIFT 56
#define QF_ON(f) ((MK_QFMTS >> (f)) & 1)
#ifndef MK_QUMAX
#define MK_QUMAX 1  // units (32 elements each) per lane and row of an item at most (plan.py: Tuning.qunits)
#endif
#ifndef MK_QROWS
#define MK_QROWS 4  // rows per item (plan.py: KernelPlan.quant_rows)
#endif
static_assert(MK_QROWS == 1 || MK_QROWS == 2 || MK_QROWS == 4, "MK_QROWS: 1, 2 or 4 rows per item");
static_assert(!MK_MMA, "quantized weights run on the scalar GEMV (Tuning.mma off)");
static_assert((MK_QFMTS & 1) == 0 && MK_QFMTS < (1 << 8), "MK_QFMTS: a mask of quantized format codes 1..7");
#ifndef MK_QI8
#define MK_QI8 0  // the integer GEMV: inputs quantized per unit, dp4a (plan.py: Tuning.qint8)
#endif
static_assert(MK_XSW * 16 >= MK_XW * (MK_QI8 ? 2 : 1) && MK_XSW % 4 == 0 && MK_SMEM_XSUM % 16 == 0 &&
                  MK_SMEM_XSUM + MK_NT * MK_XSW * 4 <= MK_SMEM_END,
              "the carve holds a sum per 16 staged inputs per token (integer GEMV: 4 floats per unit)");

__device__ __forceinline__ int qf_code(const void* tagged) { return (int)((u64)tagged >> QF_TAG_SHIFT); }
__device__ __forceinline__ const unsigned char* qf_ptr(const void* tagged) {
    return (const unsigned char*)((u64)tagged & ((1ull << QF_TAG_SHIFT) - 1));
}
__device__ __forceinline__ bool gemv_desc_quant(const GemvDesc& d) { return qf_code(d.seg[0]) != QF_BF16; }

// ---- geometry ------------------------------------------------------------------------------------------
struct QPlan {
    int nunits;  // units per row
    int nk;      // chunks per row
    int u;       // units per lane per item (<= MK_QUMAX)
    int round;   // rows per round
};
// kernels/plan.py mirrors this (quant_chunk_width) to keep a chunk inside the staged window.
__host__ __device__ __forceinline__ constexpr QPlan qplan(int K) {
    QPlan p{};
    p.nunits = K / 32;
    const int lpr = (p.nunits + 31) / 32;
    p.nk = (lpr + MK_QUMAX - 1) / MK_QUMAX;
    p.u = (lpr + p.nk - 1) / p.nk;
    p.round = (MK_PART_ROWS / p.nk) / MK_QROWS * MK_QROWS & ~1;  // whole items (gate/up pairs)
    return p;
}
__host__ __device__ __forceinline__ constexpr int qplan_pass_chunks(const QPlan& p) {
    const int fit = MK_XW / (p.u * 1024);
    return fit < 1 ? 1 : fit < p.nk ? fit : p.nk;
}
__device__ __forceinline__ void qplan_pass_range(const GemvDesc& d, const QPlan& p, int q, int& k0, int& k1) {
    const int width = qplan_pass_chunks(p) * p.u * 1024;
    k0 = q * width;
    k1 = min(d.K, k0 + width);
}

// Bytes per row of plane `i` of format F (quant_layout.PLANES), and the number of planes.
template <int F>
__device__ __forceinline__ int q_plane_row_bytes(int i, int K) {
    const int units = K / 32, supers = K / 256;
    switch (F) {
        case QF_Q4_K: return i == 0 ? units * 16 : supers * 16;
        case QF_Q5_K: return i == 0 ? units * 16 : i == 1 ? units * 4 : supers * 16;
        case QF_Q6_K: return i == 0 ? units * 16 : i == 1 ? units * 8 : i == 2 ? units * 2 : supers * 2;
        case QF_Q8_0: return i == 0 ? units * 32 : units * 2;
        case QF_Q4_0: return i == 0 ? units * 16 : units * 2;
        case QF_Q5_0: return i == 0 ? units * 16 : i == 1 ? units * 4 : units * 2;
        default: return i == 0 ? units * 16 : units * 4;  // QF_Q5_1
    }
}
template <int F>
__device__ __forceinline__ int q_planes() {
    return F == QF_Q4_K || F == QF_Q8_0 || F == QF_Q4_0 ? 2 : F == QF_Q6_K ? 4 : 3;
}

// A row's planes lie one after another (quant_layout.row_layout): plane i starts at the sum of the earlier planes'
// row bytes, and rows are that sum apart, rounded up to 16 bytes.
template <int F>
__device__ __forceinline__ int q_plane_offset(int i, int K) {
    int at = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (j < i && j < q_planes<F>()) at += q_plane_row_bytes<F>(j, K);
    return at;
}
template <int F>
__device__ __forceinline__ int q_row_stride(int K) {
    return (q_plane_offset<F>(4, K) + 15) & ~15;
}
struct QSeg {
    const unsigned char* base;  // row 0 of the segment
};

// ---- loads ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 ld_stream4(const void* p) {
    u32 r;
    asm volatile("ld.global.cs.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u32 ld_stream2(const void* p) {
    unsigned short r;
    asm volatile("ld.global.cs.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void ld_stream8(const void* p, u32& a, u32& b) {
    asm volatile("ld.global.cs.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}
__device__ __forceinline__ float half_bits_to_float(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
// One unit's bytes in registers: the payload (w) and its scales (s); a format uses only what it needs.
struct QUnit {
    u32 w[8];
    u32 s[4];
};

// Unit v of a row whose planes start at p[0..3].
template <int F>
__device__ __forceinline__ void q_load_unit(const unsigned char* const (&p)[4], int v, QUnit& q) {
    if (F == QF_Q8_0) {
        const vec16 a = ld_stream16(p[0] + v * 32), b = ld_stream16(p[0] + v * 32 + 16);
        q.w[0] = a.x, q.w[1] = a.y, q.w[2] = a.z, q.w[3] = a.w;
        q.w[4] = b.x, q.w[5] = b.y, q.w[6] = b.z, q.w[7] = b.w;
        q.s[0] = ld_stream2(p[1] + v * 2);
        return;
    }
    const vec16 n = ld_stream16(p[0] + v * 16);
    q.w[0] = n.x, q.w[1] = n.y, q.w[2] = n.z, q.w[3] = n.w;
    if (F == QF_Q4_K || F == QF_Q5_K) {
        const vec16 h = ld_stream16(p[F == QF_Q4_K ? 1 : 2] + (v >> 3) * 16);
        q.s[0] = h.x, q.s[1] = h.y, q.s[2] = h.z, q.s[3] = h.w;
        if (F == QF_Q5_K) q.w[4] = ld_stream4(p[1] + v * 4);
    } else if (F == QF_Q6_K) {
        ld_stream8(p[1] + v * 8, q.w[4], q.w[5]);
        q.s[0] = ld_stream2(p[2] + v * 2);
        q.s[1] = ld_stream2(p[3] + (v >> 3) * 2);
    } else if (F == QF_Q4_0) {
        q.s[0] = ld_stream2(p[1] + v * 2);
    } else if (F == QF_Q5_0) {
        q.w[4] = ld_stream4(p[1] + v * 4);
        q.s[0] = ld_stream2(p[2] + v * 2);
    } else {  // QF_Q5_1
        q.w[4] = ld_stream4(p[1] + v * 4);
        q.s[0] = ld_stream4(p[2] + v * 4);
    }
}

// Unit v of the row at `row` (K weights, planes one after another): the embedding rows and the prefill's
// dequantizer read single units this way; the GEMV keeps its plane pointers per segment.
template <int F>
__device__ __forceinline__ QUnit q_row_unit(const unsigned char* row, int K, int v) {
    const unsigned char* p[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = row + q_plane_offset<F>(k, K);
    QUnit q;
#pragma unroll
    for (int i = 0; i < 8; ++i) q.w[i] = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) q.s[i] = 0u;
    q_load_unit<F>(p, v, q);
    return q;
}

#if MK_STAGES > 0
// ---- the shared-memory ring ----------------------------------------------------------------------------
// With MK_STAGES > 0 the lane copies its units' bytes into the weight ring (cp.async) instead of its registers,
// MK_STAGES - 1 items ahead of the one it multiplies, and reads each back just before multiplying it: the bytes in
// flight no longer cost registers. A unit's vectors are its lane's ring planes (plane i of a unit at + i * MK_THREADS
// vectors; QSlot below). Two-byte fields travel in the aligned 4-byte word or 16-byte vector that holds them
// (cp.async copies 4, 8 or 16 bytes; the neighbours' halves are the same DRAM sector); q_read_unit picks the half,
// so a unit read back equals what q_load_unit loads.
#define QRING_PLANE_BYTES (MK_THREADS * 16)

// A format's ring slot. Unit j of row h of an item (its pair c = j MK_QROWS + h) takes QSlot::vecs 16-byte vectors
// of its lane's planes from plane c vecs on: the payload, then the high bits, scales and offsets it alone has; a
// Q6_K unit's 8 bytes of high bits share a plane with the next pair's (half c % 2 of plane units + c / 2). Scales
// that 8 consecutive units share or hold in one aligned 16-byte vector (a K-quant's super-block scales, the 2-byte d
// of 8 Q8_0 or Q4_0 units, the 2-byte scales of 8 Q6_K units) are copied once (q_issue_scales_f) into the slot's
// scale planes after those: pair c's at vector 4 c + lane / 8 of the warp's, and a Q6_K pair's 16 bytes holding its
// super-block's d (8 super-blocks' d) at vector 4 units + c. A 4-row Q4_K item then takes 5 planes instead of 8, a
// Q8_0 one 9 instead of 12 and a Q6_K one 7 instead of 8 (a third Q4_K item in flight, which the ring would then
// hold, measured no faster: docs/benchmarks.md). plan.py quant_slot_planes mirrors `planes`.
template <int F>
struct QSlot {
    static constexpr bool shared_scales =
        F == QF_Q4_K || F == QF_Q5_K || F == QF_Q8_0 || F == QF_Q4_0 || F == QF_Q6_K;
    static constexpr int units = MK_QUMAX * MK_QROWS;
    static constexpr int vecs = F == QF_Q4_K || F == QF_Q4_0 || F == QF_Q6_K ? 1 : 2;
    static constexpr int high_planes = F == QF_Q6_K ? (units + 1) / 2 : 0;
    static constexpr int scale_vecs = shared_scales ? units * (F == QF_Q6_K ? 5 : 4) : 0;
    static constexpr int scale_plane0 = units * vecs + high_planes;  // the first scale plane
    static constexpr int scale_planes = (scale_vecs + 31) / 32;
    static constexpr int planes = scale_plane0 + scale_planes;
    static_assert(planes <= MK_RING_PLANES, "a ring slot holds an item of every format");
};

// The aligned word holding the 2-byte field `i` of a plane of 2-byte fields.
__device__ __forceinline__ const unsigned char* q_word_of_half(const unsigned char* plane, int i) {
    return plane + (i & ~1) * 2;
}
__device__ __forceinline__ u32 q_half_of_word(u32 w, int i) { return i & 1 ? w >> 16 : w & 0xFFFFu; }

// Start copying unit v's own bytes (not its shared scales: q_issue_scales_f) of a row whose planes start at p[0..3]
// to pair c's planes of the ring slot at shared address `slot` (this lane's plane 0), where `ok`: predicated copies,
// so that issuing an item takes no branch (a lane or row without a unit leaves its vectors as they were).
template <int F>
__device__ __forceinline__ void q_issue_unit(const unsigned char* const (&p)[4], int v, bool ok, u32 slot, int c,
                                             u64 policy) {
    constexpr u32 PB = QRING_PLANE_BYTES;
    const u32 dst = slot + c * QSlot<F>::vecs * PB;
    if (F == QF_Q8_0) {
        cp_async16_if(ok, dst, p[0] + v * 32, policy);
        cp_async16_if(ok, dst + PB, p[0] + v * 32 + 16, policy);
        return;
    }
    cp_async16_if(ok, dst, p[0] + v * 16, policy);
    if (F == QF_Q5_K) {
        cp_async_small_if<4>(ok, dst + PB, p[1] + v * 4, policy);
    } else if (F == QF_Q6_K) {
        cp_async_small_if<8>(ok, slot + (QSlot<F>::units + c / 2) * PB + (c & 1) * 8, p[1] + v * 8, policy);
    } else if (F == QF_Q5_0) {
        cp_async_small_if<4>(ok, dst + PB, p[1] + v * 4, policy);
        cp_async_small_if<4>(ok, dst + PB + 4, q_word_of_half(p[2], v), policy);
    } else if (F == QF_Q5_1) {
        cp_async_small_if<4>(ok, dst + PB, p[1] + v * 4, policy);
        cp_async_small_if<4>(ok, dst + PB + 4, p[2] + v * 4, policy);
    }
}

// Loads at shared-window addresses: an item's reads back from the ring are its slot's address plus constants and
// per-lane offsets, which then fold into the instructions' immediates.
__device__ __forceinline__ vec16 lds16(u32 a) {
    vec16 r;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
    return r;
}
__device__ __forceinline__ void lds8(u32 a, u32& x, u32& y) {
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(x), "=r"(y) : "r"(a));
}
__device__ __forceinline__ u32 lds4(u32 a) {
    u32 r;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a));
    return r;
}
// Unit v (of pair c, in lane `lane`) as q_load_unit gives it, from the ring slot at shared address `slot` (this
// lane's plane 0).
template <int F>
__device__ __forceinline__ void q_read_unit(u32 slot, int c, int lane, int v, QUnit& q) {
    constexpr u32 PB = QRING_PLANE_BYTES;
    const u32 src = slot + c * QSlot<F>::vecs * PB;
    // Scale vector 4 c + lane / 8 of the warp's (plane c / 8 of the scale planes: 4 c % 32 + lane / 8 < 32).
    const u32 ssrc = slot + (QSlot<F>::scale_plane0 + c / 8) * PB + ((4 * c) % 32 + lane / 8 - lane) * 16;
    // The 2-byte field of unit v in a shared vector of 8 (Q8_0's and Q4_0's d, Q6_K's two scales): the aligned word
    // that holds it.
    auto shared_half = [&]() { return q_half_of_word(lds4(ssrc + (v & 6) * 2), v); };
    const vec16 n = lds16(src);
    q.w[0] = n.x, q.w[1] = n.y, q.w[2] = n.z, q.w[3] = n.w;
    if (F == QF_Q8_0) {
        const vec16 b = lds16(src + PB);
        q.w[4] = b.x, q.w[5] = b.y, q.w[6] = b.z, q.w[7] = b.w;
        q.s[0] = shared_half();
    } else if (F == QF_Q4_K || F == QF_Q5_K) {
        const vec16 h = lds16(ssrc);
        q.s[0] = h.x, q.s[1] = h.y, q.s[2] = h.z, q.s[3] = h.w;
        if (F == QF_Q5_K) q.w[4] = lds4(src + PB);
    } else if (F == QF_Q6_K) {
        lds8(slot + (QSlot<F>::units + c / 2) * PB + (c & 1) * 8, q.w[4], q.w[5]);
        q.s[0] = shared_half();
        // Super-block v / 8's d among the 8 of the pair's d vector (4 units + c of the warp's).
        const int dv = 4 * QSlot<F>::units + c;
        const u32 d = slot + (QSlot<F>::scale_plane0 + dv / 32) * PB + (dv % 32 - lane) * 16;
        q.s[1] = q_half_of_word(lds4(d + ((v >> 3) & 6) * 2), v >> 3);
    } else if (F == QF_Q4_0) {
        q.s[0] = shared_half();
    } else {  // QF_Q5_0, QF_Q5_1
        u32 a, b;
        lds8(src + PB, a, b);
        q.w[4] = a;
        q.s[0] = F == QF_Q5_0 ? q_half_of_word(b, v) : b;
    }
}
#endif

// The unit's scale factors: (a, b) with weight = a * level - b (K-quants; Q5_1: a * level + b), or the
// symmetric formats' d. `v`: the unit's index in its row (a K-quant's sub-block is v % 8).
template <int F>
__device__ __forceinline__ void q_scales(const QUnit& q, int v, float& a, float& b) {
    if (F == QF_Q4_K || F == QF_Q5_K) {
        const int j = v & 7;
        const u32 byte = (u32)((((u64)q.s[2] << 32) | q.s[1]) >> (8 * j)) & 0xFFu;
        const u32 sc = byte & 63u, m = (byte >> 6) | (((q.s[3] >> (4 * j)) & 0xFu) << 2);
        a = __fmul_rn(half_bits_to_float(q.s[0] & 0xFFFFu), (float)sc);
        b = __fmul_rn(half_bits_to_float(q.s[0] >> 16), (float)m);
    } else if (F == QF_Q6_K) {
        a = half_bits_to_float(q.s[1]);  // d; the sub-block scales are applied per half
        b = 0.0f;
    } else if (F == QF_Q5_1) {
        a = half_bits_to_float(q.s[0] & 0xFFFFu);
        b = half_bits_to_float(q.s[0] >> 16);
    } else {
        a = half_bits_to_float(q.s[0]);
        b = 0.0f;
    }
}

// ---- the dot products -----------------------------------------------------------------------------------
// A unit's weights are w = a q - b (or per 16-element half s_h (q - c) for Q6_K) on integer levels q. The lane
// multiplies the levels, not the weights: each level is placed into the mantissa of a float constant M (one shift
// and one logic op: F = M + q exactly), the token's sums S = sum F x over each half are taken, and the unit adds
// a (S - M X) - b X, where X = sum x over the half is the same for every row and is summed once per staged
// window (q_stage_sums). The levels are extracted once for all MK_NT tokens.
template <int F>
struct QMagic {
    // Where a level's bits go (its top bit at bit 22) and the float with those mantissa bits clear: M = 2^(bits).
    static constexpr int bits = F == QF_Q8_0 ? 8 : F == QF_Q6_K ? 6 : (F == QF_Q4_K || F == QF_Q4_0) ? 4 : 5;
    static constexpr u32 magic = (u32)(127 + bits) << 23;
    static constexpr float m = (float)(1 << bits);
};
// Bits of w at `from` moved to `to` (the others are masked off by q_and_or).
template <int FROM, int TO>
__device__ __forceinline__ u32 q_move(u32 w) {
    return TO >= FROM ? (w << (TO - FROM)) : (w >> (FROM - TO));
}
// (a & mask) | c as one logic op: a LOP3 takes one immediate, so ptxas makes two of `(a & MASK) | C` with both
// constant; with the operands in registers it keeps one (the constants are set once, outside the loop).
__device__ __forceinline__ u32 q_and_or(u32 a, u32 mask, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(c));
    return d;
}
// The float M + level of element 8g + I of the unit.
template <int F, int G, int I>
__device__ __forceinline__ float q_level_f(const QUnit& q) {
    constexpr int B = QMagic<F>::bits, TO = 23 - B;
    constexpr u32 magic = QMagic<F>::magic;
    u32 bits;
    if (F == QF_Q8_0) {
        bits = q_and_or(q_move<8 * (I & 3), TO>(q.w[2 * G + (I >> 2)]), 0xFFu << TO, magic);
    } else {
        bits = q_and_or(q_move<4 * I, TO>(q.w[G]), 0xFu << TO, magic);
        if (F == QF_Q5_K || F == QF_Q5_0 || F == QF_Q5_1)
            bits = q_and_or(q_move<8 * G + I, 22>(q.w[4]), 1u << 22, bits);
        if (F == QF_Q6_K) bits = q_and_or(q_move<2 * I + 16 * (G & 1), 21>(q.w[4 + (G >> 1)]), 3u << 21, bits);
    }
    return __uint_as_float(bits);
}

// Slot G of unit v holds the unit's group G ^ q_slot_xor(v) in every per-element plane (quant_layout.py
// group_slot_xor): the lanes of a shared-memory wavefront then read their inputs from distinct banks.
__device__ __forceinline__ int q_slot_xor(int v) { return (v >> 1) & 3; }

// The weights of slot G of unit v (its elements in order) as bf16, packed as a bf16 row's 16 bytes hold them: the
// weight in fp32 by worker/quant's float operations (quant_layout.read_repacked's, without fused multiply-adds),
// rounded to nearest even. The quantized embedding rows (embed.cuh) and the prefill's dequantizer (dequant.cuh)
// read weights as values; the GEMV multiplies levels instead (q_unit_dot).
template <int F, int G>
__device__ __forceinline__ vec16 q_slot_bf16(const QUnit& q, int v) {
    float a, b;
    q_scales<F>(q, v, a, b);
    // The level's offset c (Q6_K: w = d sc_h (q - 32)), as q_unit_dot applies it.
    constexpr float c = F == QF_Q8_0 ? 128.0f : F == QF_Q4_0 ? 8.0f : F == QF_Q5_0 ? 16.0f : F == QF_Q6_K ? 32.0f : 0.0f;
    if (F == QF_Q6_K) a = __fmul_rn(a, (float)(int)(signed char)((q.s[0] >> (8 * (G >> 1))) & 0xFFu));
    float w[8];
#define Q_SLOT_W(I)                                                                                 \
    {                                                                                               \
        const float l = __fsub_rn(q_level_f<F, G, I>(q), QMagic<F>::m + c); /* q - c, exact */     \
        w[I] = F == QF_Q4_K || F == QF_Q5_K ? __fsub_rn(__fmul_rn(a, l), b)                         \
               : F == QF_Q5_1               ? __fadd_rn(__fmul_rn(a, l), b)                         \
                                            : __fmul_rn(a, l);                                      \
    }
    Q_SLOT_W(0) Q_SLOT_W(1) Q_SLOT_W(2) Q_SLOT_W(3) Q_SLOT_W(4) Q_SLOT_W(5) Q_SLOT_W(6) Q_SLOT_W(7)
#undef Q_SLOT_W
    vec16 out;
    out.x = pack_bf2(w[0], w[1]), out.y = pack_bf2(w[2], w[3]), out.z = pack_bf2(w[4], w[5]), out.w = pack_bf2(w[6], w[7]);
    return out;
}
// The float2 at a shared-memory address (a plain load of a generic pointer compiles to a generic LD).
__device__ __forceinline__ float2 ld_shared_f2(const float* p) {
    float2 r;
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(r.x), "=f"(r.y) : "r"(a));
    return r;
}

// sum F x over slot G (the unit's group G ^ r: its elements' inputs) for every row of the item and every token,
// into the half's sums. A token's 8 inputs are read and converted once for all MK_QROWS rows.
template <int F, int G>
__device__ __forceinline__ void q_group(const QUnit (&q)[MK_QROWS], const vec16* xv, int r,
                                        float (&s)[MK_QROWS][MK_NT]) {
#pragma unroll
    for (int t = 0; t < MK_NT; ++t) {
        const vec16 xq = ld_shared16(xv + t * MK_XLDV + (G ^ r));
        const float x[8] = {bf_lo(xq.x), bf_hi(xq.x), bf_lo(xq.y), bf_hi(xq.y),
                            bf_lo(xq.z), bf_hi(xq.z), bf_lo(xq.w), bf_hi(xq.w)};
#pragma unroll
        for (int h = 0; h < MK_QROWS; ++h) {
            float v = s[h][t];
            v = fmaf(q_level_f<F, G, 0>(q[h]), x[0], v);
            v = fmaf(q_level_f<F, G, 1>(q[h]), x[1], v);
            v = fmaf(q_level_f<F, G, 2>(q[h]), x[2], v);
            v = fmaf(q_level_f<F, G, 3>(q[h]), x[3], v);
            v = fmaf(q_level_f<F, G, 4>(q[h]), x[4], v);
            v = fmaf(q_level_f<F, G, 5>(q[h]), x[5], v);
            v = fmaf(q_level_f<F, G, 6>(q[h]), x[6], v);
            v = fmaf(q_level_f<F, G, 7>(q[h]), x[7], v);
            s[h][t] = v;
        }
    }
}

// Add unit v's products of every row h of the item (q[h]) for every token: `xv` its staged inputs, `xh` its two
// half sums of token 0 (token t at + t * MK_XSW). Slots 0-1 (s0) hold the unit's half r >> 1, slots 2-3 (s1) the
// other. A row's sums are the same whatever rows share its item.
template <int F>
__device__ __forceinline__ void q_unit_dot(const QUnit (&q)[MK_QROWS], int v, const vec16* xv, const float* xh,
                                           float (&acc)[MK_QROWS][MK_NT]) {
    const int r = q_slot_xor(v);
    float s0[MK_QROWS][MK_NT], s1[MK_QROWS][MK_NT];
#pragma unroll
    for (int h = 0; h < MK_QROWS; ++h)
#pragma unroll
        for (int t = 0; t < MK_NT; ++t) s0[h][t] = s1[h][t] = 0.0f;
    q_group<F, 0>(q, xv, r, s0);
    q_group<F, 1>(q, xv, r, s0);
    q_group<F, 2>(q, xv, r, s1);
    q_group<F, 3>(q, xv, r, s1);
    constexpr float M = QMagic<F>::m;
    // The level's offset c (w = a (q - c) - b): Q8_0 stores q + 128, Q4_0 and Q5_0 are centred at 8 and 16.
    constexpr float c = F == QF_Q8_0 ? 128.0f : F == QF_Q4_0 ? 8.0f : F == QF_Q5_0 ? 16.0f : 0.0f;
#pragma unroll
    for (int h = 0; h < MK_QROWS; ++h) {
        float a, b;
        q_scales<F>(q[h], v, a, b);
        if (F == QF_Q6_K) {  // per half: d sc_h (q - 32); the scales are slotted as their halves are
            const float a0 = a * (float)(int)(signed char)(q[h].s[0] & 0xFFu);
            const float a1 = a * (float)(int)(signed char)((q[h].s[0] >> 8) & 0xFFu);
#pragma unroll
            for (int t = 0; t < MK_NT; ++t) {
                const float2 xx = ld_shared_f2(xh + t * MK_XSW);
                const float x0 = r & 2 ? xx.y : xx.x, x1 = r & 2 ? xx.x : xx.y;
                acc[h][t] = fmaf(a0, fmaf(-(M + 32.0f), x0, s0[h][t]), acc[h][t]);
                acc[h][t] = fmaf(a1, fmaf(-(M + 32.0f), x1, s1[h][t]), acc[h][t]);
            }
        } else {
#pragma unroll
            for (int t = 0; t < MK_NT; ++t) {
                const float2 xx = ld_shared_f2(xh + t * MK_XSW);
                const float x = xx.x + xx.y, sum = s0[h][t] + s1[h][t];
                const float lv = fmaf(-(M + c), x, sum);  // sum (q - c) x
                acc[h][t] = fmaf(a, lv, acc[h][t]);
                if (F == QF_Q4_K || F == QF_Q5_K) acc[h][t] = fmaf(-b, x, acc[h][t]);
                if (F == QF_Q5_1) acc[h][t] = fmaf(b, x, acc[h][t]);
            }
        }
    }
}

#if MK_QI8
// ---- the integer dot products (MK_QI8) ------------------------------------------------------------------
// Each staged window's inputs are quantized once per block (q_stage_quant), unit by unit and token by token, to
// x ~= d (256 q1 + q2) with q1, q2 int8 and the unit's largest |x| at 32639 d: 15 bits of every input relative to
// its unit's largest. The two int8 planes take the bf16 input's
// place in shared memory (64 bytes per unit and token), in the order the levels come out of the weights' words:
// per slot G (the unit's group G ^ q_slot_xor(v)) a word of its even elements, then one of its odd ones; chunk c
// of the unit's four 16-byte chunks (plane 1 slots 0-1, 2-3, plane 2 slots 0-1, 2-3) at c ^ q_chunk_xor(u), so
// that the 8 lanes of a wavefront read distinct bank quads. A unit's levels are then multiplied 4 at a time
// (dp4a) in exact integers, and the unit's scales are applied in fp32 per row and token (q_unit_dot8).
__device__ __forceinline__ int q_chunk_xor(int u) { return (u >> 1) & 3; }
__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) { return __dp4a((int)a, (int)b, c); }
// The unit's levels of slot G: lo the even elements' (byte j: element 2j), hi the odd ones', as int8 lanes.
template <int F, int G>
__device__ __forceinline__ void q_levels8(const QUnit& q, u32& lo, u32& hi) {
    if (F == QF_Q8_0) {  // stored as q + 128: the sign bit flipped gives the int8
        const u32 a = q.w[2 * G], b = q.w[2 * G + 1];
        lo = __byte_perm(a, b, 0x6420) ^ 0x80808080u;
        hi = __byte_perm(a, b, 0x7531) ^ 0x80808080u;
        return;
    }
    const u32 w = q.w[G];
    lo = w & 0x0F0F0F0Fu;
    hi = (w >> 4) & 0x0F0F0F0Fu;
    if (F == QF_Q5_K || F == QF_Q5_0 || F == QF_Q5_1) {  // bit 8 G + i of w[4]: element i's fifth bit
        const u32 e = (q.w[4] >> (8 * G)) & 0xFFu;
        const u32 ev = (e & 1u) | ((e & 4u) << 6) | ((e & 16u) << 12) | ((e & 64u) << 18);
        const u32 od = ((e >> 1) & 1u) | ((e & 8u) << 5) | ((e & 32u) << 11) | ((e & 128u) << 17);
        lo |= ev << 4;
        hi |= od << 4;
    }
    if (F == QF_Q6_K) {  // bits 2 i + 16 (G & 1) of w[4 + G / 2]: element i's two high bits
        // The group's two bytes to bytes 0 and 2 (one byte permute), then a nibble per byte.
        u32 x = __byte_perm(q.w[4 + (G >> 1)], 0u, G & 1 ? 0x4342 : 0x4140);
        x = (x | (x << 4)) & 0x0F0F0F0Fu;  // byte j: elements 2j (bits 0-1) and 2j + 1 (bits 2-3)
        lo |= (x & 0x03030303u) << 4;
        hi |= (x & 0x0C0C0C0Cu) << 2;
    }
}
// Add unit v's products of every row h of the item for every token: `xq` the unit's staged int8 planes of token 0
// (token t at + t * MK_XLD * 2 bytes), `xf` its (d, S of slots 0-1, S of slots 2-3, S) of token 0 (token t at
// + t * MK_XSW / 4; S: sums of the inputs' integers 256 q1 + q2), `u` its index in the window. With integer sums
// T = sum q (256 q1 + q2) the unit adds d (a (T - c S) - b S): the weights times the quantized inputs.
template <int F>
__device__ __forceinline__ void q_unit_dot8(const QUnit (&q)[MK_QROWS], int v, int u, const unsigned char* xq,
                                            const float4* xf, float (&acc)[MK_QROWS][MK_NT]) {
    u32 lo[MK_QROWS][4], hi[MK_QROWS][4];
    float a[MK_QROWS], b[MK_QROWS];
#pragma unroll
    for (int h = 0; h < MK_QROWS; ++h) {
        q_levels8<F, 0>(q[h], lo[h][0], hi[h][0]);
        q_levels8<F, 1>(q[h], lo[h][1], hi[h][1]);
        q_levels8<F, 2>(q[h], lo[h][2], hi[h][2]);
        q_levels8<F, 3>(q[h], lo[h][3], hi[h][3]);
        q_scales<F>(q[h], v, a[h], b[h]);
        if (F == QF_Q6_K) {  // per half: d sc_h, slotted as the halves are
            const float d = a[h];
            a[h] = d * (float)(int)(signed char)(q[h].s[0] & 0xFFu);
            b[h] = d * (float)(int)(signed char)((q[h].s[0] >> 8) & 0xFFu);
        }
    }
    const int sw = q_chunk_xor(u);
    // The level's offset c (w = a (q - c) - b): Q4_0 and Q5_0 are centred at 8 and 16, Q6_K at 32.
    constexpr int c = F == QF_Q4_0 ? 8 : F == QF_Q5_0 ? 16 : F == QF_Q6_K ? 32 : 0;
#pragma unroll
    for (int t = 0; t < MK_NT; ++t) {
        const unsigned char* base = xq + t * (MK_XLD * 2);
        const vec16 p0 = ld_shared16(base + 16 * (0 ^ sw)), p1 = ld_shared16(base + 16 * (1 ^ sw));
        const vec16 r0 = ld_shared16(base + 16 * (2 ^ sw)), r1 = ld_shared16(base + 16 * (3 ^ sw));
        const vec16 fv = ld_shared16(xf + t * (MK_XSW / 4));
        const float d = __uint_as_float(fv.x);
        const int sa = (int)fv.y, sb = (int)fv.z, st = (int)fv.w;  // the sums of the inputs' integers (int bits)
#pragma unroll
        for (int h = 0; h < MK_QROWS; ++h) {
            int s1 = dp4a(lo[h][0], p0.x, 0), s2 = dp4a(lo[h][0], r0.x, 0);
            s1 = dp4a(hi[h][0], p0.y, s1), s2 = dp4a(hi[h][0], r0.y, s2);
            s1 = dp4a(lo[h][1], p0.z, s1), s2 = dp4a(lo[h][1], r0.z, s2);
            s1 = dp4a(hi[h][1], p0.w, s1), s2 = dp4a(hi[h][1], r0.w, s2);
            if (F == QF_Q6_K) {  // the halves apart: slots 0-1, then 2-3
                const int ta = s1 * 256 + s2 - c * sa;
                int u1 = dp4a(lo[h][2], p1.x, 0), u2 = dp4a(lo[h][2], r1.x, 0);
                u1 = dp4a(hi[h][2], p1.y, u1), u2 = dp4a(hi[h][2], r1.y, u2);
                u1 = dp4a(lo[h][3], p1.z, u1), u2 = dp4a(lo[h][3], r1.z, u2);
                u1 = dp4a(hi[h][3], p1.w, u1), u2 = dp4a(hi[h][3], r1.w, u2);
                const int tb = u1 * 256 + u2 - c * sb;
                acc[h][t] = fmaf(d, fmaf(a[h], (float)ta, b[h] * (float)tb), acc[h][t]);
            } else {
                s1 = dp4a(lo[h][2], p1.x, s1), s2 = dp4a(lo[h][2], r1.x, s2);
                s1 = dp4a(hi[h][2], p1.y, s1), s2 = dp4a(hi[h][2], r1.y, s2);
                s1 = dp4a(lo[h][3], p1.z, s1), s2 = dp4a(lo[h][3], r1.z, s2);
                s1 = dp4a(hi[h][3], p1.w, s1), s2 = dp4a(hi[h][3], r1.w, s2);
                const int tq = s1 * 256 + s2 - c * st;  // sum (q - c) x / d, exact
                float lv = a[h] * (float)tq;
                if (F == QF_Q4_K || F == QF_Q5_K) lv = fmaf(-b[h], (float)st, lv);
                if (F == QF_Q5_1) lv = fmaf(b[h], (float)st, lv);
                acc[h][t] = fmaf(d, lv, acc[h][t]);
            }
        }
    }
}
#endif

// The warp's sums of an item's MK_QROWS rows (a[h]: this lane's share of row h): lane (32 / MK_QROWS) h ends with
// row h's. The first steps of the butterfly each keep half of the rows, so it takes 5 + MK_QROWS - 2 shuffles
// instead of 5 per row; every row's additions pair the same lanes in the same order as warp_sum's.
__device__ __forceinline__ float q_rows_sum(const float (&a)[MK_QROWS], int lane) {
    float v;
    if constexpr (MK_QROWS == 4) {
        const bool hi = lane & 16;
        const float k0 = (hi ? a[2] : a[0]) + __shfl_xor_sync(0xffffffffu, hi ? a[0] : a[2], 16);
        const float k1 = (hi ? a[3] : a[1]) + __shfl_xor_sync(0xffffffffu, hi ? a[1] : a[3], 16);
        const bool odd = lane & 8;
        v = (odd ? k1 : k0) + __shfl_xor_sync(0xffffffffu, odd ? k0 : k1, 8);
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    } else if constexpr (MK_QROWS == 2) {
        const bool hi = lane & 16;
        v = (hi ? a[1] : a[0]) + __shfl_xor_sync(0xffffffffu, hi ? a[0] : a[1], 16);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    } else {
        v = warp_sum(a[0]);
    }
    return v;
}

// An item's row sums into the partials (part[t * MK_PART_ROWS + row * nk + chunk]; rows past the round are not
// stored), and its accumulators cleared for the next item.
__device__ __forceinline__ void q_store_item(const QPlan& p, float (&acc)[MK_QROWS][MK_NT], int rg, int chunk, int nr,
                                             int lane, float* part) {
    const int h = lane / (32 / MK_QROWS), i = rg * MK_QROWS + h;
#pragma unroll
    for (int t = 0; t < MK_NT; ++t) {
        float a[MK_QROWS];
#pragma unroll
        for (int j = 0; j < MK_QROWS; ++j) {
            a[j] = acc[j][t];
            acc[j][t] = 0.0f;
        }
        const float v = q_rows_sum(a, lane);
        if (lane % (32 / MK_QROWS) == 0 && i < nr) part[t * MK_PART_ROWS + i * p.nk + chunk] = v;
    }
}

// The staged window's sums over each 16 inputs, per token (xsum[t * MK_XSW + h] for inputs k0 + 16 h ..), for
// q_unit_dot. Every thread; ends with a block barrier.
__device__ __forceinline__ void q_stage_sums(const bf16_t* xs_in, float* xsum, int k0, int k1) {
    const int n16 = (k1 - k0) / 16;
    const vec16* xs = (const vec16*)xs_in;
    for (int e = tid_x(); e < MK_NT * n16; e += MK_THREADS) {
        const int t = e / n16, h = e - t * n16;
        const vec16 a = ld_shared16(xs + t * MK_XLDV + 2 * h), b = ld_shared16(xs + t * MK_XLDV + 2 * h + 1);
        float s = bf_lo(a.x) + bf_hi(a.x);
        s += bf_lo(a.y) + bf_hi(a.y);
        s += bf_lo(a.z) + bf_hi(a.z);
        s += bf_lo(a.w) + bf_hi(a.w);
        s += bf_lo(b.x) + bf_hi(b.x);
        s += bf_lo(b.y) + bf_hi(b.y);
        s += bf_lo(b.z) + bf_hi(b.z);
        s += bf_lo(b.w) + bf_hi(b.w);
        xsum[t * MK_XSW + h] = s;
    }
    __syncthreads();
}
#if MK_QI8
// The staged window quantized in place (q_unit_dot8's planes) with its per-unit (d, S of slots 0-1, S of slots
// 2-3, S) at xsum + 4 (t * MK_XSW / 4 + u): a thread per unit and token reads and rewrites its own 64 bytes. Every
// thread; ends with a block barrier. The quantization is a function of the unit's inputs alone, so every launch
// size and every block gives a token the same planes.
__device__ __forceinline__ void q_stage_quant(bf16_t* xs_in, float* xsum, int k0, int k1) {
    const int nu = (k1 - k0) / 32;
    for (int e = tid_x(); e < MK_NT * nu; e += MK_THREADS) {
        const int t = e / nu, u = e - t * nu, v = k0 / 32 + u, r = q_slot_xor(v);
        unsigned char* base = (unsigned char*)(xs_in + t * MK_XLD) + u * 64;
        float x[32];
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            const vec16 a = ld_shared16(base + 16 * g);
            x[8 * g + 0] = bf_lo(a.x), x[8 * g + 1] = bf_hi(a.x), x[8 * g + 2] = bf_lo(a.y), x[8 * g + 3] = bf_hi(a.y);
            x[8 * g + 4] = bf_lo(a.z), x[8 * g + 5] = bf_hi(a.z), x[8 * g + 6] = bf_lo(a.w), x[8 * g + 7] = bf_hi(a.w);
        }
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) m = fmaxf(m, fabsf(x[i]));
        // The largest |x| at 32639 d: every x / d rounds to [-32639, 32639], whose q1 = (x16 + 128) >> 8 is an int8.
        const float d = m * (1.0f / 32639.0f), inv = m > 0.0f ? __fdiv_rn(32639.0f, m) : 0.0f;
        u32 n[4][4];  // per group g: plane 1 even, odd; plane 2 even, odd
        int gs[4];    // per group: the sum of its 16-bit integers
#pragma unroll
        for (int g = 0; g < 4; ++g) {
            gs[g] = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) n[g][k] = 0u;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int x16 = __float2int_rn(x[8 * g + i] * inv);
                gs[g] += x16;
                const int q1 = (x16 + 128) >> 8, q2 = x16 - q1 * 256;
                const int sh = 8 * (i >> 1), odd = i & 1;
                n[g][odd] |= ((u32)q1 & 0xFFu) << sh;
                n[g][2 + odd] |= ((u32)q2 & 0xFFu) << sh;
            }
        }
        u32 w[4][4];  // per slot G (group G ^ r), by selects: a register array indexed at run time is local memory
#pragma unroll
        for (int G = 0; G < 4; ++G)
#pragma unroll
            for (int k = 0; k < 4; ++k)
                w[G][k] = r == 0 ? n[G][k] : r == 1 ? n[G ^ 1][k] : r == 2 ? n[G ^ 2][k] : n[G ^ 3][k];
        const int sw = q_chunk_xor(u);
        st_shared16(base + 16 * (0 ^ sw), vec16{w[0][0], w[0][1], w[1][0], w[1][1]});
        st_shared16(base + 16 * (1 ^ sw), vec16{w[2][0], w[2][1], w[3][0], w[3][1]});
        st_shared16(base + 16 * (2 ^ sw), vec16{w[0][2], w[0][3], w[1][2], w[1][3]});
        st_shared16(base + 16 * (3 ^ sw), vec16{w[2][2], w[2][3], w[3][2], w[3][3]});
        // The sums of slots 0-1 (groups r, r ^ 1: the half r >> 1) and of slots 2-3 (the other half), exact.
        const int h0 = gs[0] + gs[1], h1 = gs[2] + gs[3];
        const int xa = r & 2 ? h1 : h0, xb = r & 2 ? h0 : h1;
        ((float4*)xsum)[t * (MK_XSW / 4) + u] =
            make_float4(d, __int_as_float(xa), __int_as_float(xb), __int_as_float(xa + xb));
    }
    __syncthreads();
}
#endif
// The half sums' region: the plan's carve (MK_SMEM_XSUM), found from the staged input's address.
__device__ __forceinline__ float* q_xsum(const bf16_t* xs) {
    return (float*)((unsigned char*)xs - MK_SMEM_XS + MK_SMEM_XSUM);
}

// What the loop needs of a staged window: its sums per 16 inputs, or (MK_QI8) its quantized planes.
__device__ __forceinline__ void q_stage_input(const bf16_t* xs, float* xsum, int k0, int k1) {
#if MK_QI8
    q_stage_quant(const_cast<bf16_t*>(xs), xsum, k0, k1);
#else
    q_stage_sums(xs, xsum, k0, k1);
#endif
}

// ---- the loop ------------------------------------------------------------------------------------------
struct QItem {
    QUnit u[MK_QUMAX][MK_QROWS];  // unit j of row h: u[j][h]
};

// The lane's units of one item in format F: rows rs + MK_QROWS rg + h of the round (rows past the round and units
// past the row load nothing). `s`, `start`: the segment and its first row (not interleaved).
template <int F>
__device__ __forceinline__ void q_load_item_f(const GemvDesc& d, int s, int start, const QPlan& p, int rs, int nr,
                                              int rg, int chunk, int lane, QItem& it) {
#pragma unroll
    for (int h = 0; h < MK_QROWS; ++h) {
        const int i = rg * MK_QROWS + h, r = rs + i;
        if (i >= nr) continue;  // warp-uniform
        const int lr = d.interleave ? (r >> 1) : r - start;
        // The segment's base from the descriptor (shared memory) per row: kept in registers across the loop, the
        // two bases were spilled.
        const unsigned char* row = qf_ptr(d.seg[d.interleave ? (r & 1) : s]) + (long long)lr * q_row_stride<F>(d.K);
        const unsigned char* rowp[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) rowp[k] = row + q_plane_offset<F>(k, d.K);
#pragma unroll
        for (int j = 0; j < MK_QUMAX; ++j) {
            const int v = (chunk * p.u + j) * 32 + lane;
            if (j < p.u && v < p.nunits) q_load_unit<F>(rowp, v, it.u[j][h]);
        }
    }
}

#if MK_STAGES > 0
// A segment's row addressing in format F, resolved once per segment. Row r (numbered as the GEMV's rows) starts at
// seg[r & 1] + (r >> 1) * stride in a gate/up interleave, else at seg + (r - start) * stride. An item's rows
// r0 + h are then base[h] + line(r0) * stride, with line(r0) = r0 / 2 (interleave: r0 is even, since block shares
// and rounds are whole pairs and items of 2 or 4 rows keep them) or r0; items of 1 row take the general form.
struct QRows {
    unsigned long long base[MK_QROWS];
    unsigned long long seg[2];
    long long stride;
    int off[4];
    bool interleave;
};
template <int F>
__device__ __forceinline__ QRows q_rows_of(const GemvDesc& d, int s, int start) {
    QRows q;
    q.stride = q_row_stride<F>(d.K);
    q.interleave = d.interleave != 0;
    q.seg[0] = (unsigned long long)qf_ptr(d.seg[q.interleave ? 0 : s]) - (q.interleave ? 0 : start * q.stride);
    q.seg[1] = (unsigned long long)qf_ptr(d.seg[q.interleave ? 1 : s]);
#pragma unroll
    for (int h = 0; h < MK_QROWS; ++h)
        q.base[h] = q.interleave ? q.seg[h & 1] + (h >> 1) * q.stride : q.seg[0] + h * q.stride;
#pragma unroll
    for (int k = 0; k < 4; ++k) q.off[k] = q_plane_offset<F>(k, d.K);
    return q;
}
// Row r0 + h of an item whose first row is r0.
__device__ __forceinline__ const unsigned char* q_row_at(const QRows& q, int r0, int h) {
    if (MK_QROWS == 1) {  // selects, not an index: a register array indexed at run time is local memory
        const unsigned long long b = (r0 & 1) && q.interleave ? q.seg[1] : q.seg[0];
        return (const unsigned char*)(b + (q.interleave ? (r0 >> 1) : r0) * q.stride);
    }
    return (const unsigned char*)(q.base[h] + (q.interleave ? (r0 >> 1) : r0) * q.stride);
}
// Row r0 + h of an item, h a run-time value (selects: a register array indexed at run time is local memory).
__device__ __forceinline__ const unsigned char* q_row_sel(const QRows& q, int r0, int h) {
    if (MK_QROWS == 1) return q_row_at(q, r0, 0);
    unsigned long long b = q.base[0];
#pragma unroll
    for (int k = 1; k < MK_QROWS; ++k) b = h == k ? q.base[k] : b;
    return (const unsigned char*)(b + (q.interleave ? (r0 >> 1) : r0) * q.stride);
}
// Start copying an item's shared scales (QSlot::shared_scales) into its slot's scale planes, one predicated copy per
// lane and scale plane: vector c = 4 (j MK_QROWS + h) + s (unit j of row h, its chunk's 8 units from 8 s: the 16
// bytes they share) by lane c % 32, and a Q6_K pair's d vector 4 units + pair likewise.
template <int F>
__device__ __forceinline__ void q_issue_scales_f(const QRows& q, const QPlan& p, int rs, int nr, int rg, int chunk,
                                                 int lane, u32 slot, u64 policy) {
    constexpr int plane = F == QF_Q5_K || F == QF_Q6_K ? 2 : 1, per8 = 4 * QSlot<F>::units;
#pragma unroll
    for (int m = 0; m < QSlot<F>::scale_planes; ++m) {
        const int c = lane + 32 * m;
        const bool d_vec = F == QF_Q6_K && c >= per8;  // 8 super-blocks' d: 64 units
        const int pair = d_vec ? c - per8 : c >> 2, j = pair / MK_QROWS, h = pair - j * MK_QROWS;
        const int v0 = (chunk * p.u + j) * 32 + (d_vec ? 0 : 8 * (c & 3));
        const bool ok = c < QSlot<F>::scale_vecs && j < p.u && rg * MK_QROWS + h < nr && v0 < p.nunits;
        const unsigned char* row = q_row_sel(q, rs + rg * MK_QROWS, h);
        const unsigned char* src = d_vec ? row + q.off[3] + (v0 >> 6) * 16 : row + q.off[plane] + (v0 >> 3) * 16;
        cp_async16_if(ok, slot + (QSlot<F>::scale_plane0 + m) * QRING_PLANE_BYTES, src, policy);
    }
}
// Start copying the lane's units of one item (q_load_item_f's) into the ring slot at shared address `slot` (this
// lane's plane 0 of the slot); unit j of row h goes to planes ((j * MK_QROWS + h) * QSlot::vecs) on.
template <int F>
__device__ __forceinline__ void q_issue_item_f(const QRows& q, const QPlan& p, int rs, int nr, int rg, int chunk,
                                               int lane, u32 slot, u64 policy) {
#pragma unroll
    for (int h = 0; h < MK_QROWS; ++h) {
        const bool row_ok = rg * MK_QROWS + h < nr;
        const unsigned char* row = q_row_at(q, rs + rg * MK_QROWS, h);
        const unsigned char* rowp[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) rowp[k] = row + q.off[k];
#pragma unroll
        for (int j = 0; j < MK_QUMAX; ++j) {
            const int v = (chunk * p.u + j) * 32 + lane;
            q_issue_unit<F>(rowp, v, row_ok && j < p.u && v < p.nunits, slot, j * MK_QROWS + h, policy);
        }
    }
    if (QSlot<F>::shared_scales) q_issue_scales_f<F>(q, p, rs, nr, rg, chunk, lane, slot, policy);
}
#endif

// Multiply one item of format F: unit v covers input elements [32 v, 32 v + 32), staged from element k0 on. Rows
// past the round multiply the zeros they loaded (never stored).
template <int F>
__device__ __forceinline__ void q_consume_item_f(const QPlan& p, const QItem& it, int chunk, int lane,
                                                 const vec16* xs, const float* xsum, int k0,
                                                 float (&acc)[MK_QROWS][MK_NT]) {
#pragma unroll
    for (int j = 0; j < MK_QUMAX; ++j) {
        const int v = (chunk * p.u + j) * 32 + lane;
#if MK_QI8
        const int u = v - k0 / 32;
        if (j < p.u && v < p.nunits)
            q_unit_dot8<F>(it.u[j], v, u, (const unsigned char*)xs + u * 64, (const float4*)xsum + u, acc);
#else
        if (j < p.u && v < p.nunits)
            q_unit_dot<F>(it.u[j], v, xs + (v * 32 - k0) / 8, xsum + (v * 32 - k0) / 16, acc);
#endif
    }
}

// The build's formats, by the segment's run-time code (block-uniform): one copy of the loop serves them all, as
// one copy of gemv_run serves every bf16 phase (an inlined copy per format made ptxas spill).
#define QF_DISPATCH(fmt, CALL)                                  \
    switch (fmt) {                                              \
        QF_CASE(QF_Q4_K, CALL) QF_CASE(QF_Q5_K, CALL)          \
        QF_CASE(QF_Q6_K, CALL) QF_CASE(QF_Q8_0, CALL)          \
        QF_CASE(QF_Q4_0, CALL) QF_CASE(QF_Q5_0, CALL)          \
        QF_CASE(QF_Q5_1, CALL) default: break;                  \
    }
#define QF_CASE(F, CALL)  \
    case F:               \
        if (QF_ON(F)) {   \
            CALL(F);      \
        }                 \
        break;

// Define every register of an item (a predicated load alone keeps old values live).
__device__ __forceinline__ void q_zero_item(QItem& it) {
#pragma unroll
    for (int j = 0; j < MK_QUMAX; ++j) {
#pragma unroll
        for (int h = 0; h < MK_QROWS; ++h) {
#pragma unroll
            for (int i = 0; i < 8; ++i) it.u[j][h].w[i] = 0u;
#pragma unroll
            for (int i = 0; i < 4; ++i) it.u[j][h].s[i] = 0u;
        }
    }
}
__device__ __forceinline__ void q_load_item(int fmt, const GemvDesc& d, int s, int start, const QPlan& p, int rs,
                                            int nr, int rg, int chunk, int lane, QItem& it) {
    q_zero_item(it);
#define QF_LOAD(F) q_load_item_f<(QF_ON(F) ? F : QF_Q4_K)>(d, s, start, p, rs, nr, rg, chunk, lane, it)
    QF_DISPATCH(fmt, QF_LOAD)
#undef QF_LOAD
}
__device__ __forceinline__ void q_consume_item(int fmt, const QPlan& p, const QItem& it, int chunk, int lane,
                                               const vec16* xs, const float* xsum, int k0,
                                               float (&acc)[MK_QROWS][MK_NT]) {
#define QF_CONSUME(F) q_consume_item_f<(QF_ON(F) ? F : QF_Q4_K)>(p, it, chunk, lane, xs, xsum, k0, acc)
    QF_DISPATCH(fmt, QF_CONSUME)
#undef QF_CONSUME
}

#if MK_STAGES > 0
// The shared address of ring slot `k % MK_STAGES` of format F (`ring0`: this lane's plane 0 of slot 0).
template <int F>
__device__ __forceinline__ u32 q_slot_addr(u32 ring0, int k) {
    return ring0 + (k % MK_STAGES) * QSlot<F>::planes * QRING_PLANE_BYTES;
}
// The ring's head: this warp's first MK_STAGES - 1 units of the pass over chunks [c0, c0 + nkq) of rows
// [rs, rs + nr) (`count` units in all), one commit group each (empty past the end, so that the group count stays
// uniform).
template <int F>
__device__ __forceinline__ void q_ring_head_f(const GemvDesc& d, int s, int start, const QPlan& p, int rs, int nr,
                                              int c0, int nkq, int count, int lane, u32 ring0, u64 policy) {
    const QRows rows = q_rows_of<F>(d, s, start);
#pragma unroll
    for (int k = 0; k < MK_STAGES - 1; ++k) {
        if (k < count) {
            const GemvUnit u = gemv_unit(tid_x() >> 5, k, c0, nkq);
            q_issue_item_f<F>(rows, p, rs, nr, u.rg, u.chunk, lane, q_slot_addr<F>(ring0, k), policy);
        }
        cp_async_commit();
    }
}
__device__ __forceinline__ void q_ring_head(int fmt, const GemvDesc& d, int s, int start, const QPlan& p, int rs,
                                            int nr, int c0, int nkq, int count, int lane, u32 ring0, u64 policy) {
#define QF_HEAD(F) q_ring_head_f<(QF_ON(F) ? F : QF_Q4_K)>(d, s, start, p, rs, nr, c0, nkq, count, lane, ring0, policy)
    QF_DISPATCH(fmt, QF_HEAD)
#undef QF_HEAD
}
#endif

// The segment holding row a: its index and first row.
__device__ __forceinline__ void q_segment_of(const GemvDesc& d, int a, int& s, int& start) {
    s = 0, start = 0;
    for (int j = 0; j + 1 < d.nseg; ++j) {
        if (a >= d.end[j]) {
            s = j + 1;
            start = d.end[j];
        }
    }
}

#if MK_STAGES > 0
// This warp's `count` units of one pass in format F through the ring (head issued): one copy of the loop per format,
// so that issuing, reading back, multiplying and reducing an item is straight-line code the compiler can schedule
// as one block (the ring holds the items, so the copies fit the registers without spilling).
// gemv_unit's (row group, chunk) of a warp's units k = 0, 1, ...: advanced by MK_NWARPS items a step without a
// division per unit.
struct QUnitWalk {
    int rg, chunk;  // of the current unit (chunk counted from the pass's first, c0)
    int step_rg, step_chunk, nkq;
    __device__ __forceinline__ QUnitWalk(int warp, int k, int nkq_) : nkq(nkq_) {
        const int i = warp + k * MK_NWARPS;
        rg = i / nkq;
        chunk = i - rg * nkq;
        step_rg = MK_NWARPS / nkq;
        step_chunk = MK_NWARPS - step_rg * nkq;
    }
    __device__ __forceinline__ void next() {
        rg += step_rg;
        chunk += step_chunk;
        if (chunk >= nkq) {
            chunk -= nkq;
            ++rg;
        }
    }
};

template <int F>
__device__ __forceinline__ void q_ring_pass_f(const GemvDesc& d, int s, int start, const QPlan& p, int rs, int nr,
                                              int c0, int nkq, int count, int k0, int lane, int warp, u32 ring0,
                                              const vec16* xs, const float* xsum, float* part,
                                              u64 policy) {
    float acc[MK_QROWS][MK_NT];
#pragma unroll
    for (int h = 0; h < MK_QROWS; ++h)
#pragma unroll
        for (int t = 0; t < MK_NT; ++t) acc[h][t] = 0.0f;
    const QRows rows = q_rows_of<F>(d, s, start);
    QUnitWalk cur(warp, 0, nkq), ahead(warp, MK_STAGES - 1, nkq);
    for (int k = 0; k < count; ++k) {
        const int kn = k + MK_STAGES - 1;
        // Shared scales: another lane copies them, so every lane's reads of the slot about to be refilled come first,
        // and that lane's completed copy is seen only after the warp's barrier below.
        if (QSlot<F>::shared_scales) __syncwarp();
        if (kn < count)
            q_issue_item_f<F>(rows, p, rs, nr, ahead.rg, c0 + ahead.chunk, lane, q_slot_addr<F>(ring0, kn),
                              evict_first_policy());
        ahead.next();
        cp_async_commit();
        cp_async_wait<MK_STAGES - 1>();  // unit k's group is complete
        if (QSlot<F>::shared_scales) __syncwarp();
        const int chunk = c0 + cur.chunk;
        // Every unit of the slot is read back: those past the round's rows or the row's units hold stale bytes,
        // which rows past the round multiply without storing and units past the row are skipped by.
        QItem it;
        const u32 slot = q_slot_addr<F>(ring0, k);
#pragma unroll
        for (int h = 0; h < MK_QROWS; ++h)
#pragma unroll
            for (int j = 0; j < MK_QUMAX; ++j)
                q_read_unit<F>(slot, j * MK_QROWS + h, lane, (chunk * p.u + j) * 32 + lane, it.u[j][h]);
        q_consume_item_f<F>(p, it, chunk, lane, xs, xsum, k0, acc);
        q_store_item(p, acc, cur.rg, chunk, nr, lane, part);
        cur.next();
    }
    cp_async_wait<0>();  // only empty groups can be pending: the slots are free for the next pass
}
#endif

// Rows [a, b) of the block's share, all in one segment (or a gate/up interleave of two segments of one format).
// `staged`: window 0 is in shared memory (updated as passes restage).
template <class Finish, class Stage>
__device__ __forceinline__ void gemv_quant_rows(const GemvDesc& d, int a, int b, const bf16_t* xs_in, float* part,
                                                float* rowval, vec16* ring, bool& head, bool& staged,
                                                Finish finish, Stage stage) {
    const QPlan p = qplan(d.K);
    const int lane = tid_x() & 31, warp = tid_x() >> 5;
    const vec16* xs = (const vec16*)xs_in;
    float* xsum = q_xsum(xs_in);
    const int cpp = qplan_pass_chunks(p);
    const int npass = (p.nk + cpp - 1) / cpp;
    // The segment of row a (its start row and rows), or both halves of a gate/up interleave.
    int s, start;
    q_segment_of(d, a, s, start);
    const int fmt = qf_code(d.seg[d.interleave ? 0 : s]);
#if MK_STAGES > 0
    const u32 ring0 = smem_addr(ring + warp * 32 + lane);  // this lane's plane 0 of slot 0
#endif
    int rs = a, nr = min(p.round, b - a);
    while (nr > 0) {
        const int next_rs = rs + nr, next_nr = min(p.round, b - next_rs);
        for (int q = 0; q < npass; ++q) {
            const int c0 = q * cpp, nkq = min(cpp, p.nk - c0);
            int k0 = 0, k1 = 0;
            qplan_pass_range(d, p, q, k0, k1);
            // Items of MK_QROWS rows by one chunk (gemv_unit's order, its row group rg standing for rows
            // MK_QROWS rg ..).
            const int count = gemv_units(warp, (nr + MK_QROWS - 1) / MK_QROWS * nkq);
#if MK_STAGES > 0
            // Unit k lives in ring slot k % MK_STAGES; one commit group per unit (empty past the end, so that the
            // count stays uniform). The head does not depend on the input: in flight while the window is staged
            // (or issued before the phase: gemv_issue_first_head_quant).
            const u64 policy = evict_first_policy();
            if (!head) q_ring_head(fmt, d, s, start, p, rs, nr, c0, nkq, count, lane, ring0, policy);
            head = false;
#endif
            if (q > 0 || !staged) {
                __syncthreads();  // every warp is done with the previous window
                stage(k0, k1);
                q_stage_input(xs_in, xsum, k0, k1);
            }
#if MK_STAGES > 0
#define QF_PASS(F)                                                                                               \
    q_ring_pass_f<(QF_ON(F) ? F : QF_Q4_K)>(d, s, start, p, rs, nr, c0, nkq, count, k0, lane, warp, ring0, xs, xsum, \
                                            part, policy)
            QF_DISPATCH(fmt, QF_PASS)
#undef QF_PASS
#else
            float acc[MK_QROWS][MK_NT];
#pragma unroll
            for (int h = 0; h < MK_QROWS; ++h)
#pragma unroll
                for (int t = 0; t < MK_NT; ++t) acc[h][t] = 0.0f;
            QItem ia, ib;
            auto load = [&](int k, QItem& it) {
                const GemvUnit u = gemv_unit(warp, k, c0, nkq);
                q_load_item(fmt, d, s, start, p, rs, nr, u.rg, u.chunk, lane, it);
            };
            auto consume = [&](int k, const QItem& it) {
                const GemvUnit u = gemv_unit(warp, k, c0, nkq);
                q_consume_item(fmt, p, it, u.chunk, lane, xs, xsum, k0, acc);
                q_store_item(p, acc, u.rg, u.chunk, nr, lane, part);
            };
            int k = 0;
            if (count > 0) load(0, ia);
            while (k < count) {
                if (k + 1 < count) load(k + 1, ib);
                consume(k, ia);
                if (++k >= count) break;
                if (k + 1 < count) load(k + 1, ia);
                consume(k, ib);
                ++k;
            }
#endif
        }
        staged = npass == 1;
        __syncthreads();
#ifdef MK_PHASE_TIMING
        if (tid_x() == 0) mk_gemv_t[1] = global_timer_ns();
#endif
        gemv_round_finish(part, rowval, rs, nr, p.nk, p.round, finish);
        rs = next_rs;
        nr = next_nr;
    }
}

// The quantized GEMV of this block's rows, one segment (one format) at a time.
template <class Finish, class Stage>
__device__ __forceinline__ void gemv_run_quant(const GemvDesc& d, const bf16_t* xs, float* part, float* rowval,
                                               vec16* ring, bool head_issued, Finish finish, Stage stage) {
    int r0, r1;
    block_row_range(d.nrows, d.align, r0, r1);
#ifdef MK_PHASE_TIMING
    if (tid_x() == 0 && r1 > r0 && mk_gemv_t[0] == 0) mk_gemv_t[0] = global_timer_ns();
#endif
    bool staged = true;
    {  // the sums of window 0, which the phase's prologue staged
        int k0, k1;
        qplan_pass_range(d, qplan(d.K), 0, k0, k1);
        q_stage_input(xs, q_xsum(xs), k0, k1);
    }
    bool head = head_issued;  // the first segment's first items are in flight
    for (int a = r0; a < r1;) {
        int s, start;
        q_segment_of(d, a, s, start);
        const int b = d.interleave ? r1 : min(r1, d.end[s]);
        gemv_quant_rows(d, a, b, xs, part, rowval, ring, head, staged, finish, stage);
        a = b;
    }
}

#if MK_STAGES > 0
// gemv_issue_first_head for a quantized GEMV: this warp's first MK_STAGES - 1 units of the block's first segment,
// round and pass, one commit group each, before the phase's input exists.
__device__ void gemv_issue_first_head_quant(const GemvDesc& d, vec16* ring) {
    const QPlan p = qplan(d.K);
    int r0, r1;
    block_row_range(d.nrows, d.align, r0, r1);
    const int lane = tid_x() & 31, warp = tid_x() >> 5;
    int s, start;
    q_segment_of(d, r0, s, start);
    const int b = d.interleave ? r1 : min(r1, d.end[s]);
    const int nr = min(p.round, b - r0), nkq = min(qplan_pass_chunks(p), p.nk);
    const int count = nr > 0 ? gemv_units(warp, (nr + MK_QROWS - 1) / MK_QROWS * nkq) : 0;
    const int fmt = qf_code(d.seg[d.interleave ? 0 : s]);
    const u32 ring0 = smem_addr(ring + warp * 32 + lane);
    const u64 policy = evict_first_policy();
    q_ring_head(fmt, d, s, start, p, r0, nr, 0, nkq, count, lane, ring0, policy);
}
#endif

// Pull the first plane (the bulk of the bytes) of up to `max_bytes` of block b's rows of a coming quantized GEMV
// phase into L2.
__device__ void gemv_prefetch_share_quant(const GemvDesc& d, int b, int max_bytes) {
    int r0, r1;
    row_range_of(b, d.nrows, d.align, r0, r1);
    const int f = qf_code(d.seg[0]);
    const int row_bytes = d.K / 32 * (f == QF_Q8_0 ? 32 : 16);  // the first plane's
    int stride = 0;
#define QF_STRIDE(F) stride = q_row_stride<(QF_ON(F) ? F : QF_Q4_K)>(d.K)
    QF_DISPATCH(f, QF_STRIDE)
#undef QF_STRIDE
    const int last = min(r1, r0 + max(1, max_bytes / row_bytes));
    const int pieces = (row_bytes + MK_PF_PIECE - 1) / MK_PF_PIECE;
    for (int it = tid_x(); it < (last - r0) * pieces; it += MK_THREADS) {
        const int r = r0 + it / pieces, piece = it - (it / pieces) * pieces;
        int s = 0, start = 0;
        for (int j = 0; j + 1 < d.nseg; ++j) {
            if (r >= d.end[j]) {
                s = j + 1;
                start = d.end[j];
            }
        }
        const int lr = d.interleave ? r >> 1 : r - start;
        const unsigned char* row = qf_ptr(d.seg[d.interleave ? (r & 1) : s]) + (long long)lr * stride;
        const int off = piece * MK_PF_PIECE;
        prefetch_l2_bytes(row + off, (unsigned)min(MK_PF_PIECE, row_bytes - off));
    }
}
