"""Host time a megakernel launch spends in Python before the kernel is queued, on the parts that do not need a
GPU: the plan's `smem_bytes` (read by every launch) and a KV cache's `reserve` when it already holds the room
(called for every attention layer's cache, 16 at 64 layers, and the MTP layer's), on the 27B shapes with a Q4_K_M
file's weight formats. On the CPU; the figures are host times of the machine it runs on.

    python tools/host_launch_costs.py [--tokens 1 4] [--number 20000]
"""

from __future__ import annotations

import argparse
import timeit

import torch
from onestream.kernels.plan import KernelPlan
from onestream.kernels.random_model import config_27b
from onestream.kernels.random_quant import q4_k_m_formats
from onestream.worker.kv_cache import new_kv_cache


def us_per_call(fn: object, number: int) -> float:
    return timeit.timeit(fn, number=number) / number * 1e6  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="tokens per launch of the plans")
    p.add_argument("--number", type=int, default=20_000, help="calls timed per figure")
    args = p.parse_args(argv)
    config = config_27b()
    for tokens in args.tokens:
        plan = KernelPlan(
            config,
            num_sms=132,
            tokens_per_launch=tokens,
            smem_limit=227 * 1024,
            weight_formats=q4_k_m_formats(),
        )
        plan.smem_bytes  # noqa: B018  (the first read fits the plan; launches read it after)
        print(
            f"KernelPlan.smem_bytes, T = {tokens}: {us_per_call(lambda p=plan: p.smem_bytes, args.number):.2f} us"
        )
    for kv_format in ("auto", "int8"):
        cache = new_kv_cache(
            kv_format, config.num_key_value_heads, config.head_dim, 8192, torch.bfloat16, torch.device("cpu")
        )
        cache.reserve(100)
        with torch.inference_mode():  # as the card's engine thread serves
            cost = us_per_call(lambda c=cache: c.reserve(50), args.number)
        print(f"KVCache.reserve within its capacity, {kv_format} cache: {cost:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
