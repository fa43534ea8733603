// The block-level GEMV engine every weight-streaming phase of the megakernel runs on.
//
// A phase multiplies MK_NT activation vectors x[t][K] (staged in shared memory by the phase's prologue)
// by a set of bf16 weight rows described by a `GemvDesc` (up to four row segments taken from different
// matrices, or the gate/up interleave of the MLP). The rows are split into one contiguous range per
// block; inside a block each row is cut into NK chunks of U 16-byte loads per lane, and the warps take
// (row, chunk) items round robin, double-buffering their weight registers (the next item's loads are in
// flight while the current one is multiplied). A warp-shuffle reduction leaves one partial per (token,
// item) in shared memory; the block sums the chunks of each row in a fixed order (deterministic and
// independent of MK_NT) and hands the row values to the phase's epilogue.
//
// Shared memory holds MK_XW input values per token. A phase whose K is wider runs in passes over K windows of
// whole chunks: the caller's `stage(k0, k1)` re-stages the window for each pass, each pass's (row, chunk)
// partials land in the same slots, and the row sums stay in the same order, so results do not depend on
// MK_XW (verify launches of many tokens get a narrower window than single steps, and the same values).
//
// MK_MMA (an option, off by default: slower on the H200, see Tuning.mma) multiplies on the tensor cores instead:
// an item is 8 rows by a K range (mma.sync m16n8k16, the
// weights as the B operand, the tokens as the A operand's rows), lane (g, t) = (lane / 4, lane % 4) multiplies row g at
// vectors 4 * j + t (both operands take the same permutation of K inside a vector, so no shuffles are needed; the
// shared-memory ring is filled row by row and each lane reads its vectors back, see gemv_issue_async), and
// the tensor core sums over K: per 16-byte weight vector a lane issues one shared-memory read of its token's input
// and two mma instructions whatever MK_NT is, where the scalar path reads MK_NT input vectors and issues 8 * MK_NT
// FMAs. A chunk is MK_MMA_SUB consecutive items of the same rows (summed in the accumulator), so rows keep few
// partials. Each output element of the mma is its own dot product: token t's value does not depend on the other
// tokens in the launch, so verify launches stay bit-identical to single steps.
//
// Shapes are run-time values on purpose: one copy of the hot loop serves every phase. With one
// compile-time instantiation per phase, the step loop inlined seven copies and ptxas spilled the weight
// registers of all of them.
#pragma once
#include "common.cuh"

#ifndef MK_UMAX
#define MK_UMAX 8  // most 16-byte loads per lane in one item (registers: 2 buffers x MK_UMAX x 4)
#endif
#ifndef MK_PART_ROWS
#define MK_PART_ROWS 4096  // partial sums per token kept in shared memory for one round of rows
#endif
#ifndef MK_STAGES
#define MK_STAGES 0  // > 0: weights stream through a per-thread ring of MK_STAGES items in shared memory (cp.async)
#endif
#ifndef MK_RING_PLANES
#define MK_RING_PLANES MK_UMAX  // 16-byte vectors per thread in a ring slot (plan.py: KernelPlan.ring_planes)
#endif
#ifndef MK_XW
#error "MK_XW (input values staged per token) missing: compile through onestream.kernels.build"
#endif
#ifndef MK_MMA
#define MK_MMA 0  // 1: tensor-core items of 8 rows (kernels/build.py passes it; the scalar path is the fallback)
#endif
#ifndef MK_MMA_SUB
#define MK_MMA_SUB 2  // MK_MMA: items per chunk (accumulated in registers before one partial per row is stored)
#endif
#if MK_MMA
static_assert(MK_NT <= 8, "the tensor-core GEMV multiplies at most 8 tokens (the rows of the mma's A it uses)");
#endif
#if MK_MMA
#define GEMV_IR 8             // rows per item: the mma's n
#define GEMV_KL 4             // lanes along K per row
#define GEMV_SUB MK_MMA_SUB   // items (ring slots) per chunk
#else
#define GEMV_IR 1
#define GEMV_KL 32
#define GEMV_SUB 1
#endif
#define MK_XWV (MK_XW / 8)  // 16-byte input vectors per token in shared memory
// Token stride of the staged input: 64 bytes more than the window when several tokens are staged, so that the
// tokens' rows start in different shared-memory banks (the tensor-core GEMV's lanes read one token each; the
// scalar path's lanes read consecutive vectors of one token and only pay the bytes).
#define MK_XLD (MK_XW + (MK_NT > 1 ? 64 / (int)sizeof(bf16_t) : 0))
#define MK_XLDV (MK_XLD / 8)
#define GEMV_MAX_SEGS 4
// Bytes of a block's share that the ring's head (MK_STAGES - 1 items per warp) covers, at most (the scalar path: a
// prefix of the block's rows; the tensor-core path's head is the first K range of 8-row groups, so the L2
// prefetch that skips these bytes is less exact there).
#define GEMV_HEAD_BYTES (MK_STAGES > 1 ? (MK_STAGES - 1) * MK_NWARPS * MK_UMAX * 32 * 16 : 0)

