// The decode megakernel: one persistent launch runs a whole decode step of one sequence (MK_NT tokens):
// embedding rows, every layer (Gated DeltaNet or gated attention, SwiGLU MLP, residuals, norms), the
// final norm, the lm_head and the greedy argmax. With MK_NT > 1 the launch verifies drafts: every weight is
// read once for all tokens, attention is causal within them, and with CTRL_FLAG_KEEP_STATES each DeltaNet
// layer records its state after every token but the last (the live state holds that one; the first token of a
// verify pass is always kept), so rolling back is a copy; with CTRL_FLAG_ACCEPT
// block 0 counts the drafts that match the argmax before them. CTRL_MODE MODE_MTP runs the MTP head instead
// (fc over the normed embedding and hidden, its full-attention layer, its norm, the shared lm_head) on the
// same phases: the MTP layer is the layer table's row num_layers. Phases are separated by a software grid barrier whose
// spin is bounded by a watchdog; while a block waits it prefetches its share of the next phase's weights
// into L2. The grid must be co-resident: the host sizes it from the occupancy query and launches it
// cooperatively.
//
// Compile-time switches (kernels/build.py Tuning): MK_STAGES > 0 streams GEMV weights through a shared-memory
// ring (cp.async, several items per warp in flight, no registers held) and issues each phase's first items
// before the barrier that precedes it (0: registers, where shared memory is short). MK_MMA multiplies on the
// tensor cores. MK_FP32_ACT (default 1) keeps the residual stream and the logits in fp32 and rounds every other
// intermediate to bf16 once, where it is stored, instead of at every step the bf16 reference rounds (0: the
// bf16 numerics). MK_PHASE_TIMING records per-block globaltimer stamps per phase (kernels/phase_timing.py).
//
// Kernels: mk_decode (the step), mk_phase (one phase, for the per-phase tests), mk_barrier_test, and in quantized
// builds mk_dequant (dequant.cuh: the prefill reads the repacked weights back).
#include "common.cuh"
#include "gemv.cuh"
#include "model.cuh"
#include "phases.cuh"
#include "dequant.cuh"

#ifndef MK_PF_IDLE_BYTES
#define MK_PF_IDLE_BYTES 131072  // next-phase weights each idle block pulls into L2 around a DeltaNet / attention phase
#endif

// Per-block state of the step, in shared memory: kept out of registers, which the GEMV loop needs.
struct BlockState {
    StepInfo si;
    GemvDesc desc;
    Epi epi;
    int gemv;  // the planned phase streams weights (desc/epi valid)
    int err;
    int last;  // attention: this block merges its key/value head's chunks
    int flag;  // barrier result
    u64 target;  // the grid barrier's count after this block's latest arrival (before the first: the launch base)
    int head;  // the weight ring's first items of this phase were issued before the barrier (MK_STAGES > 0)
    int planned;  // the step whose GEMV desc/epi between_phases filled (-1: none), so run_phase need not again
#ifdef MK_PHASE_TIMING
    u64 t_start;  // globaltimer when this block began the current phase
#endif
};

