// The prefill's weights: a repacked matrix (kernels/quant_layout.py) decoded back to bf16 rows in one launch, for
// the reference back end's GEMMs once the runner holds the only copy of the weights (kernels/quant_weights.py
// RepackedSource). Each thread decodes one 32-element unit with the GEMV's own loads and the embedding's value
// helper (q_slot_bf16), so the values are read_repacked's, rounded to bf16, bit for bit. Consecutive threads read
// consecutive units of a plane and write consecutive 64-byte runs of the output.
#pragma once
#include "common.cuh"
#include "gemv.cuh"

#if MK_QFMTS
template <int F>
__device__ __forceinline__ void dequant_unit(const unsigned char* row, int K, int v, vec16* out_row) {
    const QUnit q = q_row_unit<F>(row, K, v);
    const int r = q_slot_xor(v);  // slot G holds the unit's group G ^ r
    vec16* dst = out_row + 4 * v;
    dst[0 ^ r] = q_slot_bf16<F, 0>(q, v);
    dst[1 ^ r] = q_slot_bf16<F, 1>(q, v);
    dst[2 ^ r] = q_slot_bf16<F, 2>(q, v);
    dst[3 ^ r] = q_slot_bf16<F, 3>(q, v);
}

template <int F>
__device__ __forceinline__ void dequant_rows(const unsigned char* data, long long rows, int K, vec16* out) {
    const long long units = K / 32, total = rows * units, stride = q_row_stride<F>(K);
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += step) {
        const long long row = t / units;
        dequant_unit<F>(data + row * stride, K, (int)(t - row * units), out + row * (K / 8));
    }
}

// `rows` rows of K weights of format `fmt` (one the build compiles: the host checks) at `data`, row stride
// q_row_stride, into `out` ([rows, K] bf16, 16-byte aligned).
extern "C" __global__ void mk_dequant(const unsigned char* __restrict__ data, int fmt, long long rows, int K,
                                      vec16* __restrict__ out) {
    switch (fmt) {
#define DQ_CASE(F) \
    case F:        \
        if (QF_ON(F)) dequant_rows<F>(data, rows, K, out); \
        break;
        DQ_CASE(QF_Q4_K)
        DQ_CASE(QF_Q5_K)
        DQ_CASE(QF_Q6_K)
        DQ_CASE(QF_Q8_0)
        DQ_CASE(QF_Q4_0)
        DQ_CASE(QF_Q5_0)
        DQ_CASE(QF_Q5_1)
#undef DQ_CASE
        default: break;
    }
}
#endif
