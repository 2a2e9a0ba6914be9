"""The OpenAI-compatible API on Ray Serve: one engine per replica, any number of replicas, one endpoint.

Three deployments make one Serve application (``build_app``)::

    HTTP ─► Serve proxy ─► SpecdecIngress ──(DeploymentHandle, streamed)──► SpecdecReplica × N
                              │  auth, body limit, retry, error events        create_app(engine): the whole API
                              └─ /metrics ◄── SpecdecMetrics ◄── every replica pushes its registry

- ``SpecdecReplica`` holds its own engine (target, draft, policy) and runs the same FastAPI app as
  ``specdec serve`` (``create_app``); the ingress hands it each HTTP request as ASGI messages and relays
  the answer as the replica sends it (streams stay streams), so every route, error and stream format is the
  single-process one.
- ``SpecdecIngress`` is the HTTP entry point (``@serve.ingress``). It owns what a single process cannot:
  a replica that dies before anything reached the client is retried on another replica (generation has no
  side effects); one that dies mid-stream ends the stream with an OpenAI-shaped ``error`` event and
  ``[DONE]``, never a silent truncation; a response that cannot be completed otherwise is aborted so the
  client sees a broken connection rather than a short body.
- ``SpecdecMetrics`` keeps the last Prometheus exposition each replica (and ingress) pushed and serves the
  fleet on ``/metrics`` with a ``replica`` label on every sample; and each replica's ``/health`` (pushed
  every ``HEALTH_INTERVAL_S``), which the ingress serves as the fleet's ``/health`` (``fleet_health``).

Start it with ``specdec serve --ray`` (see docs/scaling.md) or compose it yourself::

    from ray import serve
    from specdec.server import ServerSettings
    from specdec.server.ray_serve import RaySettings, build_app

    serve.run(build_app(settings=ServerSettings(model_name="mine"), ray_settings=RaySettings(replicas=2)))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

try:
    import ray
    from ray import serve
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
except ImportError as e:  # pragma: no cover - exercised by the CLI's own check
    raise ImportError("specdec.server.ray_serve needs Ray Serve: pip install 'specdec[ray]'") from e

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

from specdec.commands.common import ModelSettings
from specdec.engine import Engine
from specdec.errors import InvalidRequestError
from specdec.retry_after import retry_headers
from specdec.runtime.heap import freeze_heap
from specdec.server.errors import APIError
from specdec.server.guard import Guard
from specdec.server.settings import ServerSettings

log = logging.getLogger("ray.serve")  # Serve routes it to the replica logs (and the driver)

REPLICA_HEADER = "x-specdec-replica"  # which replica answered: its Serve replica id
HEALTH_INTERVAL_S = 0.5  # seconds between a replica's /health pushes (its load, for the fleet's /health)
# what each replica counts on its own: the fleet's /health adds them up (the rest of a replica's /health is its setup)
FLEET_COUNTS = ("active", "queued", "completed", "failed", "cancelled", "rejected")
APP_NAME = "specdec"
_LOST = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)


@dataclass
class RaySettings:
    """How the application is laid out on Ray (the ``specdec serve --ray`` flags)."""

    replicas: int = 1  # engine replicas (the initial count when autoscaling)
    num_cpus: float = 1.0  # CPUs Ray reserves for each replica
    num_gpus: float = 0.0  # GPUs Ray reserves for each replica (1 for --device cuda)
    min_replicas: int | None = None  # autoscaling lower bound (default: 1 when max_replicas is set)
    max_replicas: int | None = None  # autoscaling on when set
    target_ongoing_requests: float | None = None  # autoscaling target per replica (default: Serve's, 2)
    retries: int = 2  # times a request that sent nothing yet is retried after its replica died
    metrics_interval: float = 2.0  # seconds between a replica's metric pushes
    ingress_replicas: int = 1
    app_name: str = APP_NAME
    route_prefix: str = "/"

    def __post_init__(self) -> None:
        checks = {
            "replicas": self.replicas >= 1,
            "num_cpus": self.num_cpus >= 0,
            "num_gpus": self.num_gpus >= 0,
            "retries": self.retries >= 0,
            "metrics_interval": self.metrics_interval > 0,
            "ingress_replicas": self.ingress_replicas >= 1,
            "app_name": bool(self.app_name),
            "route_prefix": self.route_prefix.startswith("/"),
        }
        if self.target_ongoing_requests is not None:
            checks["target_ongoing_requests"] = self.target_ongoing_requests > 0
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(f"invalid Ray setting {name}={getattr(self, name)!r}", name)
        if self.max_replicas is None:
            if self.min_replicas is not None or self.target_ongoing_requests is not None:
                raise InvalidRequestError(
                    "min_replicas and target_ongoing_requests need max_replicas (autoscaling)", "max_replicas"
                )
            return
        low = 1 if self.min_replicas is None else self.min_replicas
        if not 0 <= low <= self.replicas <= self.max_replicas:
            raise InvalidRequestError(
                f"autoscaling needs 0 <= min_replicas ({low}) <= replicas ({self.replicas}) "
                f"<= max_replicas ({self.max_replicas})",
                "max_replicas",
            )
        if self.max_replicas < 1:
            raise InvalidRequestError(f"max_replicas must be >= 1, got {self.max_replicas}", "max_replicas")

    def autoscaling_config(self) -> dict[str, Any] | None:
        if self.max_replicas is None:
            return None
        cfg: dict[str, Any] = {
            "min_replicas": 1 if self.min_replicas is None else self.min_replicas,
            "initial_replicas": self.replicas,
            "max_replicas": self.max_replicas,
        }
        if self.target_ongoing_requests is not None:
            cfg["target_ongoing_requests"] = self.target_ongoing_requests
        return cfg


ModelSpec = ModelSettings | Callable[[], Engine] | None


def default_model_settings() -> ModelSettings:
    """The model options of a bare ``specdec serve``: the shipped default pair."""
    return ModelSettings(
        target=None,
        draft=None,
        prompt_lookup=False,
        no_draft=False,
        device="cpu",
        dtype="auto",
        draft_dtype=None,
        runtime="auto",
        policy="fixed",
        tau=4,
        trust_remote_code=False,
        prefix_cache="auto",
    )


def build_app(
    model: ModelSpec = None,
    settings: ServerSettings | None = None,
    ray_settings: RaySettings | None = None,
    trace: str | None = None,
) -> serve.Application:
    """The Serve application: run it with ``serve.run(build_app(...))``.

    ``model`` is what each replica loads: ``ModelSettings`` (the CLI's model options; paths must exist on
    every node), a function returning an ``Engine`` (called once in each replica), or None for the
    shipped default pair. ``trace``: a JSONL trace path; each replica appends to its own file beside it,
    ``run.jsonl`` → ``run.<replica id>.jsonl`` (on the replica's node), which ``specdec audit --trace`` and
    ``specdec diagnose`` read together.
    """
    settings = settings or ServerSettings()
    rs = ray_settings or RaySettings()
    model = model if model is not None else default_model_settings()
    hub = SpecdecMetrics.options(
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        logging_config={"enable_access_log": False},  # its calls are the replicas' pushes, every few seconds
    ).bind(3 * rs.metrics_interval + 5)
    per_replica = settings.max_active + settings.max_queue + 1  # past that the replica's own 429 answers
    scaling: dict[str, Any] = (
        {"autoscaling_config": rs.autoscaling_config()}
        if rs.max_replicas is not None
        else {"num_replicas": rs.replicas}
    )
    replicas = SpecdecReplica.options(
        ray_actor_options={"num_cpus": rs.num_cpus, "num_gpus": rs.num_gpus},
        max_ongoing_requests=per_replica,
        **scaling,
    ).bind(model, settings, hub, rs.metrics_interval, trace)
    ceiling = rs.max_replicas if rs.max_replicas is not None else rs.replicas
    return SpecdecIngress.options(
        num_replicas=rs.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(100, 2 * per_replica * ceiling),
    ).bind(replicas, hub, settings, rs.retries, rs.metrics_interval)


# -- metrics -----------------------------------------------------------------------------------------


def merge_expositions(snapshots: dict[str, str], label: str = "replica") -> bytes:
    """Prometheus text expositions of several processes as one, each sample labelled ``label=<source>``."""
    families: dict[str, Metric] = {}
    for source, text in sorted(snapshots.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            elif merged.type != family.type:
                log.warning(
                    "metric %s is a %s on %s but a %s elsewhere: skipped", family.name, family.type, source, merged.type
                )
                continue
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={label: source, **sample.labels}))

    class Fleet:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fleet())  # type: ignore[arg-type]
    return generate_latest(registry)


class _MetricsHub:
    """The last exposition each replica pushed; ``render`` merges those not older than ``stale_after`` s. And the last
    ``/health`` each replica pushed; ``health`` gives those not older than ``health_stale_after`` s."""

    def __init__(self, stale_after: float, health_stale_after: float = 4 * HEALTH_INTERVAL_S + 1) -> None:
        self.stale_after = stale_after
        self.health_stale_after = health_stale_after
        self.snapshots: dict[str, tuple[float, str]] = {}
        self.healths: dict[str, tuple[float, dict[str, Any]]] = {}

    def push(self, source: str, text: str) -> None:
        self.snapshots[source] = (time.monotonic(), text)

    def push_health(self, source: str, health: dict[str, Any]) -> None:
        self.healths[source] = (time.monotonic(), health)

    def drop(self, source: str) -> None:
        self.snapshots.pop(source, None)
        self.healths.pop(source, None)

    def health(self) -> dict[str, dict[str, Any]]:
        """Each live replica's last ``/health``, with ``age_s``: how old it is."""
        now = time.monotonic()
        for source, (at, _) in list(self.healths.items()):
            if now - at > self.health_stale_after:  # a replica that died or hangs
                del self.healths[source]
        return {s: {**h, "age_s": now - at} for s, (at, h) in self.healths.items()}

    def render(self) -> bytes:
        now = time.monotonic()
        for source, (at, _) in list(self.snapshots.items()):
            if now - at > self.stale_after:  # a replica that died: its series end, as Prometheus expects
                del self.snapshots[source]
        fleet = merge_expositions({s: text for s, (_, text) in self.snapshots.items()})
        ages = {s: now - at for s, (at, _) in self.snapshots.items()}
        lines = [
            "# HELP specdec_fleet_sources Processes (replicas, ingresses) whose metrics this exposition holds.",
            "# TYPE specdec_fleet_sources gauge",
            f"specdec_fleet_sources {len(ages)}",
            "# HELP specdec_fleet_snapshot_age_seconds How old each process's last pushed metrics are.",
            "# TYPE specdec_fleet_snapshot_age_seconds gauge",
            *(f'specdec_fleet_snapshot_age_seconds{{replica="{s}"}} {age:.3f}' for s, age in sorted(ages.items())),
        ]
        return fleet + ("\n".join(lines) + "\n").encode()


def fleet_health(replicas: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The fleet's ``/health`` from each live replica's own (``_MetricsHub.health``; None when none reports): the
    setup fields of the latest (model, drafter, runtime, ``max_batch`` ... are per replica and alike), the
    ``FLEET_COUNTS`` summed over the replicas reporting now, their count, and each one's counts and age."""
    if not replicas:
        return None
    latest = min(replicas.values(), key=lambda h: float(h.get("age_s", 0.0)))
    setup = {k: v for k, v in latest.items() if k not in (*FLEET_COUNTS, "status", "age_s")}
    return {
        "status": "ok",
        **setup,
        **{k: sum(int(h.get(k, 0)) for h in replicas.values()) for k in FLEET_COUNTS},
        "replicas": len(replicas),
        "per_replica": {
            rid: {**{k: h.get(k, 0) for k in FLEET_COUNTS}, "age_s": round(float(h.get("age_s", 0.0)), 3)}
            for rid, h in sorted(replicas.items())
        },
    }


async def _push_forever(
    hub: DeploymentHandle, source: str, interval: float, render: Callable[[], Any], method: str = "push"
) -> None:
    """Push ``await render()`` to the hub (its ``method``) every ``interval`` seconds until cancelled."""
    while True:
        try:
            await getattr(hub, method).remote(source, await render())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the hub restarting: the next push lands on its replacement
            log.warning("metrics push from %s failed: %s", source, e)
        await asyncio.sleep(interval)


# -- engine replicas -----------------------------------------------------------------------------------


class _EngineReplica:
    """One engine and the single-process API around it, driven over ASGI by the ingress."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        model: ModelSpec,
        settings: ServerSettings,
        hub: DeploymentHandle,
        metrics_interval: float,
        trace: str | None = None,
    ) -> None:
        from specdec.commands.serve import replica_trace_path, serve_trace
        from specdec.server.app import create_app

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        threads = replica_threads()
        if callable(model) and not isinstance(model, ModelSettings):
            engine = model()
        else:
            engine = (model or default_model_settings()).load()
        # The batch plans' costs as --costs says: a file, else measured now (~1 s; again, after a random pause, while
        # replicas starting beside it make them implausible).
        if not engine.measured_costs:
            from specdec.tune import prime_for_serving

            log.info("replica %s: %s", self.replica_id, prime_for_serving(engine, settings))
        self.trace = None
        if trace is not None:
            path = replica_trace_path(trace, self.replica_id)
            self.trace = serve_trace(path, engine, settings, replica=self.replica_id)
            log.info("replica %s traces to %s", self.replica_id, path)
        self.app = create_app(engine, settings)
        freeze_heap()  # loaded: the heap out of the collector's scans (``specdec.runtime.heap``)
        self.hub = hub
        loop = asyncio.get_running_loop()
        self._pushers = [
            loop.create_task(_push_forever(hub, self.replica_id, metrics_interval, self._metrics)),
            loop.create_task(
                _push_forever(hub, self.replica_id, HEALTH_INTERVAL_S, self._health, method="push_health")
            ),
        ]
        log.info("replica %s serving %r with %d torch threads", self.replica_id, settings.model_name, threads)

    async def _get(self, path: str) -> bytes:
        messages = [m async for batch in self.asgi(_internal_get(path), b"") for m in batch]
        return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")

    async def _metrics(self) -> str:
        return (await self._get("/metrics")).decode()

    async def _health(self) -> dict[str, Any]:
        health: dict[str, Any] = json.loads(await self._get("/health"))
        return health

    async def asgi(self, request: dict[str, Any], body: bytes) -> AsyncIterator[list[Message]]:
        """Run one HTTP request through the app; yield its ASGI send messages as they come, in batches of
        those already sent (a whole JSON response, start and body, travels as one object)."""
        out: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()  # the caller stopped listening: the app sees a disconnect
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                message = {**message, "headers": headers}
            out.put_nowait(message)

        async def run() -> None:
            try:
                await self.app(_scope(request), receive, send)
            finally:
                out.put_nowait(None)

        task = asyncio.get_running_loop().create_task(run())
        try:
            ended = False
            while not ended:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                ended = batch[-1] is None
                messages = [m for m in batch if m is not None]
                if messages:
                    yield messages
            await task  # an exception the app let out reaches the ingress
        finally:
            if not task.done():  # cancelled: the client went away; the app frees the request
                gone.set()
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5)
                except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    task.cancel()

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose scheduler thread died is replaced."""
        thread = getattr(self.app.state.scheduler, "_thread", None)
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the scheduler's worker thread has died")

    async def __del__(self) -> None:
        for pusher in self._pushers:
            pusher.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.hub.drop.remote(self.replica_id), 2)
        self.app.state.scheduler.stop()
        if self.trace is not None:
            self.trace.close()


def replica_threads() -> int:
    """Set this process's torch threads to the CPUs Ray reserved for it (at least 1) and return the count.

    Ray exports OMP_NUM_THREADS for the reservation, but only if unset and only when the worker starts its
    task; setting torch's pool here makes ``num_cpus`` mean the replica's compute threads, always (its drafts on
    every one of them, as ``specdec serve --threads``: ``apply_threads``).
    """
    from specdec.commands.serve import apply_threads

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU") or 1.0
    return apply_threads(str(max(1, int(cpus))))


def _internal_get(path: str) -> dict[str, Any]:
    return {"method": "GET", "path": path, "headers": [], "query_string": b""}


def _scope(request: dict[str, Any]) -> dict[str, Any]:
    path = request["path"]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": request.get("http_version", "1.1"),
        "method": request["method"],
        "scheme": request.get("scheme", "http"),
        "path": path,
        "raw_path": request.get("raw_path", path.encode()),
        "root_path": request.get("root_path", ""),
        "query_string": request.get("query_string", b""),
        "headers": [(bytes(k), bytes(v)) for k, v in request.get("headers", [])],
        "client": request.get("client"),
        "server": request.get("server"),
        "state": {},
    }