#ifdef MK_PHASE_TIMING
// Timing builds: when this block's GEMV of the current phase began streaming (its prologue staged the input) and
// when the last round's weights were all multiplied (before that round's reduction and epilogue); 0 where the
// phase ran no GEMV. Written and read by thread 0 only (megakernel.cu resets them per phase).
__shared__ u64 mk_gemv_t[2];
#endif

// The plan's MK_WFMT_<KIND>: the quantized formats (masks of gemv_quant.cuh's QF_* codes) each weight kind may
// hold besides bf16; MK_QFMTS, their union, selects the quantized GEMV loops a build compiles (none: bf16 only).
#ifndef MK_QFMTS
#define MK_QFMTS 0
#endif
#ifndef MK_EFMT
#define MK_EFMT 0  // the embedding table's format code (embed.cuh decodes its rows with this file's helpers)
#endif
#ifndef MK_GEMV_BF16
#define MK_GEMV_BF16 1  // 0: no weight kind holds bf16 (a quantized model): the bf16 loop is not compiled
#endif
static_assert(MK_STAGES == 0 || MK_RING_PLANES >= MK_UMAX || !MK_GEMV_BF16, "a ring slot holds a bf16 item");
static_assert((MK_WFMT_DN_IN | MK_WFMT_DN_OUT | MK_WFMT_ATT_IN | MK_WFMT_ATT_OUT | MK_WFMT_MLP_IN | MK_WFMT_MLP_DOWN |
               MK_WFMT_LM_HEAD | MK_WFMT_MTP_FC | (MK_EFMT ? 1 << MK_EFMT : 0)) == MK_QFMTS,
              "MK_QFMTS is the union of the weight kinds' quantized formats and the embedding's");

struct GemvDesc {
    const bf16_t* seg[GEMV_MAX_SEGS];  // row segments (segment s holds rows [end[s-1], end[s]))
    int end[GEMV_MAX_SEGS];
    int nseg;
    int interleave;  // 1: row 2j is seg[0][j], row 2j+1 is seg[1][j] (gate/up pairs meet in one block)
    int K;           // input width (multiple of 8)
    int nrows;
    int align;       // block ranges are multiples of this many rows
};

struct GemvPlan {
    int nvec;   // 16-byte vectors per row
    int nk;     // chunks per row (a row's partial sums)
    int u;      // loads per lane per item (<= MK_UMAX); a chunk is GEMV_SUB items
    int round;  // rows per round
};

