"""The megakernel's host-side pieces that need no GPU: constants, source assembly, limits, reports."""

from __future__ import annotations

import argparse
import itertools
import re

import numpy as np
import pytest
import torch
from onestream.kernels.build import assemble_source, ptxas_report
from onestream.kernels.layout import (
    LAYER_FULL,
    LAYER_LINEAR,
    MAX_TOKENS_PER_LAUNCH,
    MODE_MTP,
    G,
    L,
    Phase,
    ctrl_slots,
    preamble_defines,
)
from onestream.kernels.phase_timing import (
    PHASE_NAMES,
    attention_items,
    deltanet_items,
    format_breakdown,
    format_item_times,
    item_times,
    step_phases,
    summarise,
)
from onestream.kernels.plan import (
    ATT_FOLD_LEVELS,
    ATT_MERGE_ACCS,
    ATT_PAIRS,
    AUTO_STAGES,
    FINAL_PHASES,
    LAYER_PHASES,
    LAYER_STEPS,
    QUANT_STEP_ATT_PAIRS,
    SMEM_OVER_BREAKS,
    WEIGHT_KINDS,
    KernelPlan,
    WeightFormat,
    dn_split,
    gemv_chunk_width_of,
    gemv_chunks,
    quant_chunk_width,
    weight_formats_of,
)
from onestream.kernels.random_model import config_27b, random_model
from onestream.kernels.runtime import MegakernelError, MegakernelRunner
from onestream.kernels.tuning import FP32_ACT_ENV, GEMV_ENV, SMEM_PREFER, Tuning, tuning_from_env
from onestream.worker.config import ModelConfig
from onestream.worker.errors import ContextLengthError, UnsupportedModelError
from onestream.worker.testing import tiny_config


def test_assembled_source_is_self_contained_and_carries_the_shapes() -> None:
    spec = KernelPlan(config_27b(), num_sms=132)
    src = assemble_source(spec)
    assert not re.search(r'^\s*#\s*include\s+"', src, re.M)  # headers inlined: the cache key sees every line
    assert "#pragma once" not in src
    for name, value in (("MK_H", 5120), ("MK_V", 248320), ("MK_HV", 48), ("MK_I", 17408), ("MK_ROT", 64)):
        assert f"#define {name} {value}\n" in src
    assert "#define MK_EPS 1e-06f" in src
    # mk_decode, mk_phase, mk_barrier_test, and mk_dequant (compiled in quantized builds only)
    assert src.count('extern "C" __global__') == 4


def test_table_slots_are_distinct_and_dense() -> None:
    for enum in (G, L, Phase):
        values = [int(m) for m in enum if m.name != "COUNT"]
        assert sorted(values) == list(range(len(values)))
    defines = preamble_defines()
    assert defines["CTRL_TOKEN_OUT"] == defines["CTRL_TOKEN_IN"] + MAX_TOKENS_PER_LAUNCH
    slots = ctrl_slots()
    assert slots["CTRL_INTS"] == slots["CTRL_TOKEN_OUT"] + MAX_TOKENS_PER_LAUNCH
    # The host uploads [CTRL_POS, CTRL_TOKEN_IN + T) per launch: the error slots must lie outside it.
    assert max(slots["CTRL_ERR"], slots["CTRL_ERR_INFO"]) < slots["CTRL_POS"]


def test_deltanet_split_fills_the_grid_with_block_sized_slices() -> None:
    assert dn_split(config_27b(), 132, 384) == 2  # 48 heads x 2 slices of 64 columns <= 132 blocks
    assert dn_split(config_27b(), 82, 384) == 1
    split = dn_split(tiny_config(), 132, 384)
    assert split >= 1 and 384 % (tiny_config().linear_value_head_dim // split) == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 100}, "hidden_size=100"),
        ({"head_dim": 512}, "head_dim=512"),
        ({"intermediate_size": 130}, "intermediate_size=130"),
    ],
)
def test_unsupported_shapes_are_named(overrides: dict, message: str) -> None:
    config = tiny_config(**overrides)
    with pytest.raises(UnsupportedModelError, match=message):
        KernelPlan(config, num_sms=132)


def test_tokens_per_launch_is_bounded() -> None:
    with pytest.raises(UnsupportedModelError, match="tokens per launch"):
        KernelPlan(tiny_config(), num_sms=132, tokens_per_launch=9)
    assert KernelPlan(tiny_config(), num_sms=132, tokens_per_launch=8).defines()["MK_NT"] == 8


def test_shared_memory_of_one_token_fits_ampere_and_hopper() -> None:
    spec = KernelPlan(config_27b(), num_sms=132)
    assert spec.smem_bytes <= 99 * 1024  # the sm_86 per-block limit (sm_90: 227 KB)
    # Several tokens per launch stage several activation rows: it grows with T.
    assert KernelPlan(config_27b(), num_sms=132, tokens_per_launch=2).smem_bytes > spec.smem_bytes


