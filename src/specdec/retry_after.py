"""When to try again: the headers a refusal (429 ``queue_full``) carries, written by the server and read by clients.

``Retry-After`` holds whole seconds (RFC 9110), too coarse for a server whose waiting line drains in a second or two:
rounded up, a client told "1" where a slot frees in 0.3 s idles for the rest, and one told "2" for 1.1 s idles for
0.9. The refusal also carries ``retry-after-ms``, the same wait in milliseconds, which the OpenAI SDKs read before
``Retry-After`` (and the load test and the soak test here)."""

from __future__ import annotations

import math
from collections.abc import Mapping

MAX_RETRY_AFTER = 60.0  # seconds: the most a refusal asks a client to wait


def retry_headers(seconds: float) -> dict[str, str]:
    """The headers of a refusal whose client should try again in ``seconds`` (at least 1 ms, at most
    MAX_RETRY_AFTER): ``Retry-After`` rounded up to a whole second, at least 1, and ``retry-after-ms``."""
    seconds = min(MAX_RETRY_AFTER, max(0.001, seconds))
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, round(seconds * 1e3)))}


def retry_delay(headers: Mapping[str, str]) -> float | None:
    """Seconds a refusal asks its client to wait: ``retry-after-ms`` where it holds a number, else ``Retry-After``'s
    seconds; None where neither does (a date in ``Retry-After`` included: a server on another clock). Header names
    are matched without regard to case (an ``httpx.Headers`` does that itself; a plain dict is searched)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = lowered.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        if math.isfinite(seconds) and seconds >= 0.0:
            return min(seconds, MAX_RETRY_AFTER)
    return None
