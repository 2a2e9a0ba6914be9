"""``specdec serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.commands.common import ModelSettings, add_model_args
from specdec.engine import DEFAULT_CHAIN_PLAIN, Engine, Observer
from specdec.errors import InvalidRequestError, ModelLoadError, UnsupportedError
from specdec.runtime.cpu import usable_cpus
from specdec.runtime.heap import frozen_heap

if TYPE_CHECKING:
    from specdec.server.settings import ServerSettings
    from specdec.trace import JsonlTrace

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
        "--prefill-in-step",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prompt tokens each batched step takes in, at most: joining prompts are prefilled by the steps, in the "
        "passes they share with the batch (a longer prompt in pieces over several steps), instead of passes of "
        "their own between steps; 0: every prompt in a pass of its own (default: 256 with --max-batch > 1, else 0)",
    )
    g.add_argument(
        "--chain-plain",
        type=int,
        default=None,
        metavar="PASSES",
        help="target passes a plain step chains (greedy or sampled), each pass's token the next one's row, before "
        "the step's commit (the engine's Python between passes paid once per chain; outputs unchanged); 1: one pass a step "
        f"(default: {DEFAULT_CHAIN_PLAIN} with --max-batch > 1, else 1)",
    )
    g.add_argument(
        "--prefix-cache",
        default="auto",
        metavar="MIB|auto|off",
        help="keep finished requests' keys and values by token prefix, so a prompt that begins as an earlier "
        "request's context did (a system prompt, a conversation's earlier turns) copies them instead of computing "
        "them; outputs never change (CPU kernel only). MiB per model, auto (512 where the models run on the CPU "
        "kernel, else off) or off (default: auto)",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="TOKENS",
        help="tokens a streamed choice gathers before its text is sent (its first text and its last go at once; "
        "steps with logprobs or per-step records are each sent): fewer, larger chunks under load, a less smooth "
        "stream (default: 1, every step's text as it is verified)",
    )
    g.add_argument(
        "--stream-interval-ms",
        type=float,
        default=20.0,
        metavar="MS",
        help="milliseconds a streamed choice's text waits after its last chunk before the next is sent (its first "
        "text and its last go at once): at most one chunk per MS a choice, however fast the steps are, so a client "
        "parses fewer chunks; steps slower than MS are each sent as before (default: 20; 0: every step's text)",
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
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the Jinja chat template /v1/chat/completions renders conversations with (a file, or the template "
        "itself), in place of the tokenizer's; a model without one (a base model, the shipped default pair) "
        "answers chat requests only with it",
    )
    g.add_argument("--trace", default=None, metavar="FILE", help="append a JSONL trace of every step and request")
    g.add_argument(
        "--costs",
        default=None,
        metavar="FILE",
        help="measured pass costs (specdec tune --save-costs) the adaptive policy starts its batch cost curves "
        "from, used only when measured on the served models (default: $SPECDEC_COSTS or "
        "~/.cache/specdec/costs.json when it matches, else measured at startup, about a second, again while a busy "
        "machine makes them implausible); "
        "'none': learn from steps alone",
    )
    g.add_argument(
        "--threads",
        default=None,
        metavar="N",
        help="compute threads of the model passes; auto (default): every CPU this process may use (docs/server.md). "
        "With --ray each replica uses its --replica-cpus",
    )
    g.add_argument(
        "--draft-threads",
        default=None,
        metavar="N",
        help="threads of a step's lockstep draft, at most --threads (default: every compute thread; 1 leaves the "
        "other cores to the event loop while it streams the step before: docs/server.md, Compute threads)",
    )
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    r = p.add_argument_group("ray (scale out over replicas; needs pip install 'specdec[ray]'; see docs/scaling.md)")
    r.add_argument(
        "--ray",
        action="store_true",
        help="serve through Ray Serve, one engine per replica, on a local Ray instance (unless --ray-address)",
    )
    r.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="deploy on an existing Ray cluster (HOST:PORT of its head, or 'auto'); implies --ray",
    )
    r.add_argument(
        "--replicas", type=int, default=None, help="engine replicas (default: 1; initial count when autoscaling)"
    )
    r.add_argument("--replica-cpus", type=float, default=None, help="CPUs Ray reserves per replica (default: 1)")
    r.add_argument(
        "--replica-gpus",
        type=float,
        default=None,
        help="GPUs Ray reserves per replica (default: 1 with --device cuda, else 0)",
    )
    r.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default: 1)")
    r.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas (turns autoscaling on)")
    r.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling: requests per replica Serve aims for (default: Serve's, 2)",
    )
    r.add_argument(
        "--ray-retries",
        type=int,
        default=None,
        help="times a request is sent to another replica when its replica dies before answering (default: 2)",
    )
    p.set_defaults(func=run)


_RAY_ONLY = (
    "replicas",
    "replica_cpus",
    "replica_gpus",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "ray_retries",
)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from specdec.server import ServerSettings, create_app
    from specdec.server.requests import read_chat_template

    if not 0 <= args.port <= 65535:
        raise InvalidRequestError(f"--port must be in 0..65535, got {args.port}", "port")
    settings = ServerSettings(
        model_name=args.model_name or _default_name(args.target),
        api_key=args.api_key or None,
        max_active=args.max_active,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prefill_in_step=args.prefill_in_step,
        chain_plain=args.chain_plain,
        request_timeout=args.request_timeout,
        stream_interval=args.stream_interval,
        stream_interval_ms=args.stream_interval_ms,
        max_body_bytes=args.max_body_bytes,
        # replicas (--ray) run elsewhere: a cost file by its absolute path
        costs=args.costs if args.costs in (None, "none") else str(Path(args.costs).expanduser().resolve()),
        # replicas (--ray) render with the text, not a path of this machine
        chat_template=read_chat_template(args.chat_template) if args.chat_template is not None else None,
    )
    if args.ray or args.ray_address:
        for name in ("threads", "draft_threads"):
            if getattr(args, name) is not None:
                flag = f"--{name.replace('_', '-')}"
                raise InvalidRequestError(f"{flag}: with --ray each replica computes on its --replica-cpus", name)
        return run_ray(args, settings)
    given = [f"--{name.replace('_', '-')}" for name in _RAY_ONLY if getattr(args, name) is not None]
    if given:
        raise InvalidRequestError(f"{', '.join(given)}: only with --ray (or --ray-address)", given[0])
    threads = apply_threads(args.threads, args.draft_threads)
    engine = ModelSettings.from_args(args).load()
    # create_app checks the chat template too; checked here, a bad one stops the server before its costs are measured
    if settings.chat_template is not None:
        from specdec.server.requests import check_chat_template

        check_chat_template(engine.tokenizer, settings.chat_template)
    from specdec.tune import prime_for_serving

    print(f"specdec: {prime_for_serving(engine, settings)}", file=sys.stderr)
    observers: list[Observer] = []
    if args.trace:
        observers.append(serve_trace(args.trace, engine, settings))
    app = create_app(engine, settings)
    if args.host not in LOOPBACK and not settings.api_key:
        print(
            f"specdec: warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    drafter = engine.drafter.name if engine.drafter is not None else "none (plain target decoding)"
    print(
        f"specdec: serving {settings.model_name!r} (drafter: {drafter}, policy: {engine.policy.name}, "
        f"{threads} compute thread{'s' if threads != 1 else ''} of {usable_cpus()} CPUs) on "
        f"http://{args.host}:{args.port} (OpenAI API under /v1)",
        file=sys.stderr,
        flush=True,
    )
    # Loaded: the heap (torch, the models, the engine) out of the garbage collector's scans while serving, or every
    # full collection stops the worker for ~100-200 ms (``specdec.runtime.heap``).
    try:
        with frozen_heap():
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        for obs in observers:
            close = getattr(obs, "close", None)
            if close:
                close()
    return 0


def serve_trace(path: str | Path, engine: Engine, settings: ServerSettings, **meta: Any) -> JsonlTrace:
    """The trace a server writes (``--trace``), attached to ``engine``: its header names the model, the drafter, the
    policy and the target's numerics (what ``specdec audit --trace`` must match to replay it), and ``meta``."""
    from specdec.runtime.base import target_meta
    from specdec.trace import JsonlTrace

    draft_runner = getattr(engine.drafter, "runner", None)
    header = {
        "command": "serve",
        "model_name": settings.model_name,
        **target_meta(engine.target),
        "drafter": engine.drafter.name if engine.drafter is not None else None,
        "draft": draft_runner.name if draft_runner is not None else None,
        "policy": engine.policy.name,
        **meta,
    }
    trace = JsonlTrace(path, meta=header)
    engine.observers.append(trace)
    return trace


