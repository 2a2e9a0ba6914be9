"""Predicted outputs (``prediction``) side by side: what a request that brings the text its output will mostly repeat
(the file being edited) gains, and what a useless prediction costs.

For each prompt, the reference is the target-only greedy output O. Predictions made from it: ``exact`` (O itself),
``edited`` (O with a tenth of its tokens, mid-way, replaced by other text: an edit), ``half`` (O's first half: the
model writes on past what was predicted), ``unrelated`` (another prompt's output). Contenders, in one process, taking
turns round by round so the machine's drift hits all alike: target-only, speculative (the draft model at the fixed
``--tau``), and with each prediction: speculative + prediction, and target + prediction (no draft model). Every
output is checked against O token for token. Reports tokens/s (decode and whole request, the prefill included), target
passes, predicted tokens accepted and rejected, and ratios to target-only and to speculative.

    python benchmarks/prediction.py --n-prompts 8 --max-new-tokens 256 --rounds 3 --json prediction.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = ("exact", "edited", "half", "unrelated")


def predictions(outputs: list[list[int]], i: int, filler: list[int]) -> dict[str, list[int]]:
    o = outputs[i]
    k, cut = len(o) // 2, max(1, len(o) // 10)
    return {
        "exact": o,
        "edited": o[:k] + filler[:cut] + o[k + cut :],
        "half": o[:k],
        "unrelated": outputs[(i + 1) % len(outputs)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tau", type=int, default=5, help="the speculative contenders' fixed τ (default 5)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)

    import torch

    import specdec
    from specdec.api import default_draft, default_target
    from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts

    torch.set_num_threads(os.cpu_count() or 1)
    spec = specdec.load(default_target(), default_draft())
    plain = specdec.load(default_target())  # the same target, no drafter
    for e in (spec, plain):
        e.eos_ids = frozenset()  # every output max_new_tokens long: like for like
    prompts = [q.text for q in load_prompts(DEFAULT_PROMPTS)][: args.n_prompts]
    n = args.max_new_tokens
    outputs = [spec.generate(q, max_new_tokens=n, tau=0).token_ids for q in prompts]
    filler = spec.encode(" ".join(["# a line the edit put here"] * 20))

    contenders: dict[str, tuple[Any, dict[str, Any], str | None]] = {
        "target-only": (spec, {"tau": 0}, None),
        f"speculative τ={args.tau}": (spec, {"tau": args.tau}, None),
    }
    for kind in KINDS:
        contenders[f"speculative + {kind}"] = (spec, {"tau": args.tau}, kind)
        contenders[f"target + {kind}"] = (plain, {}, kind)
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in contenders}  # (whole, decode) seconds per round
    facts: dict[str, dict[str, int]] = {c: {"passes": 0, "accepted": 0, "rejected": 0, "wrong": 0} for c in contenders}
    for rnd in range(args.rounds):
        order = list(contenders) if rnd % 2 == 0 else list(reversed(contenders))
        for name in order:
            engine, kwargs, kind = contenders[name]
            whole = decode = 0.0
            for i, q in enumerate(prompts):
                pred = predictions(outputs, i, filler)[kind] if kind else None
                t = time.perf_counter()
                r = engine.generate(q, max_new_tokens=n, prediction=pred, **kwargs)
                whole += time.perf_counter() - t
                decode += r.stats.latency - r.stats.prefill_time
                if rnd == 0:
                    f = facts[name]
                    f["passes"] += r.stats.target_passes
                    f["accepted"] += r.stats.prediction_accepted
                    f["rejected"] += r.stats.prediction_rejected
                    f["wrong"] += r.token_ids != outputs[i]
            times[name].append((whole, decode))
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)

    tokens = n * len(prompts)
    rows = []
    base = statistics.median(w for w, _ in times["target-only"])
    spec_t = statistics.median(w for w, _ in times[f"speculative τ={args.tau}"])
    for name in contenders:
        whole = statistics.median(w for w, _ in times[name])
        decode = statistics.median(d for _, d in times[name])
        rows.append(
            {
                "contender": name,
                "tok_s": tokens / whole,
                "decode_tok_s": tokens / decode,
                "x_target_only": base / whole,
                "x_speculative": spec_t / whole,
                **facts[name],
            }
        )
    from specdec.runtime.cpu import cpu_flags, cpu_model

    vendor, family, model = cpu_model()
    isa = "AVX512-BF16" if "avx512_bf16" in cpu_flags() else ("AVX2" if "avx2" in cpu_flags() else "no AVX2")
    cpu = f"{vendor} family {family} model {model}, {isa}"
    print(
        f"predicted outputs: {len(prompts)} shipped prompts x {n} tokens, {args.rounds} rounds, "
        f"{torch.get_num_threads()} threads, {cpu} ({platform.machine()})"
    )
    print(
        f"{'contender':28s} {'tok/s':>8s} {'decode':>8s} {'x target':>9s} {'x spec':>7s} {'passes':>7s} "
        f"{'accepted':>9s} {'rejected':>9s} {'wrong':>6s}"
    )
    for r in rows:
        print(
            f"{r['contender']:28s} {r['tok_s']:8.0f} {r['decode_tok_s']:8.0f} {r['x_target_only']:9.2f} "
            f"{r['x_speculative']:7.2f} {r['passes']:7d} {r['accepted']:9d} {r['rejected']:9d} {r['wrong']:6d}"
        )
    wrong = sum(r["wrong"] for r in rows)
    print("every output identical to target-only" if not wrong else f"{wrong} outputs DIFFER from target-only")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "prompts": len(prompts),
                    "max_new_tokens": n,
                    "rounds": args.rounds,
                    "cpu": cpu,
                    "threads": torch.get_num_threads(),
                    "tau": args.tau,
                    "rows": rows,
                    "times": times,
                },
                f,
                indent=2,
            )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
