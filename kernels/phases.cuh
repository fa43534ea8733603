// The phases of one decode step. Each phase is run by every block of the persistent grid; the grid
// barrier between phases lives in megakernel.cu. Rounding: every value the reference model keeps in
// bf16 is rounded to bf16 here too (rbf) in MK_FP32_ACT=0 builds; MK_FP32_ACT builds keep the residual stream,
// the logits and the intermediates marked RBI in fp32 (buffers stored as bf16 are rounded once). Arithmetic is fp32.
#pragma once
#include "common.cuh"
#include "gemv.cuh"
#include "model.cuh"
#include "embed.cuh"

// ---- shared memory ------------------------------------------------------------------------------
// The carve is the plan's (kernels/plan.py KernelPlan.carve: MK_SMEM_*, byte offsets from a 128-byte boundary of
// the shared window, whatever the static shared memory before it: a ring slot off that boundary would split each
// warp's cp.async into twice the L2 sector requests). These check what the code below relies on.
static_assert(MK_XW % 8 == 0 && MK_XW >= MK_H && (MK_XW >= MK_KMAX || MK_XW >= MK_UMAX * GEMV_KL * GEMV_SUB * 8),
              "the staged window must hold a hidden row and a whole GEMV chunk (or every input whole)");
#define PART_FLOATS (MK_NT * MK_PART_ROWS)
static_assert(MK_SMEM_XS == MK_STAGES * MK_RING_PLANES * MK_THREADS * 16, "the weight ring comes first, whole");
static_assert(MK_SMEM_XS % MK_SMEM_ALIGN == 0, "the regions after the ring keep its alignment");
static_assert(MK_SMEM_PART - MK_SMEM_XS >= MK_NT * MK_XLD * (int)sizeof(bf16_t) && MK_SMEM_PART % 16 == 0,
              "the staged input's rows");
static_assert(MK_SMEM_ROWVAL - MK_SMEM_PART == PART_FLOATS * 4 && MK_SMEM_RED - MK_SMEM_ROWVAL == PART_FLOATS * 4,
              "a round's partial sums and row values");
static_assert(MK_SMEM_END - MK_SMEM_RED >= MK_NT * MK_NWARPS * 4 && MK_SMEM_END % 16 == 0,
              "block_sum_n of every token");
static_assert(MK_SMEM_BYTES == MK_SMEM_ALIGN + MK_SMEM_END, "a launch gives the carve and its alignment slack");

struct Smem {
    vec16* ring;    // GEMV weight ring (MK_STAGES > 0), first: 128-byte aligned
    bf16_t* xs;     // [MK_NT][MK_XLD] staged GEMV input (a window of MK_XW values when K > MK_XW)
    float* part;    // GEMV partials; scratch of the DeltaNet and attention phases
    float* rowval;  // GEMV row values of one round
    float* red;     // block reductions
};
__device__ __forceinline__ Smem carve_smem(unsigned char* base) {
    const unsigned off = (unsigned)__cvta_generic_to_shared(base);
    base += (MK_SMEM_ALIGN - (off & (MK_SMEM_ALIGN - 1))) & (MK_SMEM_ALIGN - 1);
    Smem s;
    s.ring = (vec16*)base;
    s.xs = (bf16_t*)(base + MK_SMEM_XS);
    s.part = (float*)(base + MK_SMEM_PART);
    s.rowval = (float*)(base + MK_SMEM_ROWVAL);
    s.red = (float*)(base + MK_SMEM_RED);
    return s;
}

// ---- prologues: stage the GEMV input in shared memory -------------------------------------------
// RMSNorm with a zero-centred weight, given as the fp32 (1 + w): y = bf16((x * rsqrt(mean(x^2) + eps)) * w1).
// `src` is bf16 (`BF`: the embedding rows, or h in bf16 builds) or fp32 (h in MK_FP32_ACT builds); `EQ`: rows of the
// block-quantized embedding table, which embed.cuh decodes into the bf16 values a bf16 table would hold. The output
// is input vectors [off, off + H / 8) of the GEMV (off: H / 8 for the MTP fc's hidden half); of those, the ones
// in the staged window [v0, v1) go to xs (the norm always sums the whole row, so every window sees the same
// values).
//
// Inside the megakernel a dependent trip to L2 costs about a microsecond (the weight stream fills the queues), so
// the norm makes one: every token's rows and the weight (once for all tokens) are loaded together; the rows go on
// to shared memory as they are summed, and the normalising pass after the block reduction reads them from there
// instead of reloading them from L2 token by token. The raw rows sit at the end of the span xs..rowval (free
// in the prologue), placed so that token t's output reaches no raw row of a token >= t; a block barrier between
// tokens keeps the earlier tokens' rows until they are read. Where they do not fit (T = 8 on the 27B shapes), and
// for the MTP fc's halves, the pass reloads from L2.
#define RMS_SPAN_BYTES (MK_SMEM_RED - MK_SMEM_XS)
__host__ __device__ constexpr bool rms_staged_fits(int e) {  // e: bytes per raw value
    const long long row = (long long)MK_H * e, base = (RMS_SPAN_BYTES - MK_NT * row) / 16 * 16;
    if (base < 0) return false;
    for (int t = 0; t < MK_NT; ++t)
        if ((long long)t * MK_XLD * sizeof(bf16_t) + (long long)MK_H * sizeof(bf16_t) > base + t * row) return false;
    return true;
}
// 8 bf16 values of a row: a bf16 row's, or (EQ) the quantized embedding row's decoded.
template <bool EQ>
__device__ __forceinline__ vec16 ld_row8(const void* row, int vi) {
#if MK_EFMT
    if (EQ) return embed_load8(row, vi);
#endif
    return ld_cg16((const bf16_t*)row + vi * 8);
}
template <bool BF, bool EQ = false>
__device__ __forceinline__ void rmsnorm_rows(const void* const (&src)[MK_NT], const float* w1, bf16_t* xs, float* red,
                                             int off, int v0, int v1) {
    constexpr int NVEC = MK_H / 8;
    constexpr int VPT = (NVEC + MK_THREADS - 1) / MK_THREADS;
    constexpr bool RAW_BF = !MK_FP32_ACT || BF;
    constexpr int E = RAW_BF ? 2 : 4, ROW = MK_H * E;
    constexpr bool FITS = MK_NT > 1 && rms_staged_fits(E);
    const bool staged = FITS && off == 0 && v0 == 0 && v1 >= NVEC;
    unsigned char* raw = (unsigned char*)xs + (RMS_SPAN_BYTES - MK_NT * ROW) / 16 * 16;
    // Output vector vi of the GEMV input falls in the staged window.
    auto in_window = [&](int vi) { return vi < NVEC && off + vi >= v0 && off + vi < v1; };
    // The weight (fp32, its own allocation: 16-byte aligned), in flight with the rows' loads.
    float wv[VPT][8];
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
        const int vi = tid_x() + j * MK_THREADS;
        if (in_window(vi)) {
            const float4 a = __ldg((const float4*)(w1 + vi * 8)), b = __ldg((const float4*)(w1 + vi * 8 + 4));
            wv[j][0] = a.x, wv[j][1] = a.y, wv[j][2] = a.z, wv[j][3] = a.w;
            wv[j][4] = b.x, wv[j][5] = b.y, wv[j][6] = b.z, wv[j][7] = b.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) wv[j][e] = 0.0f;
        }
    }
    // Every token's loads, then one block reduction for all of them (the same sums as token by token).
    float vt[VPT][8];
    float ss[MK_NT];
#pragma unroll
    for (int t = 0; t < MK_NT; ++t) {
        ss[t] = 0.0f;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int vi = tid_x() + j * MK_THREADS;
            if (vi < NVEC) {
                unsigned char* dst = raw + t * ROW + vi * 8 * E;
                if (RAW_BF) {
                    const vec16 v = ld_row8<EQ>(src[t], vi);
                    if (staged) *(vec16*)dst = v;
                    unpack8(v, vt[j]);
                } else {
                    ld_cg_f8((const float*)src[t] + vi * 8, vt[j]);
                    if (staged) {
                        *(float4*)dst = make_float4(vt[j][0], vt[j][1], vt[j][2], vt[j][3]);
                        *(float4*)(dst + 16) = make_float4(vt[j][4], vt[j][5], vt[j][6], vt[j][7]);
                    }
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) ss[t] = fmaf(vt[j][e], vt[j][e], ss[t]);
            }
        }
    }
    block_sum_n(ss, red);  // its barriers also order the raw rows' stores before their reads
#pragma unroll
    for (int t = 0; t < MK_NT; ++t) {
        if (staged && t > 0) __syncthreads();  // token t - 1's raw row is read: t's output may overwrite it
        const float r = rsqrtf(ss[t] / (float)MK_H + MK_EPS);
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int vi = tid_x() + j * MK_THREADS;
            if (!in_window(vi)) continue;
            if (MK_NT > 1) {  // one token: still in vt
                const unsigned char* at = raw + t * ROW + vi * 8 * E;
                if (staged) {
                    if (RAW_BF) {
                        unpack8(*(const vec16*)at, vt[j]);
                    } else {
                        const float4 a = *(const float4*)at, b = *(const float4*)(at + 16);
                        vt[j][0] = a.x, vt[j][1] = a.y, vt[j][2] = a.z, vt[j][3] = a.w;
                        vt[j][4] = b.x, vt[j][5] = b.y, vt[j][6] = b.z, vt[j][7] = b.w;
                    }
                } else {
                    if (EQ) unpack8(ld_row8<EQ>(src[t], vi), vt[j]);
                    else ld_cg_act8(src[t], vi, BF, vt[j]);
                }
            }
            u32 o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[e] = pack_bf2((vt[j][2 * e] * r) * wv[j][2 * e], (vt[j][2 * e + 1] * r) * wv[j][2 * e + 1]);
            vec16 out;
            out.x = o[0], out.y = o[1], out.z = o[2], out.w = o[3];
            ((vec16*)xs)[t * MK_XLDV + off + vi - v0] = out;
        }
    }
    __syncthreads();
}
// `kind`: what the rows hold (model.cuh SRC_*).
__device__ void stage_rmsnorm(const void* const (&src)[MK_NT], int kind, const float* w1, bf16_t* xs, float* red,
                              int off, int v0, int v1) {
#if MK_EFMT
    if (kind == SRC_EMBED) rmsnorm_rows<true, true>(src, w1, xs, red, off, v0, v1);
    else
#endif
    if (kind != SRC_F32) rmsnorm_rows<true>(src, w1, xs, red, off, v0, v1);
    else rmsnorm_rows<false>(src, w1, xs, red, off, v0, v1);
}

