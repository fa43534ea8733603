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
#define GEMV_MAX_SEGS 4

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
    int nk;     // chunks per row
    int u;      // loads per lane per chunk (<= MK_UMAX)
    int round;  // rows per round
};

__device__ __forceinline__ GemvPlan gemv_plan(int K) {
    GemvPlan p;
    p.nvec = K / 8;
    const int lpr = (p.nvec + 31) / 32;
    p.nk = (lpr + MK_UMAX - 1) / MK_UMAX;
    p.u = (lpr + p.nk - 1) / p.nk;
    p.round = (MK_PART_ROWS / p.nk) & ~1;
    return p;
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

// This block's share [r0, r1) of `nrows` rows, split in units of `align` rows.
__device__ __forceinline__ void block_row_range(int nrows, int align, int& r0, int& r1) {
    const long long units = nrows / align;
    r0 = (int)(units * bid_x() / nblocks()) * align;
    r1 = (int)(units * (bid_x() + 1) / nblocks()) * align;
}

__device__ __forceinline__ void gemv_load(const GemvDesc& d, const GemvPlan& p, int row, int chunk, int lane,
                                          vec16 (&w)[MK_UMAX]) {
    const vec16* base = (const vec16*)gemv_row(d, row);
#pragma unroll
    for (int u = 0; u < MK_UMAX; ++u) {
        const int v = (chunk * p.u + u) * 32 + lane;
        // Define the register on both paths: a predicated load alone keeps the old value live across
        // iterations, which the register allocator answered with spills around every load.
        if (u < p.u && v < p.nvec) {
            w[u] = ld_stream16(base + v);
        } else {
            w[u].x = w[u].y = w[u].z = w[u].w = 0u;
        }
    }
}

__device__ __forceinline__ void gemv_consume(const GemvPlan& p, const vec16 (&w)[MK_UMAX], int item, int chunk,
                                             int lane, const vec16* xs, float* part) {
    float acc[MK_NT];
#pragma unroll
    for (int t = 0; t < MK_NT; ++t) acc[t] = 0.0f;
#pragma unroll
    for (int u = 0; u < MK_UMAX; ++u) {
        const int v = (chunk * p.u + u) * 32 + lane;
        if (u < p.u && v < p.nvec) {
#pragma unroll
            for (int t = 0; t < MK_NT; ++t) acc[t] += dot8(w[u], xs[t * p.nvec + v]);
        }
    }
#pragma unroll
    for (int t = 0; t < MK_NT; ++t) {
        const float s = warp_sum(acc[t]);
        if (lane == 0) part[t * MK_PART_ROWS + item] = s;
    }
}

// Multiply this block's rows by xs (shared memory, [MK_NT][K] bf16); after each round of rows, call
// `finish(row0, nrows, rowval, ld)` where rowval[t * ld + i] is row row0 + i's value for token t.
template <class Finish>
__device__ void gemv_run(const GemvDesc& d, const bf16_t* xs_bf, float* part, float* rowval, Finish finish) {
    const GemvPlan p = gemv_plan(d.K);
    const int lane = tid_x() & 31, warp = tid_x() >> 5;
    const vec16* xs = (const vec16*)xs_bf;
    int r0, r1;
    block_row_range(d.nrows, d.align, r0, r1);
    for (int rs = r0; rs < r1; rs += p.round) {
        const int nr = min(p.round, r1 - rs);
        const int nitems = nr * p.nk;
        vec16 wa[MK_UMAX], wb[MK_UMAX];
        int i = warp;
        if (i < nitems) gemv_load(d, p, rs + i / p.nk, i % p.nk, lane, wa);
        while (i < nitems) {
            const int j = i + MK_NWARPS;
            if (j < nitems) gemv_load(d, p, rs + j / p.nk, j % p.nk, lane, wb);
            gemv_consume(p, wa, i, i % p.nk, lane, xs, part);
            if (j >= nitems) break;
            const int k = j + MK_NWARPS;
            if (k < nitems) gemv_load(d, p, rs + k / p.nk, k % p.nk, lane, wa);
            gemv_consume(p, wb, j, j % p.nk, lane, xs, part);
            i = k;
        }
        __syncthreads();
        for (int e = tid_x(); e < nr * MK_NT; e += MK_THREADS) {
            const int t = e / nr, r = e - t * nr;
            const float* pp = part + t * MK_PART_ROWS + r * p.nk;
            float s = 0.0f;
            for (int c = 0; c < p.nk; ++c) s += pp[c];
            rowval[t * p.round + r] = s;
        }
        __syncthreads();
        finish(rs, nr, rowval, p.round);
        __syncthreads();
    }
}

// Pull the first `max_bytes` of this block's rows of a coming GEMV phase into L2 while the grid waits.
__device__ void gemv_prefetch(const GemvDesc& d, int max_bytes) {
    if (max_bytes <= 0 || d.nrows <= 0) return;
    const int lines_per_row = (d.K * 2 + 127) / 128;
    int r0, r1;
    block_row_range(d.nrows, d.align, r0, r1);
    const long long total = (long long)(r1 - r0) * lines_per_row;
    const long long budget = max_bytes / 128;
    const int n = (int)(total < budget ? total : budget);
    for (int li = tid_x(); li < n; li += MK_THREADS) {
        const int row = r0 + li / lines_per_row;
        const int off = (li % lines_per_row) * 128;
        prefetch_l2((const char*)gemv_row(d, row) + off);
    }
}
