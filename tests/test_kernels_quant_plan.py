"""Builds of the megakernel for quantized weights, without a GPU: the plan's formats and defines, the weights'
grouping and table pointers (kernels/quant_weights.py), and nvcc builds of the quantized GEMV."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from onestream.kernels.build import assemble_source, nvcc_compile, ptxas_report
from onestream.kernels.plan import (
    WEIGHT_FORMAT_CODES,
    WEIGHT_KINDS,
    KernelPlan,
    WeightFormat,
    quant_chunk_width,
    quant_slot_planes,
    weight_formats_of,
)
from onestream.kernels.quant_layout import FORMAT_CODES
from onestream.kernels.quant_weights import TAG_SHIFT, DeviceWeights
from onestream.kernels.random_model import config_27b, random_model
from onestream.kernels.random_quant import preset_types, q4_k_m_formats, quantize_randomly
from onestream.kernels.tuning import Tuning
from onestream.worker.errors import UnsupportedModelError
from onestream.worker.quant import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    QuantType,
    install_quantized_weights,
)
from onestream.worker.testing import tiny_config

W = WeightFormat


def small_config():
    return tiny_config(
        hidden_size=256, intermediate_size=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64
    )


def test_codes_are_the_layouts() -> None:
    assert WEIGHT_FORMAT_CODES[W.BF16] == 0
    for qtype, code in FORMAT_CODES.items():
        assert WEIGHT_FORMAT_CODES[W(qtype.name.lower())] == code
        assert W(qtype.name.lower()).quant_type is qtype


def test_a_quantized_plan_names_its_formats_per_kind() -> None:
    plan = KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q4_k_m_formats())
    d = plan.defines()
    q4, q6 = 1 << FORMAT_CODES[QuantType.Q4_K], 1 << FORMAT_CODES[QuantType.Q6_K]
    assert d["MK_WFMT_MLP_DOWN"] == q4 | q6 and d["MK_WFMT_MLP_IN"] == q4 and d["MK_WFMT_LM_HEAD"] == q4 | q6
    assert d["MK_QFMTS"] == q4 | q6
    # No kind holds bf16: the bf16 GEMV is left out; a ring slot holds the largest quantized item (4 rows of Q6_K
    # units: a payload plane each, their high bits in 2 planes, their shared scales in 1), and the window holds
    # every input.
    assert d["MK_GEMV_BF16"] == 0 and plan.window == config_27b().intermediate_size
    assert plan.stages == 2 and plan.quant_rows == 4 and d["MK_RING_PLANES"] == 4 + 2 + 1
    src = assemble_source(plan)
    assert "#define MK_QFMTS " in src and "gemv_run_quant" in src


def test_quantized_items_take_their_formats_ring_planes() -> None:
    """An item's ring planes per format (gemv_quant.cuh QSlot): a vector per unit of Q4_K, Q4_0 and Q6_K (whose 8
    bytes of high bits take half a vector more), two of the others, and one vector of shared scales per 8 units of
    Q4_K, Q5_K, Q8_0, Q4_0 and Q6_K (4 per unit and warp; Q6_K one more per unit, its super-blocks' d)."""
    code = {f: WEIGHT_FORMAT_CODES[f] for f in W if f is not W.BF16}
    planes = {f.name: quant_slot_planes(c, 4) for f, c in code.items()}
    assert planes == {"Q4_K": 5, "Q5_K": 9, "Q6_K": 7, "Q8_0": 9, "Q4_0": 5, "Q5_0": 8, "Q5_1": 8}
    assert quant_slot_planes(code[W.Q6_K], 1) == 3 and quant_slot_planes(code[W.Q6_K], 2) == 4
    assert quant_slot_planes(code[W.Q4_K], 1) == 2 and quant_slot_planes(code[W.Q4_K], 8) == 9
    assert quant_slot_planes(code[W.Q4_K], 16) == 16 + 2


def test_the_weight_ring_holds_quantized_items() -> None:
    """A Q4_K_M model streams its items through the ring; a Q8_0 model keeps the register double buffer unless
    the tuning names a ring, whose slots then hold its 9-plane items."""
    q8 = weight_formats_of({k: {W.Q8_0} for k in WEIGHT_KINDS})
    plan = KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q8)
    assert plan.quant_slot_planes == 9 and plan.stages == 0 and plan.carve.xs == 0
    ring = KernelPlan(
        config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q8, tuning=Tuning(stages=2)
    )
    assert ring.stages == 2 and ring.ring_planes == 9
    assert ring.carve.xs == 2 * ring.ring_planes * ring.tuning.threads * 16


