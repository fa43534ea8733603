"""What encoding an agent's conversation costs per turn, whole against a segment at a time (worker/segment_encoding.py).

A conversation of the project's own source files (a system prompt of `--system-chars`, then messages of
`--message-chars`, user and assistant in turn), rendered with the model's chat template turn by turn as an agent
resends it; each turn's text is encoded whole by the tokenizer library and by `Tokenizer.encode` (segments,
remembered across turns). Prints the median time per turn of each, from the second turn on, and the template's
own time.

    python tools/encode_turns.py [--model worker/assets/default_model] [--turns 12]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    from onestream.worker.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(ROOT / "worker" / "assets" / "default_model"))
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--system-chars", type=int, default=60000)
    parser.add_argument("--message-chars", type=int, default=4000)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    corpus = "".join(p.read_text() for p in sorted((ROOT / "cluster").rglob("*.py")))
    corpus += "".join(p.read_text() for p in sorted((ROOT / "worker").rglob("*.py")))
    messages = [{"role": "system", "content": corpus[: args.system_chars]}]
    whole_ms, segment_ms, template_ms, tokens = [], [], [], 0
    for turn in range(args.turns):
        start = args.system_chars + turn * args.message_chars
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": corpus[start : start + args.message_chars]})
        t0 = time.perf_counter()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        t1 = time.perf_counter()
        want = tokenizer.backend.encode(text, add_special_tokens=False).ids
        t2 = time.perf_counter()
        got = tokenizer.encode(text, memo_scope="user:agent")  # as the engine encodes a request's prompt
        t3 = time.perf_counter()
        if got != want:
            raise SystemExit(f"turn {turn}: the segments' ids differ from the whole text's")
        if turn:
            template_ms.append(1e3 * (t1 - t0))
            whole_ms.append(1e3 * (t2 - t1))
            segment_ms.append(1e3 * (t3 - t2))
        tokens = len(want)
    print(
        f"{args.turns} turns, {tokens:,} tokens at the last: per turn (median of turns 2..{args.turns}) "
        f"whole {statistics.median(whole_ms):.1f} ms, by segment {statistics.median(segment_ms):.1f} ms "
        f"({statistics.median(whole_ms) / statistics.median(segment_ms):.1f}x), the chat template "
        f"{statistics.median(template_ms):.1f} ms; same ids every turn"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
