"""Errors the engine raises. Each names what was wrong; the router maps them to gRPC status codes."""

from __future__ import annotations


class OnestreamError(Exception):
    """Base class of every error this project raises on purpose."""


class CheckpointError(OnestreamError):
    """A checkpoint directory is malformed: missing/unexpected tensors, bad shapes, truncated shards."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's `model_type` (or an architecture option) is not one this engine implements."""


class InvalidRequestError(OnestreamError, ValueError):
    """A request's parameters are invalid; raised before any work is done (gRPC INVALID_ARGUMENT)."""


class ContextLengthError(InvalidRequestError):
    """The prompt (plus max tokens) does not fit in the context (gRPC INVALID_ARGUMENT)."""


class UnknownSessionError(OnestreamError, KeyError):
    """No cached session has this id (gRPC NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown session"


class StateError(OnestreamError, ValueError):
    """A sequence-state operation that cannot be done: rollback past what is reachable, restore of a foreign
    or stale snapshot, a state made by another model."""


class EngineBusyError(OnestreamError, RuntimeError):
    """A second generation was started while one is running (an engine serves one sequence at a time)."""


class BackendUnavailableError(OnestreamError, RuntimeError):
    """The requested back end cannot run here (no GPU, kernels failed to build)."""


class MemoryBudgetError(BackendUnavailableError):
    """The card's memory (or the operator's budget) cannot hold the model at its context, even with the shortest
    prefill piece."""


QUOTED_CHARS = 40  # how much of a client's value an error message quotes


def quoted(value: object) -> str:
    """A client's value as an error message quotes it: its repr, cut short so that a huge value is never
    echoed back (a reply's status message travels in a header that clients limit to a few KiB)."""
    text = repr(value)
    return text if len(text) <= QUOTED_CHARS else f"{text[: QUOTED_CHARS - 5]}...({len(text)} chars)"
