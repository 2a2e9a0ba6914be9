"""One worker thread runs all model work: continuous batching of the active requests.

Each request is a ``Job``: a function that tokenises and starts it (``build``, run on the worker between
steps), then it joins the batch. Its prompt is prefilled by the batch's steps, at most ``Engine.prefill_in_step``
tokens per step (a longer prompt in pieces), in the target and draft passes it shares with the batch: one stream
of the weights for all, where a pass of its own streamed them once more per joining request and a long prompt
stalled every running request for its whole prefill. Each round is one ``Engine.step`` over up
to ``max_batch`` active sequences: one lockstep draft and one target pass shared by all of them. A
request leaves the batch the moment it finishes, is cancelled or runs past its deadline, and a waiting
one joins at the next round, or, arriving while a round drafts, that round's target pass (its prompt and first token
there, ``Engine.step``'s ``join``). With more active requests than ``max_batch`` the rounds rotate over
them (``max_batch=1``: one request per pass, round-robin). Results travel back to the request's event
loop through an ``asyncio.Queue``. A bounded waiting line answers 429; deadlines and client
disconnects cancel the ``Generation`` and free its cache slot.

A request asking for ``n`` samples is one job owning n Generations (prefilled once, ``Engine.start_many``):
they always run in the same step, count n towards ``max_active``, ``max_queue`` and ``max_batch``, and
are cancelled together (disconnect, deadline, failure). Each sample reports its own ``Step``s and its
own ``Done`` (``index`` j); the job ends when all n are done.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from specdec.engine import Engine, Generation, GenerationResult, StepEvent
from specdec.errors import SpecdecError
from specdec.retry_after import retry_headers
from specdec.sampling_params import TokenLogprob
from specdec.server.errors import APIError, from_specdec

log = logging.getLogger("specdec.server")


@dataclass(frozen=True)
class Prompt:
    """A choice's prompt: its ids and, where the request asked (echo with logprobs), their scores."""

    prompt_ids: list[int]
    prompt_logprobs: list[TokenLogprob] | None


@dataclass
class Started:
    prompt_tokens: int
    prompts: list[Prompt] = field(default_factory=list)  # each choice's: a streamed echo's first chunk


@dataclass
class Step:
    event: StepEvent
    detail: dict[str, Any] | None  # the step record with decoded pieces, when the client asked for steps
    index: int = 0  # which of the request's n samples


@dataclass
class Done:
    result: GenerationResult
    index: int = 0  # which of the request's n samples finished (the job ends after all n)


@dataclass
class Failed:
    error: APIError


Message = Started | Step | Done | Failed


