// Shared device helpers of the decode megakernel: types, bf16 rounding, cache-hinted loads, reductions,
// and the watchdog-bounded grid barrier.
//
// No system or CUDA headers on purpose: the same text compiles under nvcc and under NVRTC without an
// include path, so the run-time build does not depend on where the CUDA headers live.
#pragma once

typedef unsigned short bf16_t;  // raw bfloat16 bits
typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(16) vec16 {  // 16 bytes: 8 bf16
    u32 x, y, z, w;
};

#ifndef MK_FP32_ACT
#define MK_FP32_ACT 1  // 1: fp32 residual stream and logits, intermediates rounded to bf16 once; 0: bf16 everywhere
#endif


#define MK_WARP 32
#define MK_NWARPS (MK_THREADS / MK_WARP)
#define MK_INF __int_as_float(0x7f800000)

// Thread/block indices read through volatile asm: the megakernel's step loop runs every phase, and
// with plain threadIdx the compiler hoisted each phase's index arithmetic out of the loop, holding it in
// registers across all phases until the GEMV loops spilled. Re-reading the special registers is free.
__device__ __forceinline__ int tid_x() {
    int r;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r));
    return r;
}
__device__ __forceinline__ int bid_x() {
    int r;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(r));
    return r;
}
__device__ __forceinline__ int nblocks() {
    int r;
    asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(r));
    return r;
}

// ---- bf16 <-> fp32 -----------------------------------------------------------------------------
__device__ __forceinline__ float bf2f(bf16_t b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ float bf_lo(u32 p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float bf_hi(u32 p) { return __uint_as_float(p & 0xffff0000u); }

// Round to nearest even, as torch's float -> bfloat16 conversion does: the sm_80 conversion instruction (one
// instruction where the integer rounding takes six; every block runs the norm prologues' conversions for every
// token). NaN stays NaN (the canonical 0x7fff).
__device__ __forceinline__ bf16_t f2bf(float f) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
// Two values rounded and packed in one instruction: lo in the low half (the lower address), hi in the high half.
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// The value a bf16 tensor would hold: every intermediate that the reference keeps in bf16 goes through this.
__device__ __forceinline__ float rbf(float f) { return bf2f(f2bf(f)); }
// Intermediate roundings of the bf16 reference's numerics. MK_FP32_ACT builds keep these values in fp32 (closer
// to the fp32 reference: the stored buffers are then rounded once, where they are written).
#if MK_FP32_ACT
#define RBI(x) (x)
#else
#define RBI(x) rbf(x)
#endif

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
// With the fast exponential and division (a few ulp in fp32, then rounded to bf16): for the DeltaNet gated norm, which
// every block computes for every token and value (the precise one made that prologue compute-bound: 10 us at T = 4).
__device__ __forceinline__ float silu_fast(float x) { return __fdividef(x, 1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch.nn.functional.softplus with beta 1, threshold 20.
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// ---- loads ---------------------------------------------------------------------------------------
// Weights are read once per step: stream them (evict-first, no L1 allocation), 16 bytes per lane.
__device__ __forceinline__ vec16 ld_stream16(const void* p) {
    vec16 r;
    asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
// ---- asynchronous global -> shared copies (sm_80+), for the GEMV's shared-memory weight ring -------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
// 16 bytes from shared memory through an explicit shared load. The GEMV's operands (the weight ring, the staged
// input) reach its loop as generic pointers, which the compiler turned into generic loads (LD.E): this names the
// state space, so they issue as LDS.
__device__ __forceinline__ vec16 ld_shared16(const void* p) {
    vec16 r;
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
    return r;
}
__device__ __forceinline__ u32 ld_shared4(const void* p) {
    u32 r;
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a));
    return r;
}
__device__ __forceinline__ void ld_shared8(const void* p, u32& x, u32& y) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(x), "=r"(y) : "r"(a));
}
__device__ __forceinline__ void st_shared16(void* p, const vec16& v) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// An L2 policy that evicts streamed weights first (what the .cs register loads ask for).
__device__ __forceinline__ u64 evict_first_policy() {
    u64 pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
// 16 bytes from global `src` to shared `dst_smem` (a shared-window address), bypassing L1; registers stay free.
__device__ __forceinline__ void cp_async16(u32 dst_smem, const void* src, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst_smem), "l"(src), "l"(policy)
                 : "memory");
}
// The same for data written earlier in this launch (activations): L2 only, no eviction hint.
__device__ __forceinline__ void cp_async16_l2(u32 dst_smem, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst_smem), "l"(src) : "memory");
}
// 4 or 8 bytes (the quantized GEMV's scale and high-bit planes): the small copies go through L1 (.ca is the only
// form for them); the hint still marks the lines evict-first in L2.
template <int N>
__device__ __forceinline__ void cp_async_small(u32 dst_smem, const void* src, u64 policy) {
    static_assert(N == 4 || N == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], %2, %3;" ::"r"(dst_smem), "l"(src), "n"(N),
                 "l"(policy)
                 : "memory");
}
// The same copies where `ok` alone (a predicated instruction, no branch; elsewhere the destination keeps its bytes).
__device__ __forceinline__ void cp_async16_if(bool ok, u32 dst_smem, const void* src, u64 policy) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %3, 0; @p cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2; }" ::"r"(
            dst_smem),
        "l"(src), "l"(policy), "r"((int)ok)
        : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_small_if(bool ok, u32 dst_smem, const void* src, u64 policy) {
    static_assert(N == 4 || N == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %4, 0; @p cp.async.ca.shared.global.L2::cache_hint [%0], [%1], %2, %3; }" ::"r"(
            dst_smem),
        "l"(src), "n"(N), "l"(policy), "r"((int)ok)
        : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Data written earlier in this launch by other blocks: bypass L1 (not coherent across SMs), read L2.
