"""``specdec generate PROMPT``: one completion, as text (with a stats line) or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Literal

from specdec.commands.common import (
    ModelSettings,
    add_format_args,
    add_logits_rule_args,
    add_model_args,
    format_kwargs,
    logits_rule_kwargs,
)
from specdec.engine import Engine, Generation, Observer, check_request
from specdec.errors import InvalidRequestError
from specdec.policy import request_policy
from specdec.viz import StepRenderer, Style, default_style


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion with speculative decoding",
        description="Generate a completion. With no model options the shipped default pair is used.",
    )
    p.add_argument("prompt", help="prompt text ('-' reads it from standard input)")
    add_model_args(p)
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument(
        "--min-p", type=float, default=0.0, help="keep tokens at least MIN_P times as likely as the likeliest (0 = off)"
    )
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--max-verify-passes", type=int, default=None, help="hard cap on target passes for the request")
    g.add_argument(
        "--n",
        type=int,
        default=1,
        metavar="N",
        help="N independent samples of the prompt, prefilled once and stepped together (with --seed S, sample 0 "
        "is what N=1 gives)",
    )
    add_logits_rule_args(g)
    add_format_args(p.add_argument_group("output format (structured output; one of)"))
    g.add_argument(
        "--prediction",
        type=Path,
        default=None,
        metavar="FILE",
        help="a predicted output: text the output is expected to repeat much of (e.g. the file being edited); steps "
        "draft from it where the output follows it (the same output, fewer target passes)",
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's log probability and its N most likely alternatives",
    )
    o = p.add_argument_group("output")
    o.add_argument("--stream", action="store_true", help="print text as it is verified")
    o.add_argument(
        "--json", action="store_true", help="print one JSON object with text, token_ids, stats (one line per sample)"
    )
    o.add_argument("--trace", default=None, metavar="FILE", help="append a JSONL trace of every step")
    o.add_argument(
        "--show-steps",
        nargs="?",
        const="auto",
        default=None,
        type=_step_style,
        metavar="ansi|plain",
        help="render every step as it happens: accepted, rejected and correction "
        "tokens, τ and the policy's reason (default form: ansi on a terminal, plain otherwise)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.logprobs is not None and not args.json:
        raise InvalidRequestError("--logprobs prints them in the --json output: add --json", "logprobs")
    if args.show_steps and args.json:
        raise InvalidRequestError(
            "--show-steps and --json cannot be combined: --json prints one JSON object", "show_steps"
        )
    prediction = None
    if args.prediction is not None:
        try:
            prediction = args.prediction.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequestError(
                f"--prediction {args.prediction}: cannot read it as text: {e}", "prediction"
            ) from e
    output_format = format_kwargs(args)  # files read and JSON parsed before the models load
    settings: dict[str, Any] = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        max_verify_passes=args.max_verify_passes,
        logprobs=args.logprobs,
    )
    # and the settings that need no model checked: a bad one is its one-line error at once, not after the load
    check_request(**settings)
    request_policy(args.policy, args.tau)
    engine = ModelSettings.from_args(args).load()
    observers: list[Observer] = []
    if args.trace:
        from specdec.runtime.base import target_meta
        from specdec.trace import JsonlTrace

        observers.append(JsonlTrace(args.trace, meta={"command": "generate", **target_meta(engine.target)}))
        engine.observers.extend(observers)
    kwargs = dict(**settings, **logits_rule_kwargs(args), **output_format, prediction=prediction)
    if args.n != 1:
        return _samples(engine, prompt, args, kwargs, observers)
    gen = engine.start(prompt, **kwargs)
    if args.show_steps:
        return _show_steps(gen, engine, args.show_steps, observers)
    try:
        for event in gen:
            if args.stream and not args.json and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    finally:
        _close(observers)
    result = gen.result()
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    if not args.stream:
        sys.stdout.write(result.text)
    s = result.stats
    print()
    print(
        f"[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s | α {s.acceptance_rate:.2f} | mean accepted length "
        f"{s.mean_accepted_length:.2f} (incl. correction token) | {s.target_passes} target passes | "
        f"finish: {s.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _samples(
    engine: Engine, prompt: str, args: argparse.Namespace, kwargs: dict[str, Any], observers: list[Observer]
) -> int:
    """``--n N``: the samples stepped together, then printed one after the other (JSON: one line each)."""
    for flag, on in (("--stream", args.stream), ("--show-steps", args.show_steps)):
        if on:
            raise InvalidRequestError(f"{flag} shows one sample: it cannot be combined with --n {args.n}", "n")
    gens = engine.start_many(prompt, args.n, **kwargs)
    try:
        while not all(g.done for g in gens):
            engine.step(gens)
    finally:
        _close(observers)
    for index, gen in enumerate(gens):
        result = gen.result()
        if args.json:
            print(json.dumps({"index": index, **result.to_json()}))
            continue
        print(f"--- sample {index} ---")
        print(result.text)
        s = result.stats
        print(
            f"[sample {index}: {s.new_tokens} tokens | α {s.acceptance_rate:.2f} | {s.target_passes} target passes | "
            f"finish: {s.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _step_style(value: str) -> str:
    if value not in ("auto", "ansi", "plain"):  # "auto": the const of a bare --show-steps
        raise argparse.ArgumentTypeError(
            f"expected ansi or plain, got {value!r} (put the prompt before --show-steps, or write --show-steps=ansi)"
        )
    return value


def _show_steps(gen: Generation, engine: Engine, style: Style | Literal["auto"], observers: list[Observer]) -> int:
    """Print each step as it is verified, then the output text and a stats footer."""
    renderer = StepRenderer(engine.tokenizer, default_style(sys.stdout) if style == "auto" else style)
    if renderer.legend():
        print(renderer.legend(), flush=True)
    try:
        for event in gen:
            print(renderer.step(event.record), flush=True)
    finally:
        _close(observers)
    result = gen.result()
    print("--- output ---")
    print(result.text)
    print(renderer.footer(result.stats), flush=True)
    return 0


def _close(observers: list[Observer]) -> None:
    for obs in observers:
        close = getattr(obs, "close", None)
        if close:
            close()