@dataclass
class Job:
    """One request as the scheduler sees it. ``build`` runs on the worker thread and returns the request's
    ``n`` Generations (one unless the client asked for more samples)."""

    request_id: str
    build: Callable[[Engine], list[Generation]]
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the request is abandoned
    want_steps: bool = False
    n: int = 1  # sequences: what the job counts towards max_active, max_queue and max_batch
    prompts: int = 1  # distinct prompts among them (a completion's list of prompts: n sequences each)
    # Whether the client reads the text as it comes (a streaming response; ``want_steps`` has every step posted either
    # way): a request answered at its end gets its Done alone, not a message per step for its event loop to drop.
    stream: bool = True
    # Tokens a streaming sample gathers before its text is posted (``specdec serve --stream-interval``), and seconds
    # since its last post (``--stream-interval-ms``): its first text and its last go at once, whatever was gathered;
    # steps with logprobs or records are posted each on its own.
    stream_interval: int = 1
    stream_wait: float = 0.0
    queue: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    gens: list[Generation] = field(default_factory=list)
    reported: set[int] = field(default_factory=set)  # samples whose Done was posted
    finished: bool = False
    # Per sample: its text gathered since its last post and the tokens of it (the stream interval), and when its text
    # was last posted (time.monotonic(); absent: none of its text posted yet).
    held: dict[int, tuple[StepEvent, int]] = field(default_factory=dict)
    posted_at: dict[int, float] = field(default_factory=dict)

    def post(self, msg: Message) -> None:
        """Hand a message to the request's event loop (called from the worker thread)."""
        post_all([(self, msg)])

    async def messages(self) -> AsyncIterator[Message]:
        """Messages until all ``n`` samples are done, or the request failed."""
        done = 0
        while True:
            msg = await self.queue.get()
            yield msg
            done += isinstance(msg, Done)
            if isinstance(msg, Failed) or done >= self.n:
                return


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        max_active: int = 16,
        max_queue: int = 64,
        max_batch: int = 16,
        on_step: Callable[[int, int], None] | None = None,
    ) -> None:
        if max_active < 1 or max_queue < 0 or max_batch < 1:
            raise ValueError("max_active and max_batch must be >= 1 and max_queue >= 0")
        self.engine = engine
        self.max_active = max_active
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.on_step = on_step  # called with (sequences, target rows) of every batched step
        self._turn = 0  # where the next round starts among the active jobs (rotation when they exceed max_batch)
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.rejected = 0
        self._mean_latency = 1.0  # seconds, moving average of finished requests (for Retry-After)
        # The last step's messages to requests still running, handed to their loops once the next step's drafts are
        # made (``_advance``): the loop then writes them while that step's target pass runs, not while its drafts do.
        # Only running jobs have messages held, and a job leaves the running set through a step (which posts them
        # first) or ``_end`` with a failure (which does too), so nothing is held while the worker waits for work.
        self._held: list[tuple[Job, Message]] = []

    # -- called from the event loop -------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="specdec-scheduler", daemon=True)
                self._thread.start()

    @property
    def thread_native_id(self) -> int | None:
        """The worker thread's OS id while it runs (its CPU time: ``observe.ThreadCpu``), else None."""
        thread = self._thread
        return thread.native_id if thread is not None and thread.is_alive() else None

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        """Queue a job, or raise a 429 ``APIError`` when the waiting line is full."""
        self.start()
        with self._cond:
            if _sequences(self._waiting) + _sequences(self._active) + job.n > self.max_active + self.max_queue:
                self.rejected += 1
                raise APIError(
                    429,
                    f"the server is busy: {len(self._active)} requests running and {len(self._waiting)} "
                    "waiting; retry later",
                    None,
                    "queue_full",
                    headers=retry_headers(self.retry_after()),
                )
            self._waiting.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Stop a job wherever it is (waiting or running). Safe to call more than once."""
        with self._cond:
            if job.finished or job.cancelled:
                return
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
                job.finished = True
                self.cancelled += 1
                job.post(Failed(_cancelled_error()))
            self._cond.notify_all()

    def retry_after(self) -> float:
        """Seconds until a slot is likely free: the waiting line drained at the recent pace (``retry_headers`` writes
        them as whole seconds and as milliseconds)."""
        return self._mean_latency * (len(self._waiting) + 1) / self.max_active

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {
                "active": len(self._active),
                "queued": len(self._waiting),
                "max_active": self.max_active,
                "max_queue": self.max_queue,
                "max_batch": self.max_batch,
                "completed": self.completed,
                "failed": self.failed,
                "cancelled": self.cancelled,
                "rejected": self.rejected,
            }

    # -- the worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stopping:
                    break
                admitted = self._take_waiting()
            batch: list[Job] = []
            try:
                for job in admitted:
                    self._admit(job)
                batch = [job for job in self._next_batch() if self._still_wanted(job)]
                if batch:
                    self._round(batch)
            except Exception as e:  # noqa: BLE001 - a fault of the worker's own (not a request's): fail, keep serving
                self._recover(e, batch or admitted)
        # Shutting down: release everything still running or waiting (``_end`` posts what was held first).
        for job in list(self._active):
            self._end(job, Failed(_shutdown_error()))
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            self._count("failed", job)
            job.post(Failed(_shutdown_error()))

    def _round(self, batch: list[Job]) -> None:
        """One step over ``batch`` (``_advance``). The active requests left out of it (more of them than ``max_batch``:
        the rounds rotate) are set aside for the step's time (``Generation.set_aside``): a request's next record then
        holds as its rest what its own steps cost between them, not the other rounds' steps. Counted as rest, those
        priced a step of the adaptive policy ~8 ms dearer than it was at every depth, and it amortised them in deep
        drafts: 32 sequences rotating 16 at a time, in process, ran depth 8 where 3 was best, 0.89 of the best fixed
        τ (``benchmarks/engine_steps.py --max-batch``, docs/policy.md, session 55)."""
        t0 = time.perf_counter()
        self._advance(batch)
        with self._cond:
            stepped = {id(job) for job in batch}  # the late joiners too: ``_advance`` adds them to the batch
            others = [job for job in self._active if id(job) not in stepped]
        if others:
            elapsed = time.perf_counter() - t0
            for job in others:
                for g in job.gens:
                    g.set_aside(elapsed)

    def _recover(self, error: Exception, jobs: list[Job]) -> None:
        """A round failed outside what ``_admit`` and ``_advance`` answer for each request (the worker's own code, a
        metrics hook): the jobs it was serving may be half-stepped, so they end with a 500 (their caches freed), and the
        worker goes on with the others. Left to itself the thread ended, and every request in flight waited for its
        timeout while /health said ok."""
        log.exception("the scheduler's round failed; failing the requests it was serving", exc_info=error)
        failure = Failed(error if isinstance(error, APIError) else _internal_error(error))
        for job in jobs:
            if job.finished:
                continue
            try:
                self._end(job, failure)
            except Exception:  # noqa: BLE001 - what is left of the job must not stop the worker either
                log.exception("could not end request %s", job.request_id)
                with self._cond:
                    if job in self._active:
                        self._active.remove(job)

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self._count("cancelled", job)
            return
        if time.monotonic() > job.deadline:
            self._count("failed", job)
            job.post(Failed(_timeout_error()))
            return
        try:
            job.gens = job.build(self.engine)  # tokenise, validate, prefill (once for the n samples)
        except Exception as e:  # noqa: BLE001 - any failure must reach the client, never kill the worker
            self._count("failed", job)
            job.post(Failed(_as_api_error(e)))
            return
        with self._cond:
            self._active.append(job)
        per = len(job.gens) // job.prompts  # each prompt counted once, whatever its samples
        job.post(
            Started(
                prompt_tokens=sum(len(job.gens[i * per].prompt_ids) for i in range(job.prompts)),
                prompts=[Prompt(g.prompt_ids, g.prompt_logprobs) for g in job.gens],
            )
        )

    def _take_waiting(self, in_step: int | None = None) -> list[Job]:
        """The waiting jobs to admit now, first come first served (the lock held): sequences (cache slots) up to
        ``max_active``, a job larger than that alone when nothing runs. ``in_step``: sequences already in the step they
        would join (``_late_join``), which then also keeps within ``max_batch`` and never admits a job alone."""
        admitted: list[Job] = []
        running = _sequences(self._active)
        while self._waiting:
            n = self._waiting[0].n
            if in_step is None:
                if running and running + n > self.max_active:
                    break
            elif running + n > self.max_active or in_step + n > self.max_batch:
                break
            else:
                in_step += n
            admitted.append(self._waiting.popleft())
            running += n
        return admitted

    def _late_join(self, batch: list[Job], late: list[Job]) -> Callable[[], list[Generation]]:
        """``Engine.step``'s ``join`` for a round over ``batch``: the waiting jobs that fit the running set
        (``max_active``) and the step (``max_batch``), admitted (built: tokenised, started) right before the step's
        target pass, appended to ``late`` (their messages come with the step's); returns their Generations. A client
        whose request finished at the end of a step sends its next one while the following step runs: it joined the
        step after that, a step later than it could (at 16 clients ~10 ms from arriving to joining, then its first
        step)."""

        def join() -> list[Generation]:
            with self._cond:
                admitted = self._take_waiting(_sequences(batch))
            for job in admitted:
                self._admit(job)
                if job.gens and not job.finished:
                    late.append(job)
            return [g for job in late for g in job.gens]

        return join

    def _next_batch(self) -> list[Job]:
        """Active jobs holding up to ``max_batch`` sequences in all (a job's n samples always together),
        rotating so every job gets its turn when there are more."""
        with self._cond:
            active = list(self._active)
        if _sequences(active) <= self.max_batch:
            return active
        start = self._turn % len(active)
        batch: list[Job] = []
        rows = 0
        for job in active[start:] + active[:start]:
            if batch and rows + job.n > self.max_batch:
                break
            batch.append(job)
            rows += job.n
        self._turn = start + len(batch)
        return batch

    def _still_wanted(self, job: Job) -> bool:
        """End a job whose client left or whose deadline passed (its slot is free for the next round)."""
        if job.cancelled:
            self._end(job, Failed(_cancelled_error()))  # wakes a handler still waiting on the job
            return False
        if time.monotonic() > job.deadline:
            self._end(job, Failed(_timeout_error()))
            return False
        return True

    def _advance(self, batch: list[Job], join: bool = True) -> None:
        """One engine step over the batch; if it fails, each job alone, so only the one at fault fails. Requests that
        arrive while the step drafts join its target pass (``_late_join``), as far as ``max_batch`` has room."""
        late: list[Job] = []
        late_join = self._late_join(batch, late) if join else None

        def drafted() -> list[Generation]:  # the step's drafts are made: the last step's messages go out now
            self._post_held()
            return late_join() if late_join is not None else []

        try:
            events = self.engine.step([g for job in batch for g in job.gens], drafted)
        except Exception as e:  # noqa: BLE001 - find the request at fault; the others go on
            self._post_held()
            if len(batch) + len(late) == 1:
                self._end((batch + late)[0], Failed(_as_api_error(e)))
                return
            for job in batch + late:
                if not job.finished:
                    self._advance([job], join=False)
            return
        batch.extend(late)  # in place: a failure after the step (``_run``'s recovery) ends the late jobs too
        if self.on_step is not None:
            records = [ev.record for ev in events if ev is not None]
            if records:
                self.on_step(records[0].batch_size, records[0].rows)
        first = 0
        outbox: list[tuple[Job, Message]] = []  # the step's messages, handed to their loops at once below
        for job in batch:
            size = len(job.gens)  # before delivering: a job that ends drops its Generations
            try:
                self._deliver(job, events[first : first + size], outbox)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the worker
                post_all(outbox)  # what came before the failure, first
                outbox = []
                self._end(job, Failed(_as_api_error(e)))
            first += size
        # A request that finished hears of it now (its client's next request waits on it); the others' text goes out
        # once the next step has drafted (``_held``).
        now = [(job, msg) for job, msg in outbox if job.finished]
        self._held = [(job, msg) for job, msg in outbox if not job.finished]
        post_all(now)

    def _post_held(self) -> None:
        held, self._held = self._held, []
        if held:
            post_all(held)

    def _deliver(self, job: Job, events: list[StepEvent | None], outbox: list[tuple[Job, Message]]) -> None:
        finished: list[Done] = []
        for j, (gen, event) in enumerate(zip(job.gens, events)):
            if event is not None and (job.stream or job.want_steps):
                self._post_step(job, j, event, outbox)
            if gen.done and j not in job.reported:
                job.reported.add(j)
                finished.append(Done(gen.result(), j))
        if len(job.reported) == len(job.gens):
            latency = max(gen.stats.latency for gen in job.gens)
            self._mean_latency = 0.8 * self._mean_latency + 0.2 * latency
            self._end(job, None)  # out of the running set before the client hears of its last sample
        outbox.extend((job, msg) for msg in finished)

    def _post_step(self, job: Job, index: int, event: StepEvent, outbox: list[tuple[Job, Message]]) -> None:
        """A step's message for sample ``index``, or its text held back until the sample has gathered the stream
        interval's tokens and its time since its last text posted (posted at once: its first text, its last, a step
        with logprobs or a record). Held text goes out with the sample's first step past the interval, or its last."""
        if job.want_steps or event.logprobs is not None or (job.stream_interval <= 1 and job.stream_wait <= 0):
            detail = self._step_detail(event, index if job.n > 1 else None) if job.want_steps else None
            outbox.append((job, Step(event, detail, index)))
            return
        tokens = len(event.record.emitted)
        held = job.held.pop(index, None)
        if held is not None:
            event = StepEvent(event.record, held[0].text + event.text, event.finished)
            tokens += held[1]
        now = time.monotonic()
        due = tokens >= job.stream_interval and now - job.posted_at.get(index, -math.inf) >= job.stream_wait
        # No text yet (the decoder holds partial characters back), or after the first text not yet due: held.
        if not event.finished and (not event.text or (index in job.posted_at and not due)):
            job.held[index] = (event, tokens)
            return
        if event.text:
            job.posted_at[index] = now
            outbox.append((job, Step(event, None, index)))

    def _flush(self, job: Job) -> None:
        """Post the text each sample holds (before a failure ends the stream: what was verified is not dropped)."""
        held, job.held = job.held, {}
        post_all([(job, Step(event, None, index)) for index, (event, _) in sorted(held.items()) if event.text])

    def _end(self, job: Job, failure: Failed | None) -> None:
        """Remove a running job, free its caches and, if it failed, tell the client (its ``Done``s were sent)."""
        if failure is not None:
            self._post_held()  # the text of the steps before, first
            self._flush(job)
            for gen in job.gens:
                gen.cancel()  # a no-op for a sample already finished
        with self._cond:
            if job in self._active:
                self._active.remove(job)
        kind = "completed" if failure is None else "cancelled" if job.cancelled else "failed"
        self._count(kind, job)
        if failure is not None:
            job.post(failure)
        job.gens = []  # drop the Generations: their caches go with them

    def _count(self, kind: str, job: Job) -> None:
        with self._cond:
            job.finished = True
            setattr(self, kind, getattr(self, kind) + 1)

    def _step_detail(self, event: StepEvent, index: int | None = None) -> dict[str, Any]:
        """The record as JSON plus the text of each draft and emitted token, for the playground (and, for a
        request of n > 1 samples, the ``index`` of the sample)."""
        tok = self.engine.tokenizer
        rec = event.record
        detail = rec.to_json()
        if index is not None:
            detail["index"] = index
        detail["draft_pieces"] = [tok.decode([t], skip_special_tokens=False) for t in rec.draft_tokens]
        detail["emitted_pieces"] = [tok.decode([t], skip_special_tokens=False) for t in rec.emitted]
        return detail


def post_all(outbox: list[tuple[Job, Message]]) -> None:
    """Hand messages to their requests' event loops, in order, with one wake-up per loop: a step's 16 messages
    woke the server's loop 16 times, on cores the model's passes were using."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Message]]] = {}
    for job, msg in outbox:
        by_loop.setdefault(job.loop, []).append((job, msg))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            for job, _ in items:
                job.cancelled = True


def _put_all(items: list[tuple[Job, Message]]) -> None:
    for job, msg in items:
        job.queue.put_nowait(msg)


def _sequences(jobs: Iterable[Job]) -> int:
    return sum(job.n for job in jobs)


def _cancelled_error() -> APIError:
    return APIError(499, "the request was cancelled (the client disconnected)", None, "cancelled")


def _shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down", None, "shutting_down")


def _timeout_error() -> APIError:
    return APIError(408, "the request ran past the server's request timeout", None, "request_timeout")


def _as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, SpecdecError):
        return from_specdec(e)
    log.exception("request failed", exc_info=e)
    return _internal_error(e)


def _internal_error(e: Exception) -> APIError:
    return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")