// Copy of input vectors [v0, v1) of a bf16 activation [MK_NT][K] written earlier in this launch.
// The window goes global -> shared by cp.async (no registers; every copy of a thread in flight at once, one L2
// round trip instead of one per vector: a 4-token window of 8192 values is 11 vectors per thread). Waiting for
// all groups also waits for the weight ring's first units, which the GEMV needs next anyway.
__device__ void stage_copy(const bf16_t* src, int K, bf16_t* xs, int v0, int v1) {
    const int w = v1 - v0, n = MK_NT * w;
    const u32 base = smem_addr(xs);
    for (int i = tid_x(); i < n; i += MK_THREADS) {
        const int t = i / w, v = i - t * w;
        cp_async16_l2(base + (t * MK_XLDV + v) * 16, src + (long long)t * K + (v0 + v) * 8);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
}

// DeltaNet output norm per value head, gated: bf16(bf16(w * bf16(norm(o))) * silu(z)); input elements [k0, k1)
// (the staged window) go to xs.
#define GN_VH (MK_DV / 8)  // 16-byte vectors per value head
// Iterations of a thread whose loads are issued together (8 registers each; 8 made ptxas spill): as issue-and-use,
// each iteration cost a dependent L2 trip, about 1.3 us in the megakernel (10.4 us of prologue at T = 4).
#define GN_ITERS ((MK_NT * MK_HV * GN_VH + MK_THREADS - 1) / MK_THREADS)
#define GN_B (MK_NT == 1 ? 1 : GN_ITERS < 4 ? GN_ITERS : 4)  // T = 1: 2 made ptxas spill 100 bytes
#if MK_DV % 8 == 0 && GN_VH <= 32 && (GN_VH & (GN_VH - 1)) == 0
// One thread per 8 values, every token and head at once: the lanes of a head are GN_VH consecutive lanes of one
// warp, which sum the squares by shuffles (the same order for every tokens-per-launch build). Reads the norm
// weight 16 bytes at a time: like every weight the kernel streams, it must be 16-byte aligned.
__device__ void stage_gated_norm(const bf16_t* core, const bf16_t* z, const bf16_t* w, bf16_t* xs, int k0, int k1) {
    constexpr int N = MK_NT * MK_HV * GN_VH;
    constexpr int B = GN_B;  // batches of a warp whose loads are in flight together (two loads each)
    const int lane = tid_x() & 31;
    for (int w0 = tid_x() & ~31; w0 < N; w0 += B * MK_THREADS) {  // whole warps: every lane joins the shuffles
        vec16 cv[B], zv[B];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int i = w0 + b * MK_THREADS + lane, ii = i < N ? i : 0;
            const int j = ii % GN_VH, th = ii / GN_VH, t = th / MK_HV, hv = th - t * MK_HV;
            if (w0 + b * MK_THREADS < N) {  // warp-uniform
                cv[b] = ld_cg16(core + t * MK_VD + hv * MK_DV + j * 8);
                zv[b] = ld_cg16(z + t * MK_VD + hv * MK_DV + j * 8);
            }
        }
#pragma unroll
        for (int b = 0; b < B; ++b) {
            if (w0 + b * MK_THREADS >= N) break;  // warp-uniform
            const int i = w0 + b * MK_THREADS + lane;
            const bool ok = i < N;
            const int ii = ok ? i : 0;
            const int j = ii % GN_VH, th = ii / GN_VH, t = th / MK_HV, hv = th - t * MK_HV;
            const int e0 = MK_DN_OUT_HEAD(hv) * MK_DV + j * 8;  // ssm_out's column (tiled for a GGUF)
            float o[8], zz[8];
            unpack8(cv[b], o);
            unpack8(zv[b], zz);
            float ss = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) ss = fmaf(o[e], o[e], ss);
#pragma unroll
            for (int m = GN_VH / 2; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
            if (ok && e0 >= k0 && e0 < k1) {
                const float r = rsqrtf(ss / (float)MK_DV + MK_EPS);
                float wf[8], y[8];
                unpack8(*(const vec16*)(w + j * 8), wf);
#pragma unroll
                for (int e = 0; e < 8; ++e) y[e] = RBI(wf[e] * RBI(o[e] * r)) * silu_fast(zz[e]);
                vec16 out;
                out.x = pack_bf2(y[0], y[1]);
                out.y = pack_bf2(y[2], y[3]);
                out.z = pack_bf2(y[4], y[5]);
                out.w = pack_bf2(y[6], y[7]);
                ((vec16*)xs)[t * MK_XLDV + (e0 - k0) / 8] = out;
            }
        }
    }
    __syncthreads();
}
#else
// Other head widths: one warp per (token, head).
__device__ void stage_gated_norm(const bf16_t* core, const bf16_t* z, const bf16_t* w, bf16_t* xs, int k0, int k1) {
    const int lane = tid_x() & 31, warp = tid_x() >> 5;
    for (int th = warp; th < MK_NT * MK_HV; th += MK_NWARPS) {
        const int t = th / MK_HV, hv = th - t * MK_HV;
        const int base = t * MK_VD + hv * MK_DV, col = MK_DN_OUT_HEAD(hv) * MK_DV;  // col: ssm_out's
        if (col >= k1 || col + MK_DV <= k0) continue;  // warp-uniform: the head is outside the window
        float ss = 0.0f;
        for (int i = lane; i < MK_DV; i += 32) {
            const float o = bf2f(ld_cg_bf(core + base + i));
            ss = fmaf(o, o, ss);
        }
        const float r = rsqrtf(warp_sum(ss) / (float)MK_DV + MK_EPS);
        for (int i = lane; i < MK_DV; i += 32) {
            const int e = col + i;
            if (e < k0 || e >= k1) continue;
            const float n = RBI(bf2f(ld_cg_bf(core + base + i)) * r);
            const float y = RBI(bf2f(__ldg(w + i)) * n);
            xs[t * MK_XLD + e - k0] = f2bf(y * silu_fast(bf2f(ld_cg_bf(z + base + i))));
        }
    }
    __syncthreads();
}

#endif

// ---- GEMV descriptors of the phases ------------------------------------------------------------
__device__ __forceinline__ GemvDesc desc_plain(const bf16_t* w, int K, int nrows) {
    GemvDesc d;
    d.seg[0] = d.seg[1] = d.seg[2] = d.seg[3] = w;
    d.end[0] = d.end[1] = d.end[2] = d.end[3] = nrows;
    d.nseg = 1;
    d.interleave = 0;
    d.K = K;
    d.nrows = nrows;
    d.align = 1;
    return d;
}
__device__ __forceinline__ GemvDesc desc_dn_in(const Tables& tb, int l) {  // in_proj_qkv | _z | _b | _a
    GemvDesc d = desc_plain(tb.lp<const bf16_t>(l, L_QKV), MK_H, MK_DN_IN_ROWS);
    d.seg[1] = tb.lp<const bf16_t>(l, L_Z);
    d.seg[2] = tb.lp<const bf16_t>(l, L_B);
    d.seg[3] = tb.lp<const bf16_t>(l, L_A);
    d.end[0] = MK_C;
    d.end[1] = MK_C + MK_VD;
    d.end[2] = MK_C + MK_VD + MK_HV;
    d.nseg = 4;
    return d;
}
__device__ __forceinline__ GemvDesc desc_att_in(const Tables& tb, int l) {  // q_proj | k_proj | v_proj
    GemvDesc d = desc_plain(tb.lp<const bf16_t>(l, L_Q), MK_H, MK_ATT_IN_ROWS);
    d.seg[1] = tb.lp<const bf16_t>(l, L_K);
    d.seg[2] = tb.lp<const bf16_t>(l, L_V);
    d.end[0] = MK_ATT_QROWS;
    d.end[1] = MK_ATT_QROWS + MK_KVROWS;
    d.nseg = 3;
    return d;
}
__device__ __forceinline__ GemvDesc desc_gate_up(const Tables& tb, int l) {  // rows 2j, 2j+1: gate[j], up[j]
    GemvDesc d = desc_plain(tb.lp<const bf16_t>(l, L_GATE), MK_H, 2 * MK_I);
    d.seg[1] = tb.lp<const bf16_t>(l, L_UP);
    d.interleave = 1;
    d.align = 2;
    return d;
}

// ---- epilogues ----------------------------------------------------------------------------------
// Keep-states launches record the DeltaNet state after every token but the last (the plan's history entries).
static_assert(MK_HIST_ENTRIES == MK_NT - 1, "history entries");
#define EPI_DN_IN 0     // DeltaNet projections: conv + SiLU (updating the window), z, beta, g
#define EPI_STORE 1     // out[t * ld_out + r] = bf16(v)
#define EPI_RESIDUAL 2  // h[t][r] = src[t][r] + v (bf16 builds: bf16(src + bf16(v))); src: h or the embedding rows
#define EPI_SWIGLU 3    // act[t][j] = bf16(bf16(silu(bf16(gate))) * bf16(up)) from the rows (2j, 2j+1)
#define EPI_LM_HEAD 4   // logits (bf16-rounded, as the reference's) and the argmax
#define EPI_SET_H 5     // h[t][r] = v: the MTP fc's output starts the MTP layer's residual stream

struct Epi {
    int kind;
    bf16_t* out;  // EPI_STORE: output; EPI_RESIDUAL: h (resid_t); EPI_SWIGLU: act; EPI_DN_IN: conv output
    int ld_out;
    const void* src[MK_NT];  // EPI_RESIDUAL: what src_kind says (model.cuh SRC_*)
    int src_kind;
    bf16_t* zbuf;              // EPI_DN_IN ...
    float* beta;
    float* gdecay;
    const bf16_t* convw;  // [C][kernel]
    bf16_t* conv_state;   // [C][kernel - 1], oldest first
    bf16_t* hist_conv;    // keep-states launches: [MK_HIST_ENTRIES][C][kernel - 1], the window after each token but the last
    const float* neg_a;   // -exp(A_log)
    const float* dt_bias;
    float* logits;  // EPI_LM_HEAD
    u64* argkey;
};

// Ordered key of a logit and its index: the largest logit wins, the lowest index among equal ones
// (torch.argmax's choice).
__device__ __forceinline__ u64 argmax_key(float v, int idx) {
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xffffffffu - (u32)idx);
}
__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

