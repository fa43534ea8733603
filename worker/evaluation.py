"""Checking an implementation against a reference, and measuring speculative decoding.

- KL divergence, teacher-forced (llama.cpp's statistics): both sides score the same tokens in windows of
  `ctx` tokens, each window from position 0; position p of a window predicts token p+1.
- Speculative decoding: held-out prompts cut from text files, greedy generation with and without drafts
  (outputs must be identical), acceptance per draft position, mean accepted length, tok/s.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from .backend import Backend, ReferenceBackend

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


# ---- logits sources ---------------------------------------------------------------------------------


class LogitsSource(Protocol):
    name: str

    def logits(self, window: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits [T, V] (fp32) for the tokens of `window`, from position 0."""
        ...


class ReferenceForward:
    """Our reference model's stateless batched forward."""

    def __init__(self, model: Any, name: str = "reference") -> None:
        self.model = model
        self.name = name

    @torch.inference_mode()
    def logits(self, window: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(window)], dtype=torch.long, device=self.model.device)
        return self.model.forward(ids)[0][0].float()


class BackendSteps:
    """A back end's decode path, one token per step: what the megakernel runs when serving."""

    def __init__(self, backend: Backend, name: str | None = None) -> None:
        self.backend = backend
        self.name = name or f"{backend.name} (decode steps)"

    @torch.inference_mode()
    def logits(self, window: Sequence[int]) -> torch.Tensor:
        state = self.backend.new_state(len(window))
        rows = []
        for token in window:
            ids = torch.tensor([token], dtype=torch.long, device=self.backend.device)
            rows.append(self.backend.decode(ids, state).logits[-1].float())
        return torch.stack(rows)


