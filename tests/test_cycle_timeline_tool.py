"""tools/gpu/cycle_timeline.py's accounting of a profiler trace (a hand-made trace: no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_scripts import load_module

TOOL = Path(__file__).resolve().parent.parent / "tools" / "gpu" / "cycle_timeline.py"


def _trace(cycles: int) -> dict:
    """`cycles` + 1 verify launches: each cycle is a draft call (one kernel), a verify call (a kernel and the
    control block's copy back), then the host waits on the copy's event and runs Python before the next draft."""
    events: list[dict] = []
    corr = 0

    def call(label: str, host_at: float, device_at: float, dur: float, cat: str = "kernel") -> None:
        nonlocal corr
        corr += 1
        events.append(
            {"ph": "X", "cat": "user_annotation", "name": label, "tid": 1, "ts": host_at, "dur": 20.0}
        )
        events.append(
            {
                "ph": "X",
                "cat": "cuda_driver",
                "name": "cuLaunchKernel",
                "tid": 1,
                "ts": host_at + 5,
                "dur": 4.0,
                "args": {"correlation": corr},
            }
        )
        name = "mk_decode" if cat == "kernel" else "Memcpy DtoH (Device -> Pinned)"
        events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "tid": 7,
                "ts": device_at,
                "dur": dur,
                "args": {"correlation": corr},
            }
        )

    t = 0.0
    for _ in range(cycles + 1):
        call("draft", t, t + 10, 100.0)  # device 10..110
        call("verify_greedy", t + 30, t + 110.2, 300.0)  # back to back with the draft: 0.2 us spacing
        call("verify_greedy", t + 60, t + 410.2, 2.0, cat="gpu_memcpy")
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaEventSynchronize",
                "tid": 1,
                "ts": t + 80,
                "dur": 332.2,
            }
        )
        t += 500.0  # the host's Python after the wait: the next draft lands 500 us after this one
    return {"traceEvents": events}


def test_cycles_are_cut_at_the_verify_kernels_and_the_idle_time_is_given_its_launches() -> None:
    tool = load_module(TOOL)
    device, host = tool.label_device_spans(_trace(3))
    assert [s.label for s in device[:3]] == ["draft", "verify_greedy", "verify_greedy"]
    timeline = tool.cycle_timeline(device, host)
    s = timeline.summary()
    assert s["cycles"] == 3
    assert s["wall_us"] == pytest.approx(500.0)
    assert s["busy_us"] == pytest.approx(402.0)  # a draft, a verify, the copy
    assert s["idle_us"] == pytest.approx(98.0)
    # The verify kernel's copy starts as it ends, so the only gaps are the host's turn and the launch spacing.
    assert s["idle_by_pair_us"]["verify_greedy -> draft"] == pytest.approx(97.8)
    assert s["idle_by_pair_us"]["(spacing under 0.5 us)"] == pytest.approx(0.2)
    assert s["launches_by_label"] == {"verify_greedy": 2.0, "draft": 1.0}
    assert s["busy_by_label_us"]["verify_greedy"] == pytest.approx(302.0)
    # The host waited on the copy's event for 0 us of the device's idle time (the wait ended as the copy did)
    # and was in no other runtime call: the 97.8 us were Python.
    assert s["host_calls_in_idle_us"].get("cudaEventSynchronize", 0.0) == pytest.approx(0.0, abs=1e-6)
    text = tool.format_timeline("a = 0", timeline, 0.5)
    assert "verify_greedy -> draft" in text and "3 cycles" in text


def test_a_trace_without_a_verify_has_no_cycles() -> None:
    tool = load_module(TOOL)
    device, host = tool.label_device_spans({"traceEvents": []})
    assert tool.cycle_timeline(device, host).summary()["cycles"] == 0


def test_a_kernel_no_labelled_call_queued_goes_by_its_name_and_shared_memory() -> None:
    tool = load_module(TOOL)
    trace = _trace(1)
    trace["traceEvents"].append(
        {"ph": "X", "cat": "kernel", "name": "mk_decode", "tid": 7, "ts": 5.0, "dur": 1.0,
         "args": {"shared memory": 166272}}
    )  # fmt: skip
    device, _ = tool.label_device_spans(trace)
    assert "mk_decode (166272 B smem)" in {s.label for s in device}


def test_a_verify_call_that_queues_several_kernels_still_ends_one_cycle() -> None:
    """A second kernel of the verify call (an argmax after the launch) right behind the first: one cut, after it."""
    tool = load_module(TOOL)
    trace = _trace(3)
    extra = []
    for i, e in enumerate(list(trace["traceEvents"])):
        if e["cat"] == "kernel" and e["dur"] == 300.0:  # the verify launch
            corr = 1000 + i
            extra.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "tid": 1,
                    "ts": e["ts"] - 70.0,
                    "dur": 1.0,
                    "args": {"correlation": corr},
                }
            )
            extra.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": "argmax",
                    "tid": 7,
                    "ts": e["ts"] + 300.0,
                    "dur": 0.1,
                    "args": {"correlation": corr},
                }
            )
    trace["traceEvents"] += extra  # fmt: skip
    device, host = tool.label_device_spans(trace)
    assert sum(s.name == "argmax" and s.label == "verify_greedy" for s in device) == 4
    s = tool.cycle_timeline(device, host).summary()
    assert s["cycles"] == 3
    assert s["wall_us"] == pytest.approx(500.0)


def test_the_host_profile_counts_an_engines_python_per_cycle(tmp_path: Path) -> None:
    """`--host-profile`: the cycles run once more under cProfile; the report names the functions of most own time
    and the raw profile is kept (here on the embedded model on the CPU)."""
    from onestream.worker.engine import Engine

    tool = load_module(TOOL)
    engine = Engine(None, device="cpu", drafting="mtp", spec_k=2)
    args = tool.parse_args(["--k", "2", "--host-profile", "5"])
    path = tmp_path / "host.prof"
    report = tool.host_profile(engine, list(range(16, 48)), 6, args, path)
    assert report.startswith("host profile, 5 cycles")
    assert "Ordered by: internal time" in report and "due to restriction <5>" in report
    assert path.stat().st_size > 0
