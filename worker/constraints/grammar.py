"""What a constraint's grammar is to the token masks: a deterministic recognizer over output bytes.

A grammar never holds a request's position itself: states are small hashable values (tuples), so that one
grammar serves every request that asks for it and the token mask of a state is computed once
(`masks.py`). A grammar may end its control of the output (`FREE`): one that shapes only the start of an
answer leaves the rest to the model.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

State = Hashable
FREE: State = ("free",)  # the constraint is over: any token may follow, the end of the output too


class Grammar:
    """Subclasses set `key` (equal keys: the same language, so masks may be shared) and implement
    `start`, `step`, `accepts`; `loop_bytes` is an optimisation."""

    key: Hashable

    def start(self) -> State:
        raise NotImplementedError

    def step(self, state: State, byte: int) -> State | None:
        """The state after `byte`, or None when the grammar does not allow it here (FREE allows all)."""
        raise NotImplementedError

    def accepts(self, state: State) -> bool:
        """Whether the output may end here (an end-of-sequence token is allowed)."""
        raise NotImplementedError

    def loop_bytes(self, state: State) -> frozenset[int]:
        """Bytes that leave `state` as it is (inside a string: almost all), which the masks skip over in
        bulk; empty when unsure."""
        return frozenset()

    def advance(self, state: State, data: bytes) -> State | None:
        for byte in data:
            if state == FREE:
                return state
            next_state = self.step(state, byte)
            if next_state is None:
                return None
            state = next_state
        return state


class Choice:
    """A choice among byte strings none of which is a prefix of another (each ends with a delimiter
    the alternatives' names cannot hold): which one a prefix is heading for, and when it is complete."""

    def __init__(self, options: Sequence[bytes]) -> None:
        self.options = frozenset(options)
        self._prefixes = {option[:n] for option in self.options for n in range(len(option) + 1)}

    def step(self, prefix: bytes, byte: int) -> bytes | None:
        extended = prefix + bytes((byte,))
        return extended if extended in self._prefixes else None

    def complete(self, prefix: bytes) -> bool:
        return prefix in self.options
