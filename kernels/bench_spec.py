"""Speculative-decoding benchmark: what a verify launch, a draft step and a whole speculative cycle cost.

Three parts, each timed on the GPU of this run:
- verify: one megakernel launch of T = 1..8 tokens on the 27B shapes (random bf16 weights), plain (no recorded
  states) and as a verify pass (DeltaNet states recorded for rollback, greedy acceptance on the device), as a
  ratio to one plain T = 1 step. Every weight is read once per launch, so the ratio shows what the extra tokens
  cost on top of the weight stream.
- draft: one MTP head step (T = 1) against one main-model step (T = 1), same model, same context.
Every timed launch of the verify and draft parts runs at the same positions (the host position is put back after
each), so that every T sees the same context.
- embedded: the engine's greedy generation on held-out code with the embedded model, k = 1..4 drafts per cycle,
  megakernel against plain megakernel decode and against the reference back end; whether greedy speculative
  output equals plain greedy output, prompt by prompt.

Kernel times are medians over chains of back-to-back launches with CUDA events around each chain (no host sync
inside a chain); engine figures are the engine's own decode timings (`worker/evaluation.py`).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from onestream.worker.config import ModelConfig
from onestream.worker.errors import UnsupportedModelError
from onestream.worker.evaluation import SpecRun

from .benchmark import Ceilings, events_time, lm_head_bytes, module_weight_bytes, prefilled, weight_bytes
from .phase_timing import format_breakdown, step_phases, summarise

VERIFY_TARGET_TOKENS = 4
VERIFY_TARGET_RATIO = 1.15  # issue 7: a verify launch of 4 tokens costs at most 1.15x one decode step
# `python -m tools.default_model.evaluate --export-prompts DIR` writes the held-out files `eval spec` cut its
# recorded prompts from; the repository keeps them (ignored) here.
DEFAULT_PROMPTS_DIR = Path(__file__).resolve().parents[1] / ".data" / "default_model" / "spec_prompts"
EXPORT_HINT = "python -m tools.default_model.evaluate --export-prompts .data/default_model/spec_prompts"


# ---- results ------------------------------------------------------------------------------------------
@dataclass
class VerifyRow:
    tokens: int
    plain_ms: float | None = None  # one launch of T tokens, no recorded states
    verify_ms: float | None = None  # one verify launch: states recorded per token, greedy accept (T >= 2)
    build: dict[str, Any] = field(default_factory=dict)  # DiagnosticRunner.describe(T)
    breakdown: str = ""  # per-phase stamps of a plain launch (phase-timing builds)
    verify_breakdown: str = ""  # the same for a verify launch
    error: str = ""


@dataclass
class VerifyResult:
    name: str
    layers: int
    context: int
    launches: int  # back-to-back launches per timed chain
    repeats: int  # chains; the median chain counts
    weight_bytes: int  # weights one launch streams (the same for every T)
    rows: list[VerifyRow] = field(default_factory=list)
    error: str = ""

    @property
    def baseline_ms(self) -> float | None:
        """One plain T = 1 step: what every ratio is relative to."""
        return next((r.plain_ms for r in self.rows if r.tokens == 1), None)

    def ratio(self, ms: float | None) -> float | None:
        base = self.baseline_ms
        return ms / base if ms is not None and base else None

    def target_row(self) -> VerifyRow | None:
        return next((r for r in self.rows if r.tokens == VERIFY_TARGET_TOKENS), None)


@dataclass
class DraftResult:
    main_ms: float | None = None  # one main-model step, T = 1
    mtp_ms: float | None = None  # one MTP head step, T = 1
    main_weight_bytes: int = 0
    mtp_weight_bytes: int = 0  # fc, the MTP layer and the lm_head
    draft_vocab: int | None = None  # the greedy drafts' token ids below it (None: the whole vocabulary)
    greedy_ms: float | None = None  # one greedy draft as the engine chains it (mtp_chain, k = 1), draft_vocab
    error: str = ""

    @property
    def ratio(self) -> float | None:
        return self.mtp_ms / self.main_ms if self.mtp_ms is not None and self.main_ms else None

    @property
    def greedy_ratio(self) -> float | None:
        return self.greedy_ms / self.main_ms if self.greedy_ms is not None and self.main_ms else None

    @property
    def weight_ratio(self) -> float | None:
        return self.mtp_weight_bytes / self.main_weight_bytes if self.main_weight_bytes else None


@dataclass
class BackendRuns:
    backend: str  # the back end asked for ("megakernel", "reference")
    runs: list[SpecRun] = field(default_factory=list)  # k = 0 (plain) first
    differing: dict[int, list[int]] = field(
        default_factory=dict
    )  # k -> prompts whose output differs from k=0
    error: str = ""

    @property
    def plain(self) -> SpecRun | None:
        return next((r for r in self.runs if r.k == 0), None)

    def identical(self, k: int) -> bool | None:
        return None if k not in self.differing else not self.differing[k]


@dataclass
class EmbeddedResult:
    model: dict[str, Any] = field(default_factory=dict)
    prompts: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    backends: list[BackendRuns] = field(default_factory=list)
    error: str = ""

    def backend(self, name: str) -> BackendRuns | None:
        return next((b for b in self.backends if b.backend == name), None)


@dataclass
class SpecBenchResult:
    device: str
    ceilings: Ceilings | None = None
    verify: VerifyResult | None = None
    draft: DraftResult | None = None
    embedded: EmbeddedResult | None = None
    cycle: Any = None  # bench_cycle.CycleResult (`--cycle`)


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


# ---- kernel timing ------------------------------------------------------------------------------------
def _launch_ms(launch: Callable[[], Any], launches: int, repeats: int) -> float:
    """Milliseconds of one launch: the median over `repeats` chains of `launches` back-to-back launches."""
    return events_time(lambda: [launch() for _ in range(launches)], repeats) / launches * 1e3


def _rewind_position(state: Any, length: int) -> None:
    """Put the state's host position (and token ids) back to `length` after a timed launch, so that every launch
    of a series runs at the same positions: a series of T-token launches that advanced would end at T times the
    context growth of a T = 1 series, and past a chunk boundary its attention phase does more work, so the two
    would not time the same context. The device tensors keep what the launch wrote; their values do not change a
    launch's work."""
    state.length = length
    state._truncate_tokens(length)