__device__ __forceinline__ unsigned dynamic_smem_size() {
    unsigned r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// Read position and tokens; check shared memory, tokens and KV room. Every block reaches the same verdict,
// so on an error they all leave before the first barrier.
__device__ bool read_step(const Tables& tb, BlockState& bs) {
    if (tid_x() == 0) {
        int err = 0;
        if (dynamic_smem_size() < (unsigned)MK_SMEM_BYTES) err = MK_ERR_SMEM;
        bs.si.pos = ld_volatile_int(tb.ctrl + CTRL_POS);
        bs.si.flags = ld_volatile_int(tb.ctrl + CTRL_FLAGS);
        bs.si.mode = ld_volatile_int(tb.ctrl + CTRL_MODE);
        if (bs.si.mode != 0 && (bs.si.mode != MODE_MTP || tb.gi(G_MTP_FC) == 0)) err = MK_ERR_BAD_MODE;
        const int head_rows = ld_volatile_int(tb.ctrl + CTRL_HEAD_ROWS);
        bs.si.head_rows = head_rows == 0 ? MK_V : head_rows;
        if (head_rows < 0 || head_rows > MK_V || head_rows % HEAD_ROWS_ALIGN != 0) err = MK_ERR_HEAD_ROWS;
        for (int t = 0; t < MK_NT; ++t) {
            bs.si.tok[t] = ld_volatile_int(tb.ctrl + CTRL_TOKEN_IN + t);
            if (bs.si.tok[t] < 0 || bs.si.tok[t] >= MK_V) err = MK_ERR_BAD_TOKEN;
        }
        const long long room = bs.si.mode == MODE_MTP ? tb.li((int)tb.gi(G_NUM_LAYERS), L_KV_CAP) : tb.gi(G_KV_CAP);
        if (bs.si.pos < 0 || (long long)bs.si.pos + MK_NT > room) err = MK_ERR_CONTEXT;
        else if (att_chunks(bs.si) > MK_ATT_MERGE_CHUNKS) err = MK_ERR_ATTENTION_CHUNKS;  // the host checks first
        if (err != 0 && bid_x() == 0) raise_error(tb.ctrl, err, bs.si.pos);
        bs.err = err;
        bs.head = 0;
        bs.planned = -1;
        grid_barrier_init(tb.sync + MK_SYNC_BARRIER, &bs.target);
    }
    __syncthreads();
    return bs.err == 0;
}

// Fill the GEMV descriptor and epilogue of a weight-streaming phase (thread 0; callers synchronise).
__device__ void plan_gemv(const Tables& tb, const StepInfo& si, int phase, int l, BlockState& bs) {
    Epi& e = bs.epi;
    bs.gemv = 1;
    switch (phase) {
        case PH_DN_IN:
            bs.desc = desc_dn_in(tb, l);
            e.kind = EPI_DN_IN;
            e.out = tb.gp<bf16_t>(G_XBUF);
            e.zbuf = tb.gp<bf16_t>(G_ZBUF);
            e.beta = tb.gp<float>(G_BETA);
            e.gdecay = tb.gp<float>(G_GDECAY);
            e.convw = tb.lp<const bf16_t>(l, L_CONV_W);
            e.conv_state = tb.lp<bf16_t>(l, L_CONV_STATE);
            e.hist_conv = (si.flags & CTRL_FLAG_KEEP_STATES) ? tb.lp<bf16_t>(l, L_HIST_CONV) : nullptr;
            e.neg_a = tb.lp<const float>(l, L_NEG_A);
            e.dt_bias = tb.lp<const float>(l, L_DT_BIAS);
            break;
        case PH_ATT_IN:
            bs.desc = desc_att_in(tb, l);
            e.kind = EPI_STORE;
            e.out = tb.gp<bf16_t>(G_QKV_ATT);
            e.ld_out = MK_ATT_IN_ROWS;
            break;
        case PH_DN_OUT:
        case PH_ATT_OUT:
            bs.desc = phase == PH_DN_OUT ? desc_plain(tb.lp<const bf16_t>(l, L_OUT), MK_VD, MK_H)
                                         : desc_plain(tb.lp<const bf16_t>(l, L_O), MK_AD, MK_H);
            e.kind = EPI_RESIDUAL;
            e.out = tb.gp<bf16_t>(G_H);  // resid_t (the epilogue casts)
            for (int t = 0; t < MK_NT; ++t) e.src[t] = resid_src(tb, si, l, t);
            e.src_kind = resid_kind(l);
            break;
        case PH_MLP_IN:
            bs.desc = desc_gate_up(tb, l);
            e.kind = EPI_SWIGLU;
            e.out = tb.gp<bf16_t>(G_ACT);
            break;
        case PH_MLP_DOWN:
            bs.desc = desc_plain(tb.lp<const bf16_t>(l, L_DOWN), MK_I, MK_H);
            e.kind = EPI_RESIDUAL;
            e.out = tb.gp<bf16_t>(G_H);
            for (int t = 0; t < MK_NT; ++t) e.src[t] = tb.gp<const resid_t>(G_H) + t * MK_H;
            e.src_kind = MK_FP32_ACT ? SRC_F32 : SRC_BF16;
            break;
        case PH_LM_HEAD:
            bs.desc = desc_plain(tb.gp<const bf16_t>(G_LM_HEAD), MK_H, si.head_rows);
            e.kind = EPI_LM_HEAD;
            e.logits = tb.gp<float>(G_LOGITS);
            e.argkey = tb.gp<u64>(G_ARGKEY);
            break;
        case PH_MTP_FC:
            bs.desc = desc_plain(tb.gp<const bf16_t>(G_MTP_FC), 2 * MK_H, MK_H);
            e.kind = EPI_SET_H;
            e.out = tb.gp<bf16_t>(G_H);
            break;
        default:
            bs.gemv = 0;
            break;
    }
}

// Block 0, after the last barrier: greedy tokens out, argmax keys reset, position advanced; greedy verify
// (CTRL_FLAG_ACCEPT): input t + 1 is a draft accepted while it equals the argmax after input t.
__device__ void finalize_step(const Tables& tb, const StepInfo& si) {
    if (bid_x() != 0 || tid_x() != 0) return;
    u64* argkey = tb.gp<u64>(G_ARGKEY);
    int* hist = (si.flags & CTRL_FLAG_FEEDBACK) ? tb.gp<int>(G_TOKEN_HIST) : nullptr;
    int last = 0, accepted = 0;
    bool matching = (si.flags & CTRL_FLAG_ACCEPT) != 0;
    for (int t = 0; t < MK_NT; ++t) {
        const u64 key = *(volatile u64*)(argkey + t);
        last = (int)(0xffffffffu - (u32)(key & 0xffffffffull));
        tb.ctrl[CTRL_TOKEN_OUT + t] = last;
        if (hist != nullptr) hist[si.pos + t] = last;
        argkey[t] = 0;  // ready for the next step
        matching = matching && t + 1 < MK_NT && si.tok[t + 1] == last;
        if (matching) ++accepted;
    }
    tb.ctrl[CTRL_ACCEPTED] = accepted;
    tb.ctrl[CTRL_POS] = si.pos + MK_NT;
    if (tb.ctrl[CTRL_FLAGS] & CTRL_FLAG_FEEDBACK) tb.ctrl[CTRL_TOKEN_IN] = last;
    __threadfence();
}

// Stage input elements [k0, k1) of weight-streaming phase `phase` of layer `l` into shared memory (the whole
// input, or one window of it when it is wider than MK_XW). Ends with a block barrier. Not inlined: the GEMV loop
// calls it between passes, and one out-of-line copy keeps its registers out of the loop's.
__device__ __noinline__ void stage_input(const Tables& tb, const StepInfo& si, int phase, int l, const Smem& sm, int k0,
                                         int k1) {
    const int v0 = k0 / 8, v1 = k1 / 8;
    switch (phase) {
        case PH_DN_IN:
        case PH_ATT_IN: {
            const void* src[MK_NT];
            for (int t = 0; t < MK_NT; ++t) src[t] = resid_src(tb, si, l, t);
            stage_rmsnorm(src, resid_kind(l), tb.lp<const float>(l, L_IN_NORM), sm.xs, sm.red, 0, v0, v1);
            break;
        }
        case PH_MTP_FC: {  // the input is [norm_e(embedding row) | norm_h(hidden)], 2H wide
            const void* emb[MK_NT];
            const void* hid[MK_NT];
            for (int t = 0; t < MK_NT; ++t) {
                emb[t] = embed_row(tb, si.tok[t]);
                hid[t] = tb.gp<const bf16_t>(G_MTP_HIDDEN_IN) + t * MK_H;
            }
            stage_rmsnorm(emb, SRC_EMBED_ROWS, tb.gp<const float>(G_MTP_PRE_E), sm.xs, sm.red, 0, v0, v1);
            stage_rmsnorm(hid, SRC_BF16, tb.gp<const float>(G_MTP_PRE_H), sm.xs, sm.red, MK_H / 8, v0, v1);
            break;
        }
        case PH_DN_OUT:
            stage_gated_norm(tb.gp<const bf16_t>(G_CORE), tb.gp<const bf16_t>(G_ZBUF),
                             tb.lp<const bf16_t>(l, L_GNORM_W), sm.xs, k0, k1);
            break;
        case PH_ATT_OUT:
            stage_copy(tb.gp<const bf16_t>(G_ATT_OUT), MK_AD, sm.xs, v0, v1);
            break;
        case PH_MLP_IN:
        case PH_LM_HEAD: {
            const void* src[MK_NT];
            for (int t = 0; t < MK_NT; ++t) src[t] = tb.gp<const resid_t>(G_H) + t * MK_H;
            const float* w1 = phase == PH_MLP_IN      ? tb.lp<const float>(l, L_POST_NORM)
                              : si.mode == MODE_MTP ? tb.gp<const float>(G_MTP_NORM)
                                                    : tb.gp<const float>(G_FINAL_NORM);
            stage_rmsnorm(src, MK_FP32_ACT ? SRC_F32 : SRC_BF16, w1, sm.xs, sm.red, 0, v0, v1);
            break;
        }
        case PH_MLP_DOWN:
            stage_copy(tb.gp<const bf16_t>(G_ACT), MK_I, sm.xs, v0, v1);
            break;
        default:
            break;
    }
}

// run_phase copies the lm_head's staged input out as the MTP's hidden, so its first pass holds a whole hidden row
// in each of the lm_head's formats (plan.py KernelPlan._hidden_pass_width sizes the window for it).
static_assert(MK_WFMT_LM_HEAD != 0 || gemv_pass_chunks(gemv_plan(MK_H)) == gemv_plan(MK_H).nk,
              "the lm_head stages a hidden row in one pass");
#if MK_QFMTS
static_assert(MK_WFMT_LM_HEAD == 0 || qplan_pass_chunks(qplan(MK_H)) == qplan(MK_H).nk,
              "the lm_head stages a hidden row in one pass");
#endif

// Runs `phase` of layer `l`; returns whether this block had work in it (the DeltaNet and attention
// phases leave some blocks idle, and those prefetch more while they wait).
__device__ __forceinline__ bool run_phase(const Tables& tb, BlockState& bs, int phase, int l, int step,
                                          unsigned char* smem_raw) {
    const Smem sm = carve_smem(smem_raw);
    const StepInfo& si = bs.si;
    // Planned before the barrier (between_phases) unless this is the launch's first phase: planning here would cost
    // every phase a dependent trip to the tables in L2, which the weight stream makes slow (about a microsecond).
    if (tid_x() == 0 && bs.planned != step) plan_gemv(tb, si, phase, l, bs);
    __syncthreads();
    switch (phase) {
        case PH_DN_REC:
            return phase_dn_rec(tb, si, l, sm.part, sm.xs);
        case PH_ATT:
            return phase_attention(tb, si, l, sm.part, sm.xs, &bs.last);
        case PH_FINALIZE:
            finalize_step(tb, si);
            return true;
        default:
            break;
    }
    if (!bs.gemv) return true;
    {  // the first window (the whole input unless it is wider than MK_XW)
        int k0, k1;
        gemv_first_window(bs.desc, k0, k1);
        stage_input(tb, si, phase, l, sm, k0, k1);
    }
    if (phase == PH_LM_HEAD && bid_x() == 0) {  // post-norm hidden (the MTP input) or the MTP's output, whole
        bf16_t* hid = tb.gp<bf16_t>(G_HIDDEN_OUT);
        // An MTP chain's next launch pairs this launch's argmax (the feedback) with its last hidden row: written
        // to the MTP input here, which this launch read in its first phase, so the host copies nothing between.
        bf16_t* next = si.mode == MODE_MTP && (si.flags & CTRL_FLAG_FEEDBACK) ? tb.gp<bf16_t>(G_MTP_HIDDEN_IN)
                                                                              : nullptr;
        for (int i = tid_x(); i < MK_NT * MK_H; i += MK_THREADS) {
            const int t = i / MK_H;
            const bf16_t v = sm.xs[t * MK_XLD + i - t * MK_H];
            hid[i] = v;
            if (next != nullptr && t == MK_NT - 1) next[i - t * MK_H] = v;
        }
    }
    // The one copy of the GEMV loop, for every weight-streaming phase.
    float* red = sm.red;
    const Epi& epi = bs.epi;
    const bool head = bs.head != 0;
    __syncthreads();  // every thread has read bs.head before thread 0 clears it (also planned below in between)
    if (tid_x() == 0) bs.head = 0;
    gemv_run(
        bs.desc, sm.xs, sm.part, sm.rowval, sm.ring, head,
        [&](int rs, int nr, const float* rowval, int ld) { epi_finish(epi, rs, nr, rowval, ld, red); },
        [&](int k0, int k1) { stage_input(tb, si, phase, l, sm, k0, k1); });
    return true;
}

// The plan's step list (kernels/plan.py launch_steps): MK_LAYER_STEPS phases per layer (MK_LINEAR_PHASE_k or
// MK_FULL_PHASE_k by the layer's kind), then the MK_FINAL_STEPS final phases; MTP steps: the MTP fc, the MTP layer
// (a full-attention layer on table row nl), the final phases.
static_assert(MK_LAYER_STEPS == 5 && MK_FINAL_STEPS == 2, "schedule() maps steps to the plan's phases");
static_assert(MK_LINEAR_PHASE_3 == MK_FULL_PHASE_3 && MK_LINEAR_PHASE_4 == MK_FULL_PHASE_4, "a shared MLP");
#define MK_MTP_STEPS (1 + MK_LAYER_STEPS + MK_FINAL_STEPS)
__device__ __forceinline__ int num_steps(const StepInfo& si, int nl) {
    return si.mode == MODE_MTP ? MK_MTP_STEPS : MK_LAYER_STEPS * nl + MK_FINAL_STEPS;
}

// The step as a flat schedule of (phase, layer) pairs.
__device__ __forceinline__ void schedule(const Tables& tb, const StepInfo& si, int step, int nl, int& phase,
                                         int& layer) {
    if (si.mode == MODE_MTP) {
        if (step == 0 || step >= 1 + MK_LAYER_STEPS) {
            phase = step == 0 ? PH_MTP_FC : step == 1 + MK_LAYER_STEPS ? MK_FINAL_PHASE_0 : MK_FINAL_PHASE_1;
            layer = nl;
            return;
        }
        step = MK_LAYER_STEPS * nl + step - 1;  // the MTP layer's phases, on table row nl
    }
    if (step >= MK_LAYER_STEPS * nl + (si.mode == MODE_MTP ? MK_LAYER_STEPS : 0)) {
        phase = step == MK_LAYER_STEPS * nl ? MK_FINAL_PHASE_0 : MK_FINAL_PHASE_1;
        layer = 0;
        return;
    }
    layer = step / MK_LAYER_STEPS;
    const int k = step - layer * MK_LAYER_STEPS;
    const bool linear = layer < nl && tb.li(layer, L_KIND) == LAYER_LINEAR;
    if (k == 0) phase = linear ? MK_LINEAR_PHASE_0 : MK_FULL_PHASE_0;
    else if (k == 1) phase = linear ? MK_LINEAR_PHASE_1 : MK_FULL_PHASE_1;
    else if (k == 2) phase = linear ? MK_LINEAR_PHASE_2 : MK_FULL_PHASE_2;
    else if (k == 3) phase = MK_LINEAR_PHASE_3;
    else phase = MK_LINEAR_PHASE_4;
}

// Between two phases: arrive at the grid barrier, start the next weight-streaming phase's loads (ring head,
// L2 prefetch), wait. Not inlined: its spin loop inside the step loop made ptxas spill the GEMV loop.
__device__ __noinline__ bool between_phases(const Tables& tb, BlockState& bs, int step, int phase, bool had,
                                            unsigned char* smem_raw) {
    const int nl = (int)tb.gi(G_NUM_LAYERS);
    int next_phase, next_layer;
    schedule(tb, bs.si, step + 1, nl, next_phase, next_layer);
    int next_step = step + 1;
    const u64 target = grid_arrive(tb.sync + MK_SYNC_BARRIER, &bs.target);
    // After the mixer's input projections comes the DeltaNet / attention phase, which streams no weights: its
    // inputs start towards L2 first, then the loads of the output projection after it.
    if (next_phase == PH_DN_REC || next_phase == PH_ATT) {
        prefetch_mixer_inputs(tb, bs.si, next_phase, next_layer);
        next_step = step + 2;
        schedule(tb, bs.si, next_step, nl, next_phase, next_layer);
    }
    if (tid_x() == 0) {
        plan_gemv(tb, bs.si, next_phase, next_layer, bs);
        bs.planned = next_step;
    }
    __syncthreads();
#if MK_STAGES > 0
    // The next GEMV's ring head is issued at the barrier after the mixer's input projections, so that it streams
    // during the DeltaNet / attention phase (which does not use the ring), and not again after that phase.
    if (bs.gemv && phase != PH_DN_REC && phase != PH_ATT) {
        gemv_issue_first_head(bs.desc, carve_smem(smem_raw).ring);
        if (tid_x() == 0) bs.head = 1;
    }
#endif
    if (bs.gemv) {
        const int nb = nblocks();
        int busy = nb;  // blocks with work in the phase just finished
        if (phase == PH_DN_REC) busy = min(nb, dn_rec_items());
        if (phase == PH_ATT) busy = min(nb, att_items(att_split(bs.si)));
        if (busy < nb && !had) {
            // Blocks without DeltaNet / attention work: the next stretch of EVERY block's share, split over the
            // idle blocks, so that most of the output projection is in L2 when the few busy blocks finish.
            const int nidle = nb - busy;
            for (int b = bid_x() - busy; b < nb; b += nidle)
                gemv_prefetch_share(bs.desc, b, GEMV_HEAD_BYTES, MK_PF_IDLE_BYTES);
        }
    }
    return grid_wait(tb.sync + MK_SYNC_BARRIER, target, tb.ctrl, (u64)tb.gi(G_TIMEOUT_NS), step, &bs.flag);
}

#ifdef MK_PHASE_TIMING
// Debug builds: per (step, block), when the block began the phase and when its own work in it ended (before
// the barrier). The host turns these into per-phase time, critical-path work and barrier/wait time.
__device__ __noinline__ void stamp_phase(const Tables& tb, BlockState& bs, int step) {
    if (tid_x() != 0) return;
    u64* tm = tb.gp<u64>(G_TIMING);
    if (tm == nullptr) return;
    u64* slot = tm + MK_TIMING_FIELDS * ((long long)step * nblocks() + bid_x());
    slot[0] = bs.t_start;
    slot[1] = global_timer_ns();
    slot[2] = mk_gemv_t[0];
    slot[3] = mk_gemv_t[1];
}
// A new phase: its start, and no GEMV stamps yet.
__device__ __forceinline__ void timing_phase_start(BlockState& bs) {
    if (tid_x() != 0) return;
    bs.t_start = global_timer_ns();
    mk_gemv_t[0] = mk_gemv_t[1] = 0;
}
#endif

extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_decode(const u64* __restrict__ g, const u64* __restrict__ lt, int* ctrl, u64* sync) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ BlockState bs;
    const Tables tb{g, lt, ctrl, sync};
    if (!read_step(tb, bs)) return;
    const int nsteps = num_steps(bs.si, (int)tb.gi(G_NUM_LAYERS));
#ifdef MK_PHASE_TIMING
    timing_phase_start(bs);
    if (tid_x() == 0) {
        // The row after a decode step's phases: the SM each block runs on (is a block's speed its SM's?).
        u64* tm = tb.gp<u64>(G_TIMING);
        if (tm != nullptr)
            tm[MK_TIMING_FIELDS * ((long long)(MK_LAYER_STEPS * (int)tb.gi(G_NUM_LAYERS) + MK_FINAL_STEPS) * nblocks() +
                                   bid_x())] = sm_id();
    }
#endif
    for (int step = 0; step < nsteps; ++step) {
        int phase, layer;
        schedule(tb, bs.si, step, (int)tb.gi(G_NUM_LAYERS), phase, layer);
        const bool had = run_phase(tb, bs, phase, layer, step, smem_raw);
#ifdef MK_PHASE_TIMING
        stamp_phase(tb, bs, step);
#endif
        if (step + 1 < nsteps && !between_phases(tb, bs, step, phase, had, smem_raw)) {
#if MK_STAGES > 0
            cp_async_wait<0>();  // leave no copy into shared memory in flight
#endif
            return;
        }
#ifdef MK_PHASE_TIMING
        timing_phase_start(bs);
#endif
    }
}

