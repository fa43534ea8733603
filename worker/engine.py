"""The engine: one sequence at a time, with a session cache and MTP speculative decoding.

`Engine.generate(request)` validates everything first (raising InvalidRequestError / ContextLengthError),
then returns an iterator of `TokenChunk`s ending with one `Finished`. Closing the iterator cancels the
generation at the next token boundary; `Engine.cancel(request_id)` does the same from another thread and
still yields `Finished("cancelled")`. Either way the session's state stays consistent and cached.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .api import DraftUsage, Finished, GenerateRequest, SamplingParams, Timings, TokenChunk, Usage
from .backend import MAX_VERIFY_DRAFTS, Backend, create_backend, verify_limit
from .checkpoints import open_checkpoint
from .checkpoints.hf import generation_defaults
from .constraints.decoding import Constraints, TokenConstraint
from .draft_vocab import DraftVocabulary
from .drafting import (
    DEFAULT_LOOKUP_K,
    DEFAULT_MODE,
    DEFAULT_NGRAM,
    MODES,
    DraftPolicy,
    DraftSettings,
    NGramIndex,
)
from .errors import ContextLengthError, EngineBusyError, InvalidRequestError
from .kv_cache import DEFAULT_KV_FORMAT
from .memory import checkpoint_weight_types, fit_prefill_pieces
from .prefixes import (
    DEFAULT_PREFIX_SHARING,
    MESSAGE_START_TOKENS,
    REUSE_CONVERSATION,
    REUSE_NONE,
    REUSE_SESSION,
    REUSE_SHARED,
    PrefixReuse,
    message_boundaries,
    sharing_scope,
)
from .progress import LoadProgress, ProgressReport, step_reporter
from .sampling import RequestSampler
from .sequence import Sequence
from .sessions import Session, SessionCache, SessionInfo
from .speculative import SpecStats, SpeculativeDecoder
from .stop import StopChecker
from .tokenizer import HealedTextDecoder, TokenHealing, heal_prompt

__all__ = [
    "Engine",
    "EngineBusyError",
    "Finished",
    "GenerateRequest",
    "SamplingParams",
    "Timings",
    "TokenChunk",
    "Usage",
    "generation_defaults",
]

# Longer drafts are accepted more often in total, but each extra MTP step is a serial launch: on the embedded
# model two drafts per cycle decode fastest with the reference back end (`onestream eval spec`, docs/benchmarks.md).
DEFAULT_SPEC_K = 2
# Sessions whose n-gram index (prompt lookup) the engine keeps between turns: an agent's next turn extends it
# instead of indexing its whole context again. Host memory, a few hundred bytes per token of a session.
MAX_LOOKUP_INDEXES = 8
DEFAULT_CACHE_BYTES = 4 << 30
BUSY_MESSAGE = "the engine is already generating (it serves one sequence at a time)"
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def default_lookup_k(backend: Backend) -> int:
    """The lookup's most drafts per cycle: the default, or fewer where one launch verifies fewer tokens."""
    limit = verify_limit(backend)
    return DEFAULT_LOOKUP_K if limit is None else min(DEFAULT_LOOKUP_K, limit - 1)


