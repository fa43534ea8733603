"""Reading request bodies: every wrong type or value is a 400 that names the field's path."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from onestream.worker.api import SAMPLING_FIELD_TYPES, SAMPLING_FIELDS
from onestream.worker.constraints.spec import schema_problem

from .errors import bad_field

_KINDS: dict[type, str] = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    dict: "an object",
    list: "an array",
}


def _is(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def get(
    body: Mapping[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    *,
    path: str = "",
    required: bool = False,
) -> Any:
    """`body[name]` when it has one of the types `kind` (None when absent or null, unless required)."""
    field = f"{path}{name}"
    value = body.get(name)
    if value is None:
        if required:
            raise bad_field(field, "is required")
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(_is(value, k) for k in kinds):
        wanted = " or ".join(_KINDS.get(k, k.__name__) for k in kinds)
        raise bad_field(field, f"must be {wanted}, got {type(value).__name__}")
    return value


def positive_int(body: Mapping[str, Any], name: str, *, path: str = "", required: bool = False) -> int | None:
    value = get(body, name, int, path=path, required=required)
    if value is not None and value < 1:
        raise bad_field(f"{path}{name}", f"must be >= 1, got {value}")
    return value


def stop_strings(body: Mapping[str, Any], name: str) -> list[str]:
    """A stop field: a string or a list of strings."""
    value = get(body, name, (str, list))
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    for i, stop in enumerate(values):
        if not isinstance(stop, str):
            raise bad_field(f"{name}[{i}]", f"must be a string, got {type(stop).__name__}")
    return [stop for stop in values if stop]


def object_body(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise bad_field("body", f"must be a JSON object, got {type(raw).__name__}")
    return raw


# A JSON escape of a UTF-16 surrogate: valid JSON, but alone (not in a high-low pair) no Unicode text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def valid_unicode(body: Any, raw: bytes) -> None:
    """A 400 naming the first string of `body` (parsed from `raw`) that holds a lone surrogate: no tokenizer
    or protobuf string takes one. Only a body whose bytes hold a surrogate escape is walked; an emoji sent as
    an escaped pair has one, and passes."""
    if _SURROGATE_ESCAPE.search(raw) is None:
        return
    where = _lone_surrogate(body, "")
    if where is not None:
        raise bad_field(
            where or "body", "is not valid Unicode: it holds an unpaired surrogate (\\ud800-\\udfff)"
        )


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or object key) below `value` that does not encode as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        here = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = _lone_surrogate(key, here) if isinstance(key, str) else None
        found = found if found is not None else _lone_surrogate(child, here)
        if found is not None:
            return found
    return None


def tool_schema(spec: Mapping[str, Any], name: str, *, path: str = "", required: bool = False) -> Any:
    """A tool's parameters schema (`spec[name]`): an object that the tool-call parser and the cards' call
    grammar can read (worker/constraints/spec.py `schema_problem`)."""
    schema = get(spec, name, dict, path=path, required=required)
    problem = None if schema is None else schema_problem(schema)
    if problem is not None:
        field, why = problem
        raise bad_field(f"{path}{name}.{field}", why)
    return schema


def unsupported(body: Mapping[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    """A field whose other values this server does not implement: a 400 saying so, never a silent ignore."""
    value = body.get(name)
    if value is not None and value not in allowed:
        raise bad_field(name, f"{value!r} is not supported ({why})")


def sampling(body: Mapping[str, Any], names: tuple[str, ...] = SAMPLING_FIELDS) -> Any:
    """The router's SamplingParams from the body's sampling fields among `names` (ranges: the router
    checks them and names the field)."""
    from onestream.protos.onestream.v1 import onestream_pb2 as pb

    params = pb.SamplingParams()
    for name in names:
        value = get(body, name, SAMPLING_FIELD_TYPES[name])
        if value is None:
            continue
        try:
            setattr(params, name, value)
        except (ValueError, TypeError):
            raise bad_field(name, f"{value!r} is out of range") from None
    return params


def logit_bias(body: Mapping[str, Any], into: Any) -> None:
    """OpenAI's logit_bias ({"token id": bias}) into SamplingParams.logit_bias."""
    value = get(body, "logit_bias", dict)
    for key, bias in (value or {}).items():
        if not str(key).isdigit():
            raise bad_field("logit_bias", f"keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad_field(f"logit_bias.{key}", f"must be a number, got {type(bias).__name__}")
        into.logit_bias[int(key)] = float(bias)
