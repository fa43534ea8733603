"""An incremental JSON recognizer over bytes: which bytes may come next, one byte at a time.

A state is a small hashable tuple `(mode, stack, aux)` (the open containers as a string of `o` / `a`),
so that token masks can be cached per state (`masks.py`). Strings are checked as JSON's grammar says
(escapes, no raw control characters); bytes from 0x80 on pass unchecked inside strings (a byte-level
tokenizer's pieces of one character arrive in separate tokens).

A top-level value may be limited to some kinds (`object`, `array`, `string`, `number`, `integer`,
`boolean`, `null`): what a JSON-schema type allows. The value ends with its last byte (a number: at the
first byte that is not part of it, which the grammar after it reads); trailing whitespace is not part of it.
"""

from __future__ import annotations

from .grammar import Grammar, State

# Modes (the first item of a state).
TOP = 0  # before the top-level value (aux: whitespace run)
VALUE = 1  # a value is expected (aux: whitespace run)
OBJECT_FIRST = 2  # after `{`: a key or `}`
OBJECT_KEY = 3  # after `,` in an object: a key
COLON = 4  # after a key
ARRAY_FIRST = 5  # after `[`: a value or `]`
AFTER = 6  # after a value inside a container: `,` or the closer
STRING = 7  # inside a string (aux: 1 for a key)
ESCAPE = 8  # after `\` (aux: 1 for a key)
UNICODE = 9  # inside `\uXXXX` (aux: 2 * hex digits left + key flag)
MINUS = 10  # after `-`
ZERO = 11  # a leading `0`
INTEGER = 12  # integer digits
DOT = 13  # after `.`
FRACTION = 14  # fraction digits
EXPONENT = 15  # after `e`
EXPONENT_SIGN = 16  # after `e+` / `e-`
EXPONENT_DIGITS = 17
LITERAL = 18  # inside true / false / null (aux: index into LITERALS * 8 + bytes matched)
DONE = 19  # the top-level value is complete

KINDS = ("object", "array", "string", "number", "integer", "boolean", "null")
LITERALS = (b"true", b"false", b"null")
WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
ESCAPES = frozenset(b'"\\/bfnrtu')
# Whitespace between tokens: at most a newline and this much indentation per open container (what a
# pretty printer writes), so that a model stuck emitting whitespace cannot fill its output with it.
INDENT = 4
_STRING_LOOP = frozenset(range(0x20, 0x100)) - {ord('"'), ord("\\")}
_NUMBER_ENDS = frozenset({ZERO, INTEGER, FRACTION, EXPONENT_DIGITS})
_CLOSERS = {ord("}"): "o", ord("]"): "a"}