class Engine:
    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        backend: str | Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        spec_k: int | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_context: int | None = None,
        max_checkpoints: int = 4,
        token_healing: bool = False,
        quantize: str | None = None,
        tokenizer_dir: str | Path | None = None,
        on_load_progress: Callable[[ProgressReport], None] | None = None,
        prefix_sharing: str = DEFAULT_PREFIX_SHARING,
        drafting: str = DEFAULT_MODE,
        lookup_k: int | None = None,
        ngram: tuple[int, int] = DEFAULT_NGRAM,
        adaptive_drafts: bool = True,
        extend_mtp: bool = True,
        memory_budget: int | None = None,
        kv_cache: str = DEFAULT_KV_FORMAT,
    ) -> None:
        """`model_dir` names a checkpoint in any format (`worker/checkpoints/`); `quantize` a preset that
        quantizes a full-precision one as it loads; `tokenizer_dir` a Hugging Face tokenizer to use instead of
        the checkpoint's own; `on_load_progress` hears how far the weights' load has got (a card's `loading`
        state), besides the terminal and log lines every load reports. `drafting`, `lookup_k`, `ngram`
        (the lookup's shortest and longest n-gram), `adaptive_drafts` and `extend_mtp` (continue MTP drafts
        with copies) say where speculative drafts come from and how long they are (worker/drafting/).
        `memory_budget`: the bytes the engine may hold on its device (default: what the device has for this
        process); the fast prefill's piece is the longest whose accounting fits it (worker/memory.py), unless
        $ONESTREAM_PREFILL_TOKENS sets one. `kv_cache`: the KV caches' format (worker/kv_cache.py: "auto", the
        model's dtype, or "int8")."""
        self.checkpoint = open_checkpoint(model_dir, tokenizer_dir=tokenizer_dir, quantize=quantize)
        self.model_dir = self.checkpoint.path
        if isinstance(backend, str):
            self.backend: Backend = create_backend(
                self.checkpoint,
                kind=backend,
                device=device,
                dtype=parse_dtype(dtype),
                progress=LoadProgress(self.checkpoint.stored_sizes(), on_update=on_load_progress),
                drafts=draft_source(drafting, spec_k, lookup_k),
                kv_cache=kv_cache,
            )
        else:
            self.backend = backend
        self.config = self.backend.config
        self.tokenizer = self.checkpoint.tokenizer()
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids or self.config.eos_token_ids)
        self.generation_defaults = self.checkpoint.generation_defaults()
        limit = self.config.max_position_embeddings
        if max_context is not None and max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {max_context}")
        self.max_context = min(limit, max_context) if max_context is not None else limit
        self.spec_k = DEFAULT_SPEC_K if spec_k is None else spec_k
        self.drafting = drafting
        self.lookup_k = default_lookup_k(self.backend) if lookup_k is None else lookup_k
        DraftSettings(ngram=ngram)  # validates the lengths
        self.ngram = ngram
        self.adaptive_drafts = adaptive_drafts
        self.extend_mtp = extend_mtp
        # Learns the draft vocabulary from what the engine generates (None: the back end's draft_vocab is fixed).
        self.draft_vocabulary: DraftVocabulary | None = DraftVocabulary(self.config.vocab_size)
        if memory_budget is not None and memory_budget < 1:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
        # a back end of its own, or a budget given for one passed in
        sized = isinstance(backend, str) or memory_budget is not None
        if sized and getattr(self.backend, "fast_prefill", None) is not None:
            # the fast prefill's pieces, sized for this card, context and draft length (the rollback records)
            fit_prefill_pieces(
                self.backend,
                checkpoint_weight_types(self.checkpoint, self.backend.dtype),
                self.max_context,
                drafts=self.max_drafts,
                budget=memory_budget,
            )
        self._lookup_indexes: OrderedDict[str, NGramIndex] = OrderedDict()
        # Heal text prompts that end mid-token (tokenizer.TokenHealing); off by default so that a prompt's
        # tokens are exactly what the model is fed. `onestream generate` turns it on.
        self.token_healing = token_healing
        self._sessions = SessionCache(cache_bytes, max_checkpoints=max_checkpoints)
        sharing_scope(None, prefix_sharing)  # validates the mode
        self.prefix_sharing = prefix_sharing
        starts = (self.tokenizer.token_to_id(token) for token in MESSAGE_START_TOKENS)
        self._message_starts = frozenset(i for i in starts if i is not None)
        self.last_reuse = PrefixReuse(REUSE_NONE, 0)  # of the latest turn (read by the card's metrics)
        self._run_lock = threading.Lock()
        self._cache_lock = threading.RLock()
        self._active_request: str | None = None
        # Model calls so far (prefill chunks, decode steps, drafts, verifies), counted on the engine's
        # thread: a busy engine whose count stops growing is stuck (the card's liveness, cluster/card.py).
        self.progress = 0
        self._cancel = threading.Event()
        self._constraints: Constraints | None = None

    # ---- configuration -----------------------------------------------------------------------------
    @property
    def spec_k(self) -> int:
        """Drafts per speculative cycle; 0 turns speculative decoding off (and models without MTP have 0)."""
        return self._spec_k if self.backend.has_mtp else 0

    @spec_k.setter
    def spec_k(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 16:
            raise ValueError(f"spec_k must be an integer in [0, 16], got {k!r}")
        self._spec_k = k

    @property
    def drafting(self) -> str:
        """Where drafts come from: `combined` (prompt lookup, or the MTP head when it is more confident),
        `mtp` or `lookup` (worker/drafting/). spec_k = 0 turns `combined` and `mtp` off; `lookup` runs on
        any model, with or without an MTP head."""
        return self._drafting

    @drafting.setter
    def drafting(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"drafting must be one of {MODES}, got {mode!r}")
        self._drafting = mode

    @property
    def lookup_k(self) -> int:
        """The most drafts a prompt-lookup cycle copies (its length adapts below that)."""
        return self._lookup_k

    @lookup_k.setter
    def lookup_k(self, k: int) -> None:
        limit = verify_limit(self.backend)
        top = limit - 1 if limit is not None else MAX_VERIFY_DRAFTS
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= top:
            raise ValueError(f"lookup_k must be an integer in [0, {top}] on this back end, got {k!r}")
        self._lookup_k = k

    def draft_settings(self) -> DraftSettings | None:
        """How this engine's requests draft, or None when they do not (plain decoding)."""
        if self.drafting != "lookup" and self.spec_k == 0:
            return None
        settings = DraftSettings(
            mode=self.drafting,
            mtp_k=self.spec_k,
            lookup_k=self.lookup_k,
            ngram=self.ngram,
            adaptive=self.adaptive_drafts,
            extend_mtp=self.extend_mtp,
        )
        return settings if settings.max_drafts > 0 else None

    @property
    def max_drafts(self) -> int:
        """The most drafts one cycle verifies (0: no speculative decoding)."""
        settings = self.draft_settings()
        return settings.max_drafts if settings is not None else 0

    def warm_up(self, on_progress: Callable[[ProgressReport], None] | None = None) -> None:
        """Prepare now what the first request would otherwise pay for: a back end with a
        `prepare(max_tokens, on_step)` (the megakernel: one compiled build per tokens-per-launch) gets the most a
        cycle's drafts run, and reports each build as a load reports its tensors (terminal, log lines,
        `on_progress`: the card's `loading` state)."""
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:
            prepare(self.max_drafts + 1, step_reporter("compiling kernels", "builds", on_update=on_progress))

    def default_sampling(self, **overrides: Any) -> SamplingParams:
        """SamplingParams from the model's generation_config.json defaults, with the `overrides` that are not
        None on top (what a user passed): the settings the model's authors recommend unless told otherwise."""
        given = {name: value for name, value in overrides.items() if value is not None}
        return SamplingParams(**(self.generation_defaults | given))

    def model_info(self) -> dict[str, Any]:
        c = self.config
        return {
            "model_dir": str(self.model_dir),
            "model_name": self.checkpoint.name,
            "model_type": c.model_type,
            "format": self.checkpoint.format.label,
            "format_detail": self.checkpoint.format.describe(),
            "backend": self.backend.name,
            "device": str(self.backend.device),
            "dtype": str(self.backend.dtype).removeprefix("torch."),
            "kv_cache": getattr(self.backend, "kv_format", DEFAULT_KV_FORMAT),
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "num_layers": c.num_hidden_layers,
            "layer_types": list(c.layer_types),
            "has_mtp": self.backend.has_mtp,
            "spec_k": self.spec_k,
            "drafting": self.drafting if self.max_drafts else "off",
            "lookup_k": self.lookup_k,
            "max_drafts": self.max_drafts,
            "max_context": self.max_context,
            "eos_token_ids": sorted(self.eos_token_ids),
            "generation_defaults": dict(self.generation_defaults),
        }

    # ---- sessions --------------------------------------------------------------------------------
    def sessions(self) -> list[SessionInfo]:
        with self._cache_lock:
            return self._sessions.list()

    def close_session(self, session_id: str) -> None:
        """Forget a session's cached state (UnknownSessionError if the engine holds none)."""
        with self._cache_lock:
            self._sessions.close(session_id)

    def cached_bytes(self) -> int:
        with self._cache_lock:
            return self._sessions.nbytes()

    def shared_prefixes(self) -> tuple[int, int]:
        """(count, bytes) of the prefix checkpoints shared across sessions."""
        with self._cache_lock:
            return len(self._sessions.prefixes), self._sessions.prefixes.nbytes()

    def prefix_points(self) -> list[tuple[str, tuple[int, ...]]]:
        """(scope, tokens) of every point a request without a session id can continue from: anonymous
        sessions' states and checkpoints, and the shared prefixes (what the router's prefix index holds)."""
        with self._cache_lock:
            return self._sessions.prefix_points()

    @property
    def busy(self) -> bool:
        return self._run_lock.locked()

    def cancel(self, request_id: str) -> bool:
        """Ask the running generation with this id to stop at its next token boundary."""
        if request_id is not None and self._active_request == request_id:
            self._cancel.set()
            return True
        return False

    # ---- generation ------------------------------------------------------------------------------
    def tokenize_prompt(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids; ContextLengthError, found with bounded work, when they cannot fit."""
        prompt = request.prompt
        if isinstance(prompt, str) or request.is_chat:
            text = (
                prompt
                if isinstance(prompt, str)
                else self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            )
            room = self.max_context - request.max_tokens
            scope = sharing_scope(request.user, self.prefix_sharing)
            ids = self.tokenizer.encode_at_most(text, room, memo_scope=scope)
            if ids is None:
                raise ContextLengthError(
                    f"prompt of more than {room} tokens + max_tokens={request.max_tokens} "
                    f"exceeds the context of {self.max_context} tokens"
                )
            return ids
        return list(prompt)  # type: ignore[arg-type]

    def generate(self, request: GenerateRequest) -> Iterator[TokenChunk | Finished]:
        """Validate `request` now (raising on any problem), then stream its generation."""
        request.validate(vocab_size=self.config.vocab_size, max_context=self.max_context)
        prompt_ids = self.tokenize_prompt(request)
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty after tokenization")
        request.check_context(len(prompt_ids), self.max_context)
        if self.busy:
            raise EngineBusyError(BUSY_MESSAGE)
        healing = None
        if self.token_healing and isinstance(request.prompt, str):
            healing = heal_prompt(self.tokenizer, prompt_ids)
        return self._generate(request, prompt_ids, healing)

    def _generate(
        self, request: GenerateRequest, prompt_ids: list[int], healing: TokenHealing | None = None
    ) -> Iterator[TokenChunk | Finished]:
        if not self._run_lock.acquire(blocking=False):
            raise EngineBusyError(BUSY_MESSAGE)
        session: Session | None = None
        consistent = False
        try:
            self._active_request = request.request_id
            self._cancel.clear()
            t_start = time.perf_counter()
            if healing is not None:
                prompt_ids = healing.prompt_ids
            session, reuse = self._prepare(request, prompt_ids)
            self.last_reuse = reuse
            seq, cached = session.sequence, reuse.tokens
            out = self._prefill(session, prompt_ids, reuse)
            consistent = True

            sampler = RequestSampler(
                request.sampling, prompt_ids, self.config.vocab_size, self.backend.device
            )
            stop_ids = set(request.stop_token_ids) | (
                set() if request.ignore_eos else set(self.eos_token_ids)
            )
            decoder = self.tokenizer.incremental_decoder(skip_special_tokens=True)
            checker = StopChecker(
                decoder if healing is None else HealedTextDecoder(decoder, healing.prefix),
                stop_strings=request.stop,
                stop_token_ids=stop_ids,
                max_tokens=request.max_tokens,
            )
            stats = SpecStats()
            constraint = self._constraint(request, stop_ids | set(self.eos_token_ids))
            # A constrained request decodes one token at a time (worker/constraints/decoding.py).
            speculative, index = (
                self._speculative_decoder(session, prompt_ids, stats) if constraint is None else (None, None)
            )
            usage = Usage(prompt_tokens=len(prompt_ids), cached_prompt_tokens=cached)

            # The sampled token stays on the device as the next step's input; only its host copy syncs.
            first_logits = out.logits[-1:]
            if healing is not None:  # token one must start with the text backed off the prompt
                allowed = torch.tensor(healing.allowed_ids, device=first_logits.device)
                first_logits = torch.full_like(first_logits, float("-inf")).index_copy(
                    1, allowed, first_logits.index_select(1, allowed)
                )
            if constraint is not None:
                first_logits = constraint.mask(first_logits)
            pending_ids: torch.Tensor | None = sampler.next_tokens(first_logits)
            new_tokens = pending_ids.tolist()
            if constraint is not None:
                constraint.advance(new_tokens)
            pending = new_tokens[0]
            # Measured after that read: on an accelerator the prefill has only been queued before it.
            timings = Timings(prefill_s=time.perf_counter() - t_start)
            _, text = checker.push(new_tokens)
            sampler.commit(pending_ids)  # the device copy: no upload
            if index is not None:
                index.extend(new_tokens)
            t_last = time.perf_counter()
            timings.time_to_first_token_s = t_last - t_start
            yield TokenChunk(new_tokens, text)

            plain = speculative is None and constraint is None and not seq.track_mtp
            if plain and not checker.finished and not self._cancel.is_set():
                # Plain decoding: the back end runs one step ahead of the host (`Sequence.decode_run`), each
                # token chosen on the device (the kernel's argmax, or the sampler behind the step), and stops
                # are checked as each token is read back. The stream yields at most the tokens max_tokens
                # leaves, so it ends with the checker finished.
                stream = seq.decode_run(
                    pending,
                    pending_ids,
                    checker.max_tokens - checker.generated,
                    None if sampler.plain_argmax else sampler.choose,
                )
                consistent = False
                try:
                    for token in stream:
                        _, text = checker.push([token])
                        now = time.perf_counter()
                        timings.inter_token_s.append(now - t_last)
                        t_last = now
                        consistent = True  # the step run ahead is the stream's to settle if we stop here
                        yield TokenChunk([token], text)
                        consistent = False
                        if checker.finished:
                            break
                        if self._cancel.is_set():
                            checker.finish("cancelled")
                            break
                finally:
                    # Waits for the step run ahead (it consumed the last token); the state is consistent
                    # after it only if it was before (a GeneratorExit at the yield: yes; an error: no).
                    was, consistent = consistent, False
                    stream.close()
                    consistent = was
                consistent = True
            else:
                while not checker.finished:
                    if self._cancel.is_set():
                        checker.finish("cancelled")
                        break
                    consistent = False
                    new_tokens, text, pending_ids = self._step(
                        seq, pending, pending_ids, sampler, checker, speculative, constraint
                    )
                    consistent = True
                    sampler.commit(new_tokens if pending_ids is None else pending_ids)
                    if index is not None:
                        index.extend(new_tokens)
                    if self.draft_vocabulary is not None:
                        self.backend.draft_vocab = self.draft_vocabulary.observe(new_tokens)
                    pending = new_tokens[-1]
                    now = time.perf_counter()
                    timings.inter_token_s.append(now - t_last)
                    t_last = now
                    yield TokenChunk(new_tokens, text)

            tail = checker.finish("length")
            if tail:
                yield TokenChunk([], tail)
            usage.generated_tokens = checker.generated
            usage.drafts, usage.draft_tokens = stats.drafts, stats.draft_tokens
            usage.accepted_draft_tokens = stats.accepted_tokens
            usage.accepted_per_position = list(stats.accepted_per_position)
            usage.by_source = {
                source: DraftUsage(c.drafts, c.draft_tokens, c.accepted_tokens, list(c.accepted_per_position))
                for source, c in stats.by_source.items()
                if c.drafts
            }
            t_end = time.perf_counter()
            timings.decode_s = t_end - t_start - timings.time_to_first_token_s
            timings.total_s = t_end - t_start
            assert checker.finish_reason is not None
            yield Finished(checker.finish_reason, usage, timings, checker.stop_reason)
        finally:
            self._active_request = None
            if session is not None:
                with self._cache_lock:
                    if consistent:
                        session.sequence.release_rollback_records()
                        self._sessions.put(session)
                    else:
                        self._sessions.discard(session)
            self._run_lock.release()

    def _step(
        self,
        seq: Sequence,
        pending: int,
        pending_ids: torch.Tensor | None,
        sampler: RequestSampler,
        checker: StopChecker,
        speculative: SpeculativeDecoder | None,
        constraint: TokenConstraint | None = None,
    ) -> tuple[list[int], str, torch.Tensor | None]:
        """Run `pending` (`pending_ids`: the same token on the device, if at hand) and choose what follows:
        one token, or a speculative cycle's accepted tokens. Returns the tokens kept (up to a stop), their
        text and the last one on the device (or None); the state has run all but the last.
        One host synchronisation either way."""
        remaining = checker.max_tokens - checker.generated
        if speculative is not None and remaining >= 2:
            cycle = speculative.propose(seq, pending, sampler, remaining - 1)
            if cycle is not None:
                kept, text = checker.push(cycle.tokens)
                speculative.commit(seq, cycle, kept)
                return cycle.tokens[:kept], text, None
        out = seq.feed([pending], ids=pending_ids)
        logits = out.logits if constraint is None else constraint.mask(out.logits)
        next_ids = sampler.next_tokens(logits)
        new_tokens = next_ids.tolist()
        if constraint is not None:
            constraint.advance(new_tokens)
        _, text = checker.push(new_tokens)
        return new_tokens, text, next_ids

    def _constraint(self, request: GenerateRequest, end_ids: set[int]) -> TokenConstraint | None:
        """The request's constraint, on this engine's vocabulary (whose token bytes are read once)."""
        if request.constraint is None:
            return None
        if self._constraints is None:
            self._constraints = Constraints(self.tokenizer)
        return self._constraints.begin(request.constraint, end_ids)

    def _speculative_decoder(
        self, session: Session, prompt_ids: list[int], stats: SpecStats
    ) -> tuple[SpeculativeDecoder | None, NGramIndex | None]:
        """The request's speculative decoder (None: plain decoding) and the session's n-gram index, holding
        the prompt, when its drafts copy from the context."""
        settings = self.draft_settings()
        if settings is None or (settings.uses_mtp and not session.sequence.track_mtp):
            return None, None
        index = self._lookup_index(session.session_id) if settings.uses_lookup else None
        if index is not None:
            index.sync(prompt_ids)
        policy = DraftPolicy(settings, index)
        return SpeculativeDecoder(max(settings.max_drafts, 1), stats, policy), index

    def _lookup_index(self, session_id: str) -> NGramIndex:
        index = self._lookup_indexes.pop(session_id, None)
        if index is None or (index.n_min, index.n_max) != tuple(self.ngram):
            index = NGramIndex(*self.ngram)
        self._lookup_indexes[session_id] = index
        while len(self._lookup_indexes) > MAX_LOOKUP_INDEXES:
            self._lookup_indexes.popitem(last=False)
        return index

    def _prepare(self, request: GenerateRequest, prompt: list[int]) -> tuple[Session, PrefixReuse]:
        """The session to continue (its own, the anonymous one that reuses the most of the prompt, or a
        new one) brought to the longest reusable prefix of `prompt`, and where that prefix came from."""
        settings = self.draft_settings()
        track_mtp = settings is not None and settings.uses_mtp
        scope = sharing_scope(request.user, self.prefix_sharing)
        anonymous = request.session_id is None
        with self._cache_lock:
            if anonymous:
                session = self._sessions.take_by_prefix(scope, prompt, track_mtp=track_mtp)
            else:
                session = self._sessions.take(request.session_id)
            if session is None:
                session_id = request.session_id or f"anonymous-{uuid.uuid4().hex[:16]}"
                sequence = self._new_sequence(track_mtp)
                session = Session(session_id, sequence, scope=scope, anonymous=anonymous)
                self._sessions.begin(session)
            shared = self._sessions.prefixes.longest(scope, prompt)
        if not track_mtp and session.sequence.track_mtp:
            session.sequence.stop_tracking_mtp()  # spec_k was set to 0: owed MTP pairs would only pile up
        held = session.sequence.tokens
        if 0 < len(held) < len(prompt) and held == prompt[: len(held)]:
            # About to extend the previous turn's end: keep it restorable (an edited last message).
            session.add_checkpoint(self._sessions.max_checkpoints)
        cached = session.rewind_for(prompt) if held else 0
        reuse = PrefixReuse(REUSE_CONVERSATION if anonymous else REUSE_SESSION, cached)
        if cached == 0:
            reuse = PrefixReuse(REUSE_NONE, 0)
        if (
            shared is not None
            and len(shared.tokens) > cached
            and session.sequence.can_restore(shared.checkpoint)
        ):
            session.sequence.restore(shared.checkpoint)
            with self._cache_lock:
                self._sessions.prefixes.used(shared)
            reuse = PrefixReuse(REUSE_SHARED, len(shared.tokens))
        return session, reuse

    def _new_sequence(self, track_mtp: bool) -> Sequence:
        return Sequence(self.backend, self.max_context, track_mtp=track_mtp, on_step=self._stepped)

    def _stepped(self) -> None:
        self.progress += 1

    def _prefill(self, session: Session, prompt: list[int], reuse: PrefixReuse) -> Any:
        """Run the uncached prompt tokens; returns the last step's output (its logits give token one).

        A prefill that does not continue its session's own state keeps shared checkpoints at the message
        boundaries it crosses (worker/prefixes.py)."""
        seq, start = session.sequence, reuse.tokens
        if reuse.source in (REUSE_NONE, REUSE_SHARED):
            scope = session.scope
            for boundary in message_boundaries(prompt, self._message_starts, start, len(prompt) - 2):
                with self._cache_lock:
                    if self._sessions.prefixes.holds(scope, prompt[:boundary]):
                        continue
                seq.feed(prompt[start:boundary])
                start = boundary
                checkpoint = seq.checkpoint(full=True)
                with self._cache_lock:
                    self._sessions.add_prefix(scope, checkpoint)
        if start < len(prompt) - 1:
            seq.feed(prompt[start:-1])
        if len(seq) > 0:
            session.add_checkpoint(self._sessions.max_checkpoints)  # end of prompt minus its last token
        return seq.feed(prompt[-1:])


def draft_source(
    drafting: str = DEFAULT_MODE, spec_k: int | None = None, lookup_k: int | None = None
) -> str | None:
    """Where an engine of these settings (Engine's arguments, None for its defaults) takes drafts from, as
    create_backend asks (draft_settings decides per request once the model is loaded: the MTP modes draft only with
    an MTP head)."""
    if drafting == "lookup":
        return None if lookup_k == 0 else "lookup"
    return "mtp" if (DEFAULT_SPEC_K if spec_k is None else spec_k) > 0 else None
