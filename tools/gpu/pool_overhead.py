"""What the pool path costs (issue 23, "The engine"): the same random model's TTFT and decode tok/s through
the engine in process, and through the pool (a Ray card actor holding the GPU, the router, gRPC, the project's
gRPC client), and where the difference goes.

Both sides draw the model from one `RandomModelSource` (cluster/engine_source.py: the 27B text shapes with
`--layers` layers, `--weights` bf16 or a preset's random GGUF blocks, one seed), greedy, ignore_eos, a token
prompt of `--prompt-tokens` distinct random ids per request (an anonymous request reuses a cached prefix:
every timed request has its own prompt, the same prompts on both sides), `--tokens` tokens each. A warm-up
request goes first; the timed ones follow, `--repeats` of them, each side in its own process (the GPU holds one
copy of the model at a time): the in-process engine first, then the pool.

- in process: `Engine.generate` under inference mode, as the card's engine thread calls it (on the main thread,
  or with `--engine-thread worker` on a thread of its own, as in the card); TTFT from the
  call to the first chunk, decode tok/s over the chunks after the first (tokens after the first over the time
  from the first chunk to the last).
- pool: TTFT from `PoolClient.generate` to the client's first chunk event; decode as above on the client's
  receive times. Three host stamps per chunk (`time.perf_counter`, CLOCK_MONOTONIC: one clock for every
  process of the machine): as it leaves the engine inside the card (`StampedSource`), as the router takes it
  from the card's link (the tool wraps `cluster.router._next_object`, the one place the router awaits an item),
  and as the client receives it; and two per request in the router, as its handler takes it and as it leaves
  on the card's link. So: TTFT = client -> engine start (gRPC to the router's handler, admission and
  scheduling, the card's link and its thread hop) + the engine's own first token + engine -> router (the card's loop,
  the link) + router -> client (gRPC); the decode gap splits into the engine's own gap inside the card (against
  the in-process gap: what sharing the card's process with Ray costs the engine) and the hops' jitter.

    PYTHONPATH=/tmp/onestream-pkg python3 tools/gpu/pool_overhead.py --layers 64 [--weights q4_k_m] [--mtp 2]
    python tools/gpu/pool_overhead.py --device cpu --tiny --layers 2        # the CPU check, any machine

Prints a table and writes pool_overhead.json under --out (default $OUT, else the working directory).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TTFT_LIMIT_MS = 2.0  # the issue's bars
DECODE_LIMIT = 0.02
STAMPS_WAIT_S = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--weights", default="bf16", help="bf16, or a preset's random GGUF blocks (q4_k_m, ...)")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny shapes instead of the 27B ones")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="timed requests per side (after one warm-up)")
    p.add_argument(
        "--mtp", type=int, default=0, metavar="K", help="also time MTP drafts of K (0: plain only)"
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        nargs="+",
        default=[1.0],
        help="greedy with each penalty on both sides, one row each (1: plain greedy, the kernel's own argmax)",
    )
    p.add_argument(
        "--engine-thread",
        choices=("main", "worker"),
        default="main",
        help="where the in-process engine runs: the main thread, or a worker thread as in the card",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the card to come up")
    p.add_argument(
        "--limit-s",
        type=float,
        default=0.0,
        help="seconds for everything (0: no limit): a side still running then is ended and reported missing",
    )
    p.add_argument("--phase", choices=("all", "engine", "pool"), default="all", help=argparse.SUPPRESS)
    p.add_argument("--phase-out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- what both sides share --------------------------------------------------------------------------------
def make_source(args: argparse.Namespace) -> Any:
    from onestream.cluster.engine_source import RandomModelSource

    return RandomModelSource(
        "tiny" if args.tiny else "27b",
        layers=args.layers,
        weights=args.weights,
        seed=args.seed,
        mtp=args.mtp > 0,
    )


def configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, engine options) of each timed configuration: plain greedy, then MTP drafts when asked."""
    room = {"max_context": args.prompt_tokens + args.tokens + 64}  # no more KV than the requests reach
    out = [("plain", {"spec_k": 0, **room})]
    if args.mtp:
        out.append((f"mtp k={args.mtp}", {"spec_k": args.mtp, "drafting": "mtp", **room}))
    return out


