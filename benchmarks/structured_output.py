"""What an output format (``response_format``) costs, target-only and speculative, side by side in one process.

Greedy requests over a few code prompts, each format with and without speculation (``tau=0`` against the engine's
policy), every configuration once to warm up, then ``--rounds`` rounds with the configurations interleaved (this
machine's memory bandwidth moves by the minute: only figures of one run compare). Free-text requests run with
``ignore_eos`` to their full length; formatted ones end where their format does. Every speculative output is checked
against its target-only one, token for token.

    python benchmarks/structured_output.py                       # the default pair
    python benchmarks/structured_output.py --rounds 10 --max-new-tokens 128 --json formats.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "def load_settings(path):\n    # returns the settings as JSON\n",
    "import json\n\nCONFIG = ",
    "class Item:\n    # serialised as\n",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "size": {"type": "integer"},
    },
    "required": ["name", "tags", "size"],
    "additionalProperties": False,
}
FORMATS: dict[str, dict[str, Any] | None] = {
    "free text": None,
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}},
    "regex": {"type": "regex", "regex": r"[a-z_]+ = [0-9]+(\n[a-z_]+ = [0-9]+)*"},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target checkpoint (default: the shipped pair)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    args = ap.parse_args(argv)

    import specdec

    engine = specdec.load(args.target, args.draft)
    configs = [(name, tau) for name in FORMATS for tau in (0, None)]
    outputs: dict[tuple[str, int | None], list[list[int]]] = {}

    def run(name: str, tau: int | None) -> tuple[int, float]:
        fmt = FORMATS[name]
        tokens, seconds, outs = 0, 0.0, []
        for prompt in PROMPTS:
            kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "tau": tau, "ignore_eos": fmt is None}
            if fmt is not None:
                kwargs["response_format"] = fmt
            t0 = time.perf_counter()
            r = engine.generate(prompt, **kwargs)
            seconds += time.perf_counter() - t0
            tokens += len(r.token_ids)
            outs.append(r.token_ids)
        outputs[(name, tau)] = outs
        return tokens, seconds

    for config in configs:
        run(*config)  # warm-up
    totals = {config: [0, 0.0] for config in configs}
    for _ in range(args.rounds):
        for config in configs:
            t, s = run(*config)
            totals[config][0] += t
            totals[config][1] += s
    rate = {config: t / s for config, (t, s) in totals.items()}
    free = rate[("free text", 0)]
    rows = []
    print(f"{'format':12s} {'target-only':>12s} {'speculative':>12s} {'speedup':>8s} {'vs free':>8s}  identical")
    for name in FORMATS:
        plain, spec = rate[(name, 0)], rate[(name, None)]
        same = outputs[(name, 0)] == outputs[(name, None)]
        rows.append({"format": name, "target_only": plain, "speculative": spec, "identical": same})
        print(f"{name:12s} {plain:12.0f} {spec:12.0f} {spec / plain:7.2f}× {plain / free:7.2f}×  {same}")
    if args.json:
        meta = {"cpu": platform.processor() or platform.machine(), "rounds": args.rounds}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
