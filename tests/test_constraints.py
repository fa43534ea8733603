"""Constrained decoding (worker/constraints/): the grammars byte by byte, the token masks over the embedded
model's real vocabulary, and the engine decoding under a constraint."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onestream.worker.api import GenerateRequest, SamplingParams
from onestream.worker.checkpoints import open_checkpoint
from onestream.worker.constraints import ConstrainedTool, OutputConstraint
from onestream.worker.constraints.decoding import Constraints, grammar_for, token_bytes
from onestream.worker.constraints.grammar import FREE, Grammar
from onestream.worker.constraints.json_grammar import JsonValue
from onestream.worker.constraints.masks import allowed_tokens
from onestream.worker.errors import InvalidRequestError
from onestream.worker.loading import default_model_dir
from onestream.worker.tokenizer import Tokenizer

JSON_OBJECT = OutputConstraint("json_object")
SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "count": {"type": "integer"},
        "options": {"type": "object"},
        "force": {"type": ["boolean", "null"]},
    },
    "required": ["path", "count"],
}
TOOLS = (ConstrainedTool("write_file", json.dumps(SCHEMA)), ConstrainedTool("list_dir", "{}"))


def matches(grammar: Grammar, text: str) -> bool:
    """Whether `text` is a whole output of `grammar` (FREE counts: the constraint let go)."""
    state = grammar.advance(grammar.start(), text.encode())
    return state is not None and (state == FREE or grammar.accepts(state))


def prefix_ok(grammar: Grammar, text: str) -> bool:
    return grammar.advance(grammar.start(), text.encode()) is not None


# ---- the JSON grammar ---------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(value=st.dictionaries(st.text(max_size=8), json_values, max_size=4), indent=st.sampled_from([None, 2]))
def test_every_json_object_is_accepted(value: dict[str, Any], indent: int | None) -> None:
    grammar = grammar_for(JSON_OBJECT)
    for ascii_only in (True, False):
        assert matches(grammar, json.dumps(value, indent=indent, ensure_ascii=ascii_only))


@pytest.mark.parametrize(
    "text",
    ['{"a": 01}', '{"a": 1,}', "[1]", '{"a" 1}', '{"a": "\n"}', '{"a": tru}', '{"a": 1e}', '{"a": 1.}',
     "{'a': 1}", '{"a": NaN}', '{"a": "\\x"}', '{"a": 1}}', ' {"a": 1}', '{"a":        1}', "{} {}"],
)  # fmt: skip
def test_what_json_objects_are_not_is_refused(text: str) -> None:
    assert not matches(grammar_for(JSON_OBJECT), text)


def test_a_number_ends_where_what_follows_it_begins() -> None:
    grammar = JsonValue(frozenset({"integer"}), leading_whitespace=False)
    state = grammar.advance(grammar.start(), b"-120")
    assert state is not None and grammar.accepts(state)
    assert grammar.step(state, ord(".")) is None  # an integer has no fraction
    assert grammar.advance(grammar.start(), b"01") is None
    assert not matches(grammar, "true") and matches(JsonValue(frozenset({"boolean", "null"})), "null")


# ---- the tool-call grammars ---------------------------------------------------------------------------
XML_ANY = OutputConstraint("tool_call", "xml", TOOLS)
XML_PARALLEL = OutputConstraint("tool_call", "xml", TOOLS, parallel_calls=True)
CALL = "</function>\n</tool_call>"


@pytest.mark.parametrize(
    ("constraint", "text", "whole"),
    [
        (XML_ANY, f"write_file>\n<parameter=path>\na <b>.py\n\n</parameter>\n<parameter=count>\n12\n</parameter>\n{CALL}", True),
        (XML_ANY, f'write_file>\n<parameter=count>\n-3\n</parameter>\n<parameter=options>\n{{"a": [1]}}\n</parameter>\n<parameter=path>\nx\n</parameter>\n{CALL}', True),
        (XML_ANY, f"list_dir>\n{CALL}", True),
        (XML_ANY, f"list_dir>\n{CALL}\nmore text", False),  # the turn ends with the call
        (XML_ANY, f"list_dir>\n{CALL}\n<tool_call>\n<function=list_dir>\n{CALL}", False),
        (XML_PARALLEL, f"list_dir>\n{CALL}\n<tool_call>\n<function=list_dir>\n{CALL}", True),
        (XML_PARALLEL, f"list_dir>\n{CALL}\n<tool_call>\n<function=rm>", False),
        (OutputConstraint("tool_call", "xml", TOOLS, "list_dir"), CALL, True),
        (XML_ANY, f"write_file>\n<parameter=count>\n1\n</parameter>\n{CALL}", False),  # path is required
        (XML_ANY, "write_file>\n<parameter=count>\n1.5", False),  # an integer
        (XML_ANY, "write_file>\n<parameter=path>\na</function>", False),  # a tag that would cut the value
        (XML_ANY, "write_file>\n<parameter=path>\na\n</parameter>\n<parameter=path>", False),  # twice
        (XML_ANY, "write_file>\n<parameter=mode>", False),  # undeclared
        (XML_ANY, "rm>", False),
        (OutputConstraint("tool_call", "json", TOOLS), 'list_dir", "arguments": {"a": [1]}}\n</tool_call>', True),
        (OutputConstraint("tool_call", "json", TOOLS, "list_dir"), '{}}\n</tool_call>', True),
        (OutputConstraint("tool_call", "json", TOOLS, "list_dir", True), '{}}\n</tool_call>\n<tool_call>\n{"name": "list_dir", "arguments": {}}\n</tool_call>', True),
        (OutputConstraint("tool_call", "json", TOOLS, "list_dir"), '[]}', False),
    ],
)  # fmt: skip
def test_a_forced_call_takes_its_tools_syntax_and_parameters(
    constraint: OutputConstraint, text: str, whole: bool
) -> None:
    assert matches(grammar_for(constraint), text) is whole


def test_a_parameter_of_several_types_takes_any_of_them() -> None:
    grammar = grammar_for(XML_ANY)
    for value in ("null", "true"):
        assert prefix_ok(grammar, f"write_file>\n<parameter=force>\n{value}\n</parameter>")
    assert not prefix_ok(grammar, "write_file>\n<parameter=force>\n1")


def test_a_constraint_names_what_is_wrong_with_it() -> None:
    cases = [
        (OutputConstraint("regex"), "constraint.kind"),
        (OutputConstraint("tool_call", "yaml", TOOLS), "constraint.tool_format"),
        (OutputConstraint("tool_call", "xml", ()), "constraint.tools"),
        (
            OutputConstraint("tool_call", "xml", (ConstrainedTool("f", "{"),)),
            "constraint.tools[0].parameters",
        ),
        (OutputConstraint("tool_call", "xml", TOOLS, "rm"), "constraint.tool_name"),
    ]
    # Schemas the call grammar cannot read (each was an INTERNAL error of the card before it was named).
    for schema, field in [
        ({"properties": ["path"]}, "properties: must be an object"),
        ({"properties": {"path": "string"}}, "properties.path: must be an object"),
        ({"properties": {"path": {"type": True}}}, "properties.path.type: must be a type name"),
        ({"properties": {"path": {"type": [["string"]]}}}, "properties.path.type: must be a type name"),
        ({"properties": {}, "required": 1.5}, "required: must be a list of parameter names"),
        ({"properties": {}, "required": [[]]}, "required: must be a list of parameter names"),
    ]:
        tools = (ConstrainedTool("f", json.dumps(schema)),)
        cases.append((OutputConstraint("tool_call", "xml", tools), f"constraint.tools[0].parameters.{field}"))
    for constraint, field in cases:
        with pytest.raises(InvalidRequestError, match=field.replace("[", r"\[").replace("]", r"\]")):
            GenerateRequest("x", constraint=constraint).validate()


# ---- masks over the embedded model's vocabulary ---------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return open_checkpoint(default_model_dir()).tokenizer()


@pytest.fixture(scope="module")
def constraints(tokenizer: Tokenizer) -> Constraints:
    return Constraints(tokenizer)


def test_token_bytes_spell_what_the_tokenizer_decodes(tokenizer: Tokenizer) -> None:
    pieces = token_bytes(tokenizer)
    text = 'def f(x):\n    return {"é": [1, 2.5e-3], "b": "\\n"}  # ünïcode ✓'
    ids = tokenizer.encode(text)
    assert b"".join(pieces[i] or b"" for i in ids).decode() == text
    special = tokenizer.token_to_id("<|im_end|>")
    assert special is not None and pieces[special] is None


def test_a_mask_allows_exactly_the_tokens_the_grammar_steps_through(constraints: Constraints) -> None:
    vocabulary = constraints.masks.vocabulary
    grammar = grammar_for(XML_ANY)
    state = grammar.advance(grammar.start(), b"write_file>\n<parameter=path>\nsrc/")
    assert state is not None
    mask = allowed_tokens(grammar, state, vocabulary)
    for token_id in range(vocabulary.size):
        piece = vocabulary.token(token_id)
        expected = bool(piece) and grammar.advance(state, piece) is not None
        assert mask[token_id] == expected, (token_id, piece)


def test_random_walks_under_the_mask_end_in_valid_json(
    tokenizer: Tokenizer, constraints: Constraints
) -> None:
    rng = random.Random(7)
    end = tokenizer.eos_token_ids
    finished = 0
    for _ in range(20):
        constraint = constraints.begin(JSON_OBJECT, end)
        ids: list[int] = []
        for _step in range(200):
            allowed = constraint.allowed()
            assert allowed is not None and allowed.any()
            choices = allowed.nonzero()[0].tolist()
            # Lean on the structural tokens so that walks close their objects.
            closing = [
                i for i in choices if i in end or constraints.masks.vocabulary.token(i) in (b"}", b"]", b'"')
            ]
            token = rng.choice(closing if closing and rng.random() < 0.5 else choices)
            if token in end:
                break
            constraint.advance([token])
            ids.append(token)
        else:
            continue
        finished += 1
        assert isinstance(json.loads(tokenizer.decode(ids)), dict)
    assert finished > 0


# ---- the engine -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Any:
    from onestream.worker.engine import Engine

    return Engine(max_context=512)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_answers_json_and_drafts_nothing(engine: Any, temperature: float) -> None:
    assert engine.spec_k > 0  # the embedded model speculates, except under a constraint
    request = GenerateRequest(
        "import json\n\ndata = json.loads('",
        SamplingParams(temperature=temperature, seed=1),
        max_tokens=16,
        constraint=JSON_OBJECT,
    )
    *chunks, finished = engine.generate(request)
    text = "".join(c.text for c in chunks)
    assert finished.usage.drafts == 0
    assert prefix_ok(grammar_for(JSON_OBJECT), text)
    if finished.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    if temperature == 0:
        assert finished.finish_reason == "stop", text