def _portable(scope: Scope) -> dict[str, Any]:
    """What of an ASGI scope travels to a replica (plain, picklable values)."""
    keys = ("http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string", "client", "server")
    out = {k: scope[k] for k in keys if k in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    return out


# -- ingress ----------------------------------------------------------------------------------------------


class _Relay:
    """Passes a replica's response on to the client; knows whether anything reached the client yet."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.start: dict[str, Any] | None = None  # held until the first body bytes, so a retry stays possible
        self.started = False
        self.complete = False
        self.sse = False
        self.bytes_sent = 0

    async def pass_on(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.start = message
            headers = {bytes(k).lower(): bytes(v) for k, v in message.get("headers", [])}
            self.sse = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            return
        if kind != "http.response.body" or self.complete:
            return
        if not self.started:
            assert self.start is not None, "a response body before its start"
            await self.send(self.start)
            self.started = True
        body = message.get("body", b"")
        self.bytes_sent += len(body)
        await self.send(message)
        self.complete = not message.get("more_body", False)

    async def fail(self, error: APIError) -> None:
        """End the response as well as what was already sent allows."""
        if not self.started:
            payload = json.dumps(error.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
            await self.send({"type": "http.response.start", "status": error.status, "headers": headers})
            await self.send({"type": "http.response.body", "body": payload, "more_body": False})
        elif self.sse:
            event = b"data: " + json.dumps(error.body()).encode() + b"\n\ndata: [DONE]\n\n"
            await self.send({"type": "http.response.body", "body": event, "more_body": False})
        else:  # part of a plain body went out: a short body must not look whole, so break the connection
            raise RuntimeError(f"response aborted after {self.bytes_sent} bytes: {error.message}")
        self.complete = True


class _Forwarder:
    """The ingress's ASGI app (behind ``Guard``): /metrics from the hub, everything else to a replica."""

    def __init__(self, ingress: _Ingress) -> None:
        self.ingress = ingress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1003})
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            try:
                body = await self.ingress.hub.render.remote()
            except Exception as e:  # the hub is being replaced: say so rather than serve a partial fleet
                await _Relay(send).fail(
                    APIError(503, f"fleet metrics unavailable ({_kind(e)}): retry", None, "metrics_unavailable")
                )
                return
            await _send_ok(send, body, CONTENT_TYPE_LATEST, head=scope["method"] == "HEAD")
            return
        if scope["path"] == "/health" and scope["method"] in ("GET", "HEAD"):
            await self._health(send, head=scope["method"] == "HEAD")
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await self.ingress.forward(_portable(scope), b"".join(chunks), send)

    async def _health(self, send: Send, head: bool) -> None:
        """The fleet's ``/health``: every live replica's load added up, each one's beside it (``fleet_health``)."""
        try:
            fleet = fleet_health(await self.ingress.hub.health.remote())
        except Exception as e:  # the hub is being replaced
            fleet, why = None, f"fleet health unavailable ({_kind(e)}): retry"
        else:
            why = "no replica has reported in the last few seconds: the replicas are starting or being replaced; retry"
        if fleet is None:
            await _Relay(send).fail(APIError(503, why, None, "no_replicas", headers=retry_headers(1.0)))
            return
        await _send_ok(send, json.dumps(fleet).encode(), "application/json", head)