def test_a_plan_with_bf16_kinds_keeps_the_bf16_gemv() -> None:
    kinds = {"mlp_down": {W.Q8_0}}
    plan = KernelPlan(
        config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=weight_formats_of(kinds)
    )
    assert plan.streams_bf16 and "MK_GEMV_BF16" not in plan.defines() and plan.stages > 0


def test_the_window_holds_a_quantized_chunk() -> None:
    # Many tokens per launch narrow the staged window; a chunk of the quantized GEMV must still fit it.
    for tokens in (1, 4, 8):
        for units in (1, 4):
            plan = KernelPlan(
                config_27b(),
                num_sms=82,
                tokens_per_launch=tokens,
                tuning=Tuning(qunits=units),
                weight_formats=q4_k_m_formats(),
            )
            for k in (5120, 6144, 10240, 17408):
                assert plan.window >= min(k, quant_chunk_width(k, units)), (tokens, k, plan.window)
    # One unit of 32 inputs per lane (the default): a chunk is 1024 inputs. Four at most: 5 loads per lane in 2
    # chunks of 3, 17 in 5 of 4, one for 256 inputs.
    assert quant_chunk_width(5120, 1) == quant_chunk_width(17408, 1) == quant_chunk_width(256, 1) == 1024
    assert (
        quant_chunk_width(5120, 4) == 3072
        and quant_chunk_width(17408, 4) == 4096
        and quant_chunk_width(256, 4) == 1024
    )


def test_rows_per_quantized_item_follow_the_tokens_per_launch_and_the_ring() -> None:
    """4 rows per item up to 4 tokens and 2 from 5 to 8 where such items stream through the weight ring (the
    H200's shared memory); where they would be held in registers (the RTX 3090's), 2 at 3-4 tokens and 1 beyond."""

    def plan(tokens: int, smem: int, **fields: object) -> KernelPlan:
        return KernelPlan(
            config_27b(),
            num_sms=132,
            tokens_per_launch=tokens,
            tuning=Tuning(**fields),
            smem_limit=smem,
            weight_formats=q4_k_m_formats(),
        )

    def rows(tokens: int, smem: int = 227 * 1024, **fields: object) -> int:
        return plan(tokens, smem, **fields).defines()["MK_QROWS"]

    assert [rows(t) for t in range(1, 9)] == [4, 4, 4, 4, 2, 2, 2, 2]
    assert all(plan(t, 227 * 1024).stages == 2 for t in range(1, 9))
    assert [rows(t, 99 * 1024) for t in (1, 2, 4, 5, 8)] == [4, 4, 2, 1, 1]
    assert plan(4, 227 * 1024).stages > 0 and plan(4, 99 * 1024, qrows=4).stages == 0
    assert rows(8, qrows=2) == 2
    with pytest.raises(ValueError, match="qrows"):
        Tuning(qrows=3)


def test_the_tensor_core_gemv_refuses_quantized_weights() -> None:
    with pytest.raises(UnsupportedModelError, match="scalar GEMV"):
        KernelPlan(config_27b(), num_sms=132, tuning=Tuning(mma=True), weight_formats=q4_k_m_formats())