def replica_trace_path(path: str | Path, replica: str) -> Path:
    """Where one replica of ``specdec serve --ray --trace run.jsonl`` writes: ``run.<replica>.jsonl`` beside it."""
    p = Path(path)
    return p.with_name(f"{p.stem}.{replica}{p.suffix or '.jsonl'}")


def serve_threads(value: str) -> int:
    """``--threads``: a count, or auto = every CPU this process may use.

    The model's passes run on a team of threads that meet at barriers many times per pass, beside the HTTP server's
    event loop. Once the thread that loads the models lets its own team go (``release_thread_team``), a pass on every
    core beat one that left a core to the event loop at every load (2 cores: 1.20x the tokens at 1 client, 1.03-1.07x
    at 16-32; docs/server.md, "Compute threads")."""
    if value.strip().lower() == "auto":
        return usable_cpus()
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidRequestError(f"--threads must be a positive integer or auto, got {value!r}", "threads")
    return n


def apply_threads(value: str | None, draft: str | None = None) -> int:
    """Set this process's compute threads as ``--threads`` says (None: auto) and a step's lockstep draft's as
    ``--draft-threads`` says (None: every compute thread; ``native_kernel.set_draft_threads``); return the compute
    threads' count.

    A server's event loop streams the step before while the draft runs; on 2 cores a draft on one thread (the other core
    left to the event loop) served less than one on both (docs/server.md, "Compute threads"), so every compute thread is
    the default and fewer a setting."""
    import torch

    from specdec.runtime.native_kernel import set_draft_threads

    threads = serve_threads(value or "auto")
    drafting = None
    if draft is not None:
        try:
            drafting = int(draft)
        except ValueError:
            drafting = 0
        if not 1 <= drafting <= threads:
            raise InvalidRequestError(
                f"--draft-threads must be an integer from 1 to the compute threads ({threads}), got {draft!r}",
                "draft_threads",
            )
    torch.set_num_threads(threads)
    set_draft_threads(drafting)
    return threads