class TransformersForward:
    """transformers' Qwen3_5ForCausalLM on the same checkpoint, pinned to its pure-torch paths."""

    def __init__(self, model_dir: str | Path, *, device: torch.device | str, dtype: torch.dtype) -> None:
        _block_fast_kernels()
        from transformers import Qwen3_5ForCausalLM

        self.model = Qwen3_5ForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation="eager"
        ).to(device)
        self.model.eval()
        self.device = torch.device(device)
        self.name = "transformers"

    @torch.inference_mode()
    def logits(self, window: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([list(window)], dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, use_cache=False).logits[0].float()


def _block_fast_kernels() -> None:
    """Make transformers pick its torch implementations of the DeltaNet and conv kernels: it chooses when
    its qwen3_5 module is imported, by trying to import these packages."""
    module = "transformers.models.qwen3_5.modeling_qwen3_5"
    if module in sys.modules:
        return
    for package in ("fla", "causal_conv1d"):
        sys.modules.setdefault(package, None)  # type: ignore[arg-type]  # None makes the import fail


def reference_source(backend: Backend) -> LogitsSource:
    """The cheapest faithful source for a back end: batched forward for the reference, else decode steps."""
    # Exact type, not isinstance: other back ends (the megakernel) subclass ReferenceBackend for prefill and
    # state handling, and must be measured through their own decode path.
    if type(backend) is ReferenceBackend:
        return ReferenceForward(
            backend.model, name=f"reference ({str(backend.dtype).removeprefix('torch.')})"
        )
    return BackendSteps(backend)


# ---- KL divergence statistics -----------------------------------------------------------------------


@dataclass
class KLDStats:
    positions: int
    mean_kld: float
    kld_stderr: float
    kld_max: float
    kld_min: float
    kld_percentiles: dict[str, float]
    mean_delta_p: float  # mean of p_test(true token) - p_ref(true token)
    delta_p_stderr: float
    rms_delta_p: float
    delta_p_max: float
    delta_p_min: float
    delta_p_percentiles: dict[str, float]
    max_abs_logit_diff: float
    same_top1_pct: float
    same_top1_stderr_pct: float
    ppl_test: float
    ppl_ref: float
    test_name: str = ""
    ref_name: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        lines = [
            f"KL divergence of {self.test_name} against {self.ref_name} over {self.positions} positions",
            f"PPL(test)            {self.ppl_test:12.4f}",
            f"PPL(ref)             {self.ppl_ref:12.4f}",
            f"Mean KLD             {self.mean_kld:12.6g} ± {self.kld_stderr:.6g}",
            f"Maximum KLD          {self.kld_max:12.6g}",
        ]
        lines += [f"{k + ' KLD':<21}{v:12.6g}" for k, v in self.kld_percentiles.items()]
        lines += [
            f"Minimum KLD          {self.kld_min:12.6g}",
            f"Mean Δp              {100 * self.mean_delta_p:11.6g}% ± {100 * self.delta_p_stderr:.6g}%",
            f"RMS Δp               {100 * self.rms_delta_p:11.6g}%",
            f"Maximum Δp           {100 * self.delta_p_max:11.6g}%",
        ]
        lines += [f"{k + ' Δp':<21}{100 * v:11.6g}%" for k, v in self.delta_p_percentiles.items()]
        lines += [
            f"Minimum Δp           {100 * self.delta_p_min:11.6g}%",
            f"Max |logit diff|     {self.max_abs_logit_diff:12.6g}",
            f"Same top-1           {self.same_top1_pct:11.4f}% ± {self.same_top1_stderr_pct:.4f}%",
        ]
        return "\n".join(lines)


@dataclass
class KLDAccumulator:
    """Per-position statistics, kept as scalars so that [T, V] logits never pile up."""

    kld: list[np.ndarray] = field(default_factory=list)
    delta_p: list[np.ndarray] = field(default_factory=list)
    nll_test: list[np.ndarray] = field(default_factory=list)
    nll_ref: list[np.ndarray] = field(default_factory=list)
    same_top1: list[np.ndarray] = field(default_factory=list)
    max_abs_logit_diff: float = 0.0

    def add(self, test_logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Logits [T, V] of both sides at the same positions, and the true next tokens [T]."""
        if test_logits.shape != ref_logits.shape:
            raise ValueError(f"logits shapes differ: {tuple(test_logits.shape)} vs {tuple(ref_logits.shape)}")
        test = test_logits.double().cpu()
        ref = ref_logits.double().cpu()
        targets = targets.cpu()
        log_q = torch.log_softmax(test, dim=-1)
        log_p = torch.log_softmax(ref, dim=-1)
        kld = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
        rows = torch.arange(len(targets))
        self.kld.append(kld.numpy())
        self.delta_p.append((log_q[rows, targets].exp() - log_p[rows, targets].exp()).numpy())
        self.nll_test.append((-log_q[rows, targets]).numpy())
        self.nll_ref.append((-log_p[rows, targets]).numpy())
        self.same_top1.append((test.argmax(-1) == ref.argmax(-1)).numpy())
        self.max_abs_logit_diff = max(self.max_abs_logit_diff, float((test - ref).abs().max()))

    def result(self, test_name: str = "", ref_name: str = "") -> KLDStats:
        if not self.kld:
            raise ValueError("no positions were scored (need at least 2 tokens)")
        kld, dp = np.concatenate(self.kld), np.concatenate(self.delta_p)
        same = np.concatenate(self.same_top1).astype(np.float64)
        n = len(kld)

        def stderr(x: np.ndarray) -> float:
            return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0

        return KLDStats(
            positions=n,
            mean_kld=float(kld.mean()),
            kld_stderr=stderr(kld),
            kld_max=float(kld.max()),
            kld_min=float(kld.min()),
            kld_percentiles={_pct_name(q): float(np.percentile(kld, q)) for q in KLD_PERCENTILES},
            mean_delta_p=float(dp.mean()),
            delta_p_stderr=stderr(dp),
            rms_delta_p=float(np.sqrt((dp**2).mean())),
            delta_p_max=float(dp.max()),
            delta_p_min=float(dp.min()),
            delta_p_percentiles={_pct_name(q): float(np.percentile(dp, q)) for q in DELTA_P_PERCENTILES},
            max_abs_logit_diff=self.max_abs_logit_diff,
            same_top1_pct=100.0 * float(same.mean()),
            same_top1_stderr_pct=100.0 * stderr(same),
            ppl_test=float(np.exp(np.concatenate(self.nll_test).mean())),
            ppl_ref=float(np.exp(np.concatenate(self.nll_ref).mean())),
            test_name=test_name,
            ref_name=ref_name,
        )


def _pct_name(q: float) -> str:
    return "Median" if q == 50.0 else f"{q:g}%"


def windows(tokens: Sequence[int], ctx: int) -> Iterator[list[int]]:
    """Consecutive windows of at most `ctx` tokens; a last window shorter than 2 tokens scores nothing."""
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2, got {ctx}")
    for start in range(0, len(tokens), ctx):
        window = list(tokens[start : start + ctx])
        if len(window) >= 2:
            yield window


def run_kld(test: LogitsSource, ref: LogitsSource, tokens: Sequence[int], ctx: int) -> KLDStats:
    acc = KLDAccumulator()
    for window in windows(tokens, ctx):
        targets = torch.tensor(window[1:])
        acc.add(test.logits(window)[:-1], ref.logits(window)[:-1], targets)
    return acc.result(test.name, ref.name)


def read_token_file(path: str | Path) -> list[int]:
    """Whitespace-separated token ids."""
    text = Path(path).read_text()
    try:
        return [int(t) for t in text.split()]
    except ValueError as e:
        raise ValueError(f"{path}: expected whitespace-separated integer token ids ({e})") from e


# ---- speculative decoding ---------------------------------------------------------------------------


def cut_prompts(
    token_lists: Iterable[list[int]], *, prompt_tokens: int, per_source: int, room: int
) -> list[list[int]]:
    """Up to `per_source` prompts of `prompt_tokens` tokens from each token list, evenly spaced, each
    followed in its source by at least `room` more tokens (so a continuation exists)."""
    prompts = []
    for tokens in token_lists:
        last_start = len(tokens) - prompt_tokens - room
        if last_start < 0:
            continue
        count = min(per_source, last_start + 1)
        for i in range(count):
            start = (last_start * i) // max(count - 1, 1) if count > 1 else 0
            prompts.append(tokens[start : start + prompt_tokens])
    return prompts


@dataclass
class SourceCounts:
    """A run's cycles whose drafts came from one source."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafts: int, draft_tokens: int, accepted: int, per_position: Sequence[int]) -> None:
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < len(per_position):
            self.accepted_per_position.extend([0] * (len(per_position) - len(self.accepted_per_position)))
        for i, a in enumerate(per_position):
            self.accepted_per_position[i] += a

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def as_dict(self) -> dict[str, Any]:
        per_position = [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]
        return asdict(self) | {
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": per_position,
        }


@dataclass
class SpecRun:
    k: int
    prompts: int
    generated_tokens: int
    decode_s: float
    drafts: int  # verify passes (speculative cycles)
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    outputs: list[list[int]] = field(repr=False, default_factory=list)
    drafting: str = "mtp"
    by_source: dict[str, SourceCounts] = field(default_factory=dict)
    # This process's CPU time over the same span as decode_s: on a shared host, what the decode itself cost.
    decode_cpu_s: float = 0.0

    @property
    def target_passes(self) -> int:
        """Forward passes of the target after each prompt's first token: verify cycles and plain steps (a
        lookup cycle without a match decodes one token). Every cycle yields its accepted drafts + 1 tokens
        (generation runs to max_tokens, so no cycle is cut by a stop)."""
        decoded = self.generated_tokens - self.prompts
        plain_steps = decoded - self.drafts - self.accepted_tokens
        return self.drafts + max(plain_steps, 0)

    @property
    def tokens_per_pass(self) -> float:
        """Tokens decoded per target pass: the mean accepted length counting plain steps as 1."""
        passes = self.target_passes
        return (self.generated_tokens - self.prompts) / passes if passes else 1.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first (which the prefill yields) per second of decoding."""
        return (self.generated_tokens - self.prompts) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        """Decode speed in tokens per second of this process's CPU time (other load on the host left out)."""
        return (self.generated_tokens - self.prompts) / self.decode_cpu_s if self.decode_cpu_s > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def acceptance_per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.accepted_per_position]

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        d |= {
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_cpu_s": self.tokens_per_cpu_s,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position(),
            "target_passes": self.target_passes,
            "tokens_per_pass": self.tokens_per_pass,
            "by_source": {source: counts.as_dict() for source, counts in self.by_source.items()},
        }
        return d


def run_spec(
    engine: Any, prompts: Sequence[list[int]], *, k: int, max_tokens: int, drafting: str = "mtp"
) -> SpecRun:
    """Greedy generation of every prompt with `k` MTP drafts per cycle and drafts from `drafting`
    (worker/drafting/; k = 0 with `mtp` or `combined`: plain decoding)."""
    from .api import GenerateRequest, SamplingParams

    engine.spec_k = k
    engine.drafting = drafting
    run = SpecRun(k, len(prompts), 0, 0.0, 0, 0, 0, [], drafting=drafting)
    for prompt in prompts:
        request = GenerateRequest(
            list(prompt), SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True
        )
        ids: list[int] = []
        cpu_first = None
        for item in engine.generate(request):
            if hasattr(item, "token_ids"):
                if cpu_first is None and item.token_ids:
                    cpu_first = time.process_time()  # the prefill's first token: decode starts
                ids.extend(item.token_ids)
            else:
                usage, timings = item.usage, item.timings
        if cpu_first is not None:
            run.decode_cpu_s += time.process_time() - cpu_first
        run.outputs.append(ids)
        run.generated_tokens += usage.generated_tokens
        run.decode_s += timings.decode_s
        run.drafts += usage.drafts
        run.draft_tokens += usage.draft_tokens
        run.accepted_tokens += usage.accepted_draft_tokens
        per_position = usage.accepted_per_position
        if len(run.accepted_per_position) < len(per_position):
            run.accepted_per_position.extend([0] * (len(per_position) - len(run.accepted_per_position)))
        for i, a in enumerate(per_position):
            run.accepted_per_position[i] += a
        for source, counts in usage.by_source.items():
            run.by_source.setdefault(source, SourceCounts()).add(
                counts.drafts, counts.draft_tokens, counts.accepted_tokens, counts.accepted_per_position
            )
    if drafting == "mtp":  # the MTP head's positions all exist, accepted or not (the table's columns)
        run.accepted_per_position.extend([0] * (k - len(run.accepted_per_position)))
    return run


class SpeculativeMismatchError(AssertionError):
    """Greedy speculative decoding produced a different output than plain greedy decoding."""


def differing_prompts(plain: SpecRun, run: SpecRun) -> list[int]:
    """The prompts whose output in `run` differs from the plain run's."""
    return [i for i, (a, b) in enumerate(zip(plain.outputs, run.outputs, strict=True)) if a != b]


def time_runs(
    engine: Any,
    prompts: Sequence[list[int]],
    ks: Sequence[int],
    max_tokens: int,
    draftings: Sequence[str] = ("mtp",),
) -> list[SpecRun]:
    """Plain decoding (k = 0) then each drafting mode with each k (`lookup` ignores k: once), each after a
    warm-up (first-call costs stay out of the timing: the engine's `warm_up` compiles the megakernel build of
    every verify size the mode can draft, and one prompt runs untimed); raises SpeculativeMismatchError if a speculative output differs from the plain one."""
    configs = [("mtp", 0)]
    for drafting in draftings:
        configs += [(drafting, 0)] if drafting == "lookup" else [(drafting, k) for k in ks]
    runs: list[SpecRun] = []
    for drafting, k in configs:
        engine.spec_k, engine.drafting = k, drafting
        warm_up = getattr(engine, "warm_up", None)
        if warm_up is not None:
            warm_up()
        run_spec(engine, prompts[:1], k=k, max_tokens=min(8, max_tokens), drafting=drafting)
        run = run_spec(engine, prompts, k=k, max_tokens=max_tokens, drafting=drafting)
        differing = differing_prompts(runs[0], run) if runs else []
        if differing:
            i = differing[0]
            a, b = runs[0].outputs[i], run.outputs[i]
            first = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            raise SpeculativeMismatchError(
                f"{drafting} k={k}: prompt {i}: speculative output differs from plain greedy at token {first}"
            )
        runs.append(run)
    return runs
