"""The stop logic: token by token, what a generation emits and when it ends."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class TextDecoder(Protocol):
    def push(self, token_ids: int | Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class StopChecker:
    """Turns accepted tokens into emitted tokens and text, applying stop token ids, stop strings (matched
    across chunk boundaries and never emitted) and max_tokens."""

    def __init__(
        self,
        decoder: TextDecoder,
        *,
        stop_strings: Sequence[str],
        stop_token_ids: Iterable[int],
        max_tokens: int,
    ) -> None:
        self.decoder = decoder
        self.stop_strings = list(stop_strings)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_tokens = max_tokens
        self.generated = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._held = ""  # decoded text not emitted yet: it may be the start of a stop string

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, tokens: Sequence[int]) -> tuple[int, str]:
        """Consume tokens in order until the generation ends; return (tokens kept, text to emit)."""
        text: list[str] = []
        kept = 0
        for token in tokens:
            if self.finished:
                break
            kept += 1
            self.generated += 1
            if token in self.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token
                break
            self._held += self.decoder.push(token)
            if self._cut_at_stop_string(text):
                break
            if self.generated >= self.max_tokens:
                self.finish_reason = "length"
        if not self.finished:
            text.append(self._release_safe())
        return kept, "".join(text)

    def finish(self, reason: str) -> str:
        """End the generation (if not yet ended) and return the text still held back."""
        if self.finish_reason is None:
            self.finish_reason = reason
        if self.stop_reason is not None and isinstance(self.stop_reason, str):
            return ""  # stopped by a string: everything after it is dropped
        self._held += self.decoder.flush()
        text: list[str] = []
        if not self._cut_at_stop_string(text):
            text.append(self._held)
        self._held = ""
        return "".join(text)

    def _cut_at_stop_string(self, text: list[str]) -> bool:
        """If a stop string occurs in the held text, emit what precedes it and end."""
        best: tuple[int, str] | None = None
        for s in self.stop_strings:
            i = self._held.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        text.append(self._held[: best[0]])
        self._held = ""
        self.finish_reason, self.stop_reason = "stop", best[1]
        return True

    def _release_safe(self) -> str:
        """Emit the held text except its longest suffix that could still begin a stop string."""
        held = self._held
        keep = 0
        for n in range(min(len(held), max((len(s) for s in self.stop_strings), default=1) - 1), 0, -1):
            suffix = held[-n:]
            if any(s.startswith(suffix) for s in self.stop_strings):
                keep = n
                break
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep]
