"""The card link alone (cluster/card_link.py): how long a generation's first item and each later item take
from card to router, on a new connection and on a kept one. The card's end runs in a child process (its
own event loop and interpreter, as a card actor's), serving items that carry the time they were made;
the router's end starts `--calls` generations of `--items` items, `--gap-ms` apart, and ends each at its
last item as the router does (`LinkCall.end`: the connection is kept) or cancels it (the next call opens
a new connection). Figures are medians in milliseconds of this machine's host times.

    python tools/link_latency.py [--calls 40] [--items 16] [--gap-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from onestream.cluster.card_link import CardLink, LinkServer, new_token


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=40, help="generations per mode (the first 3 warm up)")
    ap.add_argument("--items", type=int, default=16, help="items per generation")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="time between a generation's items")
    ap.add_argument("--card", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


async def serve_card(args: argparse.Namespace) -> None:
    async def items(request: Any) -> AsyncIterator[object]:
        for i in range(args.items):
            yield (i, time.perf_counter())
            await asyncio.sleep(args.gap_ms / 1e3)

    server = LinkServer("127.0.0.1", new_token(), items)
    await server.start()
    print(json.dumps({"endpoint": server.endpoint, "token": server.token}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await server.stop()


async def time_calls(args: argparse.Namespace, endpoint: str, token: str, keep: bool) -> dict[str, float]:
    link = CardLink(endpoint, token)
    first: list[float] = []
    later: list[float] = []
    try:
        for _ in range(args.calls):
            start = time.perf_counter()
            call = link.generate(("request", list(range(32))))
            for i in range(args.items):
                _, made = await call.next()  # type: ignore[misc]
                now = time.perf_counter()
                (first if i == 0 else later).append(1e3 * (now - (start if i == 0 else made)))
            call.end() if keep else call.cancel()
            await asyncio.sleep(0.01)  # the END arrives; the card's generation ends
    finally:
        await link.close()
    return {"first_item_ms": statistics.median(first[3:]), "later_item_ms": statistics.median(later)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.card:
        asyncio.run(serve_card(args))
        return 0
    card = subprocess.Popen(
        [sys.executable, __file__, "--card", "--items", str(args.items), "--gap-ms", str(args.gap_ms)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert card.stdout is not None
        where = json.loads(card.stdout.readline())
        for label, keep in (("new connection per call", False), ("kept connection", True)):
            figures = asyncio.run(time_calls(args, where["endpoint"], where["token"], keep))
            print(
                f"{label:24s} first item {figures['first_item_ms']:.3f} ms, "
                f"each later item {figures['later_item_ms']:.3f} ms (medians of {args.calls - 3} calls)"
            )
    finally:
        assert card.stdin is not None
        card.stdin.close()
        card.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