def prompts(args: argparse.Namespace, vocab: int, count: int) -> list[list[int]]:
    import random

    rng = random.Random(args.seed)
    return [[rng.randrange(16, vocab) for _ in range(args.prompt_tokens)] for _ in range(count)]


def samplings(args: argparse.Namespace) -> list[tuple[str, dict[str, float]]]:
    """(label suffix, sampling) of each row of an engine configuration: what both sides sample with, every
    penalty set, since a pool request leaves unset fields to the model's generation_config.json (the
    embedded model's sets repetition_penalty 1.15, which the in-process side would not apply)."""
    return [
        (
            "" if penalty == 1 else f" rp={penalty:g}",
            {
                "temperature": 0.0,
                "repetition_penalty": penalty,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
            },
        )
        for penalty in args.repetition_penalty
    ]


def labelled_prompts(
    args: argparse.Namespace, vocab: int
) -> list[tuple[str, dict[str, float], list[list[int]]]]:
    """Each row's sampling and prompts (a warm-up, then the timed ones), every row with prompts of its own:
    a prompt served before would be reused from the cache."""
    count = args.repeats + 1
    every = prompts(args, vocab, count * len(args.repetition_penalty))
    return [
        (suffix, params, every[i * count : (i + 1) * count])
        for i, (suffix, params) in enumerate(samplings(args))
    ]


def dtype(args: argparse.Namespace) -> str | None:
    return "fp32" if args.device == "cpu" else None  # the CPU reference runs fp32 faster; the GPU bf16


def summarise(start: float, stamps: list[tuple[float, int]]) -> dict[str, Any]:
    """TTFT and decode rate from one request's chunk stamps (seconds, tokens) after `start`."""
    tokens = sum(n for _, n in stamps)
    first, last = stamps[0][0], stamps[-1][0]
    decoded = tokens - stamps[0][1]
    return {
        "ttft_ms": 1e3 * (first - start),
        "decode_tok_s": decoded / (last - first) if last > first else None,
        "tokens": tokens,
        "chunks": len(stamps),
        "gap_ms_median": (
            1e3 * statistics.median(b - a for (a, _), (b, _) in itertools.pairwise(stamps))
            if len(stamps) > 1
            else None
        ),
    }


