"""``specdec tune``: measure candidate drafts on your prompts and recommend draft, policy and τ."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.bench.prompts import FILE_HELP as PROMPT_FILE_HELP

if TYPE_CHECKING:
    from specdec.engine import Engine
    from specdec.tune import DraftReport


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="measure candidate drafts on your prompts; recommend draft, policy and tau",
        description="Run each candidate draft on the prompts (greedy), measure acceptance by draft position and "
        "the cost ratio c, predict the speedup of every tau, recommend a draft and policy, then measure the "
        "recommendation against target-only and print predicted vs measured.",
    )
    p.add_argument("--target", type=Path, default=None, help="target checkpoint directory (default: the shipped pair)")
    p.add_argument(
        "--draft",
        type=Path,
        action="append",
        default=None,
        help="candidate draft checkpoint directory (repeatable; default: the shipped draft)",
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help=f"{PROMPT_FILE_HELP} (default: the shipped held-out prompts)",
    )
    p.add_argument("--n-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default: 64)")
    p.add_argument("--max-tau", type=int, default=8, help="draft length measured, and the largest tau predicted")
    from specdec.commands.common import (
        add_draft_tokenizer_arg,
        add_draft_vocab_arg,
        add_draft_window_arg,
        add_kv_dtype_arg,
    )

    add_draft_tokenizer_arg(p)
    add_draft_vocab_arg(p)
    add_draft_window_arg(p)
    add_kv_dtype_arg(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--draft-dtype", default=None)
    p.add_argument("--runtime", default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--no-measure", action="store_true", help="skip measuring the recommendation")
    p.add_argument(
        "--save-costs",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="write the best draft's measured costs for `specdec simulate --cost cpu` "
        "(default file: $SPECDEC_COSTS or ~/.cache/specdec/costs.json)",
    )
    p.add_argument(
        "--threads",
        default=None,
        metavar="N",
        help="compute threads to measure with (default: every CPU, as generate and bench run); auto or N: as `specdec "
        "serve --threads` runs (every CPU or N). A server uses a cost file only when it was measured with its own "
        "threads and draft threads",
    )
    p.add_argument(
        "--draft-threads",
        default=None,
        metavar="N",
        help="threads of the lockstep drafts measured, as `specdec serve --draft-threads` (default: every compute thread)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the full report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specdec.api import default_draft, default_target, load
    from specdec.errors import InvalidRequestError
    from specdec.runtime.heap import frozen_heap
    from specdec.simulate.costs import measured_costs_path
    from specdec.tune import (
        load_prompts,
        measure_batched_costs,
        measure_draft,
        measure_recommended,
        model_identity,
        plausible_batched_costs,
        recommend,
        to_json,
    )

    if args.max_tau < 1:
        raise InvalidRequestError(f"--max-tau must be >= 1, got {args.max_tau}", "max_tau")
    if args.max_new_tokens < 2:
        raise InvalidRequestError(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}", "max_new_tokens")
    if args.n_prompts is not None and args.n_prompts < 1:
        raise InvalidRequestError(f"--n-prompts must be >= 1, got {args.n_prompts}", "n_prompts")
    if args.threads is not None or args.draft_threads is not None:
        from specdec.commands.serve import apply_threads

        apply_threads(args.threads, args.draft_threads)
    prompts = load_prompts(args.prompts, args.n_prompts)
    target = args.target or default_target()
    drafts = args.draft or [default_draft()]
    opts = dict(
        device=args.device,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        runtime=args.runtime,
        trust_remote_code=args.trust_remote_code,
        draft_tokenizer=args.draft_tokenizer,
        draft_vocab=args.draft_vocab,
        draft_window=args.draft_window,
        kv_dtype=args.kv_dtype,
    )
    with contextlib.ExitStack() as stack:
        engines: dict[str, Engine] = {}
        reports: list[DraftReport] = []
        print(
            f"tune: {len(prompts)} prompts, {args.max_new_tokens} new tokens each, greedy; measuring at tau={args.max_tau}"
        )
        for d in drafts:
            engine = load(target, d, **opts)
            if not engines:  # torch and the first engine loaded: no collector pause inside the timed steps
                stack.enter_context(frozen_heap())
            engines[str(d)] = engine
            rep = measure_draft(engine, str(d), prompts, args.max_new_tokens, args.max_tau)
            reports.append(rep)
            _print_report(rep)
        rec = recommend(reports)
        settings = ", ".join(f"{k}={v}" for k, v in rec.settings.items())
        print(
            f"\nrecommendation: draft {rec.draft or '(none)'}, policy {rec.policy} ({settings}); "
            f"predicted {rec.predicted_speedup:.2f}x target-only. Why: {rec.why}"
        )
        measured = None
        if rec.draft is not None and not args.no_measure:
            measured = measure_recommended(engines[rec.draft], rec, prompts, args.max_new_tokens)
            print(
                f"measured: {measured['tokens_per_s']:.1f} tok/s vs target-only {measured['target_only_tokens_per_s']:.1f}"
                f" tok/s = {measured['speedup']:.2f}x (predicted {rec.predicted_speedup:.2f}x)"
            )
        if args.save_costs is not None:
            best = max(reports, key=lambda r: r.best_speedup)
            engine = engines[best.draft]
            print(
                "measuring batched passes (1-128 rows over up to 16 sequences) for the cost file ...", file=sys.stderr
            )
            batched, tries, why = plausible_batched_costs(lambda: measure_batched_costs(engine))
            path = Path(args.save_costs) if args.save_costs else measured_costs_path()
            if why is not None:
                print(
                    f"specdec tune: error: batched passes measured implausibly {tries} times ({why}): the machine is "
                    f"busy; {path} not written (run it again on a quiet machine)",
                    file=sys.stderr,
                )
                return 1
            if tries > 1:
                print(f"batched passes: {tries} tries, the machine was busy", file=sys.stderr)
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = {**best.costs, **batched, "name": "cpu", "model": model_identity(engine)}
            path.write_text(json.dumps(doc, indent=1) + "\n")
            rows = batched.get("rows_table") or {}
            if rows:
                one = rows[min(rows)]
                shown = ", ".join(f"{k}: {v / one:.2f}x" for k, v in rows.items())
                print(f"batched passes by rows (vs one): {shown}", file=sys.stderr)
            print(f"wrote measured costs to {path}", file=sys.stderr)
        if args.json is not None:
            args.json.write_text(json.dumps(to_json(reports, rec, measured), indent=1) + "\n")
            print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _print_report(rep: DraftReport) -> None:
    costs = rep.costs
    print(
        f"\ndraft {rep.draft}: α = {rep.acceptance_rate:.2f} (by prompt {min(rep.alpha_by_prompt, default=0):.2f}"
        f"-{max(rep.alpha_by_prompt, default=0):.2f}), c = {rep.c:.3f} (draft {1e3 * costs['draft_per_token_s']:.2f} "
        f"ms/token, verify {1e3 * costs['verify_base_s']:.2f} ms for 1 token)"
    )
    print("  acceptance by position (conditional): " + " ".join(f"{a:.2f}" for a in rep.rates))
    print("  predicted speedup by tau:             " + " ".join(f"{t}:{s:.2f}x" for t, s in rep.predicted.items() if t))
    print(f"  best tau {rep.best_tau}: {rep.best_speedup:.2f}x")
    if rep.calibration:
        print(
            "  P(accept | draft prob):              "
            + " ".join(f"{lo:.1f}+:{p:.2f}(n={n})" for lo, p, n in rep.calibration)
        )
