"""`onestream eval kld`, `onestream eval spec` and `onestream generate`, run in-process through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from onestream.worker.evaluation import KLDAccumulator, cut_prompts
from onestream.worker.testing import write_tiny_checkpoint
from onestream.worker.testing_spec import write_draftable_checkpoint

from onestream.cli import main

torch.set_num_threads(1)
CODE = '''
def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
'''


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("cli_tiny"), seed=4)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_draftable_checkpoint(tmp_path_factory.mktemp("cli_draft"), seed=6)


@pytest.fixture()
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "code.py"
    path.write_text(CODE * 3)
    return path


def test_eval_kld_against_transformers_is_zero(
    tiny_dir: Path, text_file: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("transformers")
    code = main(
        ["eval", "kld", "--model", str(tiny_dir), "--against", "hf", "--text", str(text_file), "--ctx", "96",
         "--backend", "reference", "--device", "cpu", "--dtype", "fp32", "--json"]
    )  # fmt: skip
    assert code == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["positions"] > 200
    assert abs(stats["mean_kld"]) < 1e-6 and stats["kld_max"] < 1e-5
    assert stats["same_top1_pct"] == 100.0
    assert stats["max_abs_logit_diff"] < 1e-3
    assert stats["ppl_test"] == pytest.approx(stats["ppl_ref"], rel=1e-4)


def test_eval_kld_sees_a_different_model(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    other = write_tiny_checkpoint(tmp_path / "other", seed=5)
    ids = torch.randint(0, 256, (300,)).tolist()
    token_file = tmp_path / "ids.txt"
    token_file.write_text(" ".join(map(str, ids)))
    assert main(["eval", "kld", "--model", str(tiny_dir), "--against", str(other), "--tokens", str(token_file),
                 "--ctx", "100", "--backend", "reference"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "Mean KLD" in out and "Same top-1" in out and "99.9% KLD" in out
    mean_kld = float(out.split("Mean KLD")[1].split()[0])
    assert mean_kld > 0.1  # two unrelated random models disagree


def test_eval_kld_against_the_reference_runs_the_same_quantized_weights(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--quantize applies to `--against reference` too (the megakernel's bar: the fp32 reference on the same
    quantized weights); --against-quantize overrides it."""
    token_file = tmp_path / "ids.txt"
    token_file.write_text(" ".join(map(str, torch.randint(0, 256, (200,)).tolist())))
    common = ["eval", "kld", "--model", str(tiny_dir), "--tokens", str(token_file), "--ctx", "100",
              "--backend", "reference", "--device", "cpu", "--dtype", "fp32", "--json", "--quantize", "q8_0",
              "--against", "reference"]  # fmt: skip
    assert main(common) == 0
    same = json.loads(capsys.readouterr().out)
    assert same["positions"] == 198 and abs(same["mean_kld"]) < 1e-6 and same["same_top1_pct"] == 100.0
    assert main([*common, "--against-quantize", "q4_k_m"]) == 0
    assert json.loads(capsys.readouterr().out)["mean_kld"] > 1e-4  # another quantization: it shows


def test_kld_statistics_on_known_distributions() -> None:
    torch.manual_seed(0)
    ref = torch.randn(1000, 8)
    test = ref + 0.1 * torch.randn(1000, 8)
    targets = torch.randint(0, 8, (1000,))
    acc = KLDAccumulator()
    acc.add(test[:400], ref[:400], targets[:400])
    acc.add(test[400:], ref[400:], targets[400:])
    stats = acc.result()
    p, log_q = torch.softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    kld = (p * (p.log() - log_q)).sum(-1)
    assert stats.positions == 1000
    assert stats.mean_kld == pytest.approx(float(kld.mean()), rel=1e-9)
    assert stats.kld_stderr == pytest.approx(float(kld.std() / 1000**0.5), rel=1e-6)
    assert stats.kld_percentiles["Median"] == pytest.approx(float(kld.median()), rel=1e-2)
    same = (test.argmax(-1) == ref.argmax(-1)).double().mean() * 100
    assert stats.same_top1_pct == pytest.approx(float(same))
    assert stats.max_abs_logit_diff == pytest.approx(float((test - ref).abs().max()), rel=1e-6)


