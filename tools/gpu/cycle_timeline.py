"""Where a speculative cycle's time goes through the engine: the device's timeline of greedy k-draft cycles
(accepted drafts forced, `kernels/bench_cycle.ForcedAcceptance`), recorded by `torch.profiler` (CUPTI's kernel and
copy records and the runtime calls that queued them), cut into cycles at the verify launches.

Per cycle: the device's wall time, the time it was busy and idle, the idle time by the pair of launches around
each gap (`verify -> draft` is the host's turn between a verify and the next cycle's first draft), the launches
by what queued them (`draft`, `verify`, `rollback`, ... : the back-end call around the runtime call; a kernel no
labelled call is found for goes by its name and shared memory, copies as `copies`), and the
runtime calls the host was in while the device idled (a wait on an event is the host waiting; what is left of a
gap is Python). Issue 23 asks for a cycle through the engine within 3 % of its launches on the device.

    python3 tools/gpu/cycle_timeline.py --layers 64 --k 3 --accepted 0 3 --cycles 12 [--gemv auto|scalar|mma]
        [--weights q4_k_m] [--host-profile 30]

Prints a table per acceptance and writes cycle_timeline.json (and the raw traces with --traces) under --out
(default $OUT, else the working directory). The profiler adds host time to every call; the unprofiled time per
cycle is printed beside the profiled one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALL_CATEGORIES = ("cuda_runtime", "cuda_driver")
# The back-end calls whose launches are told apart (record_function labels around them).
LABELLED_CALLS = (
    "draft",
    "draft_greedy",
    "verify_greedy",
    "decode",
    "rollback",
    "rollback_draft",
    "decode_ahead",
    "prefill",
)
CYCLE_MARK = "verify_greedy"
GAP_FLOOR_US = 0.5  # device gaps shorter than this are the hardware's own launch spacing: counted, not listed


@dataclass
class Span:
    name: str
    start: float  # microseconds, the profiler's clock
    end: float
    # The labelled back-end call that queued it (device spans), or the call's name (host spans).
    label: str = "other"
    kind: str = "kernel"  # the trace's category


@dataclass
class CycleTimeline:
    """Device time of the cycles between consecutive verify launches (from the end of one to the end of the next)."""

    wall_us: list[float] = field(default_factory=list)
    busy_us: list[float] = field(default_factory=list)
    idle_by_pair: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # summed over cycles
    busy_by_label: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    launches_by_label: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # The host's runtime calls while the device idled, summed over cycles.
    host_in_idle: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def cycles(self) -> int:
        return len(self.wall_us)

    def per_cycle(self, totals: dict[str, float] | dict[str, int]) -> dict[str, float]:
        return (
            {k: v / self.cycles for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
            if self.cycles
            else {}
        )

    def summary(self) -> dict[str, Any]:
        wall = statistics.fmean(self.wall_us) if self.wall_us else 0.0
        busy = statistics.fmean(self.busy_us) if self.busy_us else 0.0
        return {
            "cycles": self.cycles,
            "wall_us": wall,
            "busy_us": busy,
            "idle_us": wall - busy,
            "idle_share": (wall - busy) / wall if wall else 0.0,
            "idle_by_pair_us": self.per_cycle(self.idle_by_pair),
            "busy_by_label_us": self.per_cycle(self.busy_by_label),
            "launches_by_label": self.per_cycle(self.launches_by_label),
            "host_calls_in_idle_us": self.per_cycle(self.host_in_idle),
        }


def _events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def label_device_spans(trace: dict[str, Any]) -> tuple[list[Span], list[Span]]:
    """(device spans sorted by start, host runtime-call spans) of a chrome trace from `torch.profiler`. A device
    span is labelled with the innermost labelled annotation around the runtime call that queued it (kineto's
    `correlation` id links the two)."""
    events = _events(trace)
    annotations = [e for e in events if e.get("cat") == "user_annotation" and e["name"] in LABELLED_CALLS]
    calls = {}
    host: list[Span] = []
    for e in events:
        if e.get("cat") in HOST_CALL_CATEGORIES:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                calls[corr] = e
            host.append(Span(e["name"], e["ts"], e["ts"] + e["dur"], e["name"], e["cat"]))

    def label_of(call: dict[str, Any] | None, event: dict[str, Any]) -> str:
        # Without a labelled call around its launch (the megakernel's CuPy launches found none in the H100 run
        # of session 27), a kernel is told by its name and shared memory (one per build).
        best, width = fallback_label(event), float("inf")
        if call is None:
            return best
        for a in annotations:
            if (
                a.get("tid") == call.get("tid")
                and a["ts"] <= call["ts"] <= a["ts"] + a["dur"]
                and a["dur"] < width
            ):
                best, width = a["name"], a["dur"]
        return best

    device = []
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            call = calls.get(e.get("args", {}).get("correlation"))
            device.append(Span(e["name"], e["ts"], e["ts"] + e["dur"], label_of(call, e), e["cat"]))
    device.sort(key=lambda s: s.start)
    host.sort(key=lambda s: s.start)
    return device, host


def fallback_label(event: dict[str, Any]) -> str:
    """A device span's label when no labelled call queued it: a kernel's name and shared memory, else the name."""
    smem = event.get("args", {}).get("shared memory")
    if event.get("cat") == "kernel" and smem is not None:
        return f"{event['name']} ({smem} B smem)"
    return event["name"] if event.get("cat") == "kernel" else "copies"


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def cycle_timeline(device: Sequence[Span], host: Iterable[Span], mark: str = CYCLE_MARK) -> CycleTimeline:
    """Cut the device timeline after each run of kernels queued by `mark` calls (a verify call may queue several)
    and account each whole cycle between two such cuts."""
    kernels = [s for s in device if s.kind == "kernel"]
    marks = [
        s.end
        for s, after in itertools.pairwise([*kernels, None])
        if s.label == mark and (after is None or after.label != mark)
    ]
    host = list(host)
    out = CycleTimeline()
    for c0, c1 in itertools.pairwise(marks):
        spans = [s for s in device if s.end > c0 and s.start < c1]
        out.wall_us.append(c1 - c0)
        busy, at, prev = 0.0, c0, None
        for s in spans:
            start, end = max(s.start, c0), min(s.end, c1)
            out.busy_by_label[s.label] += end - start
            if s.start >= c0:
                out.launches_by_label[s.label] += 1
            if start > at:
                gap = start - at
                if gap >= GAP_FLOOR_US:
                    out.idle_by_pair[f"{prev.label if prev else mark} -> {s.label}"] += gap
                    for h in host:
                        if h.start < start and h.end > at:
                            out.host_in_idle[h.name] += _overlap(at, start, h.start, h.end)
                else:
                    out.idle_by_pair[f"(spacing under {GAP_FLOOR_US} us)"] += gap
            if end > at:
                busy += end - max(start, at)
                at = end
                prev = s
        if c1 > at:  # nothing queued at the end: the cycle's last gap
            out.idle_by_pair[f"{prev.label if prev else mark} -> (end)"] += c1 - at
        out.busy_us.append(busy)
    return out


def format_timeline(title: str, t: CycleTimeline, unprofiled_ms: float | None) -> str:
    s = t.summary()
    lines = [
        f"{title}: {s['cycles']} cycles, device wall {s['wall_us'] / 1e3:.3f} ms per cycle (unprofiled through the "
        f"engine: {'-' if unprofiled_ms is None else f'{unprofiled_ms:.3f}'} ms), busy {s['busy_us'] / 1e3:.3f} ms, "
        f"idle {s['idle_us']:.1f} us ({100 * s['idle_share']:.2f} %)",
        "  idle per cycle, by the launches around it (us):",
    ]
    lines += [f"    {k:34s} {v:9.1f}" for k, v in s["idle_by_pair_us"].items()]
    lines.append("  busy per cycle by what queued it (us), launches per cycle:")
    launches = s["launches_by_label"]
    lines += [f"    {k:34s} {v:9.1f}  {launches.get(k, 0):5.1f}" for k, v in s["busy_by_label_us"].items()]
    lines.append("  the host's runtime calls while the device idled (us per cycle):")
    lines += [f"    {k:34s} {v:9.1f}" for k, v in list(s["host_calls_in_idle_us"].items())[:8]]
    return "\n".join(lines)


# ---- the GPU run -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--accepted", type=int, nargs="+", default=[0, 3])
    p.add_argument("--cycles", type=int, default=12, help="cycles profiled per acceptance")
    p.add_argument("--context", type=int, default=32)
    p.add_argument(
        "--gemv", choices=("auto", "scalar", "mma"), default="auto", help="auto: as the engine chooses"
    )
    p.add_argument("--weights", default="bf16", help="bf16 or a quantization preset (random blocks)")
    p.add_argument("--traces", action="store_true", help="also write each profile's chrome trace")
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="also run the cycles under cProfile and print the N functions of most own time (0: no)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


class LabelledCalls:
    """Wraps the back end's launching calls in `record_function` labels (LABELLED_CALLS)."""

    def __init__(self, backend: Any) -> None:
        from torch.profiler import record_function

        for name in LABELLED_CALLS:
            original = getattr(backend, name, None)
            if original is None:
                continue

            def wrapped(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                with record_function(_name):
                    return _original(*args, **kwargs)

            setattr(backend, name, wrapped)


def host_profile(engine: Any, prompt: list[int], chunks: int, args: argparse.Namespace, path: Path) -> str:
    """The host's Python per cycle: one more generation under cProfile (the engine runs on this thread), the
    `--host-profile` functions of most own time; the raw profile goes to `path`. Its totals include the
    generation's prefill and warm-up cycles besides the timed ones."""
    import cProfile
    import io
    import pstats

    from onestream.kernels.bench_cycle import WARM_CYCLES, engine_ms_per_yield

    profiler = cProfile.Profile()
    profiler.enable()
    engine_ms_per_yield(engine, prompt, chunks, WARM_CYCLES, room=args.k + 1)
    profiler.disable()
    profiler.dump_stats(str(path))
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    cycles = chunks - 1
    text.write(f"host profile, {cycles} cycles (totals below are for them and the prompt's prefill)\n")
    stats.print_stats(args.host_profile)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import dataclasses

    import torch
    from onestream.kernels.bench_cycle import WARM_CYCLES, ForcedAcceptance, engine_ms_per_yield
    from onestream.kernels.random_model import config_27b
    from onestream.kernels.random_quant import random_model_in
    from onestream.kernels.tuning import tuning_from_env
    from onestream.worker.engine import Engine
    from torch.profiler import ProfilerActivity, profile

    config = dataclasses.replace(config_27b(args.layers), mtp_num_hidden_layers=1)
    model = random_model_in(config, args.weights)
    tuning = (
        tuning_from_env(speculative=True) if args.gemv == "auto" else tuning_from_env(mma=args.gemv == "mma")
    )
    backend = ForcedAcceptance(model, tuning=tuning)
    LabelledCalls(backend)
    engine = Engine(None, backend=backend, drafting="mtp", spec_k=args.k, max_context=args.context + 4096)
    engine.warm_up()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, config.vocab_size, (args.context,), generator=g).tolist()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"27B shapes, {args.layers} layers, {args.weights}, {args.gemv} GEMV, k = {args.k}"
    print(title, flush=True)
    results: dict[str, Any] = {"args": vars(args), "title": title, "rows": {}}
    chunks = args.cycles + WARM_CYCLES + 1
    for accepted in args.accepted:
        backend.accepted = min(accepted, args.k)
        engine_ms_per_yield(engine, prompt, chunks, WARM_CYCLES, room=args.k + 1)  # warm-up
        unprofiled, _ = engine_ms_per_yield(engine, prompt, chunks, WARM_CYCLES, room=args.k + 1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine_ms_per_yield(engine, prompt, chunks, WARM_CYCLES, room=args.k + 1)
        path = out / f"cycle_trace_k{args.k}_a{accepted}.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
        if not args.traces:
            path.unlink()
        device, host = label_device_spans(trace)
        timeline = cycle_timeline(device, host)
        print(format_timeline(f"a = {accepted}", timeline, unprofiled), flush=True)
        results["rows"][str(accepted)] = timeline.summary() | {"unprofiled_engine_ms": unprofiled}
        if args.host_profile:
            print(host_profile(engine, prompt, chunks, args, out / f"cycle_host_k{args.k}_a{accepted}.prof"))
    (out / "cycle_timeline.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