def test_more_tokens_per_launch_fit_by_narrowing_partials_and_the_staged_window() -> None:
    hopper = 227 * 1024
    specs = [
        KernelPlan(config_27b(), num_sms=132, tokens_per_launch=t, smem_limit=hopper)
        for t in range(1, MAX_TOKENS_PER_LAUNCH + 1)
    ]
    one = specs[0]
    assert one.window == 17408 and one.stages == AUTO_STAGES  # a single token stages every input whole
    for spec in specs:  # every T up to 8 fits and keeps a weight ring; wide inputs are crossed in passes
        assert spec.smem_bytes <= hopper and spec.stages >= 2, spec.tokens_per_launch
        assert 5120 <= spec.window <= 17408 and spec.window % 8 == 0
        assert spec.defines()["MK_XW"] == spec.window
    assert specs[3].stages == AUTO_STAGES and specs[3].window < one.window  # T = 4: the full ring, a window
    # A small model keeps the full ring and its whole inputs at every T.
    for t in range(1, MAX_TOKENS_PER_LAUNCH + 1):
        small = KernelPlan(tiny_config(), num_sms=132, tokens_per_launch=t, smem_limit=hopper)
        assert small.stages == AUTO_STAGES and small.smem_bytes <= hopper
        c = small.config
        assert small.window >= max(2 * c.hidden_size, c.intermediate_size, c.linear_value_dim)


