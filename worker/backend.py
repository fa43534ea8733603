"""The interface the engine loop drives, and the reference back end (the PyTorch model).

A back end executes the model for one sequence: prefill, decode/verify steps, MTP draft steps, and the
state operations speculative decoding and the session cache need. The megakernel back end
(`onestream.kernels.backend.MegakernelBackend`) implements the same protocol, so the engine loop does not
change with the back end.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .config import ModelConfig
from .draft_vocab import greedy_draft
from .errors import BackendUnavailableError, StateError
from .kv_cache import DEFAULT_KV_FORMAT, check_kv_format
from .model import StepOutput

log = logging.getLogger(__name__)

BACKEND_CHOICES = ("auto", "reference", "megakernel")
# The most drafts one verify pass runs where a back end sets no launch bound of its own (the reference runs
# any length: long copies are what an agent's rewritten file offers; past this, copied drafts are rarely all
# accepted and the rollback records cost memory).
MAX_VERIFY_DRAFTS = 32
PREFILL_CHOICES = ("auto", "reference", "fast")
PREFILL_ENV = "ONESTREAM_PREFILL"
# Prompt tokens per prefill call on the reference path: bounds its T x T masked attention scores.
REFERENCE_PREFILL_TOKENS = 512

__all__ = [
    "BACKEND_CHOICES",
    "MAX_VERIFY_DRAFTS",
    "AheadStep",
    "Backend",
    "BackendUnavailableError",
    "ReferenceBackend",
    "StepOutput",
    "accept_greedy",
    "create_backend",
    "upload_ids",
    "verify_limit",
]


def upload_ids(tokens: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Host token ids as a LongTensor on `device`.

    To a GPU they go through pinned memory by a non-blocking copy: a plain copy from pageable memory would wait
    for every launch queued before it (a speculative cycle's rollback, say) before returning."""
    host = torch.tensor(list(tokens), dtype=torch.long)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def accept_greedy(target_tokens: Sequence[int], drafts: Sequence[int]) -> tuple[int, int]:
    """(accepted drafts, next token) given the target's argmax at each of the k+1 verified positions:
    drafts are accepted while each equals the argmax of the row before it (`Backend.verify_greedy`)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted, int(target_tokens[accepted])


def verify_limit(backend: Any) -> int | None:
    """The most tokens one verify launch of `backend` runs (None: no bound): its `max_tokens_per_launch`
    where it declares one. The megakernel runs longer verifies on the reference path, far slower, so its
    tokens per launch bound the drafts too."""
    limit = getattr(backend, "max_tokens_per_launch", None)
    if limit is None and getattr(backend, "name", None) == "megakernel":
        from onestream.kernels.layout import MAX_TOKENS_PER_LAUNCH  # type: ignore[import-not-found]

        limit = MAX_TOKENS_PER_LAUNCH
    return int(limit) if limit is not None else None


@runtime_checkable
class Backend(Protocol):
    """Executes the model for one sequence at a time. States and snapshots are opaque to the engine.

    `input_ids` are LongTensors on the back end's device. The engine reads only the last row of the logits
    of `prefill` and `draft` (a back end should not compute the others: a prompt chunk's [T, V] fp32 logits
    are 0.5 GB for T = 512 and a 248k vocabulary) but every row of `hidden`, and every row of `decode`'s
    logits (they verify drafts).
    """

    name: str
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    prefill_tokens: int  # the most prompt tokens one `prefill` call should be given
    # Greedy drafts are the argmax among token ids below it (draft_vocab.py); None: among all.
    draft_vocab: int | None

    @property
    def has_mtp(self) -> bool: ...

    def new_state(self, max_len: int) -> Any: ...

    def prefill(self, input_ids: torch.Tensor, state: Any) -> StepOutput:
        """Run T prompt tokens at positions `length..` (no per-token state kept); logits of at least the
        last row."""
        ...

    def decode(self, input_ids: torch.Tensor, state: Any, *, keep_states: bool = False) -> StepOutput:
        """Run a few tokens (1 for plain decode, k+1 to verify drafts); keep_states makes each position
        after the first token reachable by `rollback` (n < T: a verify pass always keeps its first input, so
        a back end need not record the state before it)."""
        ...

    def verify_greedy(
        self, input_ids: torch.Tensor, state: Any
    ) -> tuple[StepOutput, int, list[int], list[int]]:
        """`decode(input_ids, keep_states=True)` of [pending, d1..dk], then greedy acceptance: drafts are
        accepted while each equals the argmax of the row before it. Returns (output, accepted drafts, argmax
        per row, the inputs), read back to the host in one synchronisation. The output's logits may be a buffer
        the back end's next launch overwrites (the acceptance is settled already); its hidden rows stay."""
        ...

    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, state: Any) -> StepOutput:
        """MTP step: token t[p+1] with hidden H[p] at MTP positions `mtp_length..`; logits of at least the
        last row."""
        ...

    def draft_greedy(
        self, input_ids: torch.Tensor | Sequence[int], hidden: torch.Tensor, state: Any, k: int
    ) -> torch.Tensor:
        """`draft` of the pairs, then k - 1 further MTP steps, each fed the argmax of the step before and that
        step's last hidden row: the k greedy drafts ([k] LongTensor on the device, not read back), each the argmax
        among token ids below `draft_vocab`. All T + k - 1 MTP positions are written; `rollback_draft(k - 1)`
        drops the drafts' own. `input_ids` may be host ids (the megakernel takes them with its control block,
        one upload fewer on a cycle's critical path) or ids on the device."""
        ...

    def rollback(self, state: Any, n_tokens: int) -> None: ...

    def rollback_draft(self, state: Any, n_positions: int) -> None: ...

    def release(self, state: Any) -> None:
        """Free what the last keep_states step recorded for rollback (the state stays valid)."""
        ...

    def snapshot(self, state: Any, *, full: bool = False) -> Any:
        """A restorable point. It may leave out the KV caches (restore then truncates them): the engine
        restores a snapshot only while the state still holds the snapshot's tokens as a prefix. `full`: with
        the KV caches, restorable into any state of this back end (a prefix shared across sessions)."""
        ...

    def restore(self, state: Any, snapshot: Any) -> None: ...

    def nbytes(self, state_or_snapshot: Any) -> int: ...