// kernels/build.py mirrors this (gemv_chunks, gemv_chunk_width_of) to size rounds and windows. Constant
// expressions too, so that static_asserts can check a plan's geometry (megakernel.cu).
__host__ __device__ __forceinline__ constexpr GemvPlan gemv_plan(int K) {
    GemvPlan p{};
    p.nvec = K / 8;
    const int lpr = (p.nvec + GEMV_KL - 1) / GEMV_KL;  // loads per lane along a whole row
    p.nk = (lpr + MK_UMAX * GEMV_SUB - 1) / (MK_UMAX * GEMV_SUB);
    p.u = (lpr + p.nk * GEMV_SUB - 1) / (p.nk * GEMV_SUB);
    p.round = (MK_PART_ROWS / p.nk) & (MK_MMA ? ~7 : ~1);
    return p;
}
// 16-byte input vectors per chunk.
__host__ __device__ __forceinline__ constexpr int gemv_chunk_vecs(const GemvPlan& p) {
    return p.u * GEMV_KL * GEMV_SUB;
}
// The vector that load `uu` of sub-item `sub` of chunk `chunk` reads for `lane`.
__device__ __forceinline__ int gemv_vec(const GemvPlan& p, int chunk, int sub, int uu, int lane) {
    return ((chunk * GEMV_SUB + sub) * p.u + uu) * GEMV_KL + (lane & (GEMV_KL - 1));
}
// The row (within the range) of item row group `rg` that `lane` streams.
__device__ __forceinline__ int gemv_lane_row(int rg, int lane) { return MK_MMA ? rg * GEMV_IR + (lane >> 2) : rg; }
// Items of a pass over `nkq` chunks of `nr` rows.
__device__ __forceinline__ int gemv_items(int nr, int nkq) { return (nr + GEMV_IR - 1) / GEMV_IR * nkq; }

// Chunks per pass: as many whole chunks as the staged window holds.
__host__ __device__ __forceinline__ constexpr int gemv_pass_chunks(const GemvPlan& p) {
    const int fit = MK_XWV / gemv_chunk_vecs(p);
    return fit < 1 ? 1 : fit < p.nk ? fit : p.nk;
}
// Input elements [k0, k1) of pass q.
__device__ __forceinline__ void gemv_pass_range(const GemvDesc& d, const GemvPlan& p, int q, int& k0, int& k1) {
    const int width = gemv_pass_chunks(p) * gemv_chunk_vecs(p) * 8;
    k0 = q * width;
    k1 = min(d.K, k0 + width);
}

__device__ __forceinline__ const bf16_t* gemv_row(const GemvDesc& d, int r) {
    if (d.interleave) return d.seg[r & 1] + (long long)(r >> 1) * d.K;
    int s = 0, start = 0;
#pragma unroll
    for (int j = 0; j + 1 < GEMV_MAX_SEGS; ++j) {
        if (j + 1 < d.nseg && r >= d.end[j]) {
            s = j + 1;
            start = d.end[j];
        }
    }
    return d.seg[s] + (long long)(r - start) * d.K;
}

__device__ __forceinline__ float dot8(const vec16& w, const vec16& x) {
    float s = bf_lo(w.x) * bf_lo(x.x);
    s = fmaf(bf_hi(w.x), bf_hi(x.x), s);
    s = fmaf(bf_lo(w.y), bf_lo(x.y), s);
    s = fmaf(bf_hi(w.y), bf_hi(x.y), s);
    s = fmaf(bf_lo(w.z), bf_lo(x.z), s);
    s = fmaf(bf_hi(w.z), bf_hi(x.z), s);
    s = fmaf(bf_lo(w.w), bf_lo(x.w), s);
    s = fmaf(bf_hi(w.w), bf_hi(x.w), s);
    return s;
}


// Block b's share [r0, r1) of `nrows` rows, split in units of `align` rows.
__device__ __forceinline__ void row_range_of(int b, int nrows, int align, int& r0, int& r1) {
    const long long units = nrows / align;
    r0 = (int)(units * b / nblocks()) * align;
    r1 = (int)(units * (b + 1) / nblocks()) * align;
}
// This block's share.
__device__ __forceinline__ void block_row_range(int nrows, int align, int& r0, int& r1) {
    row_range_of(bid_x(), nrows, align, r0, r1);
}

// A warp's unit k of a pass: item warp + (k / GEMV_SUB) * MK_NWARPS (row group, chunk), sub-item k % GEMV_SUB.
struct GemvUnit {
    int rg, chunk, sub;
};
__device__ __forceinline__ GemvUnit gemv_unit(int warp, int k, int c0, int nkq) {
    const int i = warp + (k / GEMV_SUB) * MK_NWARPS;
    GemvUnit it;
    it.rg = i / nkq;
    it.chunk = c0 + i - it.rg * nkq;
    it.sub = k - (k / GEMV_SUB) * GEMV_SUB;
    return it;
}
// Units of warp `warp` in a pass of `nitems` items.
__device__ __forceinline__ int gemv_units(int warp, int nitems) {
    return warp < nitems ? ((nitems - 1 - warp) / MK_NWARPS + 1) * GEMV_SUB : 0;
}

