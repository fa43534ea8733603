"""How evenly the quantized GEMV's work splits over the grid's warps, per GEMV of the 27B shapes (CPU arithmetic).

    python tools/quant_work_split.py [--sms 132] [--warps 12] [--part-rows 4096]

Mirrors gemv_quant.cuh: rows go to the blocks by `row_range_of` (multiples of the descriptor's alignment), a block
walks its rows in rounds of `qplan`'s round, and a round's items (a row group by a chunk of 32 units per lane load)
go to its warps in turn (`gemv_units`). A warp's work is the weight rows it streams (rows past a round load nothing);
the figure per GEMV is the ideal (every warp the same) over the busiest warp's, for: the lanes' 4-row items, and
16-row tiles (wip/qtile) of whole chunks (4 super-blocks), of 2 super-blocks (its Tuning.qtile_chunk default) and of
one. A phase takes as long as its busiest warp, so 0.85 means 15 % of the phase's time is some warps waiting.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from onestream.kernels.random_model import config_27b


@dataclass(frozen=True)
class Gemv:
    name: str
    rows: int
    k: int
    align: int  # the descriptor's row alignment (gate/up pairs: 2)


def gemvs_27b() -> list[Gemv]:
    """The weight-streaming GEMVs of one step at the 27B shapes (kernels/random_model.config_27b)."""
    c = config_27b()
    h, i = c.hidden_size, c.intermediate_size
    attn = c.num_attention_heads * c.head_dim
    return [
        Gemv(
            "dn_in", c.linear_qkv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads, h, 1
        ),  # qkv | z | b | a
        Gemv("dn_out", h, c.linear_value_dim, 1),
        Gemv("att_in", 2 * attn + 2 * c.num_key_value_heads * c.head_dim, h, 1),  # q with its gate | k | v
        Gemv("att_out", h, attn, 1),
        Gemv("mlp_in", 2 * i, h, 2),  # gate / up pairs
        Gemv("mlp_down", h, i, 1),
        Gemv("lm_head", c.vocab_size, h, 1),
    ]


def balance(
    g: Gemv, item_rows: int, steps_per_chunk: int, align: int, *, sms: int, warps: int, part_rows: int
) -> float:
    """Ideal over the busiest warp's rows streamed, with items of `item_rows` rows by 1 / steps_per_chunk of a
    chunk (qplan's chunks: one per 32 units a lane loads)."""
    chunks = math.ceil(g.k // 32 / 32)
    items_per_row_group = chunks * steps_per_chunk
    round_rows = max(item_rows, (part_rows // (chunks * steps_per_chunk)) // item_rows * item_rows & ~1)
    units = g.rows // align
    busiest = 0.0
    for b in range(sms):
        r0, r1 = units * b // sms * align, units * (b + 1) // sms * align
        load = [0.0] * warps
        for rs in range(0, r1 - r0, round_rows):
            nr = min(round_rows, r1 - r0 - rs)
            groups = [min(item_rows, nr - t * item_rows) for t in range(math.ceil(nr / item_rows))]
            for n, rows in enumerate(r for r in groups for _ in range(items_per_row_group)):
                load[n % warps] += rows / steps_per_chunk
        busiest = max(busiest, *load)
    return g.rows * chunks / (sms * warps) / busiest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--warps", type=int, default=12)
    p.add_argument("--part-rows", type=int, default=4096)
    a = p.parse_args()
    kw = {"sms": a.sms, "warps": a.warps, "part_rows": a.part_rows}
    print(f"{'GEMV':9s} {'rows':>7s} {'K':>6s}  lanes' 4-row items  tiles of 4 / 2 / 1 super-blocks")
    for g in gemvs_27b():
        group = 16 if g.align == 2 else 8  # tiled weights go to the blocks in whole groups (phases.cuh)
        lanes = balance(g, 4, 1, g.align, **kw)
        tiles = [balance(g, 16, steps, group, **kw) for steps in (1, 2, 4)]
        print(f"{g.name:9s} {g.rows:7d} {g.k:6d}  {lanes:18.3f}  " + " / ".join(f"{t:.3f}" for t in tiles))


if __name__ == "__main__":
    main()