@torch.no_grad()
def test_device_weights_group_tag_and_refuse_mixtures() -> None:
    model = random_model(small_config(), seed=2, device="cpu")
    types = quantize_randomly(model, preset_types(model, "q4_k_m"), seed=3)
    assert {t.name for t in types.values()} == {"Q4_K", "Q6_K"}
    layers = [*model.model.layers, *model.mtp.layers]
    weights = DeviceWeights(model, layers, has_mtp=True)
    plan = KernelPlan(model.config, num_sms=132, weight_formats=weights.weight_formats)
    assert not plan.streams_bf16 and weights.quantized
    assert weights.gemv_bytes == sum(
        QuantType[t.name].nbytes(model.get_submodule(n.rsplit(".", 1)[0]).shape) for n, t in types.items()
    )
    ptr = weights.pointer(model.lm_head)
    assert ptr >> TAG_SHIFT == FORMAT_CODES[types["lm_head.weight"]]
    # A DeltaNet input GEMV with one bf16 tensor among quantized ones is refused (one loop per GEMV).
    mixed = random_model(small_config(), seed=2, device="cpu")
    la = mixed.model.layers[0].linear_attn
    raw = QuantizedWeight.from_float(QuantType.Q8_0, la.in_proj_z.weight.float())
    install_quantized_weights(
        mixed, {"model.layers.0.linear_attn.in_proj_z.weight": raw}, dtype=torch.bfloat16
    )
    with pytest.raises(UnsupportedModelError, match="mixes bf16 and quantized"):
        DeviceWeights(mixed, [*mixed.model.layers, *mixed.mtp.layers], has_mtp=True)