// Per-lane sums of the chunk being multiplied: the mma accumulator (token lane / 4, rows 2 (lane % 4) and + 1 of
// the item; the other two entries belong to the mma's unused rows 8..15), or one sum per token.
struct GemvAcc {
#if MK_MMA
    float c[4];  // the first k-step of every weight vector
    float d[4];  // the second: two chains of dependent mma instead of one (summed when the chunk is stored)
#else
    float c[MK_NT];
#endif
};
__device__ __forceinline__ void gemv_acc_zero(GemvAcc& a) {
#pragma unroll
    for (int i = 0; i < (int)(sizeof(a.c) / sizeof(float)); ++i) a.c[i] = 0.0f;
#if MK_MMA
#pragma unroll
    for (int i = 0; i < 4; ++i) a.d[i] = 0.0f;
#endif
}

// Add one unit (`w(u)`: the lane's weight vector of load u) to the accumulator. Vectors past the row's end and
// rows past the range contribute zeros (their ring slots hold stale data: never multiplied).
template <class W>
__device__ __forceinline__ void gemv_accumulate(const GemvPlan& p, W w, const GemvUnit& it, int nr, int lane,
                                                const vec16* xs, int v0, GemvAcc& acc) {
#if MK_MMA
    const int g = lane >> 2;
    const bool rowok = gemv_lane_row(it.rg, lane) < nr;
#pragma unroll
    for (int u = 0; u < MK_UMAX; ++u) {
        if (u < p.u) {  // warp-uniform: every lane joins the mma
            const int v = gemv_vec(p, it.chunk, it.sub, u, lane);
            vec16 wv = {0u, 0u, 0u, 0u}, xv = {0u, 0u, 0u, 0u};
            if (v < p.nvec) {
                if (rowok) wv = w(u);
                if (g < MK_NT) xv = ld_shared16(xs + g * MK_XLDV + v - v0);
            }
            mma_bf16_m16n8k16(acc.c, xv.x, xv.y, wv.x, wv.y);
            mma_bf16_m16n8k16(acc.d, xv.z, xv.w, wv.z, wv.w);
        }
    }
#else
#pragma unroll
    for (int u = 0; u < MK_UMAX; ++u) {
        const int v = gemv_vec(p, it.chunk, it.sub, u, lane);
        if (u < p.u && v < p.nvec) {
            const vec16 wv = w(u);
#pragma unroll
            for (int t = 0; t < MK_NT; ++t) acc.c[t] += dot8(wv, ld_shared16(xs + t * MK_XLDV + v - v0));
        }
    }
#endif
}

// The chunk's partial sums into shared memory: part[t * MK_PART_ROWS + row * nk + chunk].
__device__ __forceinline__ void gemv_store(const GemvPlan& p, const GemvAcc& acc, const GemvUnit& it, int nr, int lane,
                                           float* part) {
#if MK_MMA
    const int g = lane >> 2, r = it.rg * GEMV_IR + 2 * (lane & 3);
    if (g < MK_NT) {
        if (r < nr) part[g * MK_PART_ROWS + r * p.nk + it.chunk] = acc.c[0] + acc.d[0];
        if (r + 1 < nr) part[g * MK_PART_ROWS + (r + 1) * p.nk + it.chunk] = acc.c[1] + acc.d[1];
    }
#else
#pragma unroll
    for (int t = 0; t < MK_NT; ++t) {
        const float s = warp_sum(acc.c[t]);
        if (lane == 0) part[t * MK_PART_ROWS + it.rg * p.nk + it.chunk] = s;
    }
#endif
}

// The register path: the lane's weight vectors of one unit (zeros where there is nothing to load).
__device__ __forceinline__ void gemv_load(const GemvDesc& d, const GemvPlan& p, int rs, int nr, const GemvUnit& it,
                                          int lane, vec16 (&w)[MK_UMAX]) {
    const int lr = gemv_lane_row(it.rg, lane);
    const bool rowok = lr < nr;
    const vec16* base = (const vec16*)gemv_row(d, rs + (rowok ? lr : 0));
#pragma unroll
    for (int u = 0; u < MK_UMAX; ++u) {
        const int v = gemv_vec(p, it.chunk, it.sub, u, lane);
        // Define the register on both paths: a predicated load alone keeps the old value live across
        // iterations, which the register allocator answered with spills around every load.
        if (rowok && u < p.u && v < p.nvec) {
            w[u] = ld_stream16(base + v);
        } else {
            w[u].x = w[u].y = w[u].z = w[u].w = 0u;
        }
    }
}

