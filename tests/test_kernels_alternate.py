"""Alternated timing: rotation, error isolation and the table (no GPU: timers are plain functions)."""

from __future__ import annotations

import itertools

from onestream.kernels.alternate import AlternatedResult, alternate, format_alternated, round_orders


def test_every_build_takes_every_place_in_turn() -> None:
    orders = round_orders(["a", "b", "c"], 6)
    assert all(sorted(o) == ["a", "b", "c"] for o in orders)
    for place in range(3):
        assert {o[place] for o in orders[:3]} == {"a", "b", "c"}


def test_rounds_are_recorded_in_order_and_a_failing_build_is_isolated() -> None:
    calls: list[str] = []
    ticks = itertools.count(1)

    def timer(label: str, fail_on_call: int | None = None):
        own = itertools.count(1)

        def run() -> float:
            calls.append(label)
            if next(own) == fail_on_call:
                raise RuntimeError("watchdog")
            return float(next(ticks))

        return run

    results = alternate({"static": timer("static"), "dynamic": timer("dynamic", fail_on_call=2)}, 4)
    static, dynamic = results
    assert len(static.ms_per_token) == 4 and static.ms_per_token == sorted(static.ms_per_token)
    assert dynamic.error == "RuntimeError: watchdog" and len(dynamic.ms_per_token) == 1
    assert calls.count("dynamic") == 2  # not called again after it failed
    text = format_alternated(results, floor_ms=2.0)
    assert "static" in text and "RuntimeError: watchdog" in text


def test_median_spread_and_ratios() -> None:
    a = AlternatedResult("default", [16.0, 15.0, 17.0])
    b = AlternatedResult("dynamic", [15.0, 15.5, 14.5])
    assert a.median_ms == 16.0 and abs(a.spread_pct - 12.5) < 1e-9
    text = format_alternated([a, b], floor_ms=11.2)
    line = next(x for x in text.splitlines() if x.strip().startswith("dynamic"))
    assert "1.067x" in line and "74.7%" in line  # 16 / 15 faster than the first; 11.2 / 15 of the floor