# ---- the engine in process --------------------------------------------------------------------------------
def engine_phase(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from onestream.worker.api import GenerateRequest, SamplingParams

    if args.device == "cpu":
        torch.set_num_threads(1)  # as the pool's CPU card (card_torch_threads=1)
    source = make_source(args)
    # As the card runs its engine: on a thread of its own, not the one that built it.
    thread = ThreadPoolExecutor(max_workers=1) if args.engine_thread == "worker" else None
    out: dict[str, Any] = {}
    for label, options in configs(args):
        t0 = time.perf_counter()
        engine = source.build(device=args.device, dtype=dtype(args), options=options)
        engine.warm_up()  # the card compiles before it says it is ready
        built_s = time.perf_counter() - t0
        for suffix, params, row_prompts in labelled_prompts(args, engine.config.vocab_size):
            runs = []
            for i, prompt in enumerate(row_prompts):
                request = GenerateRequest(
                    prompt, SamplingParams(**params), max_tokens=args.tokens, ignore_eos=True
                )
                if thread is None:
                    start, stamps = timed_request(engine, request)
                else:
                    start, stamps = thread.submit(timed_request, engine, request).result()
                if i:  # the first request warms up
                    runs.append(summarise(start, stamps))
            out[label + suffix] = {"runs": runs, "build_s": built_s, "backend": engine.backend.name}
        del engine
        _free(args)
    return out


def timed_request(engine: Any, request: Any) -> tuple[float, list[tuple[float, int]]]:
    """When `request` started and each chunk's (time, tokens)."""
    import torch
    from onestream.worker.api import TokenChunk

    stamps: list[tuple[float, int]] = []
    with torch.inference_mode():  # the card's engine thread serves under it
        start = time.perf_counter()
        for item in engine.generate(request):
            if isinstance(item, TokenChunk):
                stamps.append((time.perf_counter(), len(item.token_ids)))
    return start, stamps


def _free(args: argparse.Namespace) -> None:
    import gc

    gc.collect()
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()


# ---- through the pool -------------------------------------------------------------------------------------
class RouterStamps:
    """Wraps the router's `_next_object` (the one await that takes an item from a card's link) to stamp
    each item as the router gets it, and stamps each request as the router's handler takes it and as it
    leaves on the card's link; the router runs in this process (PoolThread)."""

    def __init__(self) -> None:
        from onestream.cluster import router
        from onestream.cluster.card_link import CardLink

        self.items: list[tuple[float, str, int]] = []
        self.requests: dict[str, dict[str, float]] = {}  # request id -> {"handler": t, "link": t}
        original = router._next_object
        handler = router.Router.Generate
        send = CardLink.generate

        async def stamped_handler(servicer: Any, request: Any, context: Any) -> None:
            self.requests.setdefault(request.request_id, {})["handler"] = time.perf_counter()
            await handler(servicer, request, context)

        def stamped_send(link: Any, request: Any) -> Any:
            self.requests.setdefault(request.request_id, {})["link"] = time.perf_counter()
            return send(link, request)

        router.Router.Generate = stamped_handler  # type: ignore[method-assign]
        CardLink.generate = stamped_send  # type: ignore[method-assign]

        async def stamped(generator: Any) -> object:
            item = await original(generator)
            tokens = getattr(item, "token_ids", None)
            kind = "chunk" if tokens is not None else type(item).__name__
            self.items.append((time.perf_counter(), kind, len(tokens or ())))
            return item

        router._next_object = stamped  # type: ignore[assignment]

    def take(self) -> list[tuple[float, int]]:
        chunks = [(t, n) for t, kind, n in self.items if kind == "chunk"]
        self.items = []
        return chunks


def start_ray(args: argparse.Namespace) -> Any:
    """A local Ray cluster: on the GPU one node with its GPU (the card's `num_gpus=1`); on the CPU the tests'
    cluster of one CPU card slot (cluster/testing.py)."""
    import logging

    import ray

    if args.device == "cpu":
        from onestream.cluster.testing import start_cluster

        return start_cluster((1,))
    # A new local instance (as `onestream serve` starts one), whatever else runs on the machine.
    ray.init(address="local", num_gpus=1, include_dashboard=False, logging_level=logging.WARNING)
    return None


def pool_phase(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from onestream.cluster.client import PoolClient, make_request
    from onestream.cluster.config import PoolConfig
    from onestream.cluster.engine_source import StampedSource
    from onestream.cluster.server import PoolThread
    from onestream.cluster.testing import stop_cluster
    from onestream.worker.loading import default_model_dir

    cluster = start_ray(args)
    router_stamps = RouterStamps()
    source = make_source(args)
    vocab = source.config().vocab_size
    out: dict[str, Any] = {}
    try:
        for label, options in configs(args):
            stamps_dir = Path(tempfile.mkdtemp(prefix="pool-stamps-"))
            config = PoolConfig(
                model_dir=str(default_model_dir()),  # the router's tokenizer: the one the engine borrows
                grpc_address="127.0.0.1:0",
                metrics_address="127.0.0.1:0",
                cpu_cards=0 if args.device == "cpu" else None,  # CPU: where the node advertises slots
                card_torch_threads=1 if args.device == "cpu" else None,
                dtype=dtype(args),
                engine_options=options,
                engine_source=StampedSource(source, str(stamps_dir)),
                card_start_timeout_s=args.start_timeout,
                first_token_timeout_s=args.start_timeout,
                discovery_interval_s=1.0,
            )
            t0 = time.perf_counter()
            pool = PoolThread(config).start(wait_for_cards=1, ready_timeout_s=args.start_timeout)
            built_s = time.perf_counter() - t0
            print(f"  {label}: the pool serves ({built_s:.0f} s)", flush=True)
            rows: dict[str, list[dict[str, Any]]] = {}
            try:
                with PoolClient(pool.grpc_address, timeout_s=60.0) as client:
                    for suffix, params, row_prompts in labelled_prompts(args, vocab):
                        runs = rows.setdefault(label + suffix, [])
                        for i, prompt in enumerate(row_prompts):
                            request_id = f"overhead-{uuid.uuid4().hex[:8]}"
                            request = make_request(
                                prompt,
                                max_tokens=args.tokens,
                                ignore_eos=True,
                                request_id=request_id,
                                **params,
                            )
                            router_stamps.take()
                            stamps: list[tuple[float, int]] = []
                            start = time.perf_counter()
                            for event in client.generate(request, timeout_s=args.start_timeout):
                                if event.WhichOneof("event") == "chunk":
                                    stamps.append((time.perf_counter(), len(event.chunk.token_ids)))
                            routed = router_stamps.take()
                            engine = _read_stamps(stamps_dir / f"{request_id}.json")
                            at_router = router_stamps.requests.pop(request_id, {})
                            if i:
                                runs.append(
                                    summarise(start, stamps)
                                    | {"hops": hops(start, engine, routed, stamps, at_router)}
                                )
                card_backend = str(served_backend(pool))
            finally:
                cards = [r.actor for r in pool.call(pool.pool.registry.records)]
                pool.stop()
                _kill_cards(ray, cards)
            for row, runs in rows.items():
                out[row] = {"runs": runs, "build_s": built_s, "backend": card_backend}
    finally:
        if cluster is not None:
            stop_cluster(cluster)
        else:
            ray.shutdown()
    return out


def served_backend(pool: Any) -> Any:
    """The back end the card reports (the registry keeps the first card's model info)."""
    info = pool.call(lambda: pool.pool.registry.model_info) or {}
    return info.get("backend", "?")


def _kill_cards(ray: Any, cards: list[Any]) -> None:
    """Cards are detached (they outlive their router): end this configuration's before the next starts, so
    that the GPU holds one model at a time."""
    for actor in cards:
        ray.kill(actor, no_restart=True)
    time.sleep(2.0)  # the process exits and frees the GPU


def _read_stamps(path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + STAMPS_WAIT_S  # the card writes them as its stream closes
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the card wrote no stamps at {path}")
        time.sleep(0.02)
    return json.loads(path.read_text())


def hops(
    start: float,
    engine: dict[str, Any],
    routed: list[tuple[float, int]],
    client: list[tuple[float, int]],
    at_router: dict[str, float],
) -> dict[str, Any]:
    """Where one pooled request's time went, from the three stamps of every chunk and the request's two at
    the router (`at_router`: its handler took it, it left on the card's link). The card merges chunks that
    queue up behind its link, so a routed chunk is timed from the engine chunk that completed it."""
    produced = [(t, n) for t, kind, n in engine["items"] if kind == "chunk"]
    if len(routed) != len(client) or sum(n for _, n in produced) != sum(n for _, n in routed):
        return {
            "error": f"chunks differ: engine {len(produced)} of {sum(n for _, n in produced)} tokens, "
            f"router {len(routed)} of {sum(n for _, n in routed)}, client {len(client)}"
        }
    made = list(itertools.accumulate(n for _, n in produced))
    completed = [
        produced[min(bisect.bisect_left(made, total), len(made) - 1)][0]
        for total in itertools.accumulate(n for _, n in routed)
    ]
    to_router = [1e3 * (r - e) for e, (r, _) in zip(completed, routed, strict=True)]
    to_client = [1e3 * (c - r) for (r, _), (c, _) in zip(routed, client, strict=True)]
    inside = summarise(engine["start"], produced)  # the engine's own TTFT and decode, inside the card
    handler, link = at_router.get("handler"), at_router.get("link")
    return {
        "client_to_engine_ms": 1e3 * (engine["start"] - start),
        "client_to_router_ms": None if handler is None else 1e3 * (handler - start),
        "router_admission_ms": None if handler is None or link is None else 1e3 * (link - handler),
        "link_to_engine_ms": None if link is None else 1e3 * (engine["start"] - link),
        "engine_ttft_ms": inside["ttft_ms"],
        "engine_decode_tok_s": inside["decode_tok_s"],
        "first_engine_to_router_ms": to_router[0],
        "first_router_to_client_ms": to_client[0],
        "engine_to_router_ms_median": statistics.median(to_router[1:] or to_router),
        "router_to_client_ms_median": statistics.median(to_client[1:] or to_client),
        "engine_to_router_ms_max": max(to_router),
        "router_to_client_ms_max": max(to_client),
    }


# ---- both, and the table ----------------------------------------------------------------------------------
def run_phase(args: argparse.Namespace, phase: str, deadline: float | None) -> dict[str, Any] | None:
    """One side in its own process: the GPU holds one copy of the model, and a side's memory is gone after.
    None when `deadline` (perf_counter seconds) passes first: the side's process group (Ray's processes
    with it) is ended, so that what the other side measured is still reported."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / f"{phase}.json"
        argv = [*sys.argv[1:], "--phase", phase, "--phase-out", str(result)]
        child = subprocess.Popen([sys.executable, __file__, *argv], start_new_session=True)
        try:
            code = child.wait(timeout=None if deadline is None else max(deadline - time.perf_counter(), 1.0))
        except subprocess.TimeoutExpired:
            print(f"  {phase}: out of time (--limit-s {args.limit_s:.0f}); ended", flush=True)
            _end_group(child)
            return None
        if code != 0:
            raise RuntimeError(f"the {phase} side failed (exit {code})")
        return json.loads(result.read_text())


def _end_group(child: subprocess.Popen[bytes]) -> None:
    import signal

    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(child.pid, sig)
            child.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def median_of(runs: list[dict[str, Any]], key: str, sub: str | None = None) -> float | None:
    values = [(r[sub] if sub else r).get(key) for r in runs if (r[sub] if sub else r) is not None]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def report(args: argparse.Namespace, engine: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    rows = []
    labels = [label + suffix for label, _ in configs(args) for suffix, _ in samplings(args)]
    for label in labels:
        e, p = engine[label]["runs"], pool[label]["runs"]
        hop_runs = [r["hops"] for r in p if "error" not in r["hops"]]
        e_ttft, p_ttft = median_of(e, "ttft_ms"), median_of(p, "ttft_ms")
        e_tok, p_tok = median_of(e, "decode_tok_s"), median_of(p, "decode_tok_s")
        row = {
            "config": label,
            "backend": engine[label]["backend"],
            "card_backend": pool[label]["backend"],
            "engine_ttft_ms": e_ttft,
            "pool_ttft_ms": p_ttft,
            "ttft_added_ms": p_ttft - e_ttft if e_ttft is not None and p_ttft is not None else None,
            "engine_decode_tok_s": e_tok,
            "pool_decode_tok_s": p_tok,
            # decode time per token added by the pool, as a share of the engine's
            "decode_added": e_tok / p_tok - 1 if e_tok and p_tok else None,
            "hops": {k: median_of(hop_runs, k) for k in (hop_runs[0] if hop_runs else {})},
        }
        row["ttft_ok"] = row["ttft_added_ms"] is not None and row["ttft_added_ms"] <= TTFT_LIMIT_MS
        row["decode_ok"] = row["decode_added"] is not None and row["decode_added"] <= DECODE_LIMIT
        rows.append(row)
    return {"args": vars(args), "rows": rows, "engine": engine, "pool": pool}


def format_table(result: dict[str, Any]) -> str:
    def f(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    a = result["args"]
    shape = "tiny" if a["tiny"] else "27B"
    lines = [
        f"pool overhead: random {shape} shapes, {a['layers']} layers, {a['weights']}, {a['device']}; "
        f"prompt {a['prompt_tokens']} tokens, {a['tokens']} generated, median of {a['repeats']} requests",
        f"{'config':14s} {'backend':10s} {'TTFT engine':>11s} {'pool':>8s} {'added':>8s} {'bar':>5s}   "
        f"{'tok/s engine':>12s} {'pool':>8s} {'added':>7s} {'bar':>5s}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['config']:14s} {r['backend']:10s} {f(r['engine_ttft_ms']):>11s} {f(r['pool_ttft_ms']):>8s} "
            f"{f(r['ttft_added_ms']):>8s} {'ok' if r['ttft_ok'] else 'MISS':>5s}   "
            f"{f(r['engine_decode_tok_s'], '.1f'):>12s} {f(r['pool_decode_tok_s'], '.1f'):>8s} "
            f"{f(100 * r['decode_added'] if r['decode_added'] is not None else None, '.2f') + '%':>7s} "
            f"{'ok' if r['decode_ok'] else 'MISS':>5s}"
        )
    for r in result["rows"]:
        h = r["hops"]
        if not h:
            continue
        lines += [
            f"where the pool's time goes ({r['config']}, ms, medians; host stamps per chunk):",
            f"  TTFT: client -> engine start {f(h.get('client_to_engine_ms'), '.3f')} "
            f"(client -> router's handler {f(h.get('client_to_router_ms'), '.3f')}, gRPC; "
            f"admission {f(h.get('router_admission_ms'), '.3f')}; "
            f"the card's link and thread hop {f(h.get('link_to_engine_ms'), '.3f')})"
            f" + engine's own first token {f(h.get('engine_ttft_ms'), '.3f')}"
            f" + engine -> router {f(h.get('first_engine_to_router_ms'), '.3f')} (card loop, the link)"
            f" + router -> client {f(h.get('first_router_to_client_ms'), '.3f')} (gRPC)",
            f"  decode: engine inside the card {f(h.get('engine_decode_tok_s'), '.1f')} tok/s "
            f"(in process {f(r['engine_decode_tok_s'], '.1f')}); per chunk engine -> router "
            f"{f(h.get('engine_to_router_ms_median'), '.3f')} (max {f(h.get('engine_to_router_ms_max'), '.3f')}), "
            f"router -> client {f(h.get('router_to_client_ms_median'), '.3f')} "
            f"(max {f(h.get('router_to_client_ms_max'), '.3f')})",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase != "all":
        result = engine_phase(args) if args.phase == "engine" else pool_phase(args)
        Path(args.phase_out).write_text(json.dumps(result))
        return 0
    t0 = time.perf_counter()
    deadline = t0 + args.limit_s if args.limit_s > 0 else None
    engine = run_phase(args, "engine", deadline)
    if engine is None:
        return 3
    print(f"  engine in process: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    for label, side in engine.items():  # now, in case the pool's side runs out of time
        ttft, tok_s = median_of(side["runs"], "ttft_ms"), median_of(side["runs"], "decode_tok_s")
        print(f"    {label}: TTFT {ttft:.2f} ms, decode {tok_s:.1f} tok/s (built in {side['build_s']:.0f} s)")
    pool = run_phase(args, "pool", deadline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if pool is None:  # the engine's side alone, for the record
        (out / "pool_overhead.json").write_text(
            json.dumps({"args": vars(args), "engine": engine, "pool": None})
        )
        return 3
    print(f"  through the pool: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    result = report(args, engine, pool)
    print(format_table(result), flush=True)
    (out / "pool_overhead.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'pool_overhead.json'} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
