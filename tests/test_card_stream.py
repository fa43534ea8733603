"""The card's stream merges chunks that queued up behind the card's link (cluster/card.py `_coalesce`): nothing
lost or reordered, the item after the merged chunks kept for the next send, a lone chunk sent as it is."""

from __future__ import annotations

import asyncio

from onestream.cluster.card import _coalesce
from onestream.worker.api import Finished, Timings, TokenChunk, Usage


def queue_of(*items: object) -> asyncio.Queue[object]:
    queue: asyncio.Queue[object] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_queued_chunks_merge_and_the_next_item_is_held() -> None:
    end = Finished("length", Usage(generated_tokens=4), Timings())
    queue = queue_of(TokenChunk([2], "b"), TokenChunk([3, 4], "cd"), end, TokenChunk([9], "z"))
    merged, held = _coalesce(TokenChunk([1], "a"), queue)
    assert merged == TokenChunk([1, 2, 3, 4], "abcd")
    assert held is end
    assert queue.qsize() == 1  # what comes after the held item stays queued


def test_a_lone_chunk_goes_as_it_is() -> None:
    chunk = TokenChunk([5], "e")
    merged, held = _coalesce(chunk, queue_of())
    assert merged is chunk and held is None


def test_text_only_chunks_merge_too() -> None:
    merged, held = _coalesce(TokenChunk([7], "x"), queue_of(TokenChunk([], "yz")))
    assert merged == TokenChunk([7], "xyz") and held is None