// Multiply one unit held in registers; store the chunk's partials after its last sub-item.
__device__ __forceinline__ void gemv_consume_regs(const GemvPlan& p, const vec16 (&w)[MK_UMAX], const GemvUnit& it,
                                                  int nr, int lane, const vec16* xs, int v0, GemvAcc& acc,
                                                  float* part) {
    gemv_accumulate(p, [&](int u) { return w[u]; }, it, nr, lane, xs, v0, acc);
    if (it.sub == GEMV_SUB - 1) {
        gemv_store(p, acc, it, nr, lane, part);
        gemv_acc_zero(acc);
    }
}

// A round's row sums, each row's chunk partials added in chunk order (the same whichever blocks computed them), into
// rowval [MK_NT][round]; then every thread runs the epilogue on them, between block barriers.
template <class Finish>
__device__ __forceinline__ void gemv_round_finish(const float* part, float* rowval, int rs, int nr, int nk, int round,
                                                  Finish finish) {
    for (int e = tid_x(); e < nr * MK_NT; e += MK_THREADS) {
        const int t = e / nr, r = e - t * nr;
        const float* pp = part + t * MK_PART_ROWS + r * nk;
        float s = 0.0f;
        for (int c = 0; c < nk; ++c) s += pp[c];
        rowval[t * round + r] = s;
    }
    __syncthreads();
    finish(rs, nr, rowval, round);
    __syncthreads();
}

#if MK_QFMTS
#include "gemv_quant.cuh"
#endif

// Input elements [k0, k1) of the first pass of a GEMV (the window a phase's prologue stages).
__device__ __forceinline__ void gemv_first_window(const GemvDesc& d, int& k0, int& k1) {
#if MK_QFMTS
    if (gemv_desc_quant(d)) {
        qplan_pass_range(d, qplan(d.K), 0, k0, k1);
        return;
    }
#endif
    gemv_pass_range(d, gemv_plan(d.K), 0, k0, k1);
}

#if MK_STAGES > 0
// The shared-memory weight ring: MK_STAGES slots per warp, each MK_UMAX planes of 32 16-byte units per warp (plane u of
// slot s for warp w at ring[(s * MK_UMAX + u) * MK_THREADS + w * 32]). Lane l copies and reads back unit l of each
// plane itself, so no synchronisation is needed between copy and use. The copies do not occupy registers, so
// MK_STAGES units per warp are in flight (the register path: one or two).

#if MK_MMA
// The tensor-core ring is filled row by row: plane i of a slot holds row i of the item, and copy instruction i
// reads that row's stretch of up to 512 contiguous bytes, as the scalar path's instructions do. (With each lane
// copying what it multiplies, every instruction read 64 bytes of each of 8 rows: twice the L2 requests per byte.)
// Lane (g, t) then reads row g's vectors 4 u + t back from plane g, so lanes read what other lanes copied
// (__syncwarp after the wait and before a slot is refilled). Position p of plane i is stored at p ^ 4 (i & 1): the
// two rows a quarter-warp reads then fall on different banks.
static_assert(MK_STAGES == 0 || MK_UMAX == GEMV_IR, "the tensor-core ring keeps one row of an item per plane");
__device__ __forceinline__ int gemv_ring_pos(int row, int pos) { return pos ^ ((row & 1) << 2); }
#endif

