"""``specdec audit``: check that a speculative configuration's output is exactly the target's."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.bench.prompts import FILE_HELP as PROMPT_FILE_HELP
from specdec.commands.common import (
    ModelSettings,
    add_format_args,
    add_logits_rule_args,
    add_model_args,
    format_kwargs,
    logits_rule_kwargs,
)
from specdec.errors import InvalidRequestError, SpecdecError

if TYPE_CHECKING:
    from specdec.engine import Engine

FALLBACK_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "The quick brown fox",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit",
        help="verify losslessness: speculative output vs target-only decoding",
        description="Greedy (--temperature 0, default): replay prompts with target-only decoding (τ=0) and with the "
        "speculative configuration and compare token by token. Sampling (--temperature > 0): "
        "chi-square test of the first positions' token frequencies over many seeded runs against the "
        "target's exact distributions (false-failure rate ≤ --alpha). Exit status: 0 pass, 1 "
        "divergence, 2 bad input. --batch N serves the speculative runs N at a time through shared steps, as "
        "'specdec serve --max-batch N' does, and still compares each with its solo target-only run.",
    )
    add_model_args(p)
    add_logits_rule_args(p.add_argument_group("logits rules of every replayed request (a trace's carry their own)"))
    add_format_args(p.add_argument_group("output format of every request (a trace's carry their own)"))
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help=f"{PROMPT_FILE_HELP} (default: the shipped held-out prompts)",
    )
    src.add_argument(
        "--trace",
        type=Path,
        nargs="+",
        default=None,
        metavar="TRACE",
        help="replay the requests of a trace (several files as one: a Ray fleet's run.<replica>.jsonl); greedy "
        "requests are checked against the outputs the trace recorded",
    )
    g = p.add_argument_group("audit")
    g.add_argument("--samples", type=int, default=8, help="prompts to replay (default 8)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy comparison (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument(
        "--min-p", type=float, default=0.0, help="keep tokens at least MIN_P times as likely as the likeliest (0 = off)"
    )
    g.add_argument("--max-new-tokens", type=int, default=64, help="greedy: tokens compared per prompt")
    g.add_argument("--runs", type=int, default=400, help="sampling: seeded runs per prompt (default 400)")
    g.add_argument("--positions", type=int, default=2, choices=(1, 2), help="sampling: positions tested")
    g.add_argument("--alpha", type=float, default=1e-3, help="sampling: false-failure rate (default 1e-3)")
    g.add_argument(
        "--batch",
        type=int,
        default=1,
        metavar="N",
        help="serve the speculative runs up to N at a time through shared draft and target passes (continuous "
        "batching: they join mid-flight in a seeded order and leave when done); each greedy output is still "
        "compared with its solo target-only run (default 1: one at a time)",
    )
    g.add_argument(
        "--prefill-in-step",
        type=int,
        default=None,
        metavar="TOKENS",
        help="with --batch: prompt tokens each batched step takes in, at most, as 'specdec serve --prefill-in-step' "
        "(joining prompts prefilled in the passes they share with the batch, a longer one in pieces); 0: every "
        "prompt in a pass of its own (default: 256, the server's)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of the first run, of the prompt sample and of the batched order"
    )
    g.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    output_format = format_kwargs(args).get("response_format")  # files read before the models load
    engine = ModelSettings.from_args(args).load()
    from specdec.audit import audit_greedy, audit_sampling
    from specdec.engine import DEFAULT_PREFILL_IN_STEP

    if args.batch > 1:  # the prompts join the batch as a batching server takes them in
        engine.prefill_in_step = DEFAULT_PREFILL_IN_STEP if args.prefill_in_step is None else args.prefill_in_step

    replay = _prompts(args, engine)
    prompts, recorded, rules = replay.prompts, replay.recorded, replay.rules
    from specdec.logits_rules import LogitsRules
    from specdec.output_format import OutputFormat

    # the rules' flags given, as a request summary says
    asked = LogitsRules(**logits_rule_kwargs(args), output_format=OutputFormat.parse(output_format)).settings()
    if asked and rules is not None:
        raise InvalidRequestError(
            f"--{next(iter(asked)).replace('_', '-')}: a greedy --trace audit replays each request with the rules it "
            "was served with",
            next(iter(asked)),
        )
    if args.temperature == 0:
        # A recorded output is compared over its own length (a stop string may have cut it).
        limit = [len(out) for out in recorded] if recorded is not None else args.max_new_tokens
        result = audit_greedy(
            engine,
            prompts,
            max_new_tokens=limit,
            recorded=recorded,
            batch=args.batch,
            seed=args.seed,
            request_kwargs=rules if rules is not None else [asked] * len(prompts),
        )
        for d in result.divergences:
            d.request = replay.served[d.prompt_index] if replay.served is not None else None
    else:
        n = 3 if args.samples == 8 else args.samples  # the statistical test is costly: fewer prompts by default
        result = audit_sampling(
            engine,
            prompts[:n],
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            runs=args.runs,
            positions=args.positions,
            seed=args.seed,
            alpha=args.alpha,
            batch=args.batch,
            rules=asked,
        )
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        print(result.text(), end="")
    return 0 if result.ok else 1


def _check_args(args: argparse.Namespace) -> None:
    for name in ("samples", "runs", "max_new_tokens", "batch"):
        if getattr(args, name) <= 0:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be a positive integer", name)
    if args.prefill_in_step is not None and args.prefill_in_step < 0:
        raise InvalidRequestError("--prefill-in-step must be >= 0", "prefill_in_step")
    if args.prefill_in_step is not None and args.batch == 1:
        raise InvalidRequestError(
            "--prefill-in-step applies to batched audits: add --batch N (N > 1)", "prefill_in_step"
        )
    if not 0 < args.alpha < 1:
        raise InvalidRequestError("--alpha must be in (0, 1)", "alpha")
    if args.temperature < 0:
        raise InvalidRequestError("--temperature must be >= 0", "temperature")
    if args.batch > 1 and args.trace is not None and args.temperature == 0:
        raise InvalidRequestError(
            "--batch does not apply to a greedy --trace audit: it compares the outputs the trace recorded (served "
            "however the server batched them) and runs no speculative decoding of its own",
            "batch",
        )


@dataclass
class Replay:
    """What an audit replays: prompts and, for a greedy trace, the outputs it recorded, each request's logits rules
    and where it was served (its request id and trace file, named in a divergence)."""

    prompts: list[Any]
    recorded: list[list[int]] | None = None
    rules: list[dict[str, Any]] | None = None
    served: list[str] | None = None


def _prompts(args: argparse.Namespace, engine: Engine) -> Replay:
    """Prompts to replay and, for a greedy trace, the outputs it recorded and each request's logits rules."""
    if args.trace is not None:
        return _trace_prompts(args, engine)
    from specdec.bench.prompts import DEFAULT_PROMPTS, load_prompts  # the prompt files bench and tune read

    path = args.prompts or (DEFAULT_PROMPTS if DEFAULT_PROMPTS.exists() else None)
    if path is None:
        return Replay(FALLBACK_PROMPTS[: args.samples])
    prompts = [p.text for p in load_prompts(path)]
    if len(prompts) > args.samples:
        prompts = random.Random(args.seed).sample(prompts, args.samples)
    return Replay(prompts)


