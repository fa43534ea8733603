"""What the HTTP front door adds to a request's first token and to each later one, against the router's own
gRPC API, on one CPU pool: a real Ray cluster with one CPU card of the embedded model, the router with its
front door (cluster/frontdoor/), the project's gRPC client and the official `openai` SDK (`/v1/completions`,
streamed, token-id prompts: the same tokens in on both paths). Requests alternate between the two paths,
each with a prompt of its own (a prompt seen before would be served from the card's cache); the first of
each path warms up. The router (in this process) stamps each request as its handler takes it and each item
as it comes from the card, so the way in (client to the router's handler) and the way out (the router's
first item to the client's first chunk) are timed apart from the engine, whose first token varies by more
than the front door costs. Figures are medians in milliseconds of this machine's host times.

    python tools/frontdoor_latency.py [--requests 24] [--prompt-tokens 32] [--tokens 16]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from typing import Any

SAMPLING: dict[str, float] = {"temperature": 0.0, "repetition_penalty": 1.0}


class RouterStamps:
    """When the router's handler took each request and when it got each request's first item from the card
    (requests run one at a time, so the last stamps are the last request's)."""

    def __init__(self) -> None:
        from onestream.cluster import router

        self.handler: list[float] = []
        self.first_item: list[float] = []
        handler, next_object = router.Router.Generate, router._next_object

        async def stamped_handler(servicer: Any, request: Any, context: Any) -> None:
            self.handler.append(time.perf_counter())
            await handler(servicer, request, context)

        async def stamped_next(call: Any) -> object:
            item = await next_object(call)
            if len(self.first_item) < len(self.handler) and getattr(item, "token_ids", None):
                self.first_item.append(time.perf_counter())
            return item

        self._restore = lambda: (
            setattr(router.Router, "Generate", handler),
            setattr(router, "_next_object", next_object),
        )
        router.Router.Generate = stamped_handler  # type: ignore[method-assign]
        router._next_object = stamped_next  # type: ignore[assignment]

    def __enter__(self) -> RouterStamps:
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()  # the router's own code again (a test runs this tool in its process)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="timed requests per path (after one warm-up)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args(argv)


def over_grpc(client: Any, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    """When the call started and each chunk's arrival (perf_counter seconds)."""
    from onestream.cluster.client import make_request

    request = make_request(prompt, max_tokens=tokens, **SAMPLING)
    start = time.perf_counter()
    return start, [
        time.perf_counter()
        for event in client.generate(request, timeout_s=120.0)
        if event.WhichOneof("event") == "chunk"
    ]


def over_http(openai: Any, model: str, prompt: list[int], tokens: int) -> tuple[float, list[float]]:
    start = time.perf_counter()
    stream = openai.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=tokens,
        stream=True,
        temperature=SAMPLING["temperature"],
        extra_body={"repetition_penalty": SAMPLING["repetition_penalty"]},
    )
    return start, [time.perf_counter() for chunk in stream if chunk.choices and chunk.choices[0].text]


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians in ms: the first chunk, the way in, the way out, and the gap between later chunks."""
    gaps = [b - a for r in runs for a, b in itertools.pairwise(r["arrivals"])]
    return {
        "first": 1e3 * statistics.median(r["arrivals"][0] - r["start"] for r in runs),
        "in": 1e3 * statistics.median(r["handler"] - r["start"] for r in runs),
        "out": 1e3 * statistics.median(r["arrivals"][0] - r["first_item"] for r in runs),
        "gap": 1e3 * statistics.median(gaps) if gaps else float("nan"),
    }


def measure(args: argparse.Namespace, stamps: RouterStamps) -> dict[str, list[dict[str, Any]]]:
    """Each path's timed requests: start, chunk arrivals, and the router's two stamps."""
    from onestream.cluster.client import PoolClient
    from onestream.cluster.server import PoolThread
    from onestream.cluster.testing import cpu_pool_config, start_cluster, stop_cluster
    from onestream.worker.loading import default_model_dir
    from openai import OpenAI

    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, Any]]] = {"gRPC": [], "HTTP": []}
    cluster = start_cluster((1,))
    try:
        config = cpu_pool_config(str(default_model_dir()), http_address="127.0.0.1:0")
        pool = PoolThread(config).start(wait_for_cards=1, ready_timeout_s=300.0)
        try:
            openai = OpenAI(base_url=f"http://{pool.http_address}/v1", api_key="unused", max_retries=0)
            model = openai.models.list().data[0].id
            vocab = int(pool.call(lambda: pool.pool.registry.model_info)["vocab_size"])
            with PoolClient(pool.grpc_address, timeout_s=120.0) as client:
                for i in range(args.requests + 1):
                    for path in ("gRPC", "HTTP"):
                        prompt = [rng.randrange(16, vocab) for _ in range(args.prompt_tokens)]
                        start, arrivals = (
                            over_grpc(client, prompt, args.tokens)
                            if path == "gRPC"
                            else over_http(openai, model, prompt, args.tokens)
                        )
                        if i and arrivals and len(stamps.first_item) == len(stamps.handler):
                            runs[path].append(
                                {
                                    "start": start,
                                    "arrivals": arrivals,
                                    "handler": stamps.handler[-1],
                                    "first_item": stamps.first_item[-1],
                                }
                            )
        finally:
            pool.stop()
    finally:
        stop_cluster(cluster)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with RouterStamps() as stamps:
        runs = measure(args, stamps)
    print(
        f"{args.requests} requests per path, {args.prompt_tokens}-token prompts, {args.tokens} tokens each; ms"
    )
    figures = {path: summary(path_runs) for path, path_runs in runs.items()}
    for path, f in figures.items():
        print(
            f"{path}: first chunk {f['first']:.2f} (in: client -> router's handler {f['in']:.3f}; "
            f"out: router's first item -> client {f['out']:.3f}), later chunks {f['gap']:.2f} apart"
        )
    added = {k: figures["HTTP"][k] - figures["gRPC"][k] for k in ("in", "out")}
    print(
        f"the front door adds {added['in'] + added['out']:+.3f} to the first chunk "
        f"(in {added['in']:+.3f}, out {added['out']:+.3f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