def test_ptxas_report_parsing() -> None:
    text = """ptxas info    : Compiling entry function 'mk_decode' for 'sm_90'
ptxas info    : Function properties for mk_decode
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : Function properties for _Z3foov
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""
    report = ptxas_report(text)
    assert report["mk_decode"] == {"stack": 8, "spill_stores": 4, "spill_loads": 12, "registers": 168}
    assert report["_Z3foov"]["spill_stores"] == 0


def test_runner_refuses_a_cpu_model() -> None:
    model = random_model(tiny_config(), device="cpu")
    with pytest.raises(MegakernelError, match="CUDA"):
        MegakernelRunner(model)


def test_random_model_is_bf16_with_fp32_decay_parameters() -> None:
    model = random_model(tiny_config(), seed=3, device="cpu")
    la = model.model.layers[0].linear_attn
    assert model.dtype == torch.bfloat16 and la.A_log.dtype == torch.float32
    other = random_model(tiny_config(), seed=4, device="cpu")
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_27b_config_has_the_real_shapes() -> None:
    config = config_27b()
    assert isinstance(config, ModelConfig)
    assert len(config.linear_attention_layers) == 48 and len(config.full_attention_layers) == 16
    assert config.linear_qkv_dim == 10240


def test_bench_command_registers() -> None:
    from onestream.commands import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "decode", "--layers", "8", "--skip-hf"])
    assert args.layers == 8 and args.skip_hf and args.func is bench.run_decode and args.alternate == 0
    assert parser.parse_args(["bench", "decode", "--alternate", "5"]).alternate == 5


def test_bench_variants_and_tuning_overrides_parse(capsys: pytest.CaptureFixture) -> None:
    from onestream.commands import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "bench",
            "decode",
            "--variant",
            "noidle:mma=1,pf_idle_bytes=0",
            "--variant",
            "t:phase_timing=1",
        ]
    )
    (label, noidle), (_, timing) = args.variant
    assert label == "noidle" and noidle.mma and noidle.pf_idle_bytes == 0
    assert noidle.fp32_act and not noidle.phase_timing and timing.phase_timing
    # bench spec applies --tuning after --gemv / --phase-timing, so it keeps the fields named, not a whole Tuning
    spec = parser.parse_args(["bench", "spec", "--tuning", "fp32_act=false,att_pairs=2"])
    assert spec.tuning == {"fp32_act": False, "att_pairs": 2}
    for bad in (
        "nolabel",
        "default:att_pairs=1",  # the bench's own build
        "x:nosuch=1",
        "x:release_barrier=0",  # a switch that lost: gone (its branch is named in docs/benchmarks.md)
        "x:mma=maybe",
        "x:att_pairs=two",
        "x:mma=1,mma_sub=0",
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            bench._variant(bad)
    twice = parser.parse_args(["bench", "decode", "--variant", "a:att_pairs=1", "--variant", "a:att_pairs=2"])
    assert bench.run_decode(twice) == 2  # before any GPU work
    assert "labels repeat" in capsys.readouterr().err


def test_bench_decode_takes_a_list_of_contexts() -> None:
    from onestream.cli import build_parser
    from onestream.commands import bench

    parser = build_parser()
    sweep = parser.parse_args(
        ["bench", "decode", "--context", "512,8192,32768,131072", "--weights", "q4_k_m"]
    )
    assert sweep.context == [512, 8192, 32768, 131072] and sweep.weights == ["q4_k_m"]
    assert parser.parse_args(["bench", "decode"]).context == [64]
    for bad in ("", "0,512", "512,512", "5k"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench._contexts(bad)
    both = parser.parse_args(["bench", "decode", "--context", "512,32768", "--kv-cache", "auto,int8"])
    assert both.kv_cache == ["auto", "int8"] and parser.parse_args(["bench", "decode"]).kv_cache == ["auto"]
    for bad in ("", "fp8", "int8,int8"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench._kv_formats(bad)
    one = parser.parse_args(["bench", "decode", "--kv-cache", "int8"])
    assert bench.run_decode(one) == 2  # one context: refused before any GPU work


@torch.no_grad()
def test_context_bench_state_holds_the_context_in_every_cache() -> None:
    from onestream.kernels.bench_context import synthetic_state

    model = random_model(tiny_config(), seed=3, device="cpu")
    state = synthetic_state(model, 300, 340, seed=1)
    assert state.length == 300 and len(state.token_ids) == 300
    for cache in state.kv.values():
        assert cache.capacity >= 340 and cache.k[:, :300].abs().sum() > 0
        assert cache.k[:, 300:].abs().sum() == 0
    model.forward_step(torch.tensor([5]), state)  # a step continues from it
    assert state.length == 301
    int8 = synthetic_state(model, 300, 340, seed=1, kv_format="int8")
    for cache in int8.kv.values():
        assert cache.k.dtype == torch.int8 and bool((cache.k_scale[:, :300] > 0).all())
        assert cache.k[:, 300:].abs().sum() == 0 and cache.v_scale[:, 300:].abs().sum() == 0
    model.forward_step(torch.tensor([5]), int8)
    assert int8.length == 301


def test_weight_ring_only_where_shared_memory_holds_it() -> None:
    ampere = KernelPlan(config_27b(), num_sms=82)  # default limit: the sm_86 99 KB
    # Without the L1 preference both pick the same rows and window, so the ring is the only difference.
    hopper = KernelPlan(config_27b(), num_sms=132, tuning=Tuning(smem_prefer=0), smem_limit=227 * 1024)
    assert ampere.stages == 0 and ampere.defines()["MK_STAGES"] == 0
    assert hopper.stages == AUTO_STAGES and hopper.defines()["MK_STAGES"] == AUTO_STAGES
    t = hopper.tuning
    assert hopper.smem_bytes == ampere.smem_bytes + AUTO_STAGES * t.umax * t.threads * 16 <= 227 * 1024
    forced = KernelPlan(config_27b(), num_sms=132, tuning=Tuning(stages=0), smem_limit=227 * 1024)
    assert forced.stages == 0 and forced.smem_bytes == ampere.smem_bytes


def test_activation_precision_switch_reaches_the_source() -> None:
    assert Tuning().fp32_act and KernelPlan(tiny_config(), num_sms=132).defines()["MK_FP32_ACT"] == 1
    bf16 = KernelPlan(tiny_config(), num_sms=132, tuning=Tuning(fp32_act=False))
    assert bf16.defines()["MK_FP32_ACT"] == 0
    # The two precisions are different programs: the source text differs only in the switch.
    a = assemble_source(KernelPlan(tiny_config(), num_sms=132, tuning=Tuning(fp32_act=True)))
    b = assemble_source(bf16)
    diff = [(x, y) for x, y in zip(a.splitlines(), b.splitlines(), strict=True) if x != y]
    assert diff == [("#define MK_FP32_ACT 1", "#define MK_FP32_ACT 0")]


def test_environment_settings_are_read_at_the_edge_not_by_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """$ONESTREAM_MK_FP32_ACT / $ONESTREAM_MK_GEMV reach a build only through tuning_from_env (the back-end
    creation and the CLI call it); a Tuning built anywhere else has the defaults, whatever the shell exports."""
    monkeypatch.setenv(FP32_ACT_ENV, "0")
    monkeypatch.setenv(GEMV_ENV, "tensor")
    assert Tuning() == Tuning(fp32_act=True, mma=False)
    resolved = tuning_from_env()
    assert not resolved.fp32_act and resolved.mma
    assert tuning_from_env(mma=False).mma is False  # fields named at the edge win over the environment
    assert tuning_from_env({}) == Tuning()
    assert tuning_from_env({GEMV_ENV: "scalar", FP32_ACT_ENV: "true"}) == Tuning()
    # auto (the default): the tensor cores for an engine that verifies drafts, else the scalar GEMV
    assert tuning_from_env({}, speculative=True) == Tuning(mma=True)
    assert tuning_from_env({GEMV_ENV: "auto"}, speculative=False) == Tuning()
    assert tuning_from_env({GEMV_ENV: "scalar"}, speculative=True) == Tuning()
    assert tuning_from_env({GEMV_ENV: "tensor"}, speculative=False) == Tuning(mma=True)
    for env, name in (({FP32_ACT_ENV: "maybe"}, FP32_ACT_ENV), ({GEMV_ENV: "fast"}, GEMV_ENV)):
        with pytest.raises(ValueError, match=name):
            tuning_from_env(env)


def test_tensor_core_gemv_switch_checks_its_knobs_and_keeps_a_whole_item_per_round() -> None:
    hopper = 227 * 1024
    assert KernelPlan(config_27b(), num_sms=132).defines()["MK_MMA"] == 0  # the scalar GEMV is the default
    for t in (1, 4, 8):
        spec = KernelPlan(
            config_27b(), num_sms=132, tokens_per_launch=t, tuning=Tuning(mma=True), smem_limit=hopper
        )
        d = spec.defines()
        assert (d["MK_MMA"], d["MK_MMA_SUB"]) == (1, 2) and spec.smem_bytes <= hopper
        # gemv.cuh: a round holds (part_rows / chunks) & ~7 rows; every input width must leave at least one item
        # of 8 rows, or that phase would compute nothing.
        for k in (5120, 10240, 6144, 17408):
            assert (spec.part_rows // gemv_chunks(k, spec.tuning)) & ~7 >= 8, (t, k)
    with pytest.raises(ValueError, match="mma_sub"):
        Tuning(mma=True, mma_sub=0)


def test_several_tokens_pad_the_staged_rows_and_the_reduction_scratch() -> None:
    """The plan's carve: 128 bytes of alignment slack + the ring + the staged input (token rows of MK_XW + 32
    values when MK_NT > 1) + partials and row values + the reductions (max(64, tokens x warps) floats)."""
    hopper = 227 * 1024
    for t in (1, 2, 8):
        spec = KernelPlan(config_27b(), num_sms=132, tokens_per_launch=t, smem_limit=hopper)
        pad = 32 if t > 1 else 0
        red = max(64, t * spec.tuning.threads // 32)
        ring = spec.stages * spec.tuning.umax * spec.tuning.threads * 16
        xs = -(-(t * (spec.window + pad) * 2) // 16) * 16
        assert spec.smem_bytes == 128 + ring + xs + 2 * t * spec.part_rows * 4 + red * 4
    # 10 warps x 7 tokens = 70 floats of reduction scratch, rounded to 72: the whole stays 16-byte aligned.
    odd = KernelPlan(
        config_27b(), num_sms=132, tokens_per_launch=7, tuning=Tuning(threads=320), smem_limit=hopper
    )
    assert odd.smem_bytes % 16 == 0


def test_too_few_partial_rows_for_a_tensor_core_item_is_an_error() -> None:
    with pytest.raises(UnsupportedModelError, match="part_rows=256"):
        KernelPlan(config_27b(), num_sms=132, tuning=Tuning(mma=True, part_rows=256)).defines()


def test_too_few_partial_rows_for_the_mixer_scratch_is_an_error_not_a_compile_failure() -> None:
    with pytest.raises(UnsupportedModelError, match="part_rows=256 leaves the attention / DeltaNet"):
        KernelPlan(tiny_config(), num_sms=132, tuning=Tuning(part_rows=256)).defines()


def test_the_attention_tree_holds_qwens_whole_context_at_every_tokens_per_launch() -> None:
    spec = KernelPlan(tiny_config(), num_sms=132, tuning=Tuning(part_rows=512, att_split_log=0))
    assert spec.att_merge_chunks == 1 << ATT_FOLD_LEVELS  # one-chunk splits, the fold's splits
    for tokens in range(1, 9):
        default = KernelPlan(config_27b(), num_sms=132, tokens_per_launch=tokens, smem_limit=227 * 1024)
        assert default.att_merge_chunks * default.tuning.att_chunk >= 262144  # Qwen3.5's whole context


@pytest.mark.parametrize("lm_head", [WeightFormat.BF16, WeightFormat.Q6_K])
@pytest.mark.parametrize("qunits", [1, 2])
def test_the_lm_head_stages_a_hidden_row_in_one_pass(lm_head: WeightFormat, qunits: int) -> None:
    """The lm_head phase copies its staged input out as the MTP's hidden (megakernel.cu), so its first pass holds
    the whole row: a pass takes whole chunks, and the 27B's 5,120-wide row is three scalar chunks of 1,792. A
    5,120 window (sm_86 at T = 7 and 8; sm_90 at T = 5 once the attention scratch grew) staged 3,584 of the row
    first, and the hidden of a verify launch differed from its single steps' past that, on the GPU."""
    formats = (("lm_head", lm_head),) if lm_head is not WeightFormat.BF16 else ()
    for config in (config_27b(4, mtp=True), config_27b(4), tiny_config()):
        for tokens, (sms, limit) in itertools.product(range(1, 9), ((82, 99 * 1024), (132, 227 * 1024))):
            for mma in (False, True) if not formats else (False,):  # quantized weights: the scalar GEMV
                plan = KernelPlan(
                    config,
                    num_sms=sms,
                    tokens_per_launch=tokens,
                    smem_limit=limit,
                    tuning=Tuning(mma=mma, qunits=qunits),
                    weight_formats=formats,
                )
                h = config.hidden_size
                if lm_head is WeightFormat.BF16:
                    chunk = gemv_chunk_width_of(h, plan.tuning)
                    first = min(gemv_chunks(h, plan.tuning), plan.window // chunk) * chunk
                else:
                    chunk = quant_chunk_width(h, qunits)
                    first = plan.window // chunk * chunk
                assert first >= h, (config.hidden_size, tokens, sms, mma, plan.window)


Q4_K_M_FORMATS = weight_formats_of(  # the kinds' formats of a Q4_K_M file
    {
        **{kind: {WeightFormat.Q4_K} for kind in WEIGHT_KINDS},
        "att_in": {WeightFormat.Q4_K, WeightFormat.Q6_K},
        "mlp_down": {WeightFormat.Q4_K, WeightFormat.Q6_K},
        "lm_head": {WeightFormat.Q6_K},
    }
)


@pytest.mark.parametrize("tokens", [1, 2, 4, 8])
def test_the_chunk_merge_accumulators_fit_every_shipped_plan(tokens: int) -> None:
    """ATT_MERGE_ACCS accumulators and the rest of the attention scratch (six pairs an item in a quantized step) fit
    the partial-sum buffers of the 27B and tiny shapes on sm_86 and sm_90, both GEMVs, bf16 and quantized weights
    and both caches (a plan whose scratch does not fit raises)."""
    for config in (config_27b(), tiny_config()):
        for sms, limit in ((82, 99 * 1024), (132, 227 * 1024)):
            for mma, formats in ((False, ()), (True, ()), (False, Q4_K_M_FORMATS)):
                for kv in ("auto", "int8"):
                    plan = KernelPlan(
                        config,
                        num_sms=sms,
                        tokens_per_launch=tokens,
                        smem_limit=limit,
                        tuning=Tuning(mma=mma),
                        kv_cache=kv,
                        weight_formats=formats,
                    )
                    assert plan.defines()["MK_ATT_MACC"] == ATT_MERGE_ACCS
                    assert plan._scratch_fits(plan.part_rows)


def test_a_quantized_step_takes_six_attention_pairs_an_item_and_the_rest_three() -> None:
    """The plan's choice where the tuning leaves att_pairs open; a tuning's own value wins."""
    config = config_27b()

    def pairs(tokens: int, formats: tuple = (), **tuning: int) -> int:
        return KernelPlan(
            config, num_sms=132, tokens_per_launch=tokens, tuning=Tuning(**tuning), weight_formats=formats
        ).att_pairs

    assert pairs(1, Q4_K_M_FORMATS) == QUANT_STEP_ATT_PAIRS == 6
    assert pairs(1) == pairs(4, Q4_K_M_FORMATS) == pairs(8, Q4_K_M_FORMATS) == ATT_PAIRS == 3
    assert pairs(1, Q4_K_M_FORMATS, att_pairs=2) == 2 and pairs(1, att_pairs=6) == 6
    assert pairs(1, Q4_K_M_FORMATS, att_pairs=12) == 6  # a token's query heads of one key/value head at most


def test_attention_splits_fill_the_grid_at_long_context() -> None:
    """Short contexts keep one chunk per item (and the fewest pairs that fit); long ones cut the chunks into
    aligned splits of 2^k whose busiest block attends over the fewest chunks, within the fold's limit."""
    config = config_27b()
    plan = KernelPlan(
        config, num_sms=132, tokens_per_launch=1, tuning=Tuning(att_chunk=128)
    )  # the rule's figures
    short = plan.att_split(513)
    assert short.log == 0 and short.splits == 5 and short.pairs == 1 and short.items == 4 * 5 * 6
    for context in (8192, 32768, 131072):
        sp = plan.att_split(context + 1)
        chunks = -(-(context + 1) // plan.tuning.att_chunk)
        assert sp.log > 0 and sp.splits == -(-chunks // (1 << sp.log)) <= 1 << ATT_FOLD_LEVELS
        assert sp.pairs == plan.att_pairs and sp.items == 4 * sp.splits * sp.passes
        busiest = -(-sp.items // 132) << sp.log
        ideal = -(-4 * sp.passes * chunks // 132)
        assert busiest <= 1.1 * ideal + (1 << sp.log)  # no block holds more than a split over its share
    assert plan.att_split(131073).log == 5 and plan.att_split(131073).splits == 33
    assert plan.att_split(32769).splits * (1 << plan.att_split(32769).log) >= 257
    with pytest.raises(ContextLengthError, match="attention chunks"):
        KernelPlan(config, num_sms=132, tuning=Tuning(att_chunk=128, att_split_log=0)).att_split(128 * 257)
    assert (
        KernelPlan(config, 132, tuning=Tuning(att_chunk=128, att_split_log=0)).att_split(128 * 256).splits
        == 256
    )
    d = plan.defines()
    assert d["MK_ATT_SPLIT_LOG"] == plan.tuning.att_split_log and d["MK_ATT_FOLD_LEVELS"] == ATT_FOLD_LEVELS
    assert d["MK_ATT_MERGE_CHUNKS"] == 1 << (plan.tuning.att_split_log + ATT_FOLD_LEVELS)
    with pytest.raises(ValueError, match="att_split_log"):
        Tuning(att_split_log=11)


def test_phase_breakdown_from_stamps() -> None:
    rng = np.random.default_rng()
    names = ["a", "b", "a", "c"]
    blocks = 5
    starts, stamps, t = [], np.zeros((4, blocks, 2), dtype=np.int64), 1000
    busy = rng.integers(1000, 5000, size=(4, blocks))
    for s in range(4):
        depart = t + rng.integers(0, 300, size=blocks)  # blocks leave the barrier at slightly different times
        stamps[s, :, 0] = depart
        stamps[s, :, 1] = depart + busy[s]
        starts.append(depart.min())
        t = int(stamps[s, :, 1].max()) + 700  # barrier
    rows = {r.name: r for r in summarise(stamps, names)}
    assert [r for r in rows] == ["a", "b", "c"] and rows["a"].count == 2
    span_b = (starts[2] - starts[1]) / 1e3
    assert rows["b"].span_us == pytest.approx(span_b)
    assert rows["b"].busy_us == pytest.approx(busy[1].mean() / 1e3)
    assert rows["b"].critical_us == pytest.approx((stamps[1, :, 1].max() - starts[1]) / 1e3)
    assert rows["b"].barrier_us == pytest.approx((starts[2] - stamps[1, :, 1].max()) / 1e3)
    assert rows["c"].barrier_us == 0.0  # the last phase has no barrier after it
    total = sum(r.total_us for r in rows.values())
    assert total == pytest.approx((stamps[3, :, 1].max() - starts[0]) / 1e3)
    text = format_breakdown(list(rows.values()))
    assert "dn_rec" not in text and "\n   b " in text
    with pytest.raises(ValueError, match="do not match"):
        summarise(stamps[:3], names)


def test_phase_breakdown_splits_the_weight_streaming_phases() -> None:
    """GEMV stamps (stream start, last round's stream end) split a phase into prologue, stream and epilogue,
    averaged over the blocks that ran a GEMV; phases without one keep no split."""
    rng = np.random.default_rng()
    names = ["gemv", "mixer", "gemv"]
    blocks = 6
    stamps = np.zeros((3, blocks, 2), dtype=np.int64)
    gemv = np.zeros_like(stamps)
    t = 1000
    for s in range(3):
        stamps[s, :, 0] = t + rng.integers(0, 300, size=blocks)
        stamps[s, :, 1] = stamps[s, :, 0] + rng.integers(5000, 9000, size=blocks)
        if names[s] == "gemv":
            gemv[s, :, 0] = stamps[s, :, 0] + rng.integers(100, 1000, size=blocks)
            gemv[s, :, 1] = stamps[s, :, 1] - rng.integers(100, 1000, size=blocks)
        t = int(stamps[s, :, 1].max()) + 500
    gemv[2, 0] = 0  # a block without rows in that phase: left out of the means
    rows = {r.name: r for r in summarise(stamps, names, gemv)}
    idx = [0, 2]
    ran = np.ones((2, blocks), dtype=bool)
    ran[1, 0] = False
    pro = (gemv[idx, :, 0] - stamps[idx, :, 0])[ran] / 1e3
    stream = (gemv[idx, :, 1] - gemv[idx, :, 0])[ran] / 1e3
    epi = (stamps[idx, :, 1] - gemv[idx, :, 1])[ran] / 1e3
    g = rows["gemv"]
    assert (g.prologue_us, g.stream_us, g.epilogue_us) == pytest.approx(
        (pro.mean(), stream.mean(), epi.mean())
    )
    assert rows["mixer"].stream_us is None and rows["mixer"].prologue_us is None
    text = format_breakdown(list(rows.values()))
    assert "stream" in text.splitlines()[1] and len(text.splitlines()[2].split()) == 12
    assert len(text.splitlines()[3].split()) == 9  # the mixer row: no split columns
    assert "stream" not in format_breakdown(summarise(stamps, names)).splitlines()[1]
    with pytest.raises(ValueError, match="GEMV stamps"):
        summarise(stamps, names, gemv[:, :3])


def test_attention_item_labels_follow_the_kernels_split() -> None:
    """phases.cuh gives a 4-token launch at context 64 one (query head, token) pair per item (96 items fit the 132
    blocks), a single token 24; at long context the chunks overfill the grid: items take 3 pairs and splits of
    several chunks."""
    config = config_27b(4)
    pairs = KernelPlan(config, 132, 4).att_pairs
    four = attention_items(config, 4, 64, 132, pairs, 128)
    assert len(four) == 96 and four[:2] == ["kv0 c0 q0t0", "kv0 c0 q0t1"] and four[-1] == "kv3 c0 q5t3"
    assert len(attention_items(config, 1, 64, 132, KernelPlan(config, 132, 1).att_pairs, 128)) == 24
    long = attention_items(config, 1, 4000, 132, KernelPlan(config, 132, 1).att_pairs, 128)
    # splits of two chunks fill the grid
    assert len(long) == 4 * 16 * 2 and long[0] == "kv0 c0-1 q0t0,q1t0,q2t0"
    assert long == attention_items(config, 1, 4000, 132, 3, 128, split_log=5)
    assert len(attention_items(config, 1, 4000, 132, 3, 128, split_log=0)) == 4 * 32 * 2
    assert deltanet_items(config, 2)[:3] == ["hv0 slice0", "hv0 slice1", "hv1 slice0"]


def test_item_times_average_over_launches_and_pool_the_idle_blocks() -> None:
    names = ["dn_in", "attention", "att_out", "attention"]
    launches = []
    for launch in range(2):
        s = np.zeros((4, 4, 2), dtype=np.int64)
        for step in range(4):
            base = 100_000 * step + 1000 * launch
            s[step, :, 0] = base + np.array([0, 2000, 0, 1000])  # block 1 leaves the barrier 2 us late
            s[step, :, 1] = s[step, :, 0] + np.array([5000, 3000, 1000, 1000]) * (launch + 1)
        launches.append(s)
    rows = item_times(launches, names, "attention", ["first", "second"])
    assert [r.label for r in rows] == ["first", "second", "idle"]
    assert rows[1].start_us == pytest.approx(2.0) and rows[1].busy_us == pytest.approx(4.5)
    assert rows[1].end_us == pytest.approx(6.5) and rows[0].end_us == pytest.approx(7.5)
    assert rows[2].start_us == pytest.approx(0.5) and rows[2].busy_us == pytest.approx(1.5)
    text = format_item_times(rows, "attention")
    assert text.index("first") < text.index("second")  # the item that ends last comes first
    with pytest.raises(ValueError, match="items on 4 blocks"):
        item_times(launches, names, "attention", ["x"] * 5)
    with pytest.raises(ValueError, match="no phase"):
        item_times(launches, names, "dn_rec", ["x"])


def test_shared_memory_fit_leaves_l1_room_unless_it_costs_many_breaks() -> None:
    """At or below Tuning.smem_prefer the H200 keeps 60 KB of L1; the fit goes over only where staying under
    costs more than SMEM_OVER_BREAKS GEMV breaks."""
    hopper = 227 * 1024
    assert (
        KernelPlan(config_27b(), num_sms=132, smem_limit=hopper).smem_bytes <= SMEM_PREFER
    )  # the default T = 1
    # A 3-stage ring at T = 1: an 8192-input window (the wide phases in passes) keeps it under.
    deep = KernelPlan(config_27b(), num_sms=132, tuning=Tuning(stages=3), smem_limit=hopper)
    assert deep.smem_bytes <= SMEM_PREFER and deep.part_rows == 4096 and deep.window == 8192
    unpreferred = KernelPlan(
        config_27b(), num_sms=132, tuning=Tuning(stages=3, smem_prefer=0), smem_limit=hopper
    )
    assert unpreferred.smem_bytes > SMEM_PREFER and unpreferred.part_rows == 4096
    assert deep._breaks(deep.part_rows, deep.window) <= (
        unpreferred._breaks(unpreferred.part_rows, unpreferred.window) + SMEM_OVER_BREAKS
    )
    # Four tokens on the tensor cores: staying under would cost too many breaks, so the fit goes over.
    mma4 = KernelPlan(
        config_27b(), num_sms=132, tokens_per_launch=4, tuning=Tuning(mma=True), smem_limit=hopper
    )
    assert mma4.smem_bytes > SMEM_PREFER
    with pytest.raises(ValueError, match="smem_prefer"):
        Tuning(smem_prefer=-1)


@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_the_cuda_reads_the_plans_layout(tokens: int) -> None:
    """The defines are the plan's numbers: the shared-memory carve (regions in order, each whole, 16-byte
    aligned), the counters, the history length, the attention limits and the step structure."""
    plan = KernelPlan(config_27b(), num_sms=132, tokens_per_launch=tokens, smem_limit=227 * 1024)
    d, carve, t = plan.defines(), plan.carve, plan.tuning
    assert d["MK_SMEM_BYTES"] == plan.smem_bytes == carve.total == 128 + carve.end
    assert (d["MK_SMEM_XS"], d["MK_SMEM_PART"], d["MK_SMEM_ROWVAL"], d["MK_SMEM_RED"], d["MK_SMEM_END"]) == (
        carve.xs,
        carve.part,
        carve.rowval,
        carve.red,
        carve.end,
    )
    assert carve.xs == plan.stages * t.umax * t.threads * 16
    assert carve.part - carve.xs >= tokens * plan.window * 2
    assert carve.rowval - carve.part == carve.red - carve.rowval == tokens * plan.part_rows * 4
    assert all(offset % 16 == 0 for offset in carve)
    c = plan.config
    pairs = c.num_attention_heads // c.num_key_value_heads * tokens
    assert (d["MK_SYNC_BARRIER"], d["MK_SYNC_ARRIVALS"], d["MK_SYNC_COUNT"]) == (
        0,
        1,
        1 + c.num_key_value_heads * pairs,
    )
    assert d["MK_HIST_ENTRIES"] == plan.history_entries == tokens - 1
    assert d["MK_ATT_MERGE_CHUNKS"] == plan.att_merge_chunks
    att, dn = plan.scratch_floats
    assert (d["MK_ATT_SCRATCH_FLOATS"], d["MK_DN_SCRATCH_FLOATS"]) == (att, dn)
    assert att <= 2 * tokens * plan.part_rows and dn <= tokens * plan.part_rows
    for kind, name in ((LAYER_LINEAR, "LINEAR"), (LAYER_FULL, "FULL")):
        assert [d[f"MK_{name}_PHASE_{k}"] for k in range(LAYER_STEPS)] == list(LAYER_PHASES[kind])
    assert [d[f"MK_FINAL_PHASE_{k}"] for k in range(d["MK_FINAL_STEPS"])] == list(FINAL_PHASES)
    assert all(d[f"MK_WFMT_{kind.upper()}"] == 0 for kind in WEIGHT_KINDS)  # bf16 everywhere
    src = assemble_source(plan)
    for name in (
        "MK_SMEM_BYTES",
        "MK_SYNC_COUNT",
        "MK_ATT_MERGE_CHUNKS",
        "MK_HIST_ENTRIES",
        "MK_LAYER_STEPS",
    ):
        assert f"#define {name} {d[name]}\n" in src
        assert src.count(f"#define {name} ") == 1  # defined once: no second derivation in the sources


def test_the_step_list_is_the_plans() -> None:
    """One list of phases per launch: the kernel's step count (MK_LAYER_STEPS per layer, then the final
    phases), the timing breakdown's names and the MTP launch all come from it."""
    config = config_27b(8, mtp=True)
    plan = KernelPlan(config, num_sms=132)
    steps = plan.steps()
    d = plan.defines()
    assert len(steps) == d["MK_LAYER_STEPS"] * config.num_hidden_layers + d["MK_FINAL_STEPS"]
    assert [s.phase for s in steps[-2:]] == [Phase.LM_HEAD, Phase.FINALIZE]
    for layer in range(config.num_hidden_layers):
        mixer = steps[LAYER_STEPS * layer + 1]
        assert mixer.layer == layer
        assert mixer.phase == (Phase.ATT if layer in config.full_attention_layers else Phase.DN_REC)
    assert step_phases(config) == [PHASE_NAMES[s.phase] for s in steps]
    mtp = plan.steps(MODE_MTP)
    assert [s.phase for s in mtp] == [Phase.MTP_FC, *LAYER_PHASES[LAYER_FULL], *FINAL_PHASES]
    assert all(s.layer == config.num_hidden_layers for s in mtp)


def test_weight_formats_name_known_kinds() -> None:
    plan = KernelPlan(tiny_config(), num_sms=132, weight_formats=(("mlp_in", WeightFormat.BF16),))
    assert plan.formats_of("mlp_in") == plan.formats_of("lm_head") == {WeightFormat.BF16}
    assert plan.streams_bf16 and "MK_QFMTS" not in plan.defines()  # a bf16 plan keeps its defines
    with pytest.raises(UnsupportedModelError, match="unknown weight kind 'gate'"):
        KernelPlan(tiny_config(), num_sms=132, weight_formats=(("gate", WeightFormat.BF16),))
