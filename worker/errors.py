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