def _trace_prompts(args: argparse.Namespace, engine: Engine) -> Replay:
    from specdec.logits_rules import rules_from_settings
    from specdec.trace import read_trace

    trace = read_trace(args.trace)
    if args.temperature == 0:
        _check_numerics(trace.path, trace.headers, engine)
    done = [(r.summary, r) for r in trace.requests if r.summary is not None and r.summary.prompt_ids]
    if not done:
        raise SpecdecError(
            f"trace {trace.path} records no prompts (written with record_prompts=False or by an "
            "older specdec): use --prompts"
        )
    if args.temperature != 0:
        return Replay([summary.prompt_ids for summary, _ in done[: args.samples]])
    # Replay exactly what was served: greedy requests that ran to a length limit or a stop.
    greedy = [
        (summary, r) for summary, r in done if r.temperature == 0 and summary.stats.finish_reason in ("length", "stop")
    ]
    if not greedy:
        raise SpecdecError(
            f"trace {trace.path} holds no finished greedy requests to compare; pass "
            "--temperature T to test its prompts statistically"
        )
    # Each request is replayed with the logits rules it was served with (penalties, logit_bias, min_tokens, ...).
    replays = [
        (summary.prompt_ids, [t for s in r.steps for t in s.emitted], rules_from_settings(summary.settings or {}), r)
        for summary, r in greedy
    ]
    replays = [replay for replay in replays if replay[1]][: args.samples]
    return Replay(
        prompts=[ids for ids, _, _, _ in replays],
        recorded=[out for _, out, _, _ in replays],
        rules=[rules for _, _, rules, _ in replays],
        served=[f"{r.request_id} in {r.file}" for _, _, _, r in replays],
    )


def _check_numerics(path: str, headers: list[dict[str, Any]], engine: Engine) -> None:
    """A greedy replay is token for token only against a target that computes as the one that served: the same
    dtype, KV cache type, runtime, kernel instruction set and device (``target_numerics`` in the trace's headers;
    older traces do not say). Refuse the audit, naming the difference, rather than report divergences that are
    rounding."""
    from specdec.runtime.base import numerics

    here = numerics(engine.target)
    for header in headers:
        served = (header.get("meta") or {}).get("target_numerics")
        if not isinstance(served, dict):
            continue
        differ = [f"{k} {served.get(k)} (here {here.get(k)})" for k in here if served.get(k, here[k]) != here[k]]
        if differ:
            raise SpecdecError(
                f"trace {path} was served by a target computing otherwise: {', '.join(differ)}; a greedy replay is "
                "exact only with the same numerics: give audit the model options the server had (--dtype, "
                "--kv-dtype, --runtime, --device; SPECDEC_CPU_KERNEL_ISA=avx2 for the AVX2 kernel), or audit where "
                "it was served"
            )