# A kernel that runs the quantized GEMV loop alone (its partials, rounds and passes, with a trivial epilogue and
# staging), so that ptxas reports the loop's own spills: in the megakernel the loop shares a function with the
# step loop and the phases, whose spills the report does not separate.
GEMV_PROBE = r"""
extern "C" __global__ void __launch_bounds__(MK_THREADS, 1) mk_gemv_quant_probe(const GemvDesc* desc, float* out) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ GemvDesc d;
    if (tid_x() == 0) d = *desc;
    __syncthreads();
    const Smem sm = carve_smem(smem_raw);
    gemv_run_quant(
        d, sm.xs, sm.part, sm.rowval, sm.ring, false,
        [&](int rs, int nr, const float* rowval, int ld) {
            for (int i = tid_x(); i < nr * MK_NT; i += MK_THREADS) out[rs + i] = rowval[i];
        },
        [&](int k0, int k1) {
            for (int i = tid_x(); i < MK_NT * (k1 - k0); i += MK_THREADS) sm.xs[i] = 0;
            __syncthreads();
        });
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize(
    ("arch", "sms", "smem", "tokens"),
    [
        ("sm_90", 132, 227 * 1024, 1),
        ("sm_86", 82, 99 * 1024, 1),
        ("sm_90", 132, 227 * 1024, 4),
        ("sm_86", 82, 99 * 1024, 4),
        ("sm_90", 132, 227 * 1024, 8),
    ],
)
def test_the_q4_k_m_build_compiles_and_its_gemv_loop_does_not_spill(
    arch: str, sms: int, smem: int, tokens: int
) -> None:
    """The 27B Q4_K_M build compiles for the H200 and the RTX 3090, decode and T = 4 (and on the H200 T = 8, with
    its 2-row items through the ring) verifies, and the quantized GEMV loop alone spills nothing (the loop that streams every weight: a spill there would be paid per item)."""
    plan = KernelPlan(
        config_27b(), num_sms=sms, tokens_per_launch=tokens, smem_limit=smem, weight_formats=q4_k_m_formats()
    )
    report = ptxas_report(nvcc_compile(plan, arch, extra_source=GEMV_PROBE))
    assert report["mk_decode"]["registers"] * plan.tuning.threads <= 65536, report["mk_decode"]
    probe = report["mk_gemv_quant_probe"]
    assert probe["spill_stores"] == 0 and probe["spill_loads"] == 0, probe
    dequant = report["mk_dequant"]  # the prefill's reader of the repacked weights
    assert dequant["spill_stores"] == 0 and dequant["spill_loads"] == 0, dequant
    print(
        f"\nq4_k_m {arch} T = {tokens}, {plan.quant_rows} rows: mk_decode {report['mk_decode']}, GEMV loop {probe}"
    )


@torch.no_grad()
def test_repacking_hands_the_bytes_over_and_the_reference_reads_the_copy() -> None:
    """Once the runner's weights are repacked, each quantized module drops its GGUF bytes and dequantizes from
    the repacked copy, bit for bit as before: the model's tensors and the copy together hold the weights once."""

    def tensor_bytes(model) -> int:
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
        return sum(seen.values())

    model = random_model(small_config(), seed=2, device="cpu")
    quantize_randomly(model, preset_types(model, "q4_k_m"), seed=3)
    quantized = [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    before = {id(m): m.dequantize(torch.float32) for m in quantized}
    ids = torch.tensor([5, 17, 3, 250, 9])
    logits = model.forward(ids[None])[0]
    raw_bytes, held_before = sum(m.raw.numel() for m in quantized), tensor_bytes(model)
    layers = [*model.model.layers, *model.mtp.layers]
    weights = DeviceWeights(model, layers, has_mtp=True)
    assert all(m.raw.numel() == 0 and m.source is not None for m in quantized)
    for m in quantized:
        assert torch.equal(m.dequantize(torch.float32), before[id(m)])
    assert torch.equal(model.forward(ids[None])[0], logits)
    # One copy: the model's own tensors lost the GGUF bytes; the repacked copy adds them back (rows padded).
    assert tensor_bytes(model) == held_before - raw_bytes
    assert raw_bytes <= weights.repacked_bytes <= 1.05 * raw_bytes
    with pytest.raises(RuntimeError, match="handed its GGUF bytes over"):
        _ = quantized[0].quantized
    # A second runner on the model shares the first one's copy.
    again = DeviceWeights(model, layers, has_mtp=True)
    assert again.pointer(model.lm_head) == weights.pointer(model.lm_head)
    assert again.repacked_bytes == weights.repacked_bytes


def test_the_kernels_tiled_columns_are_the_gguf_layouts() -> None:
    """MK_DN_OUT_HEAD's order (quant_weights.tiled_columns) is the permutation the GGUF loader gives ssm_out."""
    from onestream.kernels.quant_weights import tiled_columns
    from onestream.worker.checkpoints.gguf_layout import grouped_to_tiled

    for hk, hv in ((1, 2), (2, 4), (16, 48), (4, 4)):
        config = tiny_config(linear_num_key_heads=hk, linear_num_value_heads=hv)
        dv = config.linear_value_head_dim
        assert torch.equal(tiled_columns(config), grouped_to_tiled(config, dv)), (hk, hv)


def test_a_tiled_plan_defines_its_order_and_others_keep_their_defines() -> None:
    plain = KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q4_k_m_formats())
    tiled = KernelPlan(
        config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q4_k_m_formats(), dn_out_tiled=True
    )
    assert "MK_DN_OUT_TILED" not in plain.defines()
    assert {**plain.defines(), "MK_DN_OUT_TILED": 1} == tiled.defines()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_tiled_build_compiles() -> None:
    # The 27B shapes take the vectorised gated norm (dv 128), value heads of 48 the per-warp one.
    plan = KernelPlan(
        config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q4_k_m_formats(), dn_out_tiled=True
    )
    nvcc_compile(plan, "sm_90", ptxas_verbose=False)
    odd = tiny_config(linear_value_head_dim=48)
    nvcc_compile(
        KernelPlan(odd, num_sms=132, smem_limit=227 * 1024, dn_out_tiled=True), "sm_90", ptxas_verbose=False
    )


# ---- a quantized embedding table ------------------------------------------------------------------------------
def test_a_quantized_embedding_defines_its_format_and_row_stride() -> None:
    """The plan names the table's format (MK_EFMT) and its device-layout row (MK_EMBED_STRIDE), compiles the
    format's decoding (MK_QFMTS, even when every GEMV is bf16); a bf16 table keeps the plan's defines as they were."""
    from onestream.kernels.quant_layout import row_layout

    plain = KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q4_k_m_formats())
    embed = KernelPlan(
        config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q4_k_m_formats(), embed_format=W.Q4_K
    )
    stride = row_layout(QuantType.Q4_K, 5120)[1]
    assert stride == 5120 // 256 * 144  # no padding: the table holds the file's bytes
    assert {
        **plain.defines(),
        "MK_EFMT": FORMAT_CODES[QuantType.Q4_K],
        "MK_EMBED_STRIDE": stride,
    } == embed.defines()
    bf16 = KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024, embed_format=W.Q8_0)
    assert bf16.defines()["MK_QFMTS"] == 1 << FORMAT_CODES[QuantType.Q8_0] and bf16.streams_bf16
    assert "MK_QFMTS" not in KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024).defines()
    with pytest.raises(UnsupportedModelError, match="tensor-core"):
        KernelPlan(config_27b(), num_sms=132, tuning=Tuning(mma=True), embed_format=W.Q4_K)


