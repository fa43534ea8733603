// The embedding rows of a block-quantized table (MK_EFMT, the plan's embed_format): the kernel reads the model's
// one copy of the table, in the device layout of kernels/quant_layout.py (the repacked weights' layout), and
// decodes the values a phase needs where it reads them (layer 0's input norm and residual, the MTP fc's input
// norm) with the quantized GEMV's unit helpers (gemv_quant.cuh). A value is what the reference's lookup gives: the
// weight in fp32 by worker/quant's float operations (read_repacked's: no fused multiply-add), rounded to bf16 (the
// compute dtype the lookup dequantizes into); so every result equals that of a bf16 table of the dequantized rows.
// bf16 tables (MK_EFMT 0) are read as they are (model.cuh embed_row).
#pragma once
#include "common.cuh"
#include "gemv.cuh"

#if MK_EFMT
static_assert(QF_ON(MK_EFMT), "the plan compiles the embedding's format into MK_QFMTS");

// Values 8 vi .. 8 vi + 7 of the embedding row at `row` (model.cuh embed_row), as bf16: what ld_cg16 reads of a
// bf16 table's row. Not inlined: the norm prologues and the residual epilogue call it for layer 0 only.
__device__ __noinline__ vec16 embed_load8(const void* row, int vi) {
    constexpr int F = MK_EFMT;
    const int v = vi >> 2;
    const QUnit q = q_row_unit<F>((const unsigned char*)row, MK_H, v);
    switch ((vi & 3) ^ q_slot_xor(v)) {  // the slot holding the unit's group vi % 4
        case 0: return q_slot_bf16<F, 0>(q, v);
        case 1: return q_slot_bf16<F, 1>(q, v);
        case 2: return q_slot_bf16<F, 2>(q, v);
        default: return q_slot_bf16<F, 3>(q, v);
    }
}
// Value r of the embedding row at `row`, as bf16 rounds it.
__device__ __forceinline__ float embed_value(const void* row, int r) {
    const vec16 x = embed_load8(row, r >> 3);
    const int e = r & 7;
    const u32 p = e < 2 ? x.x : e < 4 ? x.y : e < 6 ? x.z : x.w;
    return e & 1 ? bf_hi(p) : bf_lo(p);
}
#endif
