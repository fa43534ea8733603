"""Bounds on every request's strings and lists, checked on the wire message before any other work.

The router runs these first, so that an oversized field costs a length check, never a conversion, a
queue slot or a card's time. Each violation raises InvalidRequestError naming the field and the limit,
never quoting the value. The engine's own validation (worker/api.py) still checks the contents.
"""

from __future__ import annotations

from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.api import (
    MAX_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MESSAGE_ROLES,
    SamplingParams,
)
from onestream.worker.errors import ContextLengthError, InvalidRequestError

MAX_ABORT_IDS = 1024
MAX_ROLE_CHARS = max(len(role) for role in MESSAGE_ROLES)
# google.protobuf.Timestamp's range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z.
MIN_TIMESTAMP_S = -62_135_596_800
MAX_TIMESTAMP_S = 253_402_300_799


def check_generate(message: pb.GenerateRequest, max_context: int | None) -> None:
    """Sizes of a Generate request's fields; the prompt's only once the context is known (`max_context`)."""
    check_id("session_id", message.session_id)
    check_id("request_id", message.request_id)
    if max_context:
        _check_prompt(message, max_context)
    if len(message.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"stop has {len(message.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
        )
    for i, stop in enumerate(message.stop):
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop[{i}] is {len(stop)} characters long; at most {MAX_STOP_STRING_CHARS}"
            )
    if len(message.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            f"stop_token_ids has {len(message.stop_token_ids)} entries; at most {MAX_STOP_TOKEN_IDS} are allowed"
        )
    bias = len(message.sampling.logit_bias)
    if bias > SamplingParams.MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"sampling.logit_bias has {bias} entries; at most {SamplingParams.MAX_LOGIT_BIAS_ENTRIES}"
        )
    if message.HasField("deadline"):
        seconds, nanos = message.deadline.seconds, message.deadline.nanos
        if not MIN_TIMESTAMP_S <= seconds <= MAX_TIMESTAMP_S or not 0 <= nanos < 1_000_000_000:
            raise InvalidRequestError(
                f"deadline is out of range (seconds={seconds}, nanos={nanos}): a Timestamp lies between "
                "0001-01-01 and 9999-12-31 with nanos in [0, 1e9)"
            )


def check_abort(message: pb.AbortRequest) -> None:
    if len(message.request_ids) > MAX_ABORT_IDS:
        raise InvalidRequestError(
            f"request_ids has {len(message.request_ids)} entries; at most {MAX_ABORT_IDS} per call"
        )
    for i, request_id in enumerate(message.request_ids):
        check_id(f"request_ids[{i}]", request_id)


def check_id(name: str, value: str, *, required: bool = False) -> None:
    if required and not value:
        raise InvalidRequestError(f"{name} is empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequestError(f"{name} is {len(value)} characters long; at most {MAX_ID_CHARS}")


def _check_prompt(message: pb.GenerateRequest, max_context: int) -> None:
    """Counts only: the prompt's bytes are bounded by the engine's validation (worker/api.py),
    which the router runs next on the converted request."""
    kind = message.WhichOneof("prompt")
    if kind == "token_ids" and len(message.token_ids.ids) > max_context:
        raise ContextLengthError(
            f"prompt of {len(message.token_ids.ids)} tokens exceeds the context of {max_context} tokens"
        )
    if kind == "messages":
        messages = message.messages.messages
        if len(messages) > max_context:
            raise ContextLengthError(
                f"messages has {len(messages)} entries; a context of {max_context} tokens holds fewer"
            )
        for i, chat in enumerate(messages):
            if len(chat.role) > MAX_ROLE_CHARS:
                raise InvalidRequestError(
                    f"messages[{i}].role is {len(chat.role)} characters long; it must be one of {MESSAGE_ROLES}"
                )