class JsonValue(Grammar):
    """One JSON value; `kinds` limits the top-level value's kind (None: any); `leading_whitespace`
    allows one whitespace byte before it."""

    def __init__(self, kinds: frozenset[str] | None = None, *, leading_whitespace: bool = True) -> None:
        unknown = set(kinds or ()) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown JSON kinds {sorted(unknown)}; known: {list(KINDS)}")
        self.kinds = frozenset(KINDS) if not kinds else frozenset(kinds)
        if "integer" in self.kinds and "number" in self.kinds:
            self.kinds -= {"integer"}
        self.leading_whitespace = leading_whitespace
        self.key = ("json", tuple(sorted(self.kinds)), leading_whitespace)

    def start(self) -> State:
        return (TOP, "", 0)

    def accepts(self, state: State) -> bool:
        mode, stack, _ = state
        return mode == DONE or (mode in _NUMBER_ENDS and not stack)

    def loop_bytes(self, state: State) -> frozenset[int]:
        mode = state[0]
        if mode == STRING:
            return _STRING_LOOP
        if mode in (INTEGER, FRACTION, EXPONENT_DIGITS):
            return DIGITS
        return frozenset()

    def step(self, state: State, byte: int) -> State | None:
        mode, stack, aux = state
        if mode == STRING:
            return self._string(stack, aux, byte)
        if mode == TOP:
            if byte in WHITESPACE:
                ok = self.leading_whitespace and aux < 1
                return (TOP, stack, aux + 1) if ok else None
            return self._value_start(stack, byte, top=True)
        if mode == VALUE:
            return self._whitespace(state, byte) or self._value_start(stack, byte)
        if mode in (OBJECT_FIRST, OBJECT_KEY):
            if byte == ord('"'):
                return (STRING, stack, 1)
            if mode == OBJECT_FIRST and byte == ord("}"):
                return self._close(stack)
            return self._whitespace(state, byte)
        if mode == COLON:
            return (VALUE, stack, 0) if byte == ord(":") else self._whitespace(state, byte)
        if mode == ARRAY_FIRST:
            if byte == ord("]"):
                return self._close(stack)
            return self._whitespace(state, byte) or self._value_start(stack, byte)
        if mode == AFTER:
            return self._after(stack, byte) or self._whitespace(state, byte)
        if mode == ESCAPE:
            if byte not in ESCAPES:
                return None
            return (UNICODE, stack, 8 + aux) if byte == ord("u") else (STRING, stack, aux)
        if mode == UNICODE:
            if byte not in HEX:
                return None
            left = aux - 2
            return (UNICODE, stack, left) if left >= 2 else (STRING, stack, left)
        if mode == LITERAL:
            word, matched = divmod(aux, 8)
            literal = LITERALS[word]
            if byte != literal[matched]:
                return None
            matched += 1
            return self._end_value(stack) if matched == len(literal) else (LITERAL, stack, word * 8 + matched)
        return self._number(mode, stack, aux, byte)

    def completion(self, state: State) -> str:
        """The shortest text that makes the value read so far whole: a string closed, a key given null, a
        number or literal finished, the open containers closed (a stream cut off keeps what arrived)."""
        mode, stack, aux = state
        if mode == TOP:
            return "{}" if "object" in self.kinds else "null"
        head = ""
        if mode in (STRING, ESCAPE, UNICODE):
            key = aux % 2 if mode == UNICODE else aux
            head = {ESCAPE: "n", UNICODE: "0" * (aux // 2)}.get(mode, "") + '"' + (": null" if key else "")
        elif mode == COLON:
            head = ": null"
        elif mode == VALUE:
            head = "null"
        elif mode == OBJECT_KEY:
            head = '"": null'
        elif mode in (MINUS, DOT, EXPONENT, EXPONENT_SIGN):
            head = "0"
        elif mode == LITERAL:
            word, matched = divmod(aux, 8)
            head = LITERALS[word][matched:].decode()
        return head + "".join("}" if frame == "o" else "]" for frame in reversed(stack))

    # ---- pieces --------------------------------------------------------------------------------
    def _whitespace(self, state: State, byte: int) -> State | None:
        mode, stack, aux = state
        if byte in WHITESPACE and aux <= INDENT * len(stack):
            return (mode, stack, aux + 1)
        return None

    def _value_start(self, stack: str, byte: int, *, top: bool = False) -> State | None:
        kinds = self.kinds if top else KINDS
        if byte == ord("{") and "object" in kinds:
            return (OBJECT_FIRST, stack + "o", 0)
        if byte == ord("[") and "array" in kinds:
            return (ARRAY_FIRST, stack + "a", 0)
        if byte == ord('"') and "string" in kinds:
            return (STRING, stack, 0)
        numeric = "number" in kinds or "integer" in kinds
        integer_only = int(top and "number" not in kinds)  # aux of the number modes: no `.`, no `e`
        if byte == ord("-") and numeric:
            return (MINUS, stack, integer_only)
        if byte == ord("0") and numeric:
            return (ZERO, stack, integer_only)
        if byte in DIGITS and numeric:
            return (INTEGER, stack, integer_only)
        for word, literal in enumerate(LITERALS):
            kind = "null" if literal == b"null" else "boolean"
            if byte == literal[0] and kind in kinds:
                return (LITERAL, stack, word * 8 + 1)
        return None

    def _string(self, stack: str, key: int, byte: int) -> State | None:
        if byte == ord('"'):
            return (COLON, stack, 0) if key else self._end_value(stack)
        if byte == ord("\\"):
            return (ESCAPE, stack, key)
        return None if byte < 0x20 else (STRING, stack, key)

    def _end_value(self, stack: str) -> State:
        return (AFTER, stack, 0) if stack else (DONE, "", 0)

    def _close(self, stack: str) -> State:
        return self._end_value(stack[:-1])

    def _after(self, stack: str, byte: int) -> State | None:
        if byte == ord(","):
            return (OBJECT_KEY, stack, 0) if stack[-1] == "o" else (VALUE, stack, 0)
        if _CLOSERS.get(byte) == stack[-1]:
            return self._close(stack)
        return None

    def _number(self, mode: int, stack: str, integer_only: int, byte: int) -> State | None:
        digit = byte in DIGITS
        if mode == MINUS:
            if byte == ord("0"):
                return (ZERO, stack, integer_only)
            return (INTEGER, stack, integer_only) if digit else None
        if mode == INTEGER and digit:
            return (INTEGER, stack, integer_only)
        if mode in (ZERO, INTEGER):
            if byte == ord(".") and not integer_only:
                return (DOT, stack, 0)
            if byte in b"eE" and not integer_only:
                return (EXPONENT, stack, 0)
        elif mode in (DOT, FRACTION):
            if digit:
                return (FRACTION, stack, 0)
            if mode == FRACTION and byte in b"eE":
                return (EXPONENT, stack, 0)
        elif mode == EXPONENT:
            if byte in b"+-":
                return (EXPONENT_SIGN, stack, 0)
            return (EXPONENT_DIGITS, stack, 0) if digit else None
        elif mode == EXPONENT_SIGN:
            return (EXPONENT_DIGITS, stack, 0) if digit else None
        elif mode == EXPONENT_DIGITS and digit:
            return (EXPONENT_DIGITS, stack, 0)
        if mode not in _NUMBER_ENDS or not stack:
            return None  # a number that cannot end here; a top-level one's end is the next grammar's
        # The number ended: this byte belongs to what follows it.
        after = (AFTER, stack, 0)
        return self._after(stack, byte) or self._whitespace(after, byte)
