"""``specdec serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdec.commands.common import ModelSettings, add_model_args
from specdec.engine import Observer
from specdec.errors import InvalidRequestError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
        "With no model options the shipped default pair is used. See docs/server.md.",
    )
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument(
        "--model-name",
        default=None,
        help="the model id clients send (default: the target directory's name, or 'specdec-default')",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDEC_API_KEY, else none)",
    )
    g.add_argument(
        "--max-active", type=int, default=16, help="requests in flight at once, each with a cache slot (default: 16)"
    )
    g.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="requests sharing each step's draft and target passes (continuous batching; the CPU kernel "
        "batches, other runtimes run one pass per request); 1: one request per pass, round-robin (default: 16)",
    )
    g.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting beyond those; more get 429 (default: 64)"
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take from arrival, then it is cancelled with 408 (default: 600)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=2 * 1024 * 1024,
        help="largest request body accepted, else 413 (default: 2 MiB)",
    )
    g.add_argument("--trace", default=None, metavar="FILE", help="append a JSONL trace of every step and request")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from specdec.server import ServerSettings, create_app

    if not 0 <= args.port <= 65535:
        raise InvalidRequestError(f"--port must be in 0..65535, got {args.port}", "port")
    settings = ServerSettings(
        model_name=args.model_name or _default_name(args.target),
        api_key=args.api_key or None,
        max_active=args.max_active,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
    )
    engine = ModelSettings.from_args(args).load()
    observers: list[Observer] = []
    if args.trace:
        from specdec.trace import JsonlTrace

        draft_runner = getattr(engine.drafter, "runner", None)
        meta = {
            "command": "serve",
            "model_name": settings.model_name,
            "target": engine.target.name,
            "drafter": engine.drafter.name if engine.drafter is not None else None,
            "draft": draft_runner.name if draft_runner is not None else None,
            "policy": engine.policy.name,
        }
        observers.append(JsonlTrace(args.trace, meta=meta))
        engine.observers.extend(observers)
    app = create_app(engine, settings)
    if args.host not in LOOPBACK and not settings.api_key:
        print(
            f"specdec: warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    drafter = engine.drafter.name if engine.drafter is not None else "none (plain target decoding)"
    print(
        f"specdec: serving {settings.model_name!r} (drafter: {drafter}, policy: {engine.policy.name}) on "
        f"http://{args.host}:{args.port} (OpenAI API under /v1)",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        for obs in observers:
            close = getattr(obs, "close", None)
            if close:
                close()
    return 0


def _default_name(target: Path | None) -> str:
    return target.resolve().name if target is not None else "specdec-default"