// Start copying unit `it` into the ring slot at shared address `slot_w` (this warp's base of the slot).
__device__ __forceinline__ void gemv_issue_async(const GemvDesc& d, const GemvPlan& p, int rs, int nr,
                                                 const GemvUnit& it, int lane, u32 slot_w, u64 policy) {
#if MK_MMA
    __syncwarp();  // every lane has read the data this slot held (the lanes read each other's copies)
    const int vb = gemv_vec(p, it.chunk, it.sub, 0, 0), v = vb + lane;
    const bool ok = lane < p.u * GEMV_KL && v < p.nvec;
    // Lane i finds row i's address once; the copies take it by shuffle (gemv_row reads the descriptor, which
    // lives in local memory: eight lookups per unit in a row would slow the stream by nearly half).
    const int own_row = it.rg * GEMV_IR + (lane & (GEMV_IR - 1));
    const unsigned long long row_addr = (unsigned long long)gemv_row(d, rs + min(own_row, nr - 1));
#pragma unroll
    for (int i = 0; i < GEMV_IR; ++i) {
        const int r = it.rg * GEMV_IR + i;
        const vec16* row = (const vec16*)__shfl_sync(0xffffffffu, row_addr, i);
        if (ok && r < nr) cp_async16(slot_w + (i * MK_THREADS + gemv_ring_pos(i, lane)) * 16, row + v, policy);
    }
#else
    const int lr = gemv_lane_row(it.rg, lane);
    if (lr >= nr) return;
    const vec16* base = (const vec16*)gemv_row(d, rs + lr);
#pragma unroll
    for (int u = 0; u < MK_UMAX; ++u) {
        const int v = gemv_vec(p, it.chunk, it.sub, u, lane);
        if (u < p.u && v < p.nvec) cp_async16(slot_w + (u * MK_THREADS + lane) * 16, base + v, policy);
    }
#endif
}

// The ring's head: this warp's first MK_STAGES - 1 units of the pass over chunks [c0, c0 + nkq) of rows
// [rs, rs + nr) (ring0: the warp's base of slot 0), one commit group each (empty groups where the warp has fewer
// units, so that group counting stays uniform).
__device__ __forceinline__ void gemv_ring_head(const GemvDesc& d, const GemvPlan& p, int rs, int nr, int c0, int nkq,
                                               int lane, int warp, u32 ring0, u64 policy) {
    const int count = gemv_units(warp, gemv_items(nr, nkq));
#pragma unroll
    for (int k = 0; k < MK_STAGES - 1; ++k) {
        if (k < count)
            gemv_issue_async(d, p, rs, nr, gemv_unit(warp, k, c0, nkq), lane, ring0 + k * MK_UMAX * MK_THREADS * 16,
                             policy);
        cp_async_commit();
    }
}

// Issue the head of this block's first round of a coming GEMV phase before its inputs exist (weights do not
// depend on them): called between phases, so the loads are in flight across the grid barrier and the
// phase's prologue (norm, staging). gemv_run(..., head_issued = true) then skips issuing it again.
__device__ void gemv_issue_first_head(const GemvDesc& d, vec16* ring) {
#if MK_QFMTS
    if (gemv_desc_quant(d)) {
        gemv_issue_first_head_quant(d, ring);
        return;
    }
#endif
    const GemvPlan p = gemv_plan(d.K);
    int r0, r1;
    block_row_range(d.nrows, d.align, r0, r1);
    const int nkq = gemv_pass_chunks(p);
    gemv_ring_head(d, p, r0, min(p.round, max(0, r1 - r0)), 0, nkq, tid_x() & 31, tid_x() >> 5,
                   smem_addr(ring + (tid_x() & ~31)), evict_first_policy());
}
#endif

