"""`onestream serve`: run the pool (cards on every node of a Ray cluster, the gRPC router, metrics)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from .generate import (
    MODEL_HELP,
    add_drafting_arguments,
    add_format_arguments,
    add_kv_cache_argument,
    drafting_options,
    engine_format_options,
)

EXTRA_CARDS_WAIT_S = 60.0
# The flags of the addresses that serve the API: beyond loopback they need --api-keys (or --insecure).
LISTENERS = ("listen", "http")


# CPU cards started by a plain `onestream serve` on a machine without GPUs.
DEFAULT_LOCAL_CPU_CARDS = 2


def register(subparsers: Any) -> None:
    from onestream.worker.prefixes import DEFAULT_PREFIX_SHARING, PREFIX_SHARING_MODES

    p = subparsers.add_parser(
        "serve",
        help="run the pool: a card per GPU of every Ray node, the gRPC router, Prometheus metrics",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help=MODEL_HELP)
    add_format_arguments(p)
    p.add_argument("--listen", default="127.0.0.1:50051", help="gRPC address (HOST:PORT; 0.0.0.0 for all)")
    p.add_argument("--metrics", default="127.0.0.1:9400", help="router /metrics and /sd address")
    p.add_argument(
        "--card-metrics-host",
        default=None,
        metavar="HOST",
        help="interface every card's /metrics binds to on its node (default: the node's Ray IP address; "
        "127.0.0.1 keeps them on the node, 0.0.0.0 opens them on every interface)",
    )
    p.add_argument(
        "--http",
        default="127.0.0.1:8000",
        metavar="ADDR",
        help="HTTP front door: OpenAI and Anthropic APIs (HOST:PORT; 'off' for none)",
    )
    p.add_argument(
        "--http-user-sessions",
        action="store_true",
        help="a request's `user` field (Anthropic: metadata.user_id) pins its session when it sends no "
        "x-session-id: for agents that put a conversation id there (docs/http.md)",
    )
    p.add_argument("--address", default=None, help="Ray cluster to join (e.g. HEAD:6379); default: start one")
    p.add_argument(
        "--cpu-cards",
        type=int,
        default=None,
        metavar="N",
        help="run CPU cards (reference back end) instead of GPU cards: N on the local Ray node; with "
        "--address, where nodes advertise the onestream_cpu_card resource",
    )
    p.add_argument("--backend", default="auto", choices=("auto", "reference", "megakernel"))
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: the back end's choice)")
    p.add_argument("--spec-k", type=int, default=None, help="MTP drafts per speculative cycle (0 = off)")
    add_kv_cache_argument(p)
    add_drafting_arguments(p)
    p.add_argument("--max-context", type=int, default=None, help="cap the context length of every card")
    p.add_argument("--cache-gib", type=float, default=None, help="session cache per card, GiB")
    p.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="GB",
        help="device memory a GPU card may plan with, GB (default: what its device has free for it): the "
        "prefill piece is the longest that fits it by our accounting ($ONESTREAM_PREFILL_TOKENS overrides)",
    )
    p.add_argument("--card-threads", type=int, default=None, help="torch threads per CPU card")
    p.add_argument("--queue", type=int, default=256, help="requests that may wait for a card")
    p.add_argument("--home-wait", type=float, default=2.0, help="seconds a turn waits for its busy home card")
    p.add_argument(
        "--prefix-sharing",
        default=DEFAULT_PREFIX_SHARING,
        choices=PREFIX_SHARING_MODES,
        help="who shares cached prompt prefixes: each user alone (default), or the whole team",
    )
    p.add_argument("--drain-timeout", type=float, default=300.0, help="seconds to finish streams on SIGTERM")
    users = p.add_argument_group("users (docs/pool.md: auth, ownership, limits)")
    users.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="turn authentication on: lines of `KEY USER` (`KEY USER admin` for an admin key); "
        "re-read on SIGHUP",
    )
    users.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback without --api-keys (a trusted network)",
    )
    users.add_argument(
        "--user-max-concurrent", type=int, default=None, metavar="N", help="a user's requests in flight"
    )
    users.add_argument(
        "--user-max-queued", type=int, default=None, metavar="N", help="a user's requests waiting for a card"
    )
    users.add_argument(
        "--metrics-per-user", action="store_true", help="label the per-user counters with the user"
    )
    bench = p.add_argument_group("benchmarks (cluster/engine_source.py: cards that draw a random model)")
    bench.add_argument(
        "--random-model",
        default=None,
        choices=("27b", "tiny"),
        help="every card draws a random model of these shapes on its device instead of loading --model "
        "(the embedded model lends its tokenizer: send token-id prompts)",
    )
    bench.add_argument(
        "--random-layers", type=int, default=None, metavar="N", help="its layers (default: all)"
    )
    bench.add_argument(
        "--random-weights", default="bf16", help="bf16, or a preset's random GGUF blocks (q4_k_m, q8_0, ...)"
    )
    bench.add_argument("--random-mtp", action="store_true", help="give it an MTP head (for --spec-k)")
    bench.add_argument("--random-seed", type=int, default=7)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)


def random_source(args: argparse.Namespace) -> Any:
    """The cards' RandomModelSource when --random-model is given, else None (they load --model)."""
    if args.random_model is None:
        return None
    from onestream.cluster.engine_source import RandomModelSource

    return RandomModelSource(
        args.random_model,
        layers=args.random_layers,
        weights=args.random_weights,
        seed=args.random_seed,
        mtp=args.random_mtp,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    problem = users_problem(args)  # before anything slow starts
    if problem is None and args.random_model is not None and args.model is not None:
        problem = "--random-model and --model name two models; give one"
    if problem:
        print(f"onestream serve: {problem}", file=sys.stderr)
        return 2
    from onestream.cluster.config import PoolConfig
    from onestream.worker.errors import CheckpointError
    from onestream.worker.loading import default_model_dir

    try:
        model_dir = args.model or str(default_model_dir())
    except CheckpointError as e:
        print(f"onestream serve: {e}", file=sys.stderr)
        return 2
    if args.cpu_cards is not None and args.cpu_cards < 0:
        print("onestream serve: --cpu-cards must be >= 0", file=sys.stderr)
        return 2
    if args.cpu_cards is None and not args.address and not _local_gpu_count():
        # A laptop or CI box: the pool still runs, on CPU cards, so `onestream serve` works anywhere.
        args.cpu_cards = DEFAULT_LOCAL_CPU_CARDS
        print(
            f"onestream serve: no GPU here; running {args.cpu_cards} CPU cards (reference back end); "
            "--cpu-cards N to choose",
            flush=True,
        )
    engine_options: dict[str, Any] = {}
    if args.spec_k is not None:
        engine_options["spec_k"] = args.spec_k
    if args.kv_cache != "auto":
        engine_options["kv_cache"] = args.kv_cache
    engine_options |= drafting_options(args)
    if args.max_context is not None:
        engine_options["max_context"] = args.max_context
    if args.cache_gib is not None:
        engine_options["cache_bytes"] = int(args.cache_gib * (1 << 30))
    if args.memory_budget is not None:
        if args.memory_budget <= 0:
            print("onestream serve: --memory-budget must be a positive number of GB", file=sys.stderr)
            return 2
        engine_options["memory_budget"] = int(args.memory_budget * 1e9)
    engine_options |= {k: v for k, v in engine_format_options(args).items() if v is not None}
    try:
        source = random_source(args)
    except ValueError as e:
        print(f"onestream serve: {e}", file=sys.stderr)
        return 2
    try:
        if source is not None:  # nothing to load: the memory is the drawn model's
            print(f"onestream serve: cards draw {source.label} (random weights, token prompts)", flush=True)
        elif not (
            args.address and not Path(model_dir).exists()
        ):  # a remote cluster's path may be its nodes' only
            print(f"onestream serve: {_memory_report(model_dir, args, engine_options)}", flush=True)
    except CheckpointError as e:
        print(f"onestream serve: {e}", file=sys.stderr)
        return 2
    config = PoolConfig(
        model_dir=model_dir,
        grpc_address=args.listen,
        metrics_address=args.metrics,
        http_address=None if args.http == "off" else args.http,
        http_user_sessions=args.http_user_sessions,
        cpu_cards=args.cpu_cards,
        backend=args.backend,
        dtype=args.dtype,
        card_torch_threads=args.card_threads,
        card_metrics_host=args.card_metrics_host,
        engine_options=engine_options,
        engine_source=source,
        queue_capacity=args.queue,
        home_wait_s=args.home_wait,
        prefix_sharing=args.prefix_sharing,
        drain_timeout_s=args.drain_timeout,
        api_keys_path=args.api_keys,
        user_max_concurrent=args.user_max_concurrent,
        user_max_queued=args.user_max_queued,
        metrics_per_user=args.metrics_per_user,
    )
    ray_address = _connect_ray(args.address, args.cpu_cards)
    if _card_slots(args.cpu_cards) == 0:
        what = "onestream_cpu_card resources" if args.cpu_cards is not None else "GPUs"
        if not args.address:
            hint = (
                "use --cpu-cards N to run CPU cards"
                if args.cpu_cards is None
                else "use --cpu-cards N with N >= 1"
            )
            print(f"onestream serve: this machine has no {what}; {hint}", file=sys.stderr)
            return 2
        # A cluster may gain GPU nodes later (autoscaling): their cards join when they come.
        print(
            f"onestream serve: the Ray cluster has no {what} yet; waiting for nodes that have them",
            flush=True,
        )
    return asyncio.run(_serve(config, ray_address))


def users_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the user flags, before anything starts: a listener beyond loopback without
    keys (unless --insecure), per-user settings without users, a key file that does not parse."""
    from onestream.cluster.auth import ApiKeys, KeyFileError, exposure_error

    for flag in ("user_max_concurrent", "user_max_queued"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            return f"--{flag.replace('_', '-')} must be >= 1, got {value}"
    if not args.api_keys:
        per_user = [
            f"--{flag.replace('_', '-')}"
            for flag in ("user_max_concurrent", "user_max_queued", "metrics_per_user")
            if getattr(args, flag) not in (None, False)
        ]
        if per_user:
            return f"{', '.join(per_user)} needs --api-keys: without keys there are no users"
    else:
        try:
            ApiKeys.load(args.api_keys)
        except KeyFileError as e:
            return str(e)
    listeners = {f"--{name}": getattr(args, name) for name in LISTENERS}
    listeners = {flag: address for flag, address in listeners.items() if address and address != "off"}
    return exposure_error(listeners, keys=bool(args.api_keys), insecure=args.insecure)


def _memory_report(model_dir: str, args: argparse.Namespace, engine_options: dict[str, Any]) -> str:
    """What one card needs for this model, format and context (worker/memory.py), and whether the local GPU
    has it, with the prefill piece its engine will choose (memory.choose_prefill_piece)."""
    import torch

    from onestream.worker.checkpoints import open_checkpoint
    from onestream.worker.engine import parse_dtype
    from onestream.worker.memory import fit_report
    from onestream.worker.prefill import operator_piece_tokens
    from onestream.worker.prefill.deltanet import expected_kernel

    checkpoint = open_checkpoint(model_dir, quantize=args.quantize, tokenizer_dir=args.tokenizer)
    gpu = args.cpu_cards is None and torch.cuda.is_available()
    dtype = parse_dtype(args.dtype) or (torch.bfloat16 if gpu else torch.float32)
    device_bytes = None
    if gpu:  # before the card loads: its whole memory (the card plans with what its device has then)
        budget = engine_options.get("memory_budget")
        device_bytes = budget if budget is not None else torch.cuda.get_device_properties(0).total_memory
    return fit_report(
        checkpoint,
        dtype=dtype,
        context=engine_options.get("max_context"),
        spec_k=_max_drafts(engine_options),
        device_bytes=device_bytes,
        prefill_tokens=operator_piece_tokens() if gpu else None,  # a GPU card prefills on the fast path
        fast_prefill=gpu,
        delta_rule=expected_kernel() if gpu else "torch",
        megakernel=gpu and args.backend != "reference",  # when it builds
        kv_format=args.kv_cache,
    )


def _max_drafts(engine_options: dict[str, Any]) -> int:
    """The most drafts a cycle verifies with these options: what the rollback records are sized by."""
    from onestream.worker.drafting import DEFAULT_LOOKUP_K, DEFAULT_MODE
    from onestream.worker.engine import DEFAULT_SPEC_K

    mtp_k = engine_options.get("spec_k", DEFAULT_SPEC_K)
    mode = engine_options.get("drafting", DEFAULT_MODE)
    lookup_k = engine_options.get("lookup_k", DEFAULT_LOOKUP_K) if mode != "mtp" else 0
    return max(0 if mode == "lookup" else mtp_k, lookup_k if mode == "lookup" or mtp_k else 0)


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _connect_ray(address: str | None, cpu_cards: int | None) -> str:
    import ray

    from onestream.cluster.card import CPU_CARD_RESOURCE

    if address:
        ray.init(address=address, namespace="onestream", logging_level=logging.WARNING)
    else:
        resources = {CPU_CARD_RESOURCE: float(cpu_cards)} if cpu_cards else None
        ray.init(
            address="local",  # a new instance, even if another Ray cluster runs on this machine
            namespace="onestream",
            resources=resources,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    return str(ray.get_runtime_context().gcs_address)


def _card_slots(cpu_cards: int | None) -> int:
    import ray

    from onestream.cluster.card import CPU_CARD_RESOURCE

    resources = ray.cluster_resources()
    return int(resources.get(CPU_CARD_RESOURCE if cpu_cards is not None else "GPU", 0))


async def _serve(config: Any, ray_address: str) -> int:
    from onestream.cluster.server import PoolServer

    # Signals first: a SIGTERM while cards are still loading stops cleanly too.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pool = PoolServer(config)
    loop.add_signal_handler(signal.SIGHUP, _reload_keys, pool)
    print(
        f"onestream serve: model {config.model_dir}; Ray cluster at {ray_address}; starting cards…",
        flush=True,
    )
    starting = asyncio.create_task(pool.start(wait_for_cards=1))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # signalled while the cards were loading
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await pool.stop()
        print("onestream serve: interrupted while starting", file=sys.stderr, flush=True)
        return 1
    if starting.exception() is not None:
        await pool.stop()
        print(f"onestream serve: could not start: {starting.exception()}", file=sys.stderr, flush=True)
        return 1
    # The first card serves; give the others a moment so that the listing below is complete.
    with contextlib.suppress(TimeoutError):
        await pool.registry.wait_until_ready(len(pool.registry.records()), EXTRA_CARDS_WAIT_S)
    _print_addresses(pool)
    # What the router holds from now on (Ray, gRPC, the tokenizer) lives as long as it: out of the collector's
    # way, so that a full collection does not pause every stream in flight to walk it all.
    gc.collect()
    gc.freeze()
    await stopping
    gc.unfreeze()  # collectable again at exit: frozen extension objects are reported as leaks (nanobind)
    print("onestream serve: draining (finishing the streams in flight)…", flush=True)
    await pool.drain_and_stop()
    print("onestream serve: stopped", flush=True)
    return 0


def _reload_keys(pool: Any) -> None:
    if pool.reload_keys():
        print(f"onestream serve: SIGHUP: re-read {pool.config.api_keys_path}", flush=True)
    else:
        print(
            "onestream serve: SIGHUP: the key file was not re-read (see the log); the keys in force stay",
            flush=True,
        )


def _print_addresses(pool: Any) -> None:
    metrics = pool.metrics_address
    print(f"  gRPC        {pool.grpc_address}  (onestream.v1.OneStream, grpc.health.v1, reflection)")
    if pool.http_address is not None:
        print(f"  HTTP        http://{pool.http_address}/v1  (OpenAI and Anthropic APIs)")
    print(f"  metrics     http://{metrics}/metrics")
    print(f"  discovery   http://{metrics}/sd  (Prometheus http_sd_configs)")
    for record in pool.registry.records():
        ident = record.identity
        where = (
            f"{ident.device_name}  http://{ident.metrics_endpoint}/metrics" if ident else "(still starting)"
        )
        print(f"  card        {record.card_id}  {where}")
    if pool.auth.enabled:
        keys = pool.auth.keys
        print(
            f"  API keys    {len(keys)} keys of {len(keys.users)} users ({pool.config.api_keys_path}; SIGHUP re-reads)"
        )
    else:
        print("  API keys    none: every caller is anonymous (loopback only, or --insecure)")
    print("  ready; SIGTERM or Ctrl-C drains and stops", flush=True)