def test_eval_spec_prints_acceptance_and_speed(
    draft_dir: Path, text_file: Path, capsys: pytest.CaptureFixture
) -> None:
    args = ["eval", "spec", "--model", str(draft_dir), "--backend", "reference", "--k", "1", "3",
            "--prompt-tokens", "24", "--max-tokens", "24", "--prompts-per-file", "3", str(text_file)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "speculative outputs identical to plain" in out and "fastest: k=" in out
    assert main([*args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompts"] == 3 and record["outputs_identical"]
    assert record["plain"]["generated_tokens"] == 3 * 24
    for run, k in zip(record["speculative"], (1, 3), strict=True):
        assert run["k"] == k and run["drafts"] > 0 and run["draft_tokens"] <= k * run["drafts"]
        assert len(run["acceptance_per_position"]) == k
        assert 1.0 < run["mean_accepted_length"] <= k + 1
        assert run["mean_accepted_length"] == pytest.approx(1 + run["accepted_tokens"] / run["drafts"])
        assert run["tokens_per_s"] > 0 and run["speedup"] > 0


def test_eval_spec_workload_reports_each_draft_source(
    draft_dir: Path, text_file: Path, capsys: pytest.CaptureFixture
) -> None:
    args = ["eval", "spec", "--model", str(draft_dir), "--backend", "reference", "--workload", "mixed",
            "--prompt-tokens", "48", "--max-tokens", "16", "--prompts-per-file", "2", "--json",
            str(text_file)]  # fmt: skip
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["workload"] == "mixed" and record["prompts"] == 2 and record["outputs_identical"]
    runs = {run["drafting"]: run for run in record["speculative"]}
    assert set(runs) == {"mtp", "lookup", "combined"}
    assert set(runs["mtp"]["by_source"]) == {"mtp"}
    assert set(runs["lookup"]["by_source"]) <= {"lookup"}
    for run in runs.values():
        assert run["drafts"] == sum(c["drafts"] for c in run["by_source"].values())
        assert 1.0 <= run["tokens_per_pass"] <= run["mean_accepted_length"] + 1e-9
        assert run["target_passes"] <= record["plain"]["generated_tokens"] - record["prompts"]


def test_eval_spec_needs_long_enough_files(
    draft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    assert main(["eval", "spec", "--model", str(draft_dir), "--backend", "reference", str(short)]) == 2
    assert "no file has" in capsys.readouterr().err


def test_eval_spec_names_a_draft_vocabulary_it_cannot_take(
    draft_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source = tmp_path / "code.txt"
    source.write_text("def f(x):\n    return x + 1\n" * 40)
    assert main(["eval", "spec", "--model", str(draft_dir), "--backend", "reference", "--draft-vocab", "12",
                 str(source)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("onestream eval spec: ") and "multiple of 8" in err and "got 12" in err


def test_generate_streams_and_reports(draft_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(draft_dir), "--backend", "reference", "--prompt", "def main():",
                 "--max-tokens", "12", "--ignore-eos", "--spec-k", "2"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "finish=length" in captured.err and "generated=12" in captured.err and "tok/s" in captured.err
    assert main(["generate", "--model", str(draft_dir), "--backend", "reference", "--prompt", "def main():",
                 "--max-tokens", "12", "--ignore-eos", "--json", "--temperature", "0.8", "--seed", "3",
                 "--top-p", "0.9"]) == 0  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    assert len(record["token_ids"]) == 12 and record["finish_reason"] == "length"
    assert record["usage"]["generated_tokens"] == 12


def test_generate_rejects_bad_parameters(draft_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(draft_dir), "--backend", "reference", "--prompt", "x",
                 "--top-p", "1.5"]) == 2  # fmt: skip
    assert "top_p must be in" in capsys.readouterr().err


def test_eval_reports_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 three")
    assert (
        main(["eval", "kld", "--model", str(tmp_path / "missing"), "--against", "hf", "--tokens", str(ids)])
        == 2
    )
    assert "missing: no such file or directory" in capsys.readouterr().err


def test_prompts_are_cut_evenly_with_room_to_continue() -> None:
    sources = [list(range(100)), list(range(29)), list(range(30)), list(range(1000, 1050))]
    prompts = cut_prompts(sources, prompt_tokens=20, per_source=3, room=10)
    assert prompts[:3] == [list(range(0, 20)), list(range(35, 55)), list(range(70, 90))]
    assert prompts[3] == list(range(0, 20))  # 29 tokens leave no room; 30 leave room for one prompt
    assert prompts[4:] == [list(range(1000, 1020)), list(range(1010, 1030)), list(range(1020, 1040))]


def test_backends_built_on_the_reference_are_measured_through_their_own_decode(tmp_path: Path) -> None:
    """The megakernel back end subclasses ReferenceBackend; eval kld must still run ITS decode steps, not the
    reference's batched forward (a bug that once made `--backend megakernel` measure the reference)."""
    from onestream.worker.backend import ReferenceBackend
    from onestream.worker.evaluation import BackendSteps, ReferenceForward, reference_source
    from onestream.worker.loading import load_model

    model = load_model(write_tiny_checkpoint(tmp_path / "m"), dtype=torch.float32)

    class DerivedBackend(ReferenceBackend):
        name = "derived"

    assert isinstance(reference_source(ReferenceBackend(model)), ReferenceForward)
    assert isinstance(reference_source(DerivedBackend(model)), BackendSteps)