class _Ingress:
    """The HTTP entry point: auth and body limits at the edge, replica failures made explicit."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self,
        replicas: DeploymentHandle,
        hub: DeploymentHandle,
        settings: ServerSettings,
        retries: int,
        metrics_interval: float,
    ) -> None:
        self.replicas = replicas
        self.hub = hub
        self.settings = settings
        self.retries = retries
        self.id = "ingress-" + serve.get_replica_context().replica_id.unique_id
        self.registry = CollectorRegistry(auto_describe=True)
        self.retried = Counter(
            "specdec_ray_retries",
            "Requests sent again to another replica because theirs failed before answering.",
            registry=self.registry,
        )
        self.failed = Counter(
            "specdec_ray_replica_failures",
            "Responses a replica failure ended with an error: before anything was sent (after the retries), "
            "mid-stream (an error event), or mid-body (connection aborted).",
            ["when"],
            registry=self.registry,
        )
        for when in ("before_response", "mid_stream", "mid_body"):
            self.failed.labels(when=when)
        self._pusher = asyncio.get_running_loop().create_task(
            _push_forever(hub, self.id, metrics_interval, self._render)
        )

    def __serve_build_asgi_app__(self) -> Any:
        return Guard(_Forwarder(self), api_key=self.settings.api_key, max_body_bytes=self.settings.max_body_bytes)

    async def _render(self) -> str:
        return generate_latest(self.registry).decode()

    async def forward(self, request: dict[str, Any], body: bytes, send: Send) -> None:
        attempt = 0
        while True:
            relay = _Relay(send)
            stream = cast(DeploymentResponseGenerator, self.replicas.options(stream=True).asgi.remote(request, body))
            try:
                async for batch in stream:
                    for message in batch:
                        await relay.pass_on(message)
                if relay.complete:
                    return
                failure: BaseException = RuntimeError("the replica ended the response before its last byte")
                lost = False
            except asyncio.CancelledError:  # the client went away: stop the replica's work too
                stream.cancel()
                raise
            except _LOST as e:
                failure, lost = e, True
            except Exception as e:
                failure, lost = e, False
            if relay.complete:  # everything reached the client; the replica failed afterwards
                return
            if lost and not relay.started and attempt < self.retries:
                attempt += 1
                self.retried.inc()
                log.warning("replica lost before answering (%s): retry %d of %d", _kind(failure), attempt, self.retries)
                await asyncio.sleep(0.2 * attempt)  # give the router time to drop the dead replica
                continue
            when = "before_response" if not relay.started else ("mid_stream" if relay.sse else "mid_body")
            self.failed.labels(when=when).inc()
            log.error("request failed (%s, %s): %s", when, _kind(failure), failure)
            await relay.fail(_replica_error(failure, relay, lost, attempt))
            return


async def _send_ok(send: Send, body: bytes, content_type: str, head: bool) -> None:
    """A 200 answer the ingress makes itself (the fleet's /metrics and /health); HEAD: the headers alone."""
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})