@torch.no_grad()
@pytest.mark.parametrize("qtype", [QuantType.Q4_K, QuantType.Q6_K, QuantType.Q5_1])
def test_device_weights_repack_a_quantized_embedding_and_hand_it_over(qtype: QuantType) -> None:
    """An untied quantized table is repacked like a GEMV weight and handed over: its lookups read the copy, bit
    for bit as before, and the kernel's rows are that copy (no bf16 table beside it)."""
    model = random_model(small_config(), seed=4, device="cpu")
    quantize_randomly(model, preset_types(model, "q4_k_m"), seed=5)
    table = model.model.embed_tokens.weight
    install_quantized_weights(
        model,
        {"model.embed_tokens.weight": QuantizedWeight.from_float(qtype, table.float())},
        dtype=torch.bfloat16,
    )
    embed = model.model.embed_tokens
    assert isinstance(embed, QuantizedEmbedding)
    ids = torch.tensor([[3, 250, 9, 3]])
    rows = embed(ids)
    raw = embed.raw.numel()
    weights = DeviceWeights(model, [*model.model.layers, *model.mtp.layers], has_mtp=True)
    assert weights.embed_format is WeightFormat(qtype.name.lower())
    assert embed.raw.numel() == 0 and torch.equal(embed(ids), rows)
    packed = weights.embed_table()
    assert packed.dtype == torch.uint8 and packed.numel() >= raw
    assert (
        weights.gemv_bytes == DeviceWeights(model, [*model.model.layers, *model.mtp.layers], True).gemv_bytes
    )
    # The bf16 table of an unquantized model is the model's own tensor.
    plain = random_model(small_config(), seed=4, device="cpu")
    bf16 = DeviceWeights(plain, [*plain.model.layers, *plain.mtp.layers], has_mtp=True)
    assert bf16.embed_format is WeightFormat.BF16
    assert bf16.embed_table().data_ptr() == plain.model.embed_tokens.weight.data_ptr()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_quantized_embedding_builds_compile() -> None:
    """The 27B Q4_K_M build reading a Q4_K table compiles for the H200, and so does a bf16 build (bf16 activations)
    reading a Q5_1 one (the decoding without any quantized GEMV)."""
    plan = KernelPlan(
        config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q4_k_m_formats(), embed_format=W.Q4_K
    )
    report = ptxas_report(nvcc_compile(plan, "sm_90"))
    assert report["mk_decode"]["registers"] * plan.tuning.threads <= 65536, report["mk_decode"]
    print(f"\nq4_k_m, Q4_K table: mk_decode {report['mk_decode']}")
    small = KernelPlan(small_config(), num_sms=132, tuning=Tuning(fp32_act=False), embed_format=W.Q5_1)
    nvcc_compile(small, "sm_90", ptxas_verbose=False)


def test_a_plans_layout_is_worked_out_once() -> None:
    """Every launch reads `smem_bytes`; a plan is immutable, so its carve and the format sums under it are worked
    out once (recomputed, they cost 0.1-0.2 ms of Python a launch: a speculative cycle's several launches
    lengthened the host's turn between the verify and the next draft)."""
    plan = KernelPlan(config_27b(), num_sms=132, smem_limit=227 * 1024, weight_formats=q4_k_m_formats())
    assert plan.carve is plan.carve and plan.smem_bytes == plan.carve.total
    start = time.perf_counter()
    for _ in range(10_000):
        plan.smem_bytes  # noqa: B018
    assert time.perf_counter() - start < 0.1