__device__ void epi_dn_in(const Epi& e, int rs, int nr, const float* rowval, int ld) {
    for (int i = tid_x(); i < nr; i += MK_THREADS) {
        const int r = rs + i;
        if (r < MK_C) {
            float w[MK_CONVK], st[MK_CONVK - 1];
#pragma unroll
            for (int j = 0; j < MK_CONVK; ++j) w[j] = bf2f(e.convw[r * MK_CONVK + j]);
#pragma unroll
            for (int j = 0; j < MK_CONVK - 1; ++j) st[j] = bf2f(e.conv_state[r * (MK_CONVK - 1) + j]);
            bf16_t* hist = e.hist_conv != nullptr ? e.hist_conv + r * (MK_CONVK - 1) : nullptr;
            constexpr int hstride = MK_C * (MK_CONVK - 1);
            for (int t = 0; t < MK_NT; ++t) {
                // (window * w).sum() in bf16 products, as the reference's decode step; then SiLU in bf16.
                // MK_FP32_ACT: in fp32; the window keeps x rounded to bf16, as the state tensor stores it.
                const float xf = rowval[t * ld + i], x = rbf(xf);
                float y = 0.0f;
#pragma unroll
                for (int j = 0; j < MK_CONVK - 1; ++j) y += RBI(st[j] * w[j]);
                y += RBI(RBI(xf) * w[MK_CONVK - 1]);
                e.out[t * MK_C + r] = f2bf(silu_f(RBI(y)));
#pragma unroll
                for (int j = 0; j + 1 < MK_CONVK - 1; ++j) st[j] = st[j + 1];
                st[MK_CONVK - 2] = x;
                if (hist != nullptr && t + 1 < MK_NT) {
#pragma unroll
                    for (int j = 0; j < MK_CONVK - 1; ++j) hist[t * hstride + j] = f2bf(st[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < MK_CONVK - 1; ++j) e.conv_state[r * (MK_CONVK - 1) + j] = f2bf(st[j]);
        } else if (r < MK_C + MK_VD) {
            for (int t = 0; t < MK_NT; ++t) e.zbuf[t * MK_VD + r - MK_C] = f2bf(rowval[t * ld + i]);
        } else if (r < MK_C + MK_VD + MK_HV) {
            const int hv = r - MK_C - MK_VD;
            for (int t = 0; t < MK_NT; ++t) e.beta[t * MK_HV + hv] = RBI(sigmoid_f(RBI(rowval[t * ld + i])));
        } else {
            const int hv = r - MK_C - MK_VD - MK_HV;
            for (int t = 0; t < MK_NT; ++t)
                e.gdecay[t * MK_HV + hv] = e.neg_a[hv] * softplus_f(RBI(rowval[t * ld + i]) + e.dt_bias[hv]);
        }
    }
}

__device__ void epi_lm_head(const Epi& e, int rs, int nr, const float* rowval, int ld, float* red) {
    const int lane = tid_x() & 31, warp = tid_x() >> 5;
    u64* wk = (u64*)red;
    for (int t = 0; t < MK_NT; ++t) {
        u64 best = 0;
        for (int i = tid_x(); i < nr; i += MK_THREADS) {
            const float v = RBI(rowval[t * ld + i]);
            e.logits[(long long)t * MK_V + rs + i] = v;
            const u64 k = argmax_key(v, rs + i);
            best = k > best ? k : best;
        }
        best = warp_max_u64(best);
        if (lane == 0) wk[warp] = best;
        __syncthreads();
        if (tid_x() == 0) {
            u64 m = 0;
            for (int w = 0; w < MK_NWARPS; ++w) m = wk[w] > m ? wk[w] : m;
            atomicMax(e.argkey + t, m);
        }
        __syncthreads();
    }
}

__device__ void epi_finish(const Epi& e, int rs, int nr, const float* rowval, int ld, float* red) {
    switch (e.kind) {
        case EPI_DN_IN:
            epi_dn_in(e, rs, nr, rowval, ld);
            break;
        case EPI_STORE:
            for (int k = tid_x(); k < nr * MK_NT; k += MK_THREADS) {
                const int t = k / nr, i = k - t * nr;
                e.out[t * e.ld_out + rs + i] = f2bf(rowval[t * ld + i]);
            }
            break;
        case EPI_RESIDUAL:
            for (int k = tid_x(); k < nr * MK_NT; k += MK_THREADS) {
                const int t = k / nr, i = k - t * nr, r = rs + i;
#if MK_EFMT
                const float old = e.src_kind == SRC_EMBED       ? embed_value(e.src[t], r)
                                  : !MK_FP32_ACT || e.src_kind ? bf2f(ld_cg_bf((const bf16_t*)e.src[t] + r))
                                                                : ld_cg_f((const float*)e.src[t] + r);
#elif MK_FP32_ACT
                const float old = e.src_kind ? bf2f(ld_cg_bf((const bf16_t*)e.src[t] + r)) : ld_cg_f((const float*)e.src[t] + r);
#else
                const float old = bf2f(ld_cg_bf((const bf16_t*)e.src[t] + r));
#endif
#if MK_FP32_ACT
                ((float*)e.out)[t * MK_H + r] = old + rowval[t * ld + i];
#else
                e.out[t * MK_H + r] = f2bf(old + rbf(rowval[t * ld + i]));
#endif
            }
            break;
        case EPI_SWIGLU: {
            const int np = nr / 2;
            for (int k = tid_x(); k < np * MK_NT; k += MK_THREADS) {
                const int t = k / np, p = k - t * np;
                const float g = RBI(rowval[t * ld + 2 * p]), u = RBI(rowval[t * ld + 2 * p + 1]);
                e.out[t * MK_I + (rs >> 1) + p] = f2bf(RBI(silu_f(g)) * u);
            }
            break;
        }
        case EPI_LM_HEAD:
            epi_lm_head(e, rs, nr, rowval, ld, red);
            break;
        case EPI_SET_H:
            for (int k = tid_x(); k < nr * MK_NT; k += MK_THREADS) {
                const int t = k / nr, i = k - t * nr;
#if MK_FP32_ACT
                ((float*)e.out)[t * MK_H + rs + i] = rowval[t * ld + i];
#else
                e.out[t * MK_H + rs + i] = f2bf(rowval[t * ld + i]);
#endif
            }
            break;
        default:
            break;
    }
}

// One warp loads a row of N bf16 values (lane l holds elements l, l + 32, ...; zeros past N) and returns the
// sum of their squares, added lane by lane in element order, then across the warp.
template <int N, int PL>
__device__ __forceinline__ float warp_load_sumsq(const bf16_t* src, float (&x)[PL]) {
    static_assert(PL * 32 >= N, "too few values per lane");
    const int lane = tid_x() & 31;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PL; ++j) {
        const int i = lane + 32 * j;
        x[j] = i < N ? bf2f(ld_cg_bf(src + i)) : 0.0f;
        ss = fmaf(x[j], x[j], ss);
    }
    return warp_sum(ss);
}

// ---- Gated DeltaNet recurrence ------------------------------------------------------------------
// Work item = (value head, slice of DN_SW state columns). Columns are independent in the delta rule, so a
// block owns its slice of S [dk, dv] in registers for all MK_NT tokens.
#define DN_SW (MK_DV / MK_DN_SPLIT)
#define DN_RG (MK_THREADS / DN_SW)
#define DN_RPT ((MK_DK + DN_RG - 1) / DN_RG)
#define DN_KPL ((MK_DK + 31) / 32)  // q / k values per lane in the l2 norm
// The plan sizes the scratch (MK_DN_SCRATCH_FLOATS) as phase_dn_rec lays it out, within the partial sums.
static_assert(MK_DN_SCRATCH_FLOATS == 2 * MK_NT * MK_DK + MK_THREADS + DN_SW + MK_NT * DN_SW + 2 * MK_NT &&
                  MK_DN_SCRATCH_FLOATS <= PART_FLOATS,
              "DeltaNet scratch exceeds shared memory");

// Work items of the recurrence; blocks [items, grid) have none.
__device__ __forceinline__ int dn_rec_items() { return MK_HV * MK_DN_SPLIT; }

// Returns whether this block had an item (blocks without one prefetch while they wait). Keep-states launches
// also store the slice after every token but the last (L_HIST_REC, one state per entry; the live state holds the
// last, and the first token of a verify pass is never rolled back, so the state before it is not kept). On sm_90
// a record, and then the new live state, go through the staged input's buffer (`stage`, free in this phase) as
// bulk stores, one per row of the slice: nothing later in this launch reads them, so the grid barriers after the
// phase need not wait for them.
constexpr bool DN_BULK_STATE = MK_BULK_STORES && (DN_SW * 4) % 16 == 0 &&
                                MK_DK * DN_SW * 4 <= MK_NT * MK_XLD * (int)sizeof(bf16_t) && MK_DK <= MK_THREADS;
constexpr bool DN_BULK_HIST = DN_BULK_STATE && MK_NT > 1;
__device__ bool phase_dn_rec(const Tables& tb, const StepInfo& si, int layer, float* scratch, bf16_t* stage_buf) {
    const int tid = tid_x(), lane = tid & 31, warp = tid >> 5;
    float* qn = scratch;                // [NT][DK]
    float* kn = qn + MK_NT * MK_DK;     // [NT][DK]
    float* red = kn + MK_NT * MK_DK;    // [THREADS]
    float* dl = red + MK_THREADS;       // [DN_SW]
    float* vs = dl + DN_SW;             // [NT][DN_SW]
    float* sc = vs + MK_NT * DN_SW;     // [NT][2]: beta, decay
    const bf16_t* xbuf = tb.gp<const bf16_t>(G_XBUF);
    const float* beta = tb.gp<const float>(G_BETA);
    const float* gdecay = tb.gp<const float>(G_GDECAY);
    bf16_t* core = tb.gp<bf16_t>(G_CORE);
    float* S = tb.lp<float>(layer, L_REC_STATE);
    float* H = (si.flags & CTRL_FLAG_KEEP_STATES) ? tb.lp<float>(layer, L_HIST_REC) : nullptr;
    constexpr long long hstride = (long long)MK_HV * MK_DK * MK_DV;
    const float qscale = rsqrtf((float)MK_DK);
    const int col = tid % DN_SW, rg = tid / DN_SW;
    const int nitems = dn_rec_items();
    bool any = false;
    for (int item = bid_x(); item < nitems; item += nblocks()) {
        any = true;
        const int hv = item / MK_DN_SPLIT, c0 = (item % MK_DN_SPLIT) * DN_SW, hk = hv / MK_VR;
        const long long off = (long long)hv * MK_DK * MK_DV + c0 + col;
        float* Sh = S + off;
        float* Hh = H != nullptr ? H + off : nullptr;
        float* stage = (float*)stage_buf;  // [DK][DN_SW]: one record of the slice (DN_BULK_HIST)
        float* Hrow = H != nullptr ? H + (long long)hv * MK_DK * MK_DV + c0 + (long long)tid * MK_DV : nullptr;
        float* Srow = S + (long long)hv * MK_DK * MK_DV + c0 + (long long)tid * MK_DV;
        // The state slice first, then every token's inputs: all of them are loads in flight together, one round
        // trip before the recurrence instead of one per dependent load. Warp 2u / 2u + 1 l2-normalises token u's
        // q / k (fp32, eps 1e-6, q scaled by dk^-0.5) from registers; the first threads read beta, the decay and
        // this slice's values.
        float s[DN_RPT];
#pragma unroll
        for (int r = 0; r < DN_RPT; ++r) {
            const int i = rg + r * DN_RG;
            s[r] = (i < MK_DK) ? Sh[i * MK_DV] : 0.0f;
        }
        for (int job = warp; job < 2 * MK_NT; job += MK_NWARPS) {
            const int t = job >> 1, isk = job & 1;
            const bf16_t* src = xbuf + t * MK_C + (isk ? MK_HK * MK_DK : 0) + hk * MK_DK;
            float x[DN_KPL];
            const float inv = rsqrtf(warp_load_sumsq<MK_DK>(src, x) + 1e-6f);
#pragma unroll
            for (int j = 0; j < DN_KPL; ++j) {
                const int i = lane + 32 * j;
                if (i >= MK_DK) continue;
                const float v = x[j] * inv;
                if (isk) kn[t * MK_DK + i] = v;
                else qn[t * MK_DK + i] = v * qscale;
            }
        }
        for (int e = tid; e < MK_NT * DN_SW; e += MK_THREADS) {
            const int t = e / DN_SW, c = e - t * DN_SW;
            vs[e] = bf2f(ld_cg_bf(xbuf + t * MK_C + 2 * MK_HK * MK_DK + hv * MK_DV + c0 + c));
        }
        if (tid < MK_NT) {
            sc[2 * tid] = ld_cg_f(beta + tid * MK_HV + hv);
            sc[2 * tid + 1] = expf(ld_cg_f(gdecay + tid * MK_HV + hv));
        }
        __syncthreads();  // the inputs of every token are in shared memory
        for (int t = 0; t < MK_NT; ++t) {
            // The previous record's requests have read the stage before anyone writes it again (two block
            // barriers come first).
            if (DN_BULK_HIST && Hh != nullptr && tid < MK_DK) bulk_wait_read();
            const float* qt = qn + t * MK_DK;
            const float* kt = kn + t * MK_DK;
            const float b = sc[2 * t], decay = sc[2 * t + 1];
            float pk = 0.0f;
#pragma unroll
            for (int r = 0; r < DN_RPT; ++r) {
                const int i = rg + r * DN_RG;
                if (i < MK_DK) {
                    s[r] *= decay;
                    pk = fmaf(s[r], kt[i], pk);
                }
            }
            red[tid] = pk;
            __syncthreads();
            if (rg == 0) {
                float kv = 0.0f;
                for (int g = 0; g < DN_RG; ++g) kv += red[g * DN_SW + col];
                dl[col] = (vs[t * DN_SW + col] - kv) * b;
            }
            __syncthreads();
            const float d = dl[col];
            float po = 0.0f;
#pragma unroll
            for (int r = 0; r < DN_RPT; ++r) {
                const int i = rg + r * DN_RG;
                if (i < MK_DK) {
                    s[r] = fmaf(kt[i], d, s[r]);
                    po = fmaf(s[r], qt[i], po);
                }
            }
            red[tid] = po;
            if (Hh != nullptr && t + 1 < MK_NT) {
#pragma unroll
                for (int r = 0; r < DN_RPT; ++r) {
                    const int i = rg + r * DN_RG;
                    if (i >= MK_DK) continue;
                    if (DN_BULK_HIST) stage[i * DN_SW + col] = s[r];
                    else Hh[t * hstride + i * MK_DV] = s[r];
                }
                if (DN_BULK_HIST) fence_proxy_async_smem();
            }
            __syncthreads();
            if (DN_BULK_HIST && Hh != nullptr && t + 1 < MK_NT && tid < MK_DK)
                bulk_store(Hrow + t * hstride, stage + tid * DN_SW, DN_SW * 4);
            if (rg == 0) {
                float o = 0.0f;
                for (int g = 0; g < DN_RG; ++g) o += red[g * DN_SW + col];
                core[t * MK_VD + hv * MK_DV + c0 + col] = f2bf(o);
            }
            __syncthreads();
        }
        if (DN_BULK_STATE && tid < MK_DK) bulk_wait_read();  // the last record has left the stage
        __syncthreads();
#pragma unroll
        for (int r = 0; r < DN_RPT; ++r) {
            const int i = rg + r * DN_RG;
            if (i >= MK_DK) continue;
            if (DN_BULK_STATE) stage[i * DN_SW + col] = s[r];
            else Sh[i * MK_DV] = s[r];
        }
        if (DN_BULK_STATE) {
            fence_proxy_async_smem();
            __syncthreads();
            if (tid < MK_DK) bulk_store(Srow, stage + tid * DN_SW, DN_SW * 4);
        }
    }
    if (DN_BULK_STATE && tid < MK_DK) bulk_wait_read();  // the next phase (or item) stages over it
    return any;
}

// ---- gated full attention -----------------------------------------------------------------------
// Flash decoding over a fixed binary tree. The keys are cut into chunks of MK_ATT_CHUNK positions; a chunk's
// partial (max, sum, unnormalised output; scores in log2 units) per (query head, token) pair is computed by one
// block, its warps merged in warp order. Partials combine pairwise up a binary tree over the chunk index (att_join: left, then right; an
// empty side leaves the other's bits unchanged), so a pair's result depends only on its position and the cache,
// never on how the tree is cut into work: a token's attention is bit-identical whether it runs alone or in a
// verify pass, and whatever split the context length and the grid give.
// Work item = (key/value head, split, pass of np <= MK_ATT_PAIRS pairs). A split is an aligned subtree of 2^k
// chunks (att_split: k from the context length and the grid, the rule of kernels/plan.py `att_split`): its
// block computes the subtree's root (a stack of nodes per value, in registers) and writes it to the partials;
// the last split item of a (key/value head, pass) to arrive folds the splits' roots up the rest of the tree,
// applies the sigmoid gate and writes the attention output (with one split, the item writes it itself).
#define ATT_NPL ((MK_HD + 31) / 32)  // head dims per lane in the per-warp norm/rope helper
#define ATT_DPL 8                    // head dims per lane of the values (16 bytes; lanes past MK_HD idle)
// The scores have lanes on positions: ATT_KL lanes per key, each the dot product over ATT_DQ of its dims, so a
// score needs a log2(ATT_KL)-level butterfly and one exp per ATT_KL lanes (not a 5-level one and 32 exps).
#define ATT_PW MK_ATT_GROUP          // positions per warp step
#define ATT_KL (32 / ATT_PW)         // lanes per key
#define ATT_DQ (MK_HD / ATT_KL)      // key dims per lane
#define ATT_PB (ATT_DQ < 8 ? ATT_DQ : 8)  // dims per key load (16 bytes at most)
#define ATT_NPC (ATT_DQ / ATT_PB)    // key loads per lane and step
static_assert(MK_ATT_PAIRS <= MK_NWARPS, "MK_ATT_PAIRS must not exceed the warps of a block");
static_assert(ATT_PW == 4 || ATT_PW == 8, "positions per warp and step of the attention loop");
static_assert(MK_HD <= 32 * ATT_DPL && MK_HD % ATT_KL == 0 && ATT_DQ % ATT_PB == 0 && ATT_PB % 4 == 0,
              "head_dim must split into even pieces over a key's lanes");
// The attention scratch spans part and rowval (contiguous, 2 * PART_FLOATS); the plan sizes it
// (MK_ATT_SCRATCH_FLOATS) as attention_items lays it out.
static_assert(MK_ATT_MACC >= 1 && MK_ATT_MACC <= MK_NWARPS, "the chunk merge's accumulators");
static_assert(MK_ATT_SCRATCH_FLOATS == (1 + MK_ATT_MACC) * MK_ATT_PAIRS * MK_HD + 2 * MK_NWARPS * MK_ATT_PAIRS + MK_NT * MK_HD +
                                             2 * (MK_ATT_SPLIT_LOG + 1) * MK_ATT_PAIRS &&
                  MK_ATT_SCRATCH_FLOATS <= 2 * PART_FLOATS,
              "attention scratch exceeds shared memory");
// Chunks the tree holds (the plan's limit, which the host checks first): splits of at most 2^MK_ATT_SPLIT_LOG
// chunks, at most 2^MK_ATT_FOLD_LEVELS splits.
static_assert(MK_ATT_SPLIT_LOG >= 0 && MK_ATT_SPLIT_LOG <= 10 && MK_ATT_FOLD_LEVELS >= 1 && MK_ATT_FOLD_LEVELS <= 16 &&
                  MK_ATT_MERGE_CHUNKS == (1 << (MK_ATT_SPLIT_LOG + MK_ATT_FOLD_LEVELS)),
              "the attention tree's limits");

// The KV cache's storage (MK_KV_I8: worker/kv_cache.py's int8 format, else the model's bf16): int8 levels with
// one fp32 scale per (head, position) vector (tables L_KSCALE, L_VSCALE: [nKV, capacity]). A score is the exact
// integer sum (dp4a) of the key's levels times the query's two int8 planes (att_query_planes), times both scales;
// a value's softmax weight takes its vector's scale and its levels convert to floats (i8_elem). The new positions
// of a launch are quantized where they are made, so a verify reads them as later launches read the cache.
#ifndef MK_KV_I8
#define MK_KV_I8 0
#endif
#if MK_KV_I8
typedef signed char kv_t;
#else
typedef bf16_t kv_t;
#endif
static_assert(MK_NT * (2 * MK_HD * (int)sizeof(kv_t) + 8) <= MK_NT * MK_XLD * (int)sizeof(bf16_t),
              "the new keys and values (and their scales) exceed the GEMV input buffer");

// ATT_PB elements of a key (an aligned piece) as packed words, from the shared new positions or the cache.
struct AttKey {
    u32 w[ATT_PB * (int)sizeof(kv_t) / 4];
};
__device__ __forceinline__ AttKey att_ld_key(const kv_t* p, bool shared) {
    AttKey k;
    if constexpr (ATT_PB * sizeof(kv_t) == 16) {
        const vec16 v = shared ? ld_shared16(p) : ld_cg16(p);
        k.w[0] = v.x, k.w[1] = v.y, k.w[2] = v.z, k.w[3] = v.w;
    } else if constexpr (ATT_PB * sizeof(kv_t) == 8) {
        if (shared) {
            ld_shared8(p, k.w[0], k.w[1]);
        } else {
            const uint2 v = __ldcg((const uint2*)p);
            k.w[0] = v.x, k.w[1] = v.y;
        }
    } else {
        k.w[0] = shared ? *(const u32*)p : __ldcg((const u32*)p);
    }
    return k;
}
#if MK_KV_I8
// Byte e (0..3) of a word of int8 levels as a float: the biased byte (level + 128) in the mantissa of 2^23, less
// 2^23 + 128, exact. A byte permute and an add at full rate, where I2F.S8 runs at an eighth of the FP32 rate.
__device__ __forceinline__ float i8_elem(u32 w, int e) {
    return __int_as_float(__byte_perm(w ^ 0x80808080u, 0x4B000000u, 0x7440 | e)) - 8388736.0f;
}
#endif
// Element e of a bf16 key piece (e a constant after unrolling) as a float (int8 keys are multiplied by dp4a).
__device__ __forceinline__ float att_key_elem(const AttKey& k, int e) {
    return (e & 1) ? bf_hi(k.w[e >> 1]) : bf_lo(k.w[e >> 1]);
}
// A lane's ATT_DPL elements of one position's value (an int8 vector's scale travels with its key: load_k).
struct AttVal {
#if MK_KV_I8
    u32 w[ATT_DPL / 4];
#else
    vec16 v;
#endif
};
__device__ __forceinline__ AttVal att_val_zero() {
    AttVal v;
#if MK_KV_I8
#pragma unroll
    for (int i = 0; i < ATT_DPL / 4; ++i) v.w[i] = 0u;
#else
    v.v = vec16{0u, 0u, 0u, 0u};
#endif
    return v;
}
__device__ __forceinline__ float att_val_elem(const AttVal& v, int e) {
#if MK_KV_I8
    return i8_elem(v.w[e >> 2], e & 3);
#else
    const u32 w = e < 2 ? v.v.x : e < 4 ? v.v.y : e < 6 ? v.v.z : v.v.w;
    return (e & 1) ? bf_hi(w) : bf_lo(w);
#endif
}
#if MK_KV_I8
// One warp: a head vector's int8 levels and scale as worker/kv_cache.py quantize_int8 makes them (the largest |x|
// at 127, x times the scale's reciprocal rounded to nearest even); x[j]: element lane + 32 j.
__device__ __forceinline__ float att_quantize(const float (&x)[ATT_NPL], signed char (&q)[ATT_NPL]) {
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < ATT_NPL; ++j) m = fmaxf(m, fabsf(x[j]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float s = __fdiv_rn(m, 127.0f), inv = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
#pragma unroll
    for (int j = 0; j < ATT_NPL; ++j) q[j] = (signed char)(int)fminf(fmaxf(rintf(__fmul_rn(x[j], inv)), -127.0f), 127.0f);
    return s;
}
// One warp: a query (MK_HD floats in shared memory, normed and rotated) rewritten in place as two int8 planes,
// x ~= d (256 q1 + q2) with the largest |x| at 32639 d (15 bits relative to it, as the quantized GEMV's inputs):
// q1 at bytes [0, MK_HD), q2 at [MK_HD, 2 MK_HD), d at byte 2 MK_HD. The scores are then exact integer sums of
// levels times planes (dp4a), scaled once: a query's planes depend on it alone, so every build scores alike.
__device__ __forceinline__ void att_query_planes(float* q) {
    const int lane = tid_x() & 31;
    float x[ATT_NPL], m = 0.0f;
#pragma unroll
    for (int j = 0; j < ATT_NPL; ++j) {
        const int d = lane + 32 * j;
        x[j] = d < MK_HD ? q[d] : 0.0f;
        m = fmaxf(m, fabsf(x[j]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncwarp();  // every lane holds its floats before the planes overwrite them
    const float inv = m > 0.0f ? __fdiv_rn(32639.0f, m) : 0.0f;
    signed char* planes = (signed char*)q;
#pragma unroll
    for (int j = 0; j < ATT_NPL; ++j) {
        const int d = lane + 32 * j;
        if (d >= MK_HD) continue;
        const int x16 = __float2int_rn(x[j] * inv), q1 = (x16 + 128) >> 8;
        planes[d] = (signed char)q1;
        planes[MK_HD + d] = (signed char)(x16 - 256 * q1);
    }
    if (lane == 0) q[MK_HD / 2] = m * (1.0f / 32639.0f);
    __syncwarp();
}
#endif

// One warp: zero-centred RMSNorm of a head (fp32 1+w), then partial rotate-half RoPE at position p, into
// out[0..HD) (fp32 holding bf16 values).
__device__ void norm_rope_head(const bf16_t* src, const float* w1, const float* inv_freq, int p, float* out) {
    const int lane = tid_x() & 31;
    float x[ATT_NPL];
    const float r = rsqrtf(warp_load_sumsq<MK_HD>(src, x) / (float)MK_HD + MK_EPS);
#pragma unroll
    for (int j = 0; j < ATT_NPL; ++j) {
        const int d = lane + 32 * j;
        if (d < MK_HD) out[d] = RBI((x[j] * r) * __ldg(w1 + d));
    }
    __syncwarp();
    float y[ATT_NPL];
    constexpr int half = MK_ROT / 2;
#pragma unroll
    for (int j = 0; j < ATT_NPL; ++j) {
        const int d = lane + 32 * j;
        y[j] = d < MK_HD ? out[d] : 0.0f;
        if (d < MK_ROT) {
            const float f = (float)p * __ldg(inv_freq + (d % half));
            const float c = RBI(cosf(f)), s = RBI(sinf(f));
            const float rot = d < half ? -out[d + half] : out[d - half];
            y[j] = RBI(RBI(y[j] * c) + RBI(rot * s));
        }
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < ATT_NPL; ++j) {
        const int d = lane + 32 * j;
        if (d < MK_HD) out[d] = y[j];
    }
    __syncwarp();
}

// A block's softmax denominator of pair j over its warps (warp order), relative to the block's maximum M.
__device__ __forceinline__ float att_block_den(const float* wm, const float* wl, int j, float M) {
    float v = 0.0f;
    for (int w = 0; w < MK_NWARPS; ++w) {
        const float mw = wm[w * MK_ATT_PAIRS + j];
        if (mw != -MK_INF) v += wl[w * MK_ATT_PAIRS + j] * exp2f(mw - M);
    }
    return v;
}

// The attention output of one value: normalised, times the sigmoid of its gate.
__device__ __forceinline__ bf16_t att_gated(float num, float den, float gate) {
    return f2bf(RBI(num / den) * RBI(sigmoid_f(gate)));
}

// Flash-decoding chunks of the context at this step (the launch's last token included).
__device__ __forceinline__ int att_chunks(const StepInfo& si) {
    return (si.pos + MK_NT + MK_ATT_CHUNK - 1) / MK_ATT_CHUNK;
}

// How a step's attention is cut into work items. Mirrors kernels/plan.py `att_split` (the plan's tests pin the
// rule): pairs per item, the fewest (at most MK_ATT_PAIRS) whose one-chunk items still fit the grid (a block's time
// grows with its pairs while other blocks idle); when the chunks alone overfill the grid, splits of 2^k chunks with
// k the one that gives the busiest block the fewest chunks (ties: the larger k, fewer items). Results do not
// depend on it (the tree above).
struct AttSplit {
    int np;      // (query head, token) pairs per item
    int passes;  // passes of np pairs over a key/value head's MK_GQ_PAIRS
    int k;       // log2 of the chunks per split
    int splits;  // splits per key/value head
};
__device__ __forceinline__ AttSplit att_split(const StepInfo& si) {
    const int nch = att_chunks(si), nb = nblocks();
    AttSplit a;
    const int fit = max(1, nb / (MK_KVH * nch));  // passes per (key/value head, chunk) the grid holds
    a.np = min(MK_ATT_PAIRS, (MK_GQ_PAIRS + fit - 1) / fit);
    a.passes = (MK_GQ_PAIRS + a.np - 1) / a.np;
    a.k = 0;
    a.splits = nch;
    if (MK_KVH * nch * a.passes <= nb && nch <= (1 << MK_ATT_FOLD_LEVELS)) return a;
    int best = 0x7fffffff;
    for (int k = 0; k <= MK_ATT_SPLIT_LOG; ++k) {
        const int s = (nch + (1 << k) - 1) >> k;
        if (s > (1 << MK_ATT_FOLD_LEVELS)) continue;
        const int load = ((MK_KVH * a.passes * s + nb - 1) / nb) << k;
        if (load <= best) best = load, a.k = k, a.splits = s;
    }
    return a;
}

// Work items of the attention phase at this step; blocks [items, grid) have none.
__device__ __forceinline__ int att_items(const AttSplit& a) { return MK_KVH * a.splits * a.passes; }

// One node of the tree for one value: the pair's maximum score m in log2 units (-inf: no key), its sum l, the
// value's output a.
struct AttNode {
    float m, l, a;
};
// left then right; an empty side returns the other unchanged, so empty subtrees past a pair's position (or past
// the context) leave its bits alone.
__device__ __forceinline__ AttNode att_join(const AttNode& x, const AttNode& y) {
    if (y.m == -MK_INF) return x;
    if (x.m == -MK_INF) return y;
    const float M = fmaxf(x.m, y.m), fx = exp2f(x.m - M), fy = exp2f(y.m - M);
    return AttNode{M, fmaf(x.l, fx, y.l * fy), fmaf(x.a, fx, y.a * fy)};
}
// A binary counter of subtree roots: leaf i (0-based, in order) joins the complete subtrees it closes.
template <int LV>
__device__ __forceinline__ void att_push(AttNode (&stk)[LV], int i, AttNode node) {
    bool placed = false;
#pragma unroll
    for (int lv = 0; lv < LV; ++lv) {
        if (placed) continue;
        if ((i >> lv) & 1) {
            node = att_join(stk[lv], node);
        } else {
            stk[lv] = node;
            placed = true;
        }
    }
}
// The root over n leaves pushed (the missing leaves of the last subtree are empty).
template <int LV>
__device__ __forceinline__ AttNode att_root(const AttNode (&stk)[LV], int n) {
    AttNode node{-MK_INF, 0.0f, 0.0f};
#pragma unroll
    for (int lv = 0; lv < LV; ++lv)
        if ((n >> lv) & 1) node = att_join(stk[lv], node);
    return node;
}

// The last split item of a (key/value head, pass): each thread folds its values' split roots in split order up
// the tree (8 splits' loads in flight), gates and writes the attention output.
__device__ __noinline__ void att_fold(const Tables& tb, int kvh, int pass, int np, int nsplit, int maxch) {
    const int tid = tid_x();
    const bf16_t* qkv = tb.gp<const bf16_t>(G_QKV_ATT);
    const float* part = tb.gp<const float>(G_ATT_PART);
    bf16_t* att_out = tb.gp<bf16_t>(G_ATT_OUT);
    const long long sstride = (long long)MK_GQ_PAIRS * (MK_HD + 2);  // floats between splits of one pair
    for (int e = tid; e < np * MK_HD; e += MK_THREADS) {
        const int j = e / MK_HD, d = e - j * MK_HD, pp = pass * np + j;
        if (pp >= MK_GQ_PAIRS) continue;
        const float* pb = part + ((long long)kvh * maxch * MK_GQ_PAIRS + pp) * (MK_HD + 2);
        AttNode stk[MK_ATT_FOLD_LEVELS + 1];
#pragma unroll
        for (int lv = 0; lv <= MK_ATT_FOLD_LEVELS; ++lv) stk[lv] = AttNode{-MK_INF, 0.0f, 0.0f};
        for (int s0 = 0; s0 < nsplit; s0 += 8) {
            AttNode v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const float* q = pb + (s0 + u) * sstride;
                v[u] = s0 + u < nsplit ? AttNode{ld_cg_f(q + MK_HD), ld_cg_f(q + MK_HD + 1), ld_cg_f(q + d)}
                                       : AttNode{-MK_INF, 0.0f, 0.0f};
            }
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (s0 + u < nsplit) att_push(stk, s0 + u, v[u]);
        }
        const AttNode r = att_root(stk, nsplit);
        const int g = pp / MK_NT, t = pp - g * MK_NT, hq = kvh * MK_GQ + g;
        const float gate = bf2f(ld_cg_bf(qkv + t * MK_ATT_IN_ROWS + hq * 2 * MK_HD + MK_HD + d));
        att_out[t * MK_AD + hq * MK_HD + d] = att_gated(r.a, r.l, gate);
    }
}

// The phase with items of np <= NP pairs (NP sizes the per-lane accumulators and the per-thread tree stacks; shared
// memory keeps the MK_ATT_PAIRS strides).
template <int NP>
__device__ bool attention_items(const Tables& tb, const StepInfo& si, int layer, float* scratch, bf16_t* xs, int* s_last,
                                const AttSplit& sp) {
    // Values (pair, head dim) a thread keeps a tree stack for, and the stack's levels (a split's 2^k chunks).
    constexpr int VPT = (NP * MK_HD + MK_THREADS - 1) / MK_THREADS;
    constexpr int LV = MK_ATT_SPLIT_LOG + 1;
    const int tid = tid_x(), lane = tid & 31, warp = tid >> 5;
    const int pos = si.pos, L = pos + MK_NT;
    const int np = sp.np;
    const int maxch = (int)tb.gi(G_ATT_CHUNKS);  // room in the partials buffer (the host sizes it by capacity)
    const int cl = MK_ATT_CHUNK;
    const int nch = (L + cl - 1) / cl;  // att_chunks(si), from the position already read
    const long long cap = tb.li(layer, L_KV_CAP);  // this cache's per-head stride
    const bf16_t* qkv = tb.gp<const bf16_t>(G_QKV_ATT);
    const float* inv_freq = tb.gp<const float>(G_INV_FREQ);
    float* part = tb.gp<float>(G_ATT_PART);
    bf16_t* att_out = tb.gp<bf16_t>(G_ATT_OUT);
    kv_t* kc = tb.lp<kv_t>(layer, L_KCACHE);
    kv_t* vc = tb.lp<kv_t>(layer, L_VCACHE);
#if MK_KV_I8
    float* ksc = tb.lp<float>(layer, L_KSCALE);  // [nKV, capacity]
    float* vsc = tb.lp<float>(layer, L_VSCALE);
#endif
    const float* qn_w = tb.lp<const float>(layer, L_QNORM);
    const float* kn_w = tb.lp<const float>(layer, L_KNORM);
    const float cs = rsqrtf((float)MK_HD) * 1.44269504088896341f;  // the softmax scale times log2(e)
    const int grp = (tid & 31) / ATT_KL, sub = (tid & 31) % ATT_KL;  // the lane's position in a step, its dims

    float* qsm = scratch;                          // [PAIRS][HD]
    float* accs = qsm + MK_ATT_PAIRS * MK_HD;      // [MACC][PAIRS][HD]
    float* wm = accs + MK_ATT_MACC * MK_ATT_PAIRS * MK_HD;  // [NWARPS][PAIRS]
    float* wl = wm + MK_NWARPS * MK_ATT_PAIRS;     // [NWARPS][PAIRS]
    float* knew = wl + MK_NWARPS * MK_ATT_PAIRS;   // [NT][HD]
    float* tml = knew + MK_NT * MK_HD;             // [SPLIT_LOG + 1][PAIRS][2]: the split tree's (m, l) per level
    // [NT][2][HD]: the new positions' key and value as cached, in the GEMV input's buffer (free in this phase);
    // int8: their scales after them, [NT][2].
    kv_t* kvnew = (kv_t*)xs;
#if MK_KV_I8
    float* kvs = (float*)(kvnew + MK_NT * 2 * MK_HD);
#endif

    bool any = false;
    const int passes = sp.passes, nsplit = sp.splits;
    for (int item = bid_x(); item < MK_KVH * nsplit * passes; item += nblocks()) {
        any = true;
        const int kvh = item / (nsplit * passes), rest = item - kvh * nsplit * passes;
        const int s = rest / passes, pass = rest - s * passes;
        const int c0 = s << sp.k, c1 = min(nch, c0 + (1 << sp.k));
        const int q0 = c0 * cl, q1 = min(L, c1 * cl);  // the split's positions
        kv_t* kh = kc + (long long)kvh * cap * MK_HD;
        kv_t* vh = vc + (long long)kvh * cap * MK_HD;
#if MK_KV_I8
        float* ksh = ksc + (long long)kvh * cap;
        float* vsh = vsc + (long long)kvh * cap;
#endif
        // New positions of this split: normed, rotated key and raw value. Every pass's item of the split computes
        // them into shared memory and attends to them there, so that none waits for another block; only the pass-0
        // item writes them to the cache (for later launches). The last warps take a token each (the first np warps
        // normalise the queries meanwhile).
        const int kv_warps = max(1, MK_NWARPS - np), kw = MK_NWARPS - 1 - warp;
        if (kw < kv_warps) {
            for (int t = kw; t < MK_NT; t += kv_warps) {
                const int p = pos + t;
                if (p < q0 || p >= q1) continue;
                const bf16_t* row = qkv + t * MK_ATT_IN_ROWS;
                bf16_t vv[ATT_NPL];  // the value row, loaded beside the key's (the stores below could alias it)
#pragma unroll
                for (int j = 0; j < ATT_NPL; ++j) {
                    const int d = lane + 32 * j;
                    vv[j] = d < MK_HD ? ld_cg_bf(row + MK_ATT_QROWS + MK_KVROWS + kvh * MK_HD + d) : (bf16_t)0;
                }
                float* kt = knew + t * MK_HD;
                norm_rope_head(row + MK_ATT_QROWS + kvh * MK_HD, kn_w, inv_freq, p, kt);
                kv_t* kv = kvnew + t * 2 * MK_HD;
#if MK_KV_I8
                // The key as the model's dtype holds it, then both vectors quantized.
                float xk[ATT_NPL], xv[ATT_NPL];
#pragma unroll
                for (int j = 0; j < ATT_NPL; ++j) {
                    const int d = lane + 32 * j;
                    xk[j] = d < MK_HD ? bf2f(f2bf(kt[d])) : 0.0f;
                    xv[j] = bf2f(vv[j]);
                }
                signed char lk[ATT_NPL], lv[ATT_NPL];
                const float sk = att_quantize(xk, lk), sv = att_quantize(xv, lv);
#pragma unroll
                for (int j = 0; j < ATT_NPL; ++j) {
                    const int d = lane + 32 * j;
                    if (d >= MK_HD) continue;
                    kv[d] = lk[j];
                    kv[MK_HD + d] = lv[j];
                    if (pass == 0) {
                        kh[(long long)p * MK_HD + d] = lk[j];
                        vh[(long long)p * MK_HD + d] = lv[j];
                    }
                }
                if (lane == 0) {
                    kvs[t * 2] = sk, kvs[t * 2 + 1] = sv;
                    if (pass == 0) ksh[p] = sk, vsh[p] = sv;
                }
#else
#pragma unroll
                for (int j = 0; j < ATT_NPL; ++j) {
                    const int d = lane + 32 * j;
                    if (d >= MK_HD) continue;
                    const bf16_t kb = f2bf(kt[d]);
                    kv[d] = kb;
                    kv[MK_HD + d] = vv[j];
                    if (pass == 0) {
                        kh[(long long)p * MK_HD + d] = kb;
                        vh[(long long)p * MK_HD + d] = vv[j];
                    }
                }
#endif
                __syncwarp();
            }
        }
        if (warp < np) {
            const int pp = pass * np + warp;
            if (pp < MK_GQ_PAIRS) {
                const int g = pp / MK_NT, t = pp - g * MK_NT, hq = kvh * MK_GQ + g;
                norm_rope_head(qkv + t * MK_ATT_IN_ROWS + hq * 2 * MK_HD, qn_w, inv_freq, pos + t, qsm + warp * MK_HD);
#if MK_KV_I8
                att_query_planes(qsm + warp * MK_HD);
#endif
            }
        }
        __syncthreads();  // queries and the new keys and values ready
        const bool active = lane * ATT_DPL < MK_HD;
        int lastpos[NP];
#pragma unroll
        for (int j = 0; j < NP; ++j) {
            const int pp = pass * np + j;
            lastpos[j] = j < np && pp < MK_GQ_PAIRS ? pos + (pp % MK_NT) : -1;  // causal: keys 0..pos+t
        }
        // The split's tree stack: each value's output per level in this thread's registers, each pair's (m, l) per
        // level in shared memory (tml, written by the pair's thread of head dim 0; the same for all its values).
        float sa[VPT][LV];
#pragma unroll
        for (int v = 0; v < VPT; ++v)
#pragma unroll
            for (int lv = 0; lv < LV; ++lv) sa[v][lv] = 0.0f;
        for (int c = c0; c < c1; ++c) {
            const int p0 = c * cl, p1 = min(L, p0 + cl);
            // The next chunk of the split starts towards L2 while this one is used (the barrier before the phase
            // started the first).
            if (tid == 0 && c + 1 < c1) {
                const int n = min(L, p1 + cl) - p1, bytes = n * MK_HD * (int)sizeof(kv_t);
                const char* kn = (const char*)(kh + (long long)p1 * MK_HD);
                const char* vn = (const char*)(vh + (long long)p1 * MK_HD);
                for (int off = 0; off < bytes; off += MK_PF_PIECE) {
                    const unsigned m = (unsigned)min(bytes - off, MK_PF_PIECE);
                    prefetch_l2_bytes(kn + off, m);
                    prefetch_l2_bytes(vn + off, m);
                }
#if MK_KV_I8
                prefetch_l2_span(ksh + p1, n * 4);
                prefetch_l2_span(vsh + p1, n * 4);
#endif
            }
            // The queries stay in shared memory (qsm): registers go to the accumulators and the loads in flight.
            // l is per lane: the sum of its position group's weights (the groups' sums add up after the chunk).
            float acc[NP][ATT_DPL], m[NP], l[NP];
#if MK_KV_I8
            float qd[NP];  // the queries' plane scales (att_query_planes; unused pairs' are never read back)
#pragma unroll
            for (int j = 0; j < NP; ++j) qd[j] = qsm[j * MK_HD + MK_HD / 2];
#endif
#pragma unroll
            for (int j = 0; j < NP; ++j) {
                m[j] = -MK_INF;
                l[j] = 0.0f;
#pragma unroll
                for (int e = 0; e < ATT_DPL; ++e) acc[j][e] = 0.0f;
            }
            // A warp step takes ATT_PW consecutive positions (warp w: p0 + w * ATT_PW + i * ATT_PW * MK_NWARPS,
            // fixed by the chunk, so a pair's sums do not depend on the context length); positions of this launch
            // come from shared memory, earlier ones from the cache. Past the chunk a lane loads the chunk's last
            // position instead (finite values under a weight of 0).
            constexpr int GS = ATT_PW * MK_NWARPS;
            // `ks`, `vs`: the key's and the value's scales (int8; bf16 leaves them 1). The value's is the lane's own
            // position's: its weight takes it before the shuffles that hand the weights to every lane.
            auto load_k = [&](int q, AttKey (&k)[ATT_NPC], float& ks, float& vs) {
                q = min(q, p1 - 1);
                ks = vs = 1.0f;
                if (q >= pos) {
                    const kv_t* src = kvnew + (q - pos) * 2 * MK_HD + sub * ATT_PB;
#pragma unroll
                    for (int i = 0; i < ATT_NPC; ++i) k[i] = att_ld_key(src + ATT_KL * ATT_PB * i, true);
#if MK_KV_I8
                    ks = kvs[(q - pos) * 2];
                    vs = kvs[(q - pos) * 2 + 1];
#endif
                } else {
                    // interleaved pieces: the loads of a position's lanes are contiguous
                    const kv_t* src = kh + (long long)q * MK_HD + sub * ATT_PB;
#pragma unroll
                    for (int i = 0; i < ATT_NPC; ++i) k[i] = att_ld_key(src + ATT_KL * ATT_PB * i, false);
#if MK_KV_I8
                    ks = ld_cg_f(ksh + q);
                    vs = ld_cg_f(vsh + q);
#endif
                }
            };
            auto load_v = [&](int q, AttVal& v) {
                q = min(q, p1 - 1);
#if MK_KV_I8
                if (q >= pos) {
                    const uint2 w = *(const uint2*)(kvnew + (q - pos) * 2 * MK_HD + MK_HD + lane * ATT_DPL);
                    v.w[0] = w.x, v.w[1] = w.y;
                } else {
                    const uint2 w = __ldcg((const uint2*)(vh + (long long)q * MK_HD + lane * ATT_DPL));
                    v.w[0] = w.x, v.w[1] = w.y;
                }
#else
                v.v = q >= pos ? ld_shared16(kvnew + (q - pos) * 2 * MK_HD + MK_HD + lane * ATT_DPL)
                               : ld_cg16(vh + (long long)q * MK_HD + lane * ATT_DPL);
#endif
            };
            // One step over the positions p..p + ATT_PW - 1 from the keys in kg; the values load at its start (the
            // scores' work covers them), the keys a step ahead.
            auto att_step = [&](int p, const AttKey (&kg)[ATT_NPC], float ks, float vs) {
                AttVal vg[ATT_PW];
#pragma unroll
                for (int i = 0; i < ATT_PW; ++i) {
                    vg[i] = att_val_zero();
                    if (active) load_v(p + i, vg[i]);
                }
                // Every pair's partial score of the lane's position (its ATT_DQ dims), then a log2(ATT_KL)-level
                // butterfly within the position's lanes: each of them ends with the same bits (additions commute).
                float sc[NP];
#if MK_KV_I8
                // Exact integer sums of the key's levels times the query's two planes (att_query_planes), scaled once.
                int t1[NP], t2[NP];
#pragma unroll
                for (int j = 0; j < NP; ++j) t1[j] = t2[j] = 0;
#pragma unroll
                for (int i = 0; i < ATT_NPC; ++i) {
#pragma unroll
                    for (int j = 0; j < NP; ++j) {
                        const signed char* qj = (const signed char*)(qsm + j * MK_HD) + (sub + ATT_KL * i) * ATT_PB;
                        u32 qa[ATT_PB / 4], qb[ATT_PB / 4];  // the piece's words of each plane
                        if constexpr (ATT_PB == 8) {
                            ld_shared8(qj, qa[0], qa[1]);
                            ld_shared8(qj + MK_HD, qb[0], qb[1]);
                        } else {
                            qa[0] = ld_shared4(qj);
                            qb[0] = ld_shared4(qj + MK_HD);
                        }
#pragma unroll
                        for (int w = 0; w < ATT_PB / 4; ++w) {
                            t1[j] = __dp4a((int)kg[i].w[w], (int)qa[w], t1[j]);
                            t2[j] = __dp4a((int)kg[i].w[w], (int)qb[w], t2[j]);
                        }
                    }
                }
                int ti[NP];
#pragma unroll
                for (int j = 0; j < NP; ++j) ti[j] = t1[j] * 256 + t2[j];
#pragma unroll
                for (int o = 1; o < ATT_KL; o <<= 1)
#pragma unroll
                    for (int j = 0; j < NP; ++j) ti[j] += __shfl_xor_sync(0xffffffffu, ti[j], o);
#pragma unroll
                for (int j = 0; j < NP; ++j) sc[j] = (float)ti[j] * (qd[j] * ks);
#else
#pragma unroll
                for (int j = 0; j < NP; ++j) sc[j] = 0.0f;
#pragma unroll
                for (int i = 0; i < ATT_NPC; ++i) {
                    float kf[ATT_PB];
#pragma unroll
                    for (int e = 0; e < ATT_PB; ++e) kf[e] = att_key_elem(kg[i], e);
#pragma unroll
                    for (int j = 0; j < NP; ++j) {
                        const float* qj = qsm + j * MK_HD + (sub + ATT_KL * i) * ATT_PB;
                        float qf[ATT_PB];  // 16-byte shared loads (the compiler cannot see the alignment)
#pragma unroll
                        for (int e = 0; e < ATT_PB; e += 4) {
                            const vec16 q4 = ld_shared16(qj + e);
                            qf[e] = __uint_as_float(q4.x), qf[e + 1] = __uint_as_float(q4.y);
                            qf[e + 2] = __uint_as_float(q4.z), qf[e + 3] = __uint_as_float(q4.w);
                        }
#pragma unroll
                        for (int e = 0; e < ATT_PB; ++e) sc[j] = fmaf(qf[e], kf[e], sc[j]);
                    }
                }
#pragma unroll
                for (int o = 1; o < ATT_KL; o <<= 1)
#pragma unroll
                    for (int j = 0; j < NP; ++j) sc[j] += __shfl_xor_sync(0xffffffffu, sc[j], o);
#endif
                const int q = p + grp;  // the lane's position
                // Each pair's weights of the step's positions and its rescale; a pair whose query precedes the step
                // keeps weights 0 and rescale 1, which leave its sums exactly as they are (they are never -0).
                float w[NP][ATT_PW], corr[NP];
#pragma unroll
                for (int j = 0; j < NP; ++j) {
                    corr[j] = 1.0f;
#pragma unroll
                    for (int i = 0; i < ATT_PW; ++i) w[j][i] = 0.0f;
                    if (p > lastpos[j]) continue;  // warp-uniform; so are the later steps' tests
                    // Scores in log2 units (exp2 is one MUFU); no key: weight 0 exactly.
                    const float x = q <= lastpos[j] && q < p1 ? sc[j] * cs : -MK_INF;
                    float smax = x;
#pragma unroll
                    for (int o = ATT_KL; o < 32; o <<= 1) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));
                    const float mn = fmaxf(m[j], smax);
                    corr[j] = exp2f(m[j] - mn);
                    const float wx = exp2f(x - mn);  // one exp per position group (ATT_KL lanes), not per lane
                    l[j] = fmaf(l[j], corr[j], wx);
                    const float wv = wx * vs;  // the product each lane would form after the shuffle
#pragma unroll
                    for (int i = 0; i < ATT_PW; ++i)  // from each position's first lane
                        w[j][i] = __shfl_sync(0xffffffffu, wv, i * ATT_KL);
                    m[j] = mn;
                }
                // Each value element is converted once for all pairs, not once per pair (an int8 element costs a
                // byte permute and an add); each pair's sums are the same operations in the same order.
#pragma unroll
                for (int e = 0; e < ATT_DPL; ++e) {
                    float x[ATT_PW];
#pragma unroll
                    for (int i = 0; i < ATT_PW; ++i) x[i] = att_val_elem(vg[i], e);
#pragma unroll
                    for (int j = 0; j < NP; ++j) {
                        float u = w[j][0] * x[0];
#pragma unroll
                        for (int i = 1; i < ATT_PW; ++i) u = fmaf(w[j][i], x[i], u);
                        acc[j][e] = fmaf(acc[j][e], corr[j], u);
                    }
                }
            };
            AttKey kr[ATT_NPC];
            float krs, vrs;
            load_k(p0 + warp * ATT_PW + grp, kr, krs, vrs);
            for (int p = p0 + warp * ATT_PW; p < p1; p += GS) {
                AttKey kg[ATT_NPC];  // this step's keys (kr refills with the next step's)
#pragma unroll
                for (int i = 0; i < ATT_NPC; ++i) kg[i] = kr[i];
                const float kgs = krs, vgs = vrs;
                load_k(p + GS + grp, kr, krs, vrs);
                att_step(p, kg, kgs, vgs);
            }
            // The warp's sum per pair: its position groups' sums by a butterfly (every lane the same bits).
#pragma unroll
            for (int o = ATT_KL; o < 32; o <<= 1)
#pragma unroll
                for (int j = 0; j < NP; ++j) l[j] += __shfl_xor_sync(0xffffffffu, l[j], o);
            // The chunk's partial: the warps merged in warp order (deterministic).
            if (lane == 0) {
#pragma unroll
                for (int j = 0; j < NP; ++j) {
                    wm[warp * MK_ATT_PAIRS + j] = m[j];
                    wl[warp * MK_ATT_PAIRS + j] = l[j];
                }
            }
            __syncthreads();
            float M[NP];
#pragma unroll
            for (int j = 0; j < NP; ++j) {
                M[j] = -MK_INF;
                for (int w = 0; w < MK_NWARPS; ++w) M[j] = fmaxf(M[j], wm[w * MK_ATT_PAIRS + j]);
            }
            // MK_ATT_MACC warps at a time, each into its own accumulator (warp w into w % MK_ATT_MACC, in warp order).
            for (int w0 = 0; w0 < MK_NWARPS; w0 += MK_ATT_MACC) {
                if (warp >= w0 && warp < w0 + MK_ATT_MACC && active) {
                    float* ab = accs + (warp - w0) * MK_ATT_PAIRS * MK_HD;
#pragma unroll
                    for (int j = 0; j < NP; ++j) {
                        const float f = (m[j] == -MK_INF) ? 0.0f : exp2f(m[j] - M[j]);
#pragma unroll
                        for (int e = 0; e < ATT_DPL; ++e) {
                            const int d = j * MK_HD + lane * ATT_DPL + e;
                            ab[d] = (w0 == 0 ? 0.0f : ab[d]) + acc[j][e] * f;
                        }
                    }
                }
                __syncthreads();
            }
            // The chunk's leaf joins the split's tree (a binary counter: leaf i joins the complete subtrees it closes).
            const int i = c - c0;
#pragma unroll
            for (int v = 0; v < VPT; ++v) {
                const int e = tid + v * MK_THREADS, j = e / MK_HD;
                if (e >= np * MK_HD) continue;
                float Mj = -MK_INF;
                for (int w = 0; w < MK_NWARPS; ++w) Mj = fmaxf(Mj, wm[w * MK_ATT_PAIRS + j]);
                float a = accs[e];  // the accumulators' sum in order (the first round writes each of them)
#pragma unroll
                for (int b = 1; b < MK_ATT_MACC; ++b) a += accs[b * MK_ATT_PAIRS * MK_HD + e];
                AttNode node{Mj, Mj == -MK_INF ? 0.0f : att_block_den(wm, wl, j, Mj), a};
                bool placed = false;
#pragma unroll
                for (int lv = 0; lv < LV; ++lv) {
                    if (placed) continue;
                    float* ml = tml + (lv * MK_ATT_PAIRS + j) * 2;
                    if ((i >> lv) & 1) {
                        node = att_join(AttNode{ml[0], ml[1], sa[v][lv]}, node);
                    } else {
                        sa[v][lv] = node.a;
                        if (e == j * MK_HD) ml[0] = node.m, ml[1] = node.l;
                        placed = true;
                    }
                }
            }
            __syncthreads();  // wm, wl, accs and tml are read before the next chunk writes them
        }
        // The split's root per value: the output itself when one split covers the context, else a partial for the fold.
#pragma unroll
        for (int v = 0; v < VPT; ++v) {
            const int e = tid + v * MK_THREADS, j = e / MK_HD, d = e - j * MK_HD, pp = pass * np + j;
            if (e >= np * MK_HD || pp >= MK_GQ_PAIRS) continue;
            AttNode r{-MK_INF, 0.0f, 0.0f};  // the root over the split's chunks (a partial last subtree: empty leaves)
#pragma unroll
            for (int lv = 0; lv < LV; ++lv) {
                const float* ml = tml + (lv * MK_ATT_PAIRS + j) * 2;
                if (((c1 - c0) >> lv) & 1) r = att_join(AttNode{ml[0], ml[1], sa[v][lv]}, r);
            }
            if (nsplit == 1) {
                const int g = pp / MK_NT, t = pp - g * MK_NT, hq = kvh * MK_GQ + g;
                const float gate = bf2f(ld_cg_bf(qkv + t * MK_ATT_IN_ROWS + hq * 2 * MK_HD + MK_HD + d));
                att_out[t * MK_AD + hq * MK_HD + d] = att_gated(r.a, r.l, gate);
            } else {
                float* q = part + (((long long)kvh * maxch + s) * MK_GQ_PAIRS + pp) * (MK_HD + 2);
                q[d] = r.a;
                if (d == 0) {
                    q[MK_HD] = r.m;
                    q[MK_HD + 1] = r.l;
                }
            }
        }
        if (nsplit == 1) {
            __syncthreads();  // the scratch is read before the next item writes it
            continue;
        }
        // Arrival: the last of the splits of this (key/value head, pass) folds its pairs over all of them.
        __threadfence();
        __syncthreads();
        u64* arrivals = tb.sync + MK_SYNC_ARRIVALS + kvh * MK_GQ_PAIRS + pass;
        if (tid == 0) {
            const u64 prev = atomicAdd(arrivals, 1ull);
            *s_last = (prev == (u64)(nsplit - 1));
        }
        __syncthreads();
        if (*s_last) {
            __threadfence();
            att_fold(tb, kvh, pass, np, nsplit, maxch);
            if (tid == 0) atomicExch(arrivals, 0ull);
        }
        __syncthreads();
    }
    return any;
}

// Short context gives items of one pair (att_split): that case compiles on its own, with one pair's
// accumulators, the rest with MK_ATT_PAIRS'.
__device__ __noinline__ bool phase_attention(const Tables& tb, const StepInfo& si, int layer, float* scratch, bf16_t* xs,
                                int* s_last) {
    const AttSplit sp = att_split(si);
    if (sp.np == 1) return attention_items<1>(tb, si, layer, scratch, xs, s_last, sp);
    return attention_items<MK_ATT_PAIRS>(tb, si, layer, scratch, xs, s_last, sp);
}

// At the barrier before the DeltaNet / attention phase (thread 0): inputs of the phase start towards L2, ahead
// of the output projection's first weights, so that its loads (a chain of round trips in a few blocks) find them
// there. DeltaNet: the block's first item's share of its head's state, as contiguous rows (the item itself
// reads a column slice of every row; its sibling items' blocks prefetch the other rows). Attention: the first chunk
// of keys and values of the block's first item (only that: at long context every item's chunks would exceed L2
// and evict the weights prefetched beside them; the item brings each next chunk itself). L2 is coherent with the new positions' stores.
__device__ void prefetch_mixer_inputs(const Tables& tb, const StepInfo& si, int phase, int layer) {
    if (tid_x() != 0) return;
    if (phase == PH_DN_REC) {
        const char* S = (const char*)tb.lp<const float>(layer, L_REC_STATE);
        constexpr int head_bytes = MK_DK * MK_DV * 4, piece = head_bytes / MK_DN_SPLIT;
        const int item = bid_x();
        if (item >= dn_rec_items()) return;
        const char* base = S + (long long)(item / MK_DN_SPLIT) * head_bytes + (item % MK_DN_SPLIT) * piece;
        for (int off = 0; off < piece; off += MK_PF_PIECE)
            prefetch_l2_bytes(base + off, (unsigned)min(piece - off, MK_PF_PIECE));
    } else if (phase == PH_ATT) {
        const int L = si.pos + MK_NT;
        const AttSplit sp = att_split(si);
        const long long cap = tb.li(layer, L_KV_CAP);
        const char* kc = (const char*)tb.lp<const kv_t>(layer, L_KCACHE);
        const char* vc = (const char*)tb.lp<const kv_t>(layer, L_VCACHE);
        const int item = bid_x();
        if (item >= att_items(sp)) return;
        const int kvh = item / (sp.splits * sp.passes), c = ((item - kvh * sp.splits * sp.passes) / sp.passes) << sp.k;
        const int p0 = c * MK_ATT_CHUNK, n = min(L, p0 + MK_ATT_CHUNK) - p0;
        const int bytes = n * MK_HD * (int)sizeof(kv_t);
        const long long start = ((long long)kvh * cap + p0) * MK_HD * (int)sizeof(kv_t);
        for (int off = 0; off < bytes; off += MK_PF_PIECE) {
            const unsigned m = (unsigned)min(bytes - off, MK_PF_PIECE);
            prefetch_l2_bytes(kc + start + off, m);
            prefetch_l2_bytes(vc + start + off, m);
        }
#if MK_KV_I8
        prefetch_l2_span(tb.lp<const float>(layer, L_KSCALE) + kvh * cap + p0, n * 4);
        prefetch_l2_span(tb.lp<const float>(layer, L_VSCALE) + kvh * cap + p0, n * 4);
#endif
    }
}
