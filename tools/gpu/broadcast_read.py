"""Probe: how long a grid of one block per SM takes to read rows that every block reads (the megakernel's norm
prologues), against each block reading its own rows, outside the megakernel (no weight stream around it).

    python3 tools/gpu/broadcast_read.py

Per case: mean and max over blocks of (end - start) by globaltimer, us, over many launches (the L2 is warm).
"""

from __future__ import annotations

import cupy as cp
import numpy as np

SRC = r"""
extern "C" __global__ void __launch_bounds__(384, 1)
probe(const float* __restrict__ src, int nt, int h, int mode, unsigned long long* stamps, float* out) {
    extern __shared__ float4 sm[];
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const int nvec = h / 4;  // float4 per token
    const float4* base = (const float4*)src + (mode == 1 ? (long long)blockIdx.x * nt * nvec : 0);
    __shared__ float red[16 * 8];
    float ss[8];
    for (int t = 0; t < 8; ++t) ss[t] = 0.f;
    if (mode == 3) {  // norm-like with the rows staged by cp.async first (one round trip), then from shared memory
        for (int i = threadIdx.x; i < nt * nvec; i += 384) {
            unsigned a = (unsigned)__cvta_generic_to_shared(sm + i);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(base + i));
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
        __syncthreads();
    }
    // pass 1: every token's loads, sums of squares
#pragma unroll
    for (int t = 0; t < 8; ++t) {
        if (t < nt) {
#pragma unroll 4
            for (int i = threadIdx.x; i < nvec; i += 384) {
                const float4 v = mode == 3 ? sm[t * nvec + i] : __ldcg(base + t * nvec + i);
                ss[t] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int t = 0; t < 8; ++t)
        for (int m = 16; m > 0; m >>= 1) ss[t] += __shfl_xor_sync(0xffffffffu, ss[t], m);
    if (lane == 0)
        for (int t = 0; t < 8; ++t) red[t * 16 + warp] = ss[t];
    __syncthreads();
    for (int t = 0; t < 8; ++t) {
        float s = 0.f;
        for (int w = 0; w < 12; ++w) s += red[t * 16 + w];
        ss[t] = rsqrtf(s / h + 1e-6f);
    }
    // pass 2: token by token, reload, scale, store (as bf16 pairs) to shared memory
    unsigned* o = (unsigned*)(sm + (mode == 3 ? nt * nvec : 0));
    for (int t = 0; t < nt; ++t) {
        for (int i = threadIdx.x; i < nvec; i += 384) {
            const float4 v = mode == 3 ? sm[t * nvec + i] : __ldcg(base + t * nvec + i);
            const float r = ss[t];
            o[(t * nvec + i) * 2] = __float_as_uint(v.x * r) >> 16 | (__float_as_uint(v.y * r) & 0xffff0000u);
            o[(t * nvec + i) * 2 + 1] = __float_as_uint(v.z * r) >> 16 | (__float_as_uint(v.w * r) & 0xffff0000u);
        }
    }
    __syncthreads();
    unsigned long long t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (threadIdx.x == 0) {
        stamps[2 * blockIdx.x] = t0;
        stamps[2 * blockIdx.x + 1] = t1;
        out[blockIdx.x] = __uint_as_float(o[5]);
    }
}
"""


def main() -> None:
    kern = cp.RawKernel(SRC, "probe")
    grid = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    h = 5120
    smem = 200 * 1024
    kern.max_dynamic_shared_size_bytes = smem
    src = cp.random.standard_normal(grid * 8 * h, dtype=cp.float32)
    stamps = cp.zeros(2 * grid, dtype=cp.uint64)
    out = cp.zeros(grid, dtype=cp.float32)
    names = {0: "all blocks the same rows", 1: "each block its own rows", 3: "same rows, cp.async staged"}
    print(f"grid {grid}, hidden {h}, fp32 rows; us per block (mean / max of end - start), 200 launches")
    for mode in (0, 1, 3):
        for nt in (1, 2, 4, 8):
            if mode == 3 and nt * h * 4 * 1.5 > smem:
                continue
            per = []
            for it in range(220):
                kern(
                    (grid,),
                    (384,),
                    (src, np.int32(nt), np.int32(h), np.int32(mode), stamps, out),
                    shared_mem=smem,
                )
                if it >= 20:
                    s = stamps.get().reshape(grid, 2).astype(np.float64)
                    per.append(s[:, 1] - s[:, 0])
            a = np.array(per) / 1e3
            print(f"  {names[mode]:28s} T={nt}: mean {a.mean():6.2f}  max {a.max(axis=1).mean():6.2f}")


if __name__ == "__main__":
    main()
