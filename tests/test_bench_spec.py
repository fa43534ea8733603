"""`onestream bench spec` on the CPU: its options, the report and JSON it makes of measured results, the weights it
counts per step, the prompt sources it accepts, and its clear refusal without a GPU. The timing itself needs a GPU
(tools/gpu/README.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from onestream.kernels import bench_spec as bs
from onestream.kernels.benchmark import Ceilings
from onestream.kernels.random_model import random_model
from onestream.kernels.random_quant import quantize_randomly
from onestream.worker.evaluation import SpecRun
from onestream.worker.quant import QuantType
from onestream.worker.testing import tiny_config
from onestream.worker.testing_spec import write_draftable_checkpoint

from onestream.cli import build_parser, main
from onestream.commands import bench

torch.set_num_threads(1)
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def parse(*argv: str) -> object:
    return build_parser(only="bench").parse_args(["bench", "spec", *argv])


# ---- options ------------------------------------------------------------------------------------------
def test_defaults_cover_the_issue_sweep() -> None:
    args = parse()
    assert args.tokens == list(range(1, 9))
    assert args.k == [1, 2, 3, 4]
    assert args.layers == 64 and args.json is None
    assert not args.skip_27b and not args.skip_embedded
    assert args.func is bench.run_spec


def test_options_parse() -> None:
    args = parse("--layers", "16", "--tokens", "2", "4", "--k", "3", "--json", "out.json", "--skip-embedded")
    assert (args.layers, args.tokens, args.k, args.json, args.skip_embedded) == (
        16,
        [2, 4],
        [3],
        "out.json",
        True,
    )


@pytest.mark.parametrize(
    "argv",
    [("--tokens", "9"), ("--tokens", "0"), ("--k", "8"), ("--k", "0"), ("--layers", "0"), ("--tokens", "x")],
)
def test_out_of_range_options_are_refused(argv: tuple[str, ...], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@NO_GPU
def test_without_a_gpu_the_command_says_so_and_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "spec", "--skip-embedded"]) == 2
    err = capsys.readouterr().err
    assert "onestream bench spec" in err and "CUDA GPU" in err


# ---- prompt sources -----------------------------------------------------------------------------------
def test_prompt_files_takes_files_and_folders(tmp_path: Path) -> None:
    folder = tmp_path / "prompts"
    folder.mkdir()
    names = random.Random(3).sample([f"file_{i}.py" for i in range(20)], 5)
    for name in names:
        (folder / name).write_text("x = 1\n")
    (folder / "SOURCES.txt").write_text("\n".join(names))
    single = tmp_path / "one.py"
    single.write_text("y = 2\n")
    files = bs.prompt_files([folder, single])
    assert files == [*sorted(folder / n for n in names), single]


def test_prompt_files_names_a_missing_source(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nowhere\.py"):
        bs.prompt_files([tmp_path / "nowhere.py"])


# ---- weights per step ---------------------------------------------------------------------------------
def test_mtp_weight_bytes_counts_fc_layer_and_lm_head() -> None:
    config = tiny_config(tie_word_embeddings=False)
    model = random_model(config, seed=random.randrange(1 << 16), device="cpu")
    h, d = config.hidden_size, config.head_dim
    attention = h * config.num_attention_heads * d * 2 + 2 * h * config.num_key_value_heads * d
    attention += config.num_attention_heads * d * h  # q_proj emits [query | gate]; k, v; o_proj
    mlp = 3 * h * config.intermediate_size
    expected = 2 * (2 * h * h + attention + mlp + config.vocab_size * h + h)  # bf16; + one embedding row
    assert bs.mtp_weight_bytes(model) == expected
    without_mtp = random_model(tiny_config(mtp_num_hidden_layers=0), device="cpu")
    assert bs.mtp_weight_bytes(without_mtp) == 0


def test_weight_bytes_count_quantized_layers_by_their_blocks() -> None:
    """A q8_0 model's step and MTP step stream each matrix's blocks, not its bf16 size (bench spec --weights)."""
    config = tiny_config(tie_word_embeddings=False)
    plain = random_model(config, seed=3, device="cpu")
    bf16_step, bf16_mtp = bs.weight_bytes(plain), bs.mtp_weight_bytes(plain)
    model = random_model(config, seed=3, device="cpu")
    types = quantize_randomly(model, lambda name, shape: QuantType.Q8_0, seed=4)
    assert types and all(t is QuantType.Q8_0 for t in types.values())
    # Q8_0 keeps 34 bytes per 32 weights where bf16 keeps 64: every counted matrix shrinks by 34/64
    h = config.hidden_size
    assert bs.weight_bytes(model) - 2 * h == pytest.approx((bf16_step - 2 * h) * 34 / 64)
    assert bs.mtp_weight_bytes(model) - 2 * h == pytest.approx((bf16_mtp - 2 * h) * 34 / 64)


def test_bench_spec_takes_a_weights_preset(capsys: pytest.CaptureFixture) -> None:
    assert parse("--weights", "q4_k_m").weights == "q4_k_m"
    assert parse().weights == "bf16"
    with pytest.raises(SystemExit):
        parse("--weights", "q3_k")
    assert "--weights" in capsys.readouterr().err


def test_rewind_puts_every_timed_launch_at_the_same_positions() -> None:
    config = tiny_config()
    model = random_model(config, seed=random.randrange(1 << 16), device="cpu")
    state = model.new_state(32)
    prompt = torch.randint(0, config.vocab_size, (6,))
    model.forward_step(prompt, state)
    for _ in range(3):  # what a timed series does: a launch of T tokens, then the rewind
        model.forward_step(torch.randint(0, config.vocab_size, (4,)), state)
        bs._rewind_position(state, 6)
        assert state.length == 6
        assert state.token_ids == prompt.tolist()


# ---- report and JSON from measured results ------------------------------------------------------------
def spec_run(k: int, tok_s: float, rng: random.Random, prompts: int = 4, tokens: int = 64) -> SpecRun:
    drafts = 0 if k == 0 else rng.randint(20, 40)
    per_position = [rng.randint(0, drafts) for _ in range(k)]
    generated = prompts * tokens
    return SpecRun(
        k=k,
        prompts=prompts,
        generated_tokens=generated,
        decode_s=(generated - prompts) / tok_s,
        drafts=drafts,
        draft_tokens=drafts * k,
        accepted_tokens=sum(per_position),
        accepted_per_position=per_position,
    )


def fabricated(verify_t4_ms: float) -> bs.SpecBenchResult:
    rng = random.Random(11)
    verify = bs.VerifyResult("27B shapes", 16, 64, 16, 3, 17_000_000_000)
    verify.rows = [
        bs.VerifyRow(
            1, plain_ms=10.0, verify_ms=10.2, build={"stages": 3, "smem_bytes": 150_000, "registers": 168}
        ),
        bs.VerifyRow(2, plain_ms=10.3, verify_ms=10.6),
        bs.VerifyRow(4, plain_ms=10.8, verify_ms=verify_t4_ms),
        bs.VerifyRow(8, error="does not fit: the kernel needs 240000 bytes of shared memory"),
    ]
    draft = bs.DraftResult(
        main_ms=10.0, mtp_ms=1.3, main_weight_bytes=17_000_000_000, mtp_weight_bytes=3_400_000_000
    )
    mk = bs.BackendRuns(
        "megakernel", [spec_run(0, 1000.0, rng), spec_run(1, 1500.0, rng), spec_run(2, 1800.0, rng)]
    )
    mk.differing = {1: [], 2: [3]}
    ref = bs.BackendRuns("reference", [spec_run(0, 130.0, rng), spec_run(1, 150.0, rng)], {1: []})
    ref.error = "failed: RuntimeError: boom"
    info = {"model_name": "default_model", "dtype": "bfloat16", "device": "cuda:0"}
    embedded = bs.EmbeddedResult(info, 4, 128, 64, [mk, ref])
    return bs.SpecBenchResult("NVIDIA H200", Ceilings(3500.0, 4200.0), verify, draft, embedded)


def test_report_states_ratios_verdict_and_mismatches() -> None:
    result = fabricated(verify_t4_ms=11.0)
    text = bs.format_report(result)
    assert "1.100x" in text  # T=4 verify against the T=1 plain step
    assert "measured 1.100x, met" in text
    assert "does not fit: the kernel needs 240000 bytes" in text
    assert "27B shapes with 16 layers" in text and "smem 150000 B" in text
    assert "ratio 0.130" in text and "= 0.200" in text  # draft time and weight ratios
    assert "DIFFERS on prompts [3]" in text and "identical" in text
    assert "DIFFERS from plain greedy: {2: [3]}" in text
    assert "1.500x" in text and "1.800x" in text  # megakernel k=1, k=2 over its plain decode
    assert "failed: RuntimeError: boom" in text
    assert "4 held-out code prompts of 128 tokens, 64 greedy tokens each, bfloat16 on cuda:0" in text
    assert "MISSED" in bs.format_report(fabricated(verify_t4_ms=12.0))


def test_verdict_without_a_t4_figure_says_why() -> None:
    result = fabricated(verify_t4_ms=11.0)
    assert result.verify is not None
    result.verify.rows[2] = bs.VerifyRow(4, error="does not fit: too much shared memory")
    assert bs.verify_verdict(result.verify).endswith("does not fit: too much shared memory")
    result.verify.rows = fabricated(verify_t4_ms=11.0).verify.rows[1:]  # type: ignore[union-attr]
    assert bs.verify_verdict(result.verify).endswith("no T=1 step measured to compare with")
    assert "1.100x" not in bs.format_verify(result.verify, None)  # no baseline: no ratios


def test_json_round_trips_with_ratios() -> None:
    result = fabricated(verify_t4_ms=11.5)
    data = json.loads(json.dumps(bs.as_json(result)))
    assert data["device"] == "NVIDIA H200" and data["ceilings"]["read_gbs"] == 4200.0
    rows = {r["tokens"]: r for r in data["verify"]["rows"]}
    assert rows[4]["verify_ratio"] == pytest.approx(1.15)
    assert rows[2]["plain_ratio"] == pytest.approx(1.03)
    assert rows[8]["verify_ratio"] is None and rows[8]["error"].startswith("does not fit")
    assert data["verify"]["target"] == {"tokens": 4, "max_ratio": 1.15}
    assert data["draft"]["ratio"] == pytest.approx(0.13)
    mk, ref = data["embedded"]["backends"]
    assert [r["k"] for r in mk["runs"]] == [0, 1, 2]
    assert mk["runs"][2]["speedup"] == pytest.approx(1.8)
    assert mk["runs"][2]["outputs_identical_to_plain"] is False and mk["runs"][2]["differing_prompts"] == [3]
    assert mk["runs"][0]["outputs_identical_to_plain"] is None  # plain is the reference for the others
    assert ref["error"] == "failed: RuntimeError: boom"
    assert "outputs" not in mk["runs"][1]


def test_json_of_a_run_cut_short_has_the_parts_it_measured() -> None:
    result = bs.SpecBenchResult("NVIDIA H200", Ceilings(3500.0, 4200.0))
    data = json.loads(json.dumps(bs.as_json(result)))
    assert data["verify"] is None and data["draft"] is None and data["embedded"] is None
    assert "measured ceilings" in bs.format_report(result)


# ---- part (c) through the real engine, on the CPU ---------------------------------------------------------
def test_embedded_part_measures_every_k_and_checks_greedy_identity(tmp_path: Path) -> None:
    """The reference back end on a tiny checkpoint whose MTP head drafts well: each k is measured, drafts are
    accepted, and greedy speculative output equals plain greedy output prompt by prompt."""
    seed = random.randrange(1 << 16)
    model_dir = write_draftable_checkpoint(tmp_path / "model", seed=seed)
    rng = random.Random(seed)
    files = []
    for i in range(3):
        path = tmp_path / f"source_{i}.py"
        path.write_text("".join(f"value_{rng.randrange(1000)} = {rng.randrange(10**6)}\n" for _ in range(40)))
        files.append(path)
    result = bs.bench_embedded(
        model_dir,
        files,
        ks=[1, 3],
        prompt_tokens=16,
        prompts_per_file=1,
        max_prompts=2,
        max_tokens=12,
        backends=("reference",),
        device="cpu",
        dtype="fp32",
    )
    assert result.error == "" and result.prompts == 2
    (ref,) = result.backends
    assert ref.error == "" and [r.k for r in ref.runs] == [0, 1, 3]
    assert ref.differing == {1: [], 3: []}
    assert all(len(out) == 12 for r in ref.runs for out in r.outputs)
    assert all(r.drafts > 0 and r.accepted_tokens > 0 for r in ref.runs[1:])
    assert ref.runs[2].mean_accepted_length > 1.0
    text = bs.format_embedded(result)
    assert "2 held-out code prompts of 16 tokens, 12 greedy tokens each, float32 on cpu" in text
    assert text.count("identical") == 2


def test_embedded_part_reports_a_back_end_that_cannot_start(tmp_path: Path) -> None:
    model_dir = write_draftable_checkpoint(tmp_path / "model", seed=5)
    source = tmp_path / "source.py"
    source.write_text("x = 1\n" * 200)
    result = bs.bench_embedded(
        model_dir,
        [source],
        ks=[1],
        prompt_tokens=16,
        prompts_per_file=1,
        max_prompts=1,
        max_tokens=8,
        backends=("megakernel", "reference"),
        device="cpu",
        dtype="fp32",
    )
    megakernel, reference = result.backends
    assert megakernel.error.startswith("cannot start: BackendUnavailableError") and not megakernel.runs
    assert [r.k for r in reference.runs] == [0, 1] and reference.differing == {1: []}


# ---- part (d): whole cycles --------------------------------------------------------------------------
def test_cycle_options_parse() -> None:
    args = parse("--cycle", "--cycle-k", "1", "3", "--cycles", "4", "--profile", "mine:0.9,0.5")
    assert args.cycle and args.cycle_k == [1, 3] and args.cycles == 4
    assert args.profile == [("mine", [0.9, 0.5])]


@pytest.mark.parametrize("profile", ["x:0.5,0.9", "x:1.2", "x:", "x:a,b"])
def test_bad_profiles_are_refused(profile: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse("--cycle", "--profile", profile)
    assert "--profile" in capsys.readouterr().err


def cycle_result() -> object:
    from onestream.kernels import bench_cycle as bc

    r = bc.CycleResult("27B", context=48, cycles=10, repeats=3, chained_ms=14.0, engine_plain_ms=14.2)
    for k in (1, 3):
        for a in range(k + 1):
            r.rows.append(bc.CycleRow(k, a, engine_ms=20.0 + k + 0.1 * a, device_ms=19.5 + k + 0.1 * a))
    r.profiles = {"published": [0.96, 0.80, 0.64]}
    return r


def test_cycle_projection_weights_each_acceptance_by_its_probability() -> None:
    r = cycle_result()
    tok_s, length = r.projected(3, [0.96, 0.80, 0.64])  # type: ignore[attr-defined]
    assert length == pytest.approx(3.40)
    # P(a = 0..3) = 0.04, 0.16, 0.16, 0.64; cost 23.0 + 0.1 a
    ms = 0.04 * 23.0 + 0.16 * 23.1 + 0.16 * 23.2 + 0.64 * 23.3
    assert tok_s == pytest.approx(1e3 * 3.40 / ms)
    assert r.projected(1, [0.96, 0.80, 0.64])[1] == pytest.approx(1.96)  # type: ignore[attr-defined,index]
    assert r.projected(3, [0.9]) is None  # type: ignore[attr-defined]  # a profile shorter than k
    assert r.projected(2, [0.9, 0.8]) is None  # type: ignore[attr-defined]  # k = 2 not measured


def test_cycle_report_and_json() -> None:
    from onestream.kernels import bench_cycle as bc

    r = cycle_result()
    text = bc.format_cycle(r)  # type: ignore[arg-type]
    assert "98.6 % of the chained rate, met" in text
    assert "engine against device, worst (k, a): 1.024 (target 1.03: met)" in text
    assert "k = 3 cycle on the device (a = 0): 1.607x one plain step (target 1.30x: MISSED)" in text
    assert "projected at published (0.96 0.80 0.64)" in text and "accepted length 3.40" in text
    out = json.loads(json.dumps(bs.as_json(bs.SpecBenchResult("cpu", cycle=r))))
    assert out["cycle"]["rows"][0]["engine_over_device"] == pytest.approx(21.0 / 20.5)
    assert out["cycle"]["projected"]["published"]["3"]["engine"][1] == pytest.approx(3.40)


def test_forced_acceptance_is_benchmark_only() -> None:
    """Nothing `serve` builds can force acceptance: only the cycle bench names the back end that does."""
    repo = Path(__file__).resolve().parent.parent
    users = [
        p.relative_to(repo).as_posix()
        for folder in ("worker", "cluster", "kernels", "onestream")
        for p in (repo / folder).rglob("*.py")
        if "ForcedAcceptance" in p.read_text()
    ]
    assert users == ["kernels/bench_cycle.py"]