def _kind(e: BaseException) -> str:
    return type(e).__name__


def _replica_error(failure: BaseException, relay: _Relay, lost: bool, attempts: int) -> APIError:
    what = (
        "the replica serving this request died"
        if lost
        else f"the replica serving this request failed ({_kind(failure)})"
    )
    if not relay.started:
        tried = f" (tried {attempts + 1} replicas)" if attempts else ""
        return APIError(
            503,
            f"{what} before answering{tried}; it is being replaced: retry the request",
            None,
            "replica_failed",
            headers=retry_headers(1.0),
        )
    return APIError(
        503,
        f"{what} after {relay.bytes_sent} bytes of the response: the answer is incomplete; retry the request",
        None,
        "replica_failed",
    )


SpecdecMetrics = serve.deployment(name="SpecdecMetrics")(_MetricsHub)
SpecdecReplica = serve.deployment(name="SpecdecReplica")(_EngineReplica)
SpecdecIngress = serve.deployment(name="SpecdecIngress")(serve.ingress()(_Ingress))


# -- the CLI's entry point ------------------------------------------------------------------------------


def run_forever(
    model: ModelSpec,
    settings: ServerSettings,
    ray_settings: RaySettings,
    address: str | None,
    host: str,
    port: int,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
    trace: str | None = None,
) -> None:
    """Connect to (``address``) or start a local Ray, deploy, and serve until interrupted; ``trace`` as in
    ``build_app``."""
    import signal

    local = address is None
    if local:
        ray.init(address="local", include_dashboard=False, log_to_driver=True)
    else:
        ray.init(address=address, log_to_driver=True)

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        logging_config = {"log_level": log_level.upper(), "enable_access_log": log_level in ("info", "debug")}
        serve.start(http_options={"host": host, "port": port}, logging_config=logging_config)
        serve.run(
            build_app(model, settings, ray_settings, trace),
            name=ray_settings.app_name,
            route_prefix=ray_settings.route_prefix,
            logging_config=logging_config,
        )
        if on_ready is not None:
            on_ready(f"http://{host}:{port}{ray_settings.route_prefix.rstrip('/')}")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(ray_settings.app_name)
        finally:
            ray.shutdown()


__all__ = [
    "APP_NAME",
    "REPLICA_HEADER",
    "RaySettings",
    "build_app",
    "fleet_health",
    "merge_expositions",
    "run_forever",
]