def _random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, vocab, (n,), device="cuda", generator=g)


def bench_verify(
    runner: Any, model: Any, *, tokens: Sequence[int], context: int, launches: int, repeats: int
) -> list[VerifyRow]:
    """Time one launch of T tokens for each T, plain and as a verify pass. A T whose build does not fit the
    GPU (shared memory, registers) is reported as such; the others still run."""
    from .runtime import MegakernelError

    rows = []
    room = context + max(tokens) + 8
    # One prefill; each timed series starts from a copy of it, and every launch runs at positions context.. .
    base, _, _ = prefilled(model, context, room, seed=11)
    for t in tokens:
        row = VerifyRow(t)
        rows.append(row)
        try:
            row.build = runner.describe(t)  # compiles the T-token build
        except (MegakernelError, UnsupportedModelError) as e:  # shared memory, registers, shapes
            row.error = f"does not fit: {e}"
        except Exception as e:  # the compiler's own failure
            row.error = f"build failed: {_failure(e)}"
        if row.error:
            print(f"  T={t}: {row.error}", flush=True)
            continue
        try:
            for verify in (False, True):
                state = base.clone()
                ids = _random_ids(t, model.config.vocab_size, seed=100 + t)
                accept = verify and t >= 2

                def launch(
                    ids: torch.Tensor = ids, state: Any = state, keep: bool = verify, acc: bool = accept
                ) -> None:
                    runner.step(ids, state, keep_states=keep, accept=acc, check=False)
                    _rewind_position(state, context)

                launch()  # warm-up: module load, the state's tables
                runner.check()
                ms = _launch_ms(launch, launches, repeats)
                runner.check()  # an error in any timed launch surfaces here
                if verify:
                    row.verify_ms = ms
                else:
                    row.plain_ms = ms
                if runner.plan.tuning.phase_timing:  # the last launch's stamps
                    text = format_breakdown(
                        summarise(runner.phase_stamps(), step_phases(model.config), runner.gemv_stamps()), ms
                    )
                    if verify:
                        row.verify_breakdown = text
                    else:
                        row.breakdown = text
                    print(f"  T={t} {'verify' if verify else 'plain'}:\n{text}", flush=True)
                del state
        except Exception as e:  # one T failing at run time must not hide the others
            row.error = f"failed: {_failure(e)}"
        print(f"  T={t}: {_row_text(row, rows[0].plain_ms if rows[0].tokens == 1 else None)}", flush=True)
    return rows


