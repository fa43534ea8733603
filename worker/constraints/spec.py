"""What a request asks its output to match: the wire- and engine-neutral description of a constraint.

Needs no torch (the request types in worker/api.py carry it); `worker/constraints/decoding.py` turns it into
token masks on the card.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InvalidRequestError

JSON_OBJECT = "json_object"  # the output is one JSON object (OpenAI's response_format json_object)
TOOL_CALL = "tool_call"  # the output opens with a complete call of a declared tool (tool_choice)
KINDS = (JSON_OBJECT, TOOL_CALL)
TOOL_FORMATS = ("xml", "json")  # the chat template's call form (cluster/frontdoor/toolcalls.py)
MAX_TOOLS = 512
MAX_PARAMETERS_CHARS = 1 << 16


def schema_problem(schema: dict) -> tuple[str, str] | None:
    """What in a tool's parameters schema the call's grammar (tool_grammar.py) and parser
    (cluster/frontdoor/toolcalls.py) cannot read, as (the field's path in the schema, why); None when
    nothing. They read `properties` (an object of schema objects), each one's `type` (a type name or a list
    of them) and `required` (a list of parameter names); the rest of the schema is the model's to read."""
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            return "properties", f"must be an object, got {type(properties).__name__}"
        for name, parameter in properties.items():
            if not isinstance(parameter, dict):
                return (
                    f"properties.{name}",
                    f"must be an object (the parameter's schema), got {type(parameter).__name__}",
                )
            declared = parameter.get("type")
            if declared is not None and not _names(declared):
                return (
                    f"properties.{name}.type",
                    f"must be a type name or a list of them, got {declared!r:.80}",
                )
    required = schema.get("required")
    if required is not None and not _names(required, single=False):
        return "required", f"must be a list of parameter names, got {required!r:.80}"
    return None


def _names(value: object, *, single: bool = True) -> bool:
    return (single and isinstance(value, str)) or (
        isinstance(value, list) and all(isinstance(item, str) for item in value)
    )


@dataclass(frozen=True)
class ConstrainedTool:
    name: str
    parameters: str = "{}"  # the tool's parameters as a JSON schema (JSON text)

    def schema(self) -> dict:
        return json.loads(self.parameters)


@dataclass(frozen=True)
class OutputConstraint:
    """`kind` JSON_OBJECT, or TOOL_CALL: the prompt ends with the opening of a call in `tool_format`
    (up to the name, or with `tool_name` set past that tool's header) and the output completes it, then
    ends or (`parallel_calls`) makes more calls."""

    kind: str
    tool_format: str = ""
    tools: tuple[ConstrainedTool, ...] = ()
    tool_name: str = ""
    parallel_calls: bool = False

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"constraint.kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind != TOOL_CALL:
            return
        if self.tool_format not in TOOL_FORMATS:
            raise InvalidRequestError(
                f"constraint.tool_format must be one of {list(TOOL_FORMATS)}, got {self.tool_format!r}"
            )
        if not self.tools or len(self.tools) > MAX_TOOLS:
            raise InvalidRequestError(
                f"constraint.tools must hold 1 to {MAX_TOOLS} tools, got {len(self.tools)}"
            )
        for i, tool in enumerate(self.tools):
            if not tool.name:
                raise InvalidRequestError(f"constraint.tools[{i}].name is empty")
            if len(tool.parameters) > MAX_PARAMETERS_CHARS:
                raise InvalidRequestError(
                    f"constraint.tools[{i}].parameters is over {MAX_PARAMETERS_CHARS} characters"
                )
            try:
                schema = tool.schema()
            except ValueError as e:
                raise InvalidRequestError(f"constraint.tools[{i}].parameters is not JSON ({e})") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError(f"constraint.tools[{i}].parameters must be a JSON object")
            problem = schema_problem(schema)
            if problem is not None:
                field, why = problem
                raise InvalidRequestError(f"constraint.tools[{i}].parameters.{field}: {why}")
        if self.tool_name and self.tool_name not in {tool.name for tool in self.tools}:
            raise InvalidRequestError(f"constraint.tool_name {self.tool_name!r} names none of its tools")
