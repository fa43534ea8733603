"""Constrained decoding: a request's output made to match a grammar, by masking the tokens it may not take.

`spec.py` says what a request asks for (OutputConstraint); `grammar.py` is what a grammar must provide;
`json_grammar.py` and `tool_grammar.py` are the grammars; `masks.py` computes and caches token masks;
`decoding.py` is what the engine holds per request. A new kind of constraint (a JSON schema, a regex) is a
new Grammar and a case in `decoding.grammar_for`.
"""

from .spec import JSON_OBJECT, TOOL_CALL, ConstrainedTool, OutputConstraint

__all__ = ["JSON_OBJECT", "TOOL_CALL", "ConstrainedTool", "OutputConstraint"]