def bench_draft_vocab(vocab_size: int) -> int | None:
    """The draft vocabulary the benchmarks time a large vocabulary's drafts with: its first 32,768 ids (an
    engine learns its own from what it generates, worker/draft_vocab.py; random weights' output says nothing)."""
    return 32768 if vocab_size > 65536 else None


def bench_draft(
    runner: Any, model: Any, *, context: int, launches: int, repeats: int, draft_vocab: int | None = None
) -> DraftResult:
    """One MTP head step against one main-model step, both T = 1, on one state; and one greedy draft among the
    first `draft_vocab` token ids (None: bench_draft_vocab's, 0: all) as the engine chains them."""
    result = DraftResult(main_weight_bytes=weight_bytes(model), mtp_weight_bytes=mtp_weight_bytes(model))
    vocab = bench_draft_vocab(model.config.vocab_size) if draft_vocab is None else draft_vocab or None
    result.draft_vocab = vocab
    if not runner.has_mtp:
        result.error = "the model has no MTP head"
        return result
    try:
        room = context + 8
        state, first, hidden = prefilled(model, context, room, seed=12, mtp=True)
        ids = torch.tensor([first], device="cuda")
        mtp_at = state.mtp_length

        def main_step() -> None:
            runner.step(ids, state, check=False)
            _rewind_position(state, context)

        def mtp_step() -> None:
            runner.mtp_step(ids, hidden, state)
            state.mtp_length = mtp_at  # host bookkeeping only, like _rewind_position

        def greedy_step() -> None:
            runner.mtp_chain(ids, hidden, state, 1, vocab=vocab)
            state.mtp_length = mtp_at

        for step in (main_step, mtp_step, greedy_step):
            step()
            runner.check()
        result.main_ms = _launch_ms(main_step, launches, repeats)
        result.mtp_ms = _launch_ms(mtp_step, launches, repeats)
        result.greedy_ms = _launch_ms(greedy_step, launches, repeats)
        runner.check()
    except Exception as e:
        result.error = f"failed: {_failure(e)}"
    return result


def mtp_weight_bytes(model: Any) -> int:
    """Weights one MTP step streams: fc, the MTP layer's matrices, the lm_head (and an embedding row)."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return 0
    matrices = sum(module_weight_bytes(m) for m in _linear_modules(mtp))
    return matrices + lm_head_bytes(model) + model.config.hidden_size * 2


def _linear_modules(module: Any) -> list[Any]:
    """The layers of `module` that hold one matrix each (plain or quantized), outermost first."""
    found: list[Any] = []

    def walk(m: Any) -> None:
        if isinstance(m, torch.nn.Linear) or hasattr(m, "qtype") or hasattr(m, "inner"):
            found.append(m)
            return
        for child in m.children():
            walk(child)

    walk(module)
    return found


def bench_27b(
    config: ModelConfig,
    *,
    name: str,
    tokens: Sequence[int],
    context: int,
    launches: int,
    repeats: int,
    tuning: Any = None,
    weights: str = "bf16",
    draft_vocab: int | None = None,
) -> tuple[VerifyResult, DraftResult]:
    """Parts (a) and (b) on one random model of `config` (given an MTP head if it has none) in `weights` (bf16
    or a quantization preset: random_quant.random_model_in), with the kernel builds of `tuning` (default: the
    default Tuning)."""
    from .diagnostics import DiagnosticRunner
    from .random_quant import random_model_in

    if not config.has_mtp:
        config = dataclasses.replace(config, mtp_num_hidden_layers=1)
    model = random_model_in(config, weights)
    verify = VerifyResult(name, config.num_hidden_layers, context, launches, repeats, weight_bytes(model))
    try:
        runner = DiagnosticRunner(model, tuning=tuning)
    except Exception as e:
        verify.error = f"the megakernel cannot be built: {_failure(e)}"
        return verify, DraftResult(error=verify.error)
    verify.rows = bench_verify(
        runner, model, tokens=tokens, context=context, launches=launches, repeats=repeats
    )
    draft = bench_draft(
        runner, model, context=context, launches=launches, repeats=repeats, draft_vocab=draft_vocab
    )
    del runner, model
    gc.collect()  # the 27B weights go before part (c) loads its engines
    torch.cuda.empty_cache()
    return verify, draft


# ---- the engine on the embedded model -----------------------------------------------------------------
def prompt_files(paths: Sequence[Path]) -> list[Path]:
    """The text files named, and the files inside the folders named (sorted; SOURCES.txt lists, not code)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.is_file() and p.name != "SOURCES.txt")
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"prompt source {path} does not exist")
    return files


