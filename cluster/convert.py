"""Conversions between the wire messages (onestream.v1) and the engine's request and results."""

from __future__ import annotations

import dataclasses
from typing import Any

from onestream.protos.onestream.v1 import onestream_pb2 as pb
from onestream.worker.api import SAMPLING_FIELDS, Finished, GenerateRequest, SamplingParams, TokenChunk
from onestream.worker.constraints import ConstrainedTool, OutputConstraint
from onestream.worker.errors import InvalidRequestError

from .card import CardIdentity, SessionRecord


def request_from_proto(
    message: pb.GenerateRequest, request_id: str, sampling_defaults: dict[str, Any] | None = None
) -> GenerateRequest:
    """The engine's request for a wire request; raises InvalidRequestError naming the bad field.

    `sampling_defaults` (the model's generation_config.json defaults, from the card's model info) fill the
    sampling fields the request leaves unset, as `onestream generate` does locally."""
    kind = message.WhichOneof("prompt")
    prompt: str | list[int] | list[dict[str, Any]]
    if kind is None:
        raise InvalidRequestError("prompt is empty: set one of text, token_ids or messages")
    if kind == "text":
        prompt = message.text
    elif kind == "token_ids":
        prompt = list(message.token_ids.ids)
    else:
        prompt = [{"role": m.role, "content": m.content} for m in message.messages.messages]
    values = {name: value for name, value in (sampling_defaults or {}).items() if name in SAMPLING_FIELDS}
    values |= {
        name: getattr(message.sampling, name) for name in SAMPLING_FIELDS if message.sampling.HasField(name)
    }
    if message.sampling.logit_bias:
        values["logit_bias"] = tuple(sorted(message.sampling.logit_bias.items()))
    sampling = SamplingParams(**values)
    fields: dict[str, Any] = {}
    if message.HasField("max_tokens"):
        fields["max_tokens"] = message.max_tokens
    if message.HasField("constraint"):
        fields["constraint"] = constraint_from_proto(message.constraint)
    return GenerateRequest(
        prompt=prompt,
        sampling=sampling,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        session_id=message.session_id or None,
        request_id=request_id,
        ignore_eos=message.ignore_eos,
        **fields,
    )


def constraint_from_proto(message: pb.OutputConstraint) -> OutputConstraint:
    tools = tuple(ConstrainedTool(t.name, t.parameters or "{}") for t in message.tools)
    return OutputConstraint(
        message.kind, message.tool_format, tools, message.tool_name, message.parallel_calls
    )


def chunk_to_proto(chunk: TokenChunk) -> pb.TokenChunk:
    return pb.TokenChunk(token_ids=chunk.token_ids, text=chunk.text)


def finished_to_proto(
    finished: Finished, card: pb.Card, *, queue_wait_s: float, time_to_first_token_s: float, total_s: float
) -> pb.Finished:
    usage, timings = finished.usage, finished.timings
    decode_tokens = max(usage.generated_tokens - 1, 0)  # decode_s runs from the first token on
    message = pb.Finished(
        finish_reason=finished.finish_reason,
        usage=pb.Usage(**usage.as_dict()),  # the same fields on both sides
        timings=pb.Timings(
            queue_wait_s=queue_wait_s,
            time_to_first_token_s=time_to_first_token_s,
            prefill_s=timings.prefill_s,
            decode_s=timings.decode_s,
            total_s=total_s,
            decode_tokens_per_s=decode_tokens / timings.decode_s if timings.decode_s > 0 else 0.0,
        ),
        card=card,
    )
    if isinstance(finished.stop_reason, str):
        message.stop_string = finished.stop_reason
    elif isinstance(finished.stop_reason, int):
        message.stop_token_id = finished.stop_reason
    return message


def card_to_proto(
    identity: CardIdentity | None,
    *,
    card_id: str,
    state: int,
    restarts: int = 0,
    cached_sessions: int = 0,
    cached_session_bytes: int = 0,
    loading_fraction: float = 0.0,
) -> pb.Card:
    card = pb.Card(
        card_id=card_id,
        state=state,  # type: ignore[arg-type]
        restarts=restarts,
        cached_sessions=cached_sessions,
        cached_session_bytes=cached_session_bytes,
        loading_fraction=loading_fraction,
    )
    if identity is not None:
        card.node_id = identity.node_short
        card.node_ip = identity.node_ip
        card.gpu_index = identity.gpu_index
        card.gpu_uuid = identity.gpu_uuid
        card.device_name = identity.device_name
        card.backend = identity.backend
        card.metrics_endpoint = identity.metrics_endpoint
    return card


def session_to_proto(
    session_id: str,
    card_id: str,
    turns: int,
    last_used_wall: float,
    record: SessionRecord | None,
    *,
    user: str | None = None,
) -> pb.Session:
    session = pb.Session(session_id=session_id, card_id=card_id, turns=turns, user=user or "")
    session.last_used.FromNanoseconds(int(last_used_wall * 1e9))
    if record is not None:
        session.cached_tokens = record.cached_tokens
        session.cached_bytes = record.cached_bytes
    return session


# The engine's model_info() keys that have another name on the wire.
_MODEL_INFO_RENAMES = {"model_name": "name"}


def model_info_to_proto(info: dict[str, Any]) -> pb.ModelInfo:
    known = {f.name for f in pb.ModelInfo.DESCRIPTOR.fields} - {"extra"}
    message = pb.ModelInfo()
    for engine_key, value in info.items():
        key = _MODEL_INFO_RENAMES.get(engine_key, engine_key)
        if key in known and value is not None:
            try:
                setattr(message, key, value)
                continue
            except (TypeError, ValueError):
                pass
        message.extra[key] = _text(value)
    return message


def _text(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return value if isinstance(value, str) else repr(value)