__device__ __forceinline__ float ld_cg_f(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}
// 8 consecutive floats (32-byte aligned) written earlier in this launch.
__device__ __forceinline__ void ld_cg_f8(const float* p, float (&f)[8]) {
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3]) : "l"(p));
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(f[4]), "=f"(f[5]), "=f"(f[6]), "=f"(f[7]) : "l"(p + 4));
}
__device__ __forceinline__ bf16_t ld_cg_bf(const bf16_t* p) {
    unsigned short r;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ vec16 ld_cg16(const void* p) {
    vec16 r;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}
// Table entries: read-only for the whole launch. `volatile` keeps the compiler from hoisting every phase's
// table loads out of the step loop into registers (which made the GEMV loops spill); reloads hit L1.
__device__ __forceinline__ u64 ld_tab(const u64* p) {
    u64 v;
    asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// Bring `bytes` (a multiple of 16, at most MK_PF_PIECE) from the 16-byte aligned `p` into L2. On sm_90 this is
// one bulk-copy-engine request (cp.async.bulk.prefetch): no registers, no per-line instructions; elsewhere
// one prefetch per 128-byte line from this thread.
#define MK_PF_PIECE 32768
__device__ __forceinline__ void prefetch_l2_bytes(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
    for (unsigned off = 0; off < bytes; off += 128) prefetch_l2((const char*)p + off);
#endif
}

// Bulk stores (sm_90's bulk-copy engine): `bytes` (a multiple of 16) from shared memory to global memory as one
// request of this thread's bulk group. They complete in the background, outside the generic proxy, so a later
// grid barrier's release does not wait for them; `bulk_wait_read` waits until this thread's requests have read
// their shared memory (which may then be reused). The writes to shared memory they copy must be fenced with
// `fence_proxy_async_smem` by their writers before a block barrier that precedes the request.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MK_BULK_STORES 1
#else
#define MK_BULK_STORES 0  // the calls below are compiled out where MK_BULK_STORES is 0
#endif
__device__ __forceinline__ void bulk_store(void* dst, const void* src_smem, unsigned bytes) {
#if MK_BULK_STORES
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n\tcp.async.bulk.commit_group;" ::"l"(dst),
                 "r"((unsigned)__cvta_generic_to_shared(src_smem)), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void bulk_wait_read() {
#if MK_BULK_STORES
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}
__device__ __forceinline__ void fence_proxy_async_smem() {
#if MK_BULK_STORES
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// prefetch_l2_bytes of any span (at most MK_PF_PIECE - 16 bytes), widened to whole aligned 16-byte pieces (the
// allocator's blocks are whole 512 bytes, so the widening stays inside the allocation).
__device__ __forceinline__ void prefetch_l2_span(const void* p, unsigned bytes) {
    const unsigned long long a = (unsigned long long)p & ~15ull, e = ((unsigned long long)p + bytes + 15) & ~15ull;
    prefetch_l2_bytes((const void*)a, (unsigned)(e - a));
}

__device__ __forceinline__ void unpack8(const vec16& v, float (&f)[8]) {
    f[0] = bf_lo(v.x), f[1] = bf_hi(v.x), f[2] = bf_lo(v.y), f[3] = bf_hi(v.y);
    f[4] = bf_lo(v.z), f[5] = bf_hi(v.z), f[6] = bf_lo(v.w), f[7] = bf_hi(v.w);
}
// Values 8 * i8 .. 8 * i8 + 7 of a vector written earlier in this launch, bf16 or (bf = false) fp32.
__device__ __forceinline__ void ld_cg_act8(const void* base, int i8, bool bf, float (&f)[8]) {
    if (!MK_FP32_ACT || bf) unpack8(ld_cg16((const bf16_t*)base + i8 * 8), f);
    else ld_cg_f8((const float*)base + i8 * 8, f);
}

// ---- tensor cores (sm_80+) ---------------------------------------------------------------------
// c += A * B for one m16n8k16 tile, bf16 inputs, fp32 accumulation. A's rows 8..15 are zero (the GEMV has at most
// 8 tokens): a0 / a2 hold the lane's row (lane / 4) at k 2 (lane % 4) + {0, 1} / + {8, 9}, b0 / b1 the lane's
// column (lane / 4) at the same k. c[0], c[1]: row lane / 4, columns 2 (lane % 4) + {0, 1}; c[2], c[3] stay zero.
__device__ __forceinline__ void mma_bf16_m16n8k16(float (&c)[4], u32 a0, u32 a2, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// ---- reductions ----------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide sums of N values per thread at once, each in a fixed order (deterministic): lanes by shuffles, then
// warps in order (one pair of barriers for all N).
// `scratch` holds N * MK_NWARPS floats; every thread gets the sums.
template <int N>
__device__ __forceinline__ void block_sum_n(float (&v)[N], float* scratch) {
    const int lane = tid_x() & 31, warp = tid_x() >> 5;
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < N; ++i) scratch[i * MK_NWARPS + warp] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < MK_NWARPS; ++w) s += scratch[i * MK_NWARPS + w];
        v[i] = s;
    }
}

// ---- errors and the grid barrier ----------------------------------------------------------------
// The control block (CTRL_*), the error codes (MK_ERR_*) and the table slots are generated from
// kernels/layout.py into the source preamble, so that host and device agree by construction.

__device__ __forceinline__ unsigned sm_id() {
    unsigned r;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
    return r;
}
__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ u64 ld_acquire_u64(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ int ld_volatile_int(const int* p) { return *(const volatile int*)p; }

__device__ __forceinline__ void raise_error(int* ctrl, int code, int info) {
    if (atomicCAS(ctrl + CTRL_ERR, 0, code) == 0) atomicExch(ctrl + CTRL_ERR_INFO, info);
}

// The grid barrier: a monotonically increasing 64-bit counter (reset only by the host after an error; every
// block passes every barrier of a launch, so it is a multiple of the grid size between launches). Before its
// first barrier a block reads the counter's launch base into *s_target (no block can pass barrier 0 before this
// one arrives, so rounding down finds it). Thread 0 of every block; callers synchronise.
__device__ __forceinline__ void grid_barrier_init(const u64* counter, u64* s_target) {
    const u64 n = nblocks();
    *s_target = (*(const volatile u64*)counter / n) * n;
}

// Arrive at the grid barrier; returns the count to wait for. Call from every thread of the block.
// The release add orders this block's writes (cumulative over the bar.sync before it) and does not wait for a
// reply, so the last block to arrive is not held up by an atomic's round trip.
__device__ __forceinline__ u64 grid_arrive(u64* counter, u64* s_target) {
    __syncthreads();
    if (tid_x() == 0) {
        const u64 n = nblocks();
        *s_target += n;
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
    }
    __syncthreads();
    return *s_target;
}

// Wait until every block has arrived. Bounded: after `timeout_ns`, or as soon as another block has
// flagged an error, the block records the error and returns false; the caller must then leave the kernel.
// Polled with acquire loads: the one that sees the target orders the reads after it.
__device__ __forceinline__ bool grid_wait(u64* counter, u64 target, int* ctrl, u64 timeout_ns, int info,
                                          int* s_flag) {
    if (tid_x() == 0) {
        int ok = 1;
        if (ld_acquire_u64(counter) < target) {
            const u64 t0 = global_timer_ns();
            unsigned spins = 0;
            while (ld_acquire_u64(counter) < target) {
                if ((++spins & 63u) == 0) {
                    if (ld_volatile_int(ctrl + CTRL_ERR) != 0) {
                        ok = 0;
                        break;
                    }
                    if (global_timer_ns() - t0 > timeout_ns) {
                        raise_error(ctrl, MK_ERR_BARRIER_TIMEOUT, info);
                        ok = 0;
                        break;
                    }
                }
            }
        }
        *s_flag = ok;
    }
    __syncthreads();
    return *s_flag != 0;
}