def run_ray(args: argparse.Namespace, settings: ServerSettings) -> int:
    """``specdec serve --ray``: the same API from Ray Serve replicas, each loading its own engine."""
    model = ModelSettings.from_args(args)
    # Replicas are other processes (other machines, with --ray-address): give them absolute paths.
    model.target = model.target.resolve() if model.target is not None else None
    model.draft = model.draft.resolve() if model.draft is not None else None
    local = args.ray_address is None
    if local:
        for flag, path in (("--target", model.target), ("--draft", model.draft)):
            if path is not None and not Path(path).is_dir():
                raise ModelLoadError(f"{flag} {path}: no such directory")
        if args.host in LOOPBACK:
            # A local instance for a loopback server: Ray's own processes listen and talk on 127.0.0.1 only
            # (on Linux this switch makes Ray take the loopback address as the node's address).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if settings.chat_template is not None:  # refused here, before the replicas start, where the tokenizer is at hand
        from specdec.api import default_target, load_tokenizer
        from specdec.server.requests import check_chat_template

        target = model.target if model.target is not None else default_target()
        if Path(target).is_dir():
            check_chat_template(load_tokenizer(target), settings.chat_template)
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        raise UnsupportedError("--ray needs Ray Serve, which is not installed: pip install 'specdec[ray]'") from None
    from specdec.server.ray_serve import RaySettings, run_forever

    gpus = args.replica_gpus if args.replica_gpus is not None else (1.0 if args.device.startswith("cuda") else 0.0)
    ray_settings = RaySettings(
        replicas=args.replicas if args.replicas is not None else 1,
        num_cpus=args.replica_cpus if args.replica_cpus is not None else 1.0,
        num_gpus=gpus,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        retries=args.ray_retries if args.ray_retries is not None else 2,
    )
    if args.host not in LOOPBACK and not settings.api_key:
        print(
            f"specdec: warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    autoscaling = ray_settings.autoscaling_config()
    scaling = (
        f"{ray_settings.replicas} replicas"
        if autoscaling is None
        else f"{autoscaling['min_replicas']}..{autoscaling['max_replicas']} replicas (autoscaling)"
    )

    # Each replica appends its own trace beside --trace's path (the replicas' node: a shared folder with --ray-address).
    trace = str(Path(args.trace).expanduser().resolve()) if args.trace else None

    def ready(url: str) -> None:
        print(
            f"specdec: serving {settings.model_name!r} on Ray Serve ({scaling}, each {ray_settings.num_cpus:g} CPU "
            f"{ray_settings.num_gpus:g} GPU; policy {model.policy}) at {url} (OpenAI API under /v1)",
            file=sys.stderr,
            flush=True,
        )
        if trace:
            print(
                f"specdec: each replica traces to {replica_trace_path(trace, '<replica>')} (one trace: "
                f"specdec audit --trace {replica_trace_path(trace, '*')})",
                file=sys.stderr,
                flush=True,
            )

    run_forever(
        model, settings, ray_settings, args.ray_address, args.host, args.port, args.log_level, ready, trace=trace
    )
    return 0


def _default_name(target: Path | None) -> str:
    return target.resolve().name if target is not None else "specdec-default"