// Multiply this block's rows by xs (shared memory, [MK_NT][MK_XLD] bf16, window 0 staged by the caller); after
// each round of rows, call `finish(row0, nrows, rowval, ld)` where rowval[t * ld + i] is row row0 + i's value for
// token t. Phases wider than MK_XW run each round in passes; `stage(k0, k1)` stages input [k0, k1) (and ends
// with a block barrier). `ring` is the shared-memory weight ring (MK_STAGES > 0 builds only); the next pass's or
// round's first units are issued while the current one's last units are multiplied. A row's value does not
// depend on which block computes it.
template <class Finish, class Stage>
__device__ void gemv_run(const GemvDesc& d, const bf16_t* xs_in, float* part, float* rowval, vec16* ring,
                         bool head_issued, Finish finish, Stage stage) {
#if MK_QFMTS
    if (gemv_desc_quant(d)) {  // a quantized GEMV (its segments are all quantized): gemv_quant.cuh
        gemv_run_quant(d, xs_in, part, rowval, ring, head_issued, finish, stage);
        return;
    }
#endif
#if MK_GEMV_BF16
    const GemvPlan p = gemv_plan(d.K);
    const int lane = tid_x() & 31, warp = tid_x() >> 5;
    const vec16* xs = (const vec16*)xs_in;
    const int cpp = gemv_pass_chunks(p);
    const int npass = (p.nk + cpp - 1) / cpp;
    int r0, r1;
    block_row_range(d.nrows, d.align, r0, r1);
#if MK_STAGES > 0
    const u64 policy = evict_first_policy();
    const u32 ring0 = smem_addr(ring + warp * 32);  // this warp's base of slot 0
    const vec16* mine = ring + warp * 32;
#endif
    int rs = r0, nr = min(p.round, r1 - r0);
    bool staged = true;  // window 0 is in shared memory (the caller staged it)
#if MK_STAGES > 0
    // The weight stream continues across the breaks between passes and rounds: while a warp multiplies the last
    // units of a segment (one pass of one range), the ring slots they free take the first MK_STAGES - 1 units of
    // the following segment, so the loads stay in flight through the break (the window's restaging, the
    // reduction and the epilogue) instead of draining and refilling. `pre`: this warp's first MK_STAGES - 1 units
    // of the current segment are in flight, one commit group each, from ring slot `base` on.
    bool pre = head_issued;
    int base = 0;
#endif
#ifdef MK_PHASE_TIMING
    if (tid_x() == 0 && nr > 0 && mk_gemv_t[0] == 0) mk_gemv_t[0] = global_timer_ns();  // a block without rows: none
#endif
    while (nr > 0) {
        // This block's next round.
        const int next_rs = rs + nr, next_nr = min(p.round, r1 - next_rs);
        for (int q = 0; q < npass; ++q) {
            const int c0 = q * cpp, nkq = min(cpp, p.nk - c0);
            const int v0 = c0 * gemv_chunk_vecs(p);
            if (q > 0 || !staged) {
#if MK_STAGES > 0
                // This pass's first weights do not depend on the input: in flight while the window is staged.
                if (!pre) gemv_ring_head(d, p, rs, nr, c0, nkq, lane, warp, ring0, policy);
                if (!pre) base = 0;
                pre = true;
#endif
                __syncthreads();  // every warp is done with the previous window
                int k0, k1;
                gemv_pass_range(d, p, q, k0, k1);
                stage(k0, k1);
            }
            const int count = gemv_units(warp, gemv_items(nr, nkq));
            GemvAcc acc;
            gemv_acc_zero(acc);
#if MK_STAGES > 0
            if (!pre) {
                gemv_ring_head(d, p, rs, nr, c0, nkq, lane, warp, ring0, policy);
                base = 0;
            }
            // The following segment: the next pass over these rows, else the next static round's first pass.
            int f_rs = rs, f_nr = nr, f_c0 = c0 + cpp;
            if (q + 1 >= npass) {
                f_rs = next_rs;
                f_nr = next_nr;
                f_c0 = 0;
            }
            const int f_nkq = min(cpp, p.nk - f_c0);
            const int f_count = f_nr > 0 ? gemv_units(warp, gemv_items(f_nr, f_nkq)) : 0;
            // Stream the following segment's head from this loop only where the loop covers all of it (a warp with
            // fewer units than the head issues it at the break, as the first pass's head is issued).
            const bool ahead = f_count > 0 && count >= MK_STAGES - 1;
            // Unit k lives in slot (base + k) % MK_STAGES. One commit group per unit (empty groups past the end keep
            // the count uniform), MK_STAGES - 1 issued ahead of the one used.
            for (int k = 0; k < count; ++k) {
                const int kn = k + MK_STAGES - 1;
                const u32 slot_n = ring0 + ((base + kn) % MK_STAGES) * MK_UMAX * MK_THREADS * 16;
                if (kn < count)
                    gemv_issue_async(d, p, rs, nr, gemv_unit(warp, kn, c0, nkq), lane, slot_n, policy);
                else if (ahead && kn - count < f_count)
                    gemv_issue_async(d, p, f_rs, f_nr, gemv_unit(warp, kn - count, f_c0, f_nkq), lane, slot_n, policy);
                cp_async_commit();
                cp_async_wait<MK_STAGES - 1>();  // unit k's group is complete
                const GemvUnit it = gemv_unit(warp, k, c0, nkq);
                const vec16* slot = mine + ((base + k) % MK_STAGES) * MK_UMAX * MK_THREADS;
#if MK_MMA
                __syncwarp();  // and so are the other lanes' copies of it
                const vec16* plane = slot + (lane >> 2) * MK_THREADS;
                gemv_accumulate(
                    p, [&](int u) { return ld_shared16(plane + gemv_ring_pos(lane >> 2, 4 * u + (lane & 3))); }, it, nr,
                    lane, xs, v0, acc);
#else
                gemv_accumulate(p, [&](int u) { return ld_shared16(slot + u * MK_THREADS + lane); }, it, nr, lane, xs, v0,
                                acc);
#endif
                if (it.sub == GEMV_SUB - 1) {
                    gemv_store(p, acc, it, nr, lane, part);
                    gemv_acc_zero(acc);
                }
            }
            if (ahead) {
                base = (base + count) % MK_STAGES;
            } else {
                cp_async_wait<0>();  // only empty groups can be pending
            }
            pre = ahead;
#else
            vec16 wa[MK_UMAX], wb[MK_UMAX];
            int k = 0;
            if (count > 0) gemv_load(d, p, rs, nr, gemv_unit(warp, 0, c0, nkq), lane, wa);
            while (k < count) {
                if (k + 1 < count) gemv_load(d, p, rs, nr, gemv_unit(warp, k + 1, c0, nkq), lane, wb);
                gemv_consume_regs(p, wa, gemv_unit(warp, k, c0, nkq), nr, lane, xs, v0, acc, part);
                if (++k >= count) break;
                if (k + 1 < count) gemv_load(d, p, rs, nr, gemv_unit(warp, k + 1, c0, nkq), lane, wa);
                gemv_consume_regs(p, wb, gemv_unit(warp, k, c0, nkq), nr, lane, xs, v0, acc, part);
                ++k;
            }
#endif
        }
        staged = npass == 1;  // a multi-pass range leaves the last window staged: the next range restages window 0
        __syncthreads();
#ifdef MK_PHASE_TIMING
        if (tid_x() == 0) mk_gemv_t[1] = global_timer_ns();  // every warp is done with this round's weights
#endif
#if MK_STAGES > 0
        if (next_nr > 0 && !pre) {  // its first weights stream in during this range's reduction and epilogue
            gemv_ring_head(d, p, next_rs, next_nr, 0, min(cpp, p.nk), lane, warp, ring0, policy);
            base = 0;
            pre = true;
        }
#endif
        gemv_round_finish(part, rowval, rs, nr, p.nk, p.round, finish);
        rs = next_rs;
        nr = next_nr;
    }
#endif
}