def measure_backend(
    engine: Any, prompts: Sequence[list[int]], ks: Sequence[int], max_tokens: int, into: BackendRuns
) -> None:
    """Greedy plain decoding, then each k, on one engine, appended to `into` as measured (a failure part-way
    keeps the runs before it). A speculative output that differs from the plain one is recorded per k and
    prompt, not raised, so that every k is still measured."""
    from onestream.worker.evaluation import differing_prompts, run_spec

    plain: SpecRun | None = None
    for k in (0, *ks):
        # Warm-up on one prompt: the megakernel compiles its (k+1)-token build on first use, which must not
        # land in a timed run.
        run_spec(engine, prompts[:1], k=k, max_tokens=min(16, max_tokens))
        run = run_spec(engine, prompts, k=k, max_tokens=max_tokens)
        into.runs.append(run)
        if plain is None:
            plain = run
            continue
        into.differing[k] = differing_prompts(plain, run)


def bench_embedded(
    model_dir: Path,
    files: Sequence[Path],
    *,
    ks: Sequence[int],
    prompt_tokens: int,
    prompts_per_file: int,
    max_prompts: int,
    max_tokens: int,
    backends: Sequence[str] = ("megakernel", "reference"),
    device: str = "cuda",
    dtype: str = "bf16",
) -> EmbeddedResult:
    """Part (c): the same prompts through an engine per back end (same device and dtype for all, greedy)."""
    from onestream.worker.engine import Engine
    from onestream.worker.evaluation import cut_prompts

    result = EmbeddedResult(prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    prompts: list[list[int]] | None = None
    for kind in backends:
        runs = BackendRuns(kind)
        result.backends.append(runs)
        try:
            engine = Engine(model_dir, backend=kind, device=device, dtype=dtype)
        except Exception as e:
            runs.error = f"cannot start: {_failure(e)}"
            continue
        if not engine.backend.has_mtp:
            result.error = "the model has no MTP head"
            return result
        if prompts is None:
            result.model = engine.model_info()
            token_lists = [engine.tokenizer.encode(f.read_text(errors="replace")) for f in files]
            prompts = cut_prompts(
                token_lists, prompt_tokens=prompt_tokens, per_source=prompts_per_file, room=max_tokens
            )[:max_prompts]
            result.prompts = len(prompts)
            if not prompts:
                result.error = f"no prompt file has {prompt_tokens + max_tokens} tokens to cut a prompt from"
                return result
        try:
            measure_backend(engine, prompts, ks, max_tokens, runs)
        except Exception as e:  # a kernel error part-way: keep the k measured before it
            runs.error = f"failed: {_failure(e)}"
        print(format_backend(runs, result.backend("megakernel")), flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


# ---- report -------------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _row_text(row: VerifyRow, base_ms: float | None) -> str:
    if row.error and row.plain_ms is None:
        return row.error
    ratio = row.verify_ms / base_ms if row.verify_ms is not None and base_ms else None
    text = f"plain {_ms(row.plain_ms)} ms, verify {_ms(row.verify_ms)} ms ({_x(ratio)} one T=1 step)"
    return f"{text}; {row.error}" if row.error else text


BUILD_FIELDS = (  # (describe() key, label, unit)
    ("mma", "tensor cores", ""),
    ("stages", "stages", ""),
    ("part_rows", "part_rows", ""),
    ("window", "window", ""),
    ("smem_bytes", "smem", " B"),
    ("registers", "registers", ""),
    ("local_bytes", "local memory (stack frame and spills)", " B"),
    ("compile_s", "compile", " s"),
)


def _build_text(build: dict[str, Any]) -> str:
    return ", ".join(f"{label} {build[key]}{unit}" for key, label, unit in BUILD_FIELDS if key in build)


def format_verify(v: VerifyResult, ceilings: Ceilings | None) -> str:
    lines = [
        f"(a) verify launch cost: {v.name} with {v.layers} layers, random bf16 weights, context {v.context} "
        f"(every launch at positions {v.context}..{v.context}+T-1); median of {v.repeats} chains of {v.launches} "
        "back-to-back launches",
        f"    one launch streams {v.weight_bytes / 1e9:.2f} GB of weights"
        + (
            f" ({v.weight_bytes / (ceilings.read_gbs * 1e9) * 1e3:.3f} ms at the measured read ceiling)"
            if ceilings
            else ""
        ),
    ]
    if v.error:
        lines.append(f"    {v.error}")
        return "\n".join(lines)
    lines.append(
        f"    {'T':>2} {'plain ms':>9} {'verify ms':>10} {'verify/T1':>10} {'plain/T1':>9} {'ms/token':>9}  build"
    )
    for r in v.rows:
        if r.plain_ms is None and r.verify_ms is None:
            lines.append(f"    {r.tokens:>2} {r.error}")
            continue
        per_token = r.verify_ms / r.tokens if r.verify_ms is not None else None
        lines.append(
            f"    {r.tokens:>2} {_ms(r.plain_ms):>9} {_ms(r.verify_ms):>10} {_x(v.ratio(r.verify_ms)):>10} "
            f"{_x(v.ratio(r.plain_ms)):>9} {_ms(per_token):>9}  {_build_text(r.build)}"
            + (f"  [{r.error}]" if r.error else "")
        )
    lines.append(f"    {verify_verdict(v)}")
    return "\n".join(lines)


def verify_verdict(v: VerifyResult) -> str:
    target = (
        f"target: a verify launch of T={VERIFY_TARGET_TOKENS} at most {VERIFY_TARGET_RATIO:.2f}x one T=1 step"
    )
    row = v.target_row()
    if v.baseline_ms is None:
        return f"{target}: no T=1 step measured to compare with"
    ratio = v.ratio(row.verify_ms) if row is not None else None
    if ratio is None:
        why = row.error if row is not None and row.error else "not measured"
        return f"{target}: {why}"
    return f"{target}: measured {ratio:.3f}x, {'met' if ratio <= VERIFY_TARGET_RATIO else 'MISSED'}"


def format_draft(d: DraftResult) -> str:
    head = "(b) draft cost: one MTP head step (T=1) against one main-model step (T=1)"
    if d.ratio is None:
        return f"{head}\n    {d.error or 'not measured'}"
    weights = (
        f"; weights streamed {d.mtp_weight_bytes / 1e9:.2f} GB vs {d.main_weight_bytes / 1e9:.2f} GB "
        f"= {d.weight_ratio:.3f}"
        if d.weight_ratio is not None
        else ""
    )
    line = f"{head}\n    MTP {_ms(d.mtp_ms)} ms, main {_ms(d.main_ms)} ms: ratio {d.ratio:.3f}{weights}"
    if d.greedy_ratio is not None:
        among = f"the first {d.draft_vocab} token ids" if d.draft_vocab else "the whole vocabulary"
        line += f"\n    a greedy draft among {among} (the engine's chain): {_ms(d.greedy_ms)} ms, ratio {d.greedy_ratio:.3f}"
    return line


def format_backend(b: BackendRuns, megakernel: BackendRuns | None) -> str:
    """One back end's rows: tok/s, speed-up over its own plain decode and over plain megakernel decode."""
    mk_plain = megakernel.plain if megakernel is not None else None
    lines = []
    for r in b.runs:
        own = r.tokens_per_s / b.plain.tokens_per_s if b.plain is not None and b.plain.tokens_per_s else None
        vs_mk = (
            r.tokens_per_s / mk_plain.tokens_per_s if mk_plain is not None and mk_plain.tokens_per_s else None
        )
        per_position = " ".join(f"{a:.2f}" for a in r.acceptance_per_position())
        same = {None: "", True: "identical", False: f"DIFFERS on prompts {b.differing.get(r.k)}"}[
            b.identical(r.k)
        ]
        lines.append(
            f"    {b.backend:<11} {r.k:>2} {r.tokens_per_s:9.1f} {_x(own):>9} {_x(vs_mk):>9} "
            f"{r.mean_accepted_length:9.2f}  {per_position:<24} {same}"
        )
    if b.error:
        lines.append(f"    {b.backend:<11} {b.error}")
    return "\n".join(lines)


def format_embedded(e: EmbeddedResult) -> str:
    name = e.model.get("model_name", "embedded model")
    lines = [
        f"(c) speculative decoding on {name}: {e.prompts} held-out code prompts of {e.prompt_tokens} tokens, "
        f"{e.max_tokens} greedy tokens each, {e.model.get('dtype', '?')} on {e.model.get('device', '?')}",
    ]
    if e.error:
        lines.append(f"    {e.error}")
    lines.append(
        f"    {'backend':<11} {'k':>2} {'tok/s':>9} {'vs own k0':>9} {'vs mk k0':>9} {'mean len':>9}  "
        f"{'accepted per position':<24} output vs plain greedy"
    )
    megakernel = e.backend("megakernel")
    lines += [format_backend(b, megakernel) for b in e.backends]
    if megakernel is not None and megakernel.differing:
        bad = {k: v for k, v in megakernel.differing.items() if v}
        lines.append(
            "    megakernel greedy speculative output "
            + (
                f"DIFFERS from plain greedy: {bad} (k: prompt indices)"
                if bad
                else "equals plain greedy for every k and prompt"
            )
        )
    return "\n".join(lines)


def format_report(result: SpecBenchResult) -> str:
    lines = [f"device: {result.device}"]
    if result.ceilings is not None:
        c = result.ceilings
        lines.append(
            f"measured ceilings: copy {c.copy_gbs:.0f} GB/s (read+write), streaming read {c.read_gbs:.0f} GB/s"
        )
    if result.verify is not None:
        lines += ["", format_verify(result.verify, result.ceilings)]
    if result.draft is not None:
        lines += ["", format_draft(result.draft)]
    if result.cycle is not None:
        from .bench_cycle import format_cycle

        lines += ["", format_cycle(result.cycle)]
    if result.embedded is not None:
        lines += ["", format_embedded(result.embedded)]
    return "\n".join(lines)


def as_json(result: SpecBenchResult) -> dict[str, Any]:
    out: dict[str, Any] = {"device": result.device}
    out["ceilings"] = dataclasses.asdict(result.ceilings) if result.ceilings is not None else None
    if result.verify is not None:
        v = result.verify
        out["verify"] = dataclasses.asdict(v) | {
            "rows": [
                dataclasses.asdict(r)
                | {"verify_ratio": v.ratio(r.verify_ms), "plain_ratio": v.ratio(r.plain_ms)}
                for r in v.rows
            ],
            "target": {"tokens": VERIFY_TARGET_TOKENS, "max_ratio": VERIFY_TARGET_RATIO},
            "verdict": verify_verdict(v),
        }
    else:
        out["verify"] = None
    if result.draft is not None:
        d = result.draft
        out["draft"] = dataclasses.asdict(d) | {
            "ratio": d.ratio,
            "weight_ratio": d.weight_ratio,
            "greedy_ratio": d.greedy_ratio,
        }
    else:
        out["draft"] = None
    if result.embedded is not None:
        e = result.embedded
        backends = []
        for b in e.backends:
            plain = b.plain
            backends.append(
                {
                    "backend": b.backend,
                    "error": b.error,
                    "runs": [
                        r.as_dict()
                        | {
                            "speedup": r.tokens_per_s / plain.tokens_per_s
                            if plain is not None and plain.tokens_per_s
                            else None,
                            "outputs_identical_to_plain": b.identical(r.k),
                            "differing_prompts": b.differing.get(r.k, []),
                        }
                        for r in b.runs
                    ],
                }
            )
        out["embedded"] = {
            "model": e.model,
            "prompts": e.prompts,
            "prompt_tokens": e.prompt_tokens,
            "max_tokens": e.max_tokens,
            "error": e.error,
            "backends": backends,
        }
    else:
        out["embedded"] = None
    if result.cycle is not None:
        from .bench_cycle import cycle_json

        out["cycle"] = cycle_json(result.cycle)
    return out
