"""The measured parts of the model card (worker/assets/default_model/README.md), written from result files.

The card's figures live between `<!-- NAME:start -->` and `<!-- NAME:end -->` markers, so that they are
always the figures of the shipped weights: `gpu-run` from the GPU run's results.json
(tools/gpu/train_default_model.sh), `cpu-eval` from tools/default_model/evaluate.py's report.
"""

from __future__ import annotations

import re


class MissingMarkersError(ValueError):
    pass


def replace_block(text: str, name: str, content: str) -> str:
    """`text` with the lines between the `name` markers replaced by `content`."""
    pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.DOTALL)
    if not pattern.search(text):
        raise MissingMarkersError(f"the model card has no '<!-- {name}:start/end -->' markers")
    return pattern.sub(lambda m: m.group(1) + content.rstrip("\n") + "\n" + m.group(2), text, count=1)


def _percent(values: list[float]) -> str:
    return " / ".join(f"{100 * v:.1f} %" for v in values)


def _spec_table(spec: dict) -> list[str]:
    rows = [
        "| k | mean accepted length | accepted per position | tok/s | speed-up |",
        "|---|---|---|---|---|",
        f"| 0 (plain) | 1.00 | | {spec['plain']['tokens_per_s']:.1f} | 1.00 |",
    ]
    for run in spec["speculative"]:
        positions = " ".join(f"{p:.2f}" for p in run["acceptance_per_position"])
        rows.append(
            f"| {run['k']} | {run['mean_accepted_length']:.2f} | {positions} | {run['tokens_per_s']:.1f} "
            f"| {run['speedup']:.2f} |"
        )
    return rows


def gpu_run_block(results: dict) -> str:
    """Training, held-out evaluation, GPU speculative decoding and sample completions of one GPU run."""
    t = results["training"]
    h = t["heldout"]
    chain = h["mtp_chain_agree_with_main_top1"]
    machine = t["machine"]
    lines = [
        f"Trained on one {machine['device']} for {t['train_seconds']:.0f} s ({t['date_utc'][:10]}, torch "
        f"{machine['torch']}, Python {machine['python']}; {t['args'].get('note', '')}): {t['steps']} steps of "
        f"{t['args']['batch']} windows of {t['args']['seq_len']} tokens, {t['tokens_trained'] / 1e6:.1f} M tokens "
        f"({t['epochs']:.2f} epochs), {t['tokens_per_second'] / 1e3:.0f} k tokens/s, training step "
        f"{t.get('step_mode', 'eager')}"
        + (
            f" (torch.compile fell back: {t['compile_fallback_reason']})"
            if t.get("compile_fallback_reason")
            else ""
        )
        + f"; stopped: {t['stop_reason']}.",
        "",
        f"Held-out, teacher-forced (the saved bf16 weights, {h['windows']} windows of {h['seq_len']} tokens = "
        f"{h['tokens_scored'] / 1e6:.2f} M tokens):",
        "",
        "| | |",
        "|---|---|",
        f"| loss | {h['loss']:.3f} nats/token |",
        f"| perplexity | {h['perplexity']:.2f} |",
    ]
    if "bits_per_byte" in h:
        lines.append(f"| bits per byte | {h['bits_per_byte']:.3f} |")
    lines += [
        f"| top-1 accuracy | {100 * h['top1_accuracy']:.1f} % |",
        f"| MTP loss, depth 1 / 2 / 3 | {' / '.join(f'{v:.3f}' for v in h['mtp_loss'])} |",
        f"| MTP draft = main model's top-1 (by depth) | {_percent(h['mtp_agree_with_main_top1'])} |",
        f"| whole chain agrees up to depth 1 / 2 / 3 | {_percent(chain)} "
        f"(→ {1 + sum(chain):.2f} tokens per cycle at k = {len(chain)}, teacher-forced) |",
    ]
    spec = results.get("spec")
    if spec:
        model = spec["model"]
        lines += [
            "",
            f"Speculative decoding on the GPU ({model['backend']} back end, {model['dtype']}, {spec['prompts']} "
            f"prompts of {spec['prompt_tokens']} tokens, {spec['max_tokens']} greedy tokens each; outputs "
            f"identical to plain greedy: {spec['outputs_identical']}):",
            "",
            *_spec_table(spec),
        ]
    samples = results.get("samples")
    if samples:
        lines += ["", f"Greedy completions on the GPU ({samples['max_tokens']} tokens at most):", ""]
        for record in samples["samples"][:3]:
            lines += ["```python", (record["prompt"] + record["greedy"]["text"]).rstrip(), "```"]
    return "\n".join(lines)


def cpu_eval_block(report: dict) -> str:
    """Speculative decoding and generation time on the CPU (tools/default_model/evaluate.py's report)."""
    machine = report["machine"]
    spec = report["spec"]
    lines = [
        f"CPU ({machine['cpu']}, {machine['threads']} thread(s), torch {machine['torch']}, "
        f"{report['date_utc'][:10]}; {spec['prompts']} prompts of {spec['prompt_tokens']} tokens, "
        f"{spec['max_tokens']} greedy tokens each; outputs identical to plain greedy: "
        f"{spec['outputs_identical']}):",
        "",
        *_spec_table(spec),
    ]
    generate = report.get("generate_64")
    if generate:
        default, plain = generate["default"], generate["plain"]
        penalty = default.get("sampling", {}).get("repetition_penalty", 1.0)
        how = f"greedy, repetition penalty {penalty}, " if penalty != 1.0 else ""
        lines += [
            "",
            f"64 tokens from a short code prompt with the engine's defaults ({how}k = {default['spec_k']}): "
            f"{default['min_s']:.2f} s best / {default['median_s']:.2f} s median of 5 (plain decoding: "
            f"{plain['min_s']:.2f} s / {plain['median_s']:.2f} s).",
        ]
    check = report.get("heldout_cpu_check")
    if check:
        lines += [
            "",
            f"CPU re-check of the shipped file on {check['windows']} held-out windows "
            f"({check['tokens_scored']} tokens): loss {check['loss']:.3f}.",
        ]
    return "\n".join(lines)