// Pull bytes [skip, skip + max_bytes) of block `b`'s share of a coming GEMV phase into L2, counted in
// whole rows (each row is contiguous; segments and the gate/up interleave are resolved per row). The
// threads of this block each issue bulk requests of at most MK_PF_PIECE bytes.
__device__ void gemv_prefetch_share(const GemvDesc& d, int b, int skip_bytes, int max_bytes) {
    if (max_bytes <= 0 || d.nrows <= 0) return;
#if MK_QFMTS
    if (gemv_desc_quant(d)) {  // from the share's first row (the quantized ring's head is not skipped)
        gemv_prefetch_share_quant(d, b, max_bytes);
        return;
    }
#endif
    const int row_bytes = d.K * 2;
    const int pieces = (row_bytes + MK_PF_PIECE - 1) / MK_PF_PIECE;
    int r0, r1;
    row_range_of(b, d.nrows, d.align, r0, r1);
    const int first = r0 + skip_bytes / row_bytes;
    const int last = min(r1, first + max(1, max_bytes / row_bytes));
    for (int it = tid_x(); it < (last - first) * pieces; it += MK_THREADS) {
        const int row = first + it / pieces, piece = it - (it / pieces) * pieces;
        const int off = piece * MK_PF_PIECE;
        prefetch_l2_bytes((const char*)gemv_row(d, row) + off, (unsigned)min(MK_PF_PIECE, row_bytes - off));
    }
}
