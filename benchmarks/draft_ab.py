"""Two draft settings side by side in one process, interleaved: whole greedy requests, tokens/s against target-only.

Machine noise on a shared 2-core box moves one benchmark run against the next by 10-30% (how much of the target's
weights the L3 holds between passes). This loads target-only and two speculative engines that differ only in load
options (``specdec.load`` keywords), and times every prompt with the three taking turns, rotating who goes first, so
the noise falls on all three alike. Every speculative output is checked identical to target-only.

    python benchmarks/draft_ab.py --a draft_window=full --b draft_window=auto --tau 5
    python benchmarks/draft_ab.py --a draft_vocab=full --b draft_vocab=4096 --tau 4 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"draft_ab: expected KEY=VALUE (a specdec.load option), got {pair!r}")
        out[key] = int(value) if value.isdigit() else value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", nargs="*", default=[], metavar="KEY=VALUE", help="load options of engine A")
    ap.add_argument("--b", nargs="*", default=[], metavar="KEY=VALUE", help="load options of engine B")
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--n-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (after one warm-up)")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)

    import specdec
    from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts
    from specdec.runtime.heap import frozen_heap

    prompts = [p.text for p in load_prompts(DEFAULT_PROMPTS)[: args.n_prompts]]
    try:
        engines: dict[str, Any] = {
            "target-only": specdec.load(prompt_lookup=True),  # never drafts below: tau=0
            "A": specdec.load(tau=args.tau, **options(args.a)),
            "B": specdec.load(tau=args.tau, **options(args.b)),
        }
    except specdec.SpecdecError as e:
        raise SystemExit(f"draft_ab: {e}") from None
    names = list(engines)
    seconds = dict.fromkeys(names, 0.0)
    tokens = dict.fromkeys(names, 0)
    accepted = {n: [0, 0] for n in names}
    want: dict[int, list[int]] = {}
    differing = 0
    with frozen_heap():  # no garbage-collector pause inside the timed runs
        for rep in range(args.repeats + 1):  # the first pass warms up and is not counted
            for i, prompt in enumerate(prompts):
                k = (i + rep) % len(names)
                for name in names[k:] + names[:k]:
                    extra = {"tau": 0} if name == "target-only" else {}
                    t0 = time.perf_counter()
                    result = engines[name].generate(
                        prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True, **extra
                    )
                    dt = time.perf_counter() - t0
                    if name == "target-only":
                        want.setdefault(i, result.token_ids)
                    elif i in want and result.token_ids != want[i]:
                        differing += 1
                    if rep:
                        seconds[name] += dt
                        tokens[name] += len(result.token_ids)
                        accepted[name][0] += result.stats.accepted
                        accepted[name][1] += result.stats.drafted
    base = tokens["target-only"] / seconds["target-only"]
    report: dict[str, Any] = {"tau": args.tau, "a": args.a, "b": args.b, "prompts": len(prompts), "rows": []}
    for name in names:
        rate = tokens[name] / seconds[name]
        a, d = accepted[name]
        alpha = a / d if d else None
        report["rows"].append({"engine": name, "tok_s": rate, "x_target_only": rate / base, "alpha": alpha})
        label = {"A": f"A {' '.join(args.a) or '(defaults)'}", "B": f"B {' '.join(args.b) or '(defaults)'}"}
        print(
            f"{label.get(name, name):40s} {rate:8.1f} tok/s  x{rate / base:.3f}"
            + (f"  alpha {alpha:.3f}" if alpha is not None else "")
        )
    report["b_over_a"] = report["rows"][2]["tok_s"] / report["rows"][1]["tok_s"]
    report["differing"] = differing
    print(f"B / A: {report['b_over_a']:.3f}; outputs differing from target-only: {differing}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
