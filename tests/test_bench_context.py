"""`bench decode --context`'s report: the ratio to the shortest context, and the most the bytes allow (CPU)."""

from __future__ import annotations

import pytest
from onestream.kernels.bench_context import ContextResult, byte_bound, contexts_json, format_contexts
from onestream.kernels.benchmark import Ceilings, _state_bytes
from onestream.kernels.random_model import config_27b

CONTEXTS = (512, 32768, 131072)


def rows_for(weights: str, weight_bytes: int, tok_s: list[float | None]) -> list[ContextResult]:
    c = config_27b()
    return [
        ContextResult(weights, n, t, 1e3 / t if t else None, weight_bytes + _state_bytes(c, n))
        for n, t in zip(CONTEXTS, tok_s, strict=True)
    ]


def test_the_bound_is_the_bytes_in_inverse_ratio_and_the_report_shows_it() -> None:
    # The 27B's KV cache (16 attention layers, 4 heads of 256, bf16) at 128K is 8.6 GB a token: with the
    # Q4_K_M weights (16.1 GB) no kernel can keep 0.75 of the short-context speed (0.658), with bf16 (51.6 GB) 0.859.
    q4 = rows_for("q4_k_m", 16_123_000_000, [120.0, 100.0, None])
    bf16 = rows_for("bf16", 51_556_000_000, [70.0, 64.0, 55.0])
    rows = q4 + bf16
    assert byte_bound(rows, q4[0]) == 1.0
    assert byte_bound(rows, q4[1]) == pytest.approx(0.886, abs=1e-3)
    assert byte_bound(rows, q4[2]) == pytest.approx(0.658, abs=1e-3)
    assert byte_bound(rows, bf16[2]) == pytest.approx(0.859, abs=1e-3)
    text = format_contexts(Ceilings(copy_gbs=4200.0, read_gbs=4500.0), rows, "27B")
    assert "bytes allow" in text
    line = next(x for x in text.splitlines() if "bf16" in x and "131072" in x)
    assert line.split()[-2:] == [f"{55.0 / 70.0:.3f}", f"{byte_bound(rows, bf16[2]):.3f}"]
    failed = next(x for x in text.splitlines() if "q4_k_m" in x and "131072" in x)
    assert "-" in failed.split()  # untimed: no ratio
    record = contexts_json(Ceilings(copy_gbs=4200.0, read_gbs=4500.0), rows)["contexts"]
    assert record[1]["byte_bound"] == pytest.approx(0.886, abs=1e-3)


def test_an_int8_cache_compares_with_its_own_shortest_context_and_lowers_the_bound() -> None:
    # 260 bytes a head vector against 512: at 128K the Q4_K_M bytes then allow about 0.79 of the short-context
    # speed (issue 24's 0.75 within reach), against 0.658 with bf16 keys and values.
    c = config_27b()
    weights = 16_123_000_000
    rows = rows_for("q4_k_m", weights, [120.0, 100.0, 80.0]) + [
        ContextResult("q4_k_m", n, t, 1e3 / t, weights + _state_bytes(c, n, "int8"), kv_cache="int8")
        for n, t in zip(CONTEXTS, [121.0, 110.0, 95.0], strict=True)
    ]
    int8 = rows[3:]
    kv_int8 = _state_bytes(c, 131072, "int8") - _state_bytes(c, 512, "int8")
    assert kv_int8 / (_state_bytes(c, 131072) - _state_bytes(c, 512)) == pytest.approx(260 / 512)
    assert byte_bound(rows, int8[0]) == 1.0  # its own shortest, not the bf16 cache's
    assert byte_bound(rows, int8[2]) == pytest.approx(
        (weights + _state_bytes(c, 512, "int8")) / (weights + _state_bytes(c, 131072, "int8"))
    )
    assert 0.78 < byte_bound(rows, int8[2]) < 0.80 and byte_bound(rows, rows[2]) < 0.66
    text = format_contexts(Ceilings(copy_gbs=4200.0, read_gbs=4500.0), rows, "27B")
    line = next(x for x in text.splitlines() if "int8" in x and "131072" in x)
    assert line.split()[-2] == f"{95.0 / 121.0:.3f}"