// One phase of layer `layer` (tests compare each phase with the reference on the same inputs).
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_phase(const u64* __restrict__ g, const u64* __restrict__ lt, int* ctrl, u64* sync, int phase, int layer) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ BlockState bs;
    const Tables tb{g, lt, ctrl, sync};
    if (!read_step(tb, bs)) return;
    run_phase(tb, bs, phase, layer, /*step=*/0, smem_raw);  // nothing planned yet (bs.planned -1): plans
}

// The grid barrier alone: `rounds` barriers, each checking that every block arrived before any left;
// block `skip_block` (if >= 0) leaves before the last one, which must end in a watchdog error, not a hang.
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
    mk_barrier_test(int* ctrl, u64* sync, int* arrivals, int rounds, int skip_block, long long timeout_ns) {
    __shared__ u64 s_target;
    __shared__ int s_flag;
    if (tid_x() == 0) grid_barrier_init(sync, &s_target);
    for (int r = 0; r < rounds; ++r) {
        if (r == rounds - 1 && bid_x() == skip_block) return;
        if (tid_x() == 0) atomicAdd(arrivals + r, 1);
        const u64 target = grid_arrive(sync, &s_target);
        if (!grid_wait(sync, target, ctrl, (u64)timeout_ns, r, &s_flag)) return;
        if (tid_x() == 0 && ld_volatile_int(arrivals + r) != nblocks()) raise_error(ctrl, MK_ERR_BARRIER_BROKEN, r);
    }
}
