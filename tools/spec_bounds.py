"""How far drafts from the context can go on `onestream eval spec --workload` prompts (reference back end):
`python -m tools.spec_bounds --workload edit [--lookup-k 8 16 32] [--max-prompts 12] [--max-tokens 64]`.

Greedy output is a function of the prompt alone, so a drafting policy's accepted lengths can be replayed
on it without the model. The script generates each prompt's plain greedy output once, records the MTP
head's k greedy drafts at every position, and reports:
- copy fidelity (`edit`): how many tokens of the edited file the model writes back before it first
  departs from it (the workload's premise is that the continuation largely copies the prompt);
- the lookup alone (the engine's `DraftPolicy`, replayed) on the model's output and on the expected
  continuation itself, i.e. for a model that writes the file back exactly;
- a per-cycle oracle: each cycle takes the longest accepted of the MTP head's drafts and of every draft
  made of its first j drafts (j = 0..k) followed by what followed any earlier occurrence of the last token
  (every n-gram match of every length is among them); what no single-candidate policy over these two
  sources can beat by more than the oracle's greed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence as Seq
from typing import Any

import torch
from onestream.worker.api import SamplingParams
from onestream.worker.drafting import LOOKUP, DraftPolicy, DraftSettings, NGramIndex
from onestream.worker.drafting.mtp import continue_mtp_draft
from onestream.worker.engine import Engine
from onestream.worker.evaluation import run_spec
from onestream.worker.sampling import RequestSampler
from onestream.worker.sequence import Sequence
from onestream.worker.workloads import WORKLOADS, WorkloadPrompt, build_prompts, heldout_files


class HostIds:
    """The one `Sequence` method a lookup-only policy calls: ids on the host."""

    def ids(self, tokens: Seq[int]) -> torch.Tensor:
        return torch.tensor(list(tokens), dtype=torch.long)


def accepted(draft: Seq[int], output: Seq[int], at: int) -> int:
    n = 0
    while n < len(draft) and at + n < len(output) and draft[n] == output[at + n]:
        n += 1
    return n


def replay_lookup(prompt: list[int], output: list[int], settings: DraftSettings) -> tuple[int, int, int]:
    """(verify cycles, accepted drafts, target passes) of the engine's lookup-only policy generating
    `output` (its first token from the prefill), as `SpeculativeDecoder` and the engine loop run it."""
    index = NGramIndex(*settings.ngram)
    index.extend([*prompt, output[0]])
    policy = DraftPolicy(settings, index)
    cycles = total = passes = 0
    done = 1
    while done < len(output):
        remaining = len(output) - done
        draft = None
        if remaining >= 2:
            draft = policy.propose(HostIds(), output[done - 1], None, min(remaining - 1, settings.max_drafts))  # type: ignore[arg-type]
        passes += 1
        if draft is None:
            index.extend(output[done : done + 1])
            done += 1
            continue
        assert draft.host_tokens is not None
        n = accepted(draft.host_tokens, output, done)
        policy.record(draft, n)
        cycles, total = cycles + 1, total + n
        index.extend(output[done : done + n + 1])
        done += n + 1
    return cycles, total, passes


def mtp_chains(engine: Engine, prompt: list[int], output: list[int], k: int) -> list[list[int]]:
    """The MTP head's k greedy drafts after each position of `output` (index g: the drafts after
    output[g - 1], the pending token, as a cycle at that position would draft them)."""
    seq = Sequence(engine.backend, len(prompt) + len(output) + k + 2, track_mtp=True)
    seq.feed(prompt)
    sampler = RequestSampler(SamplingParams(temperature=0.0), prompt, engine.config.vocab_size, "cpu")
    chains: list[list[int]] = [[]]
    for g in range(1, len(output)):
        pending = output[g - 1]
        first = seq.draft_first(pending)
        chains.append(continue_mtp_draft(seq, first, sampler, k).tokens.tolist())
        verify = seq.run_verify(seq.ids([pending]))
        seq.accept_verified([pending], verify, 1)
    return chains


def oracle(prompt: list[int], output: list[int], chains: list[list[int]], most: int) -> tuple[int, int]:
    """(cycles, tokens decoded after the first) of the per-cycle oracle (module docstring)."""
    context = [*prompt, output[0]]
    done, cycles = 1, 0
    while done < len(output):
        room = min(len(output) - done - 1, most)
        best = 0
        if room >= 1:
            chain = chains[done][:room]
            best = head = accepted(chain, output, done)
            for j in range(head + 1):  # only accepted head drafts can lead a copy
                drafted = context + chain[:j]
                last = drafted[-1]
                for q in range(len(context) - 1):
                    if context[q] == last:
                        copy = (drafted[q + 1 :])[: room - j]
                        best = max(best, j + accepted(copy, output, done + j))
        cycles += 1
        context += output[done : done + best + 1]
        done += best + 1
    return cycles, len(output) - 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=WORKLOADS, default="edit")
    parser.add_argument("--lookup-k", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--ngram", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--max-prompts", type=int, default=12)
    parser.add_argument("--prompts-per-file", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine(None, backend="reference", device="cpu", dtype="fp32")
    sources, _ = heldout_files(engine.model_dir)
    prompts: list[WorkloadPrompt] = build_prompts(
        args.workload,
        sources,
        engine.tokenizer,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        per_source=args.prompts_per_file,
        max_prompts=args.max_prompts,
    )
    k = engine.spec_k  # run_spec sets it: plain decoding first
    outputs = run_spec(engine, [p.ids for p in prompts], k=0, max_tokens=args.max_tokens).outputs
    ngram = tuple(args.ngram) if args.ngram else engine.ngram
    report: dict[str, Any] = {"workload": args.workload, "prompts": len(prompts), "mtp_k": k, "ngram": ngram}
    edits = [(p, o) for p, o in zip(prompts, outputs, strict=True) if p.kind == "edit"]
    if edits:
        copied = [accepted(p.expected, o, 0) for p, o in edits]
        report["edit_tokens_copied_before_departing"] = copied
        report["edit_mean_tokens_copied"] = sum(copied) / len(copied)
    for lookup_k in args.lookup_k:
        settings = DraftSettings(mode=LOOKUP, mtp_k=0, lookup_k=lookup_k, ngram=ngram)  # type: ignore[arg-type]
        for name, texts in (("output", outputs), ("expected", [p.expected for p in prompts])):
            c = a = passes = 0
            for prompt, text in zip(prompts, texts, strict=True):
                cycles, total, n_passes = replay_lookup(prompt.ids, text, settings)
                c, a, passes = c + cycles, a + total, passes + n_passes
            decoded = sum(len(t) - 1 for t in texts)
            report[f"lookup_{lookup_k}_on_{name}"] = {
                "mean_accepted_length": 1 + a / c if c else 1.0,
                "tokens_per_pass": decoded / passes,
                "cycles": c,
            }
    chains = [mtp_chains(engine, p.ids, o, k) for p, o in zip(prompts, outputs, strict=True)]
    mtp_cycles = mtp_accepted = 0
    for o, chain in zip(outputs, chains, strict=True):
        done = 1
        while done < len(o):
            room = min(len(o) - done - 1, k)
            n = accepted(chain[done][:room], o, done) if room >= 1 else 0
            mtp_cycles += room >= 1
            mtp_accepted += n
            done += n + 1
    report["mtp_alone_mean_accepted_length"] = 1 + mtp_accepted / mtp_cycles
    for lookup_k in args.lookup_k:
        cycles = decoded = 0
        for p, o, chain in zip(prompts, outputs, chains, strict=True):
            c, d = oracle(p.ids, o, chain, max(lookup_k, k))
            cycles, decoded = cycles + c, decoded + d
        report[f"oracle_{lookup_k}_tokens_per_pass"] = decoded / cycles
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