class HostCopy:
    """A one-element device tensor on its way to the host: a non-blocking copy into pinned memory and an
    event, so reading it waits for the work before it, not for what was queued since."""

    def __init__(self, t: torch.Tensor) -> None:
        self.event = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def value(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.host.reshape(-1)[0])


@dataclass
class AheadStep:
    """One queued `decode_ahead` step: its post-norm hidden ([1, H]) and logits ([1, V]; both a back end's
    buffers, valid until its next launch), and what `ahead_token` reads the step's argmax from."""

    hidden: torch.Tensor
    token: Any
    logits: torch.Tensor


class ReferenceBackend:
    """The PyTorch reference model (`worker/model.py`) on any device and dtype.

    `prefill`: "reference" runs prompts and MTP backlogs through the model's own step; "fast" through
    `worker/prefill/` (fused attention, chunked delta rule, long pieces), which writes the same state;
    "auto" is fast on a CUDA device."""

    name = "reference"

    def __init__(self, model: Any, *, prefill: str = "reference", kv_format: str = DEFAULT_KV_FORMAT) -> None:
        if prefill not in PREFILL_CHOICES:
            raise BackendUnavailableError(f"prefill must be one of {PREFILL_CHOICES}, got {prefill!r}")
        self.kv_format = check_kv_format(kv_format)
        self.model = model
        self.config: ModelConfig = model.config
        self.device: torch.device = model.device
        self.dtype: torch.dtype = model.dtype
        self.fast_prefill: Any = None
        self.prefill_tokens = REFERENCE_PREFILL_TOKENS
        self.draft_vocab: int | None = None  # the engine's DraftVocabulary sets it
        self._ahead: tuple[Any, torch.Tensor] | None = None  # (state, its next input) of a decode_ahead run
        if prefill == "fast" or (prefill == "auto" and self.device.type == "cuda"):
            from .prefill import FastPrefill, piece_tokens_from_env

            self.fast_prefill = FastPrefill(model)
            self.prefill_tokens = piece_tokens_from_env()

    @property
    def has_mtp(self) -> bool:
        return self.config.has_mtp

    def new_state(self, max_len: int) -> Any:
        return self.model.new_state(max_len, kv_format=self.kv_format)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, state: Any) -> StepOutput:
        if self.fast_prefill is not None:
            return self.fast_prefill(input_ids, state)  # type: ignore[no-any-return]
        return self.model.forward_step(input_ids, state, logits="last")

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, state: Any, *, keep_states: bool = False) -> StepOutput:
        return self.model.forward_step(input_ids, state, keep_states=keep_states)

    @torch.inference_mode()
    def decode_ahead(self, input_ids: torch.Tensor | None, state: Any) -> AheadStep:
        """Queue one decode step without synchronising: `input_ids` ([1] on the device) feeds it, None feeds
        the previous step's argmax (still on the device). `ahead_token` reads the step's argmax."""
        if input_ids is None:
            if self._ahead is None or self._ahead[0] is not state:
                raise StateError("decode_ahead(None) continues a run of the same state only")
            input_ids = self._ahead[1]
        out = self.decode(input_ids.reshape(-1), state)
        token = out.logits[-1:].argmax(dim=-1)
        self._ahead = (state, token)
        return AheadStep(out.hidden[-1:], HostCopy(token), out.logits[-1:])

    def ahead_token(self, step: AheadStep) -> int:
        return step.token.value()

    @torch.inference_mode()
    def verify_greedy(
        self, input_ids: torch.Tensor, state: Any
    ) -> tuple[StepOutput, int, list[int], list[int]]:
        out = self.decode(input_ids, state, keep_states=True)
        n = input_ids.numel()
        host = torch.cat([input_ids.reshape(-1), out.logits.argmax(dim=-1)]).tolist()
        inputs, targets = host[:n], host[n:]
        accepted, _ = accept_greedy(targets, inputs[1:])
        return out, accepted, targets, inputs

    @torch.inference_mode()
    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, state: Any) -> StepOutput:
        if self.fast_prefill is not None and input_ids.numel() > 1:  # a prompt's MTP backlog
            return self.fast_prefill.mtp(input_ids, hidden, state)  # type: ignore[no-any-return]
        return self.model.mtp_step(input_ids, hidden, state, logits="last")

    @torch.inference_mode()
    def draft_greedy(
        self, input_ids: torch.Tensor | Sequence[int], hidden: torch.Tensor, state: Any, k: int
    ) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            input_ids = upload_ids(input_ids, self.device)
        out = self.draft(input_ids, hidden, state)
        drafts = [greedy_draft(out.logits[-1:], self.draft_vocab)]
        for _ in range(k - 1):
            out = self.draft(drafts[-1], out.hidden[-1:], state)
            drafts.append(greedy_draft(out.logits[-1:], self.draft_vocab))
        return torch.cat(drafts)

    def rollback(self, state: Any, n_tokens: int) -> None:
        state.rollback(n_tokens)

    def rollback_draft(self, state: Any, n_positions: int) -> None:
        state.rollback_mtp(n_positions)

    def release(self, state: Any) -> None:
        state.release_history()

    def snapshot(self, state: Any, *, full: bool = False) -> Any:
        return state.snapshot(include_kv=full)  # light: DeltaNet states only; KV caches restore by truncation

    def restore(self, state: Any, snapshot: Any) -> None:
        state.restore(snapshot)

    def nbytes(self, state_or_snapshot: Any) -> int:
        return int(state_or_snapshot.nbytes())


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, fp32 on the CPU (CPU bf16 matmuls are slow and gain nothing)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def create_backend(
    model: Any,
    *,
    kind: str = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    progress: Any = None,
    prefill: str | None = None,
    drafts: str | None = None,
    kv_cache: str = DEFAULT_KV_FORMAT,
) -> Backend:
    """Load `model` (a checkpoint path in any format, or an opened `Checkpoint`) and wrap it in the chosen
    back end.

    auto: the megakernel when the device is a CUDA GPU and `onestream.kernels` can build it for the model (bf16
    weights, or block-quantized ones in the formats its GEMV streams: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0, Q5_1),
    else the reference. megakernel: that or a `BackendUnavailableError` saying why not.

    prefill (default `$ONESTREAM_PREFILL`, else auto): auto runs prompts on the fast prefill path on a CUDA
    device, except for kind="reference", which stays the ground truth throughout; reference or fast force it.

    drafts: where the engine's speculative drafts come from ("mtp": the model's MTP head, "lookup": the context;
    None: it decodes plainly); the megakernel's GEMV follows it ($ONESTREAM_MK_GEMV auto: kernels/tuning.py).

    kv_cache: the KV caches' format (worker/kv_cache.py), on either back end.
    """
    from .loading import load_model

    if drafts not in (None, "mtp", "lookup"):
        raise BackendUnavailableError(f"drafts must be None, 'mtp' or 'lookup', got {drafts!r}")

    if kind not in BACKEND_CHOICES:
        raise BackendUnavailableError(f"backend must be one of {BACKEND_CHOICES}, got {kind!r}")
    check_kv_format(kv_cache)
    prefill = prefill or os.environ.get(PREFILL_ENV, "auto")
    if prefill not in PREFILL_CHOICES:
        raise BackendUnavailableError(f"prefill must be one of {PREFILL_CHOICES}, got {prefill!r}")
    if kind == "megakernel" and not torch.cuda.is_available():
        raise BackendUnavailableError(
            "backend 'megakernel' needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)"
        )
    device = torch.device(device) if device is not None else default_device()
    if kind == "megakernel" and device.type != "cuda":
        raise BackendUnavailableError(f"backend 'megakernel' runs on a CUDA device, not {device}")
    dtype = dtype or default_dtype(device)
    loaded = load_model(model, dtype=dtype, device=device, progress=progress)
    if kind == "reference" or device.type != "cuda":
        return ReferenceBackend(
            loaded, prefill="reference" if prefill == "auto" else prefill, kv_format=kv_cache
        )
    try:
        from onestream.kernels.backend import MegakernelBackend  # type: ignore[import-not-found]

        return MegakernelBackend(
            loaded, tuning=megakernel_tuning(loaded, drafts), prefill=prefill, kv_format=kv_cache
        )
    except Exception as e:  # auto falls back on any build failure, and says why
        if kind == "megakernel":
            raise BackendUnavailableError(f"the megakernel back end is unavailable: {e}") from e
        log.warning("megakernel back end unavailable (%s); using the reference back end", e)
        return ReferenceBackend(loaded, prefill=prefill, kv_format=kv_cache)


def megakernel_tuning(model: Any, drafts: str | None) -> Any:
    """The megakernel build for `model` under the operator's $ONESTREAM_MK_* settings, its GEMV by whether the engine
    will verify drafts (`drafts`: create_backend's; MTP drafts need the model's MTP head)."""
    from onestream.kernels.tuning import tuning_from_env  # type: ignore[import-not-found]

    speculative = drafts == "lookup" or (drafts == "mtp" and bool(model.config.has_mtp))
    return tuning_from_env(speculative=speculative)
