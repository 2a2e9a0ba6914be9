"""Arrival processes for the batched simulation: when each request of a workload reaches the server.

``poisson:rate=R``: open loop, requests arrive at random at R per second on average (exponential gaps),
whatever the server does: queues grow when it cannot keep up. ``clients:N``: closed loop, N clients each
send a request and send the next the moment the last one finishes (no think time): the shape of
``benchmarks/load_test.py``; the load is N requests in flight at all times until the requests run out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specdec.errors import InvalidRequestError
from specdec.policy import parse_policy_spec


@dataclass(frozen=True)
class Arrivals:
    kind: str  # "poisson" | "clients"
    rate: float = 0.0  # requests per second (poisson)
    clients: int = 0  # requests in flight (clients)

    @property
    def label(self) -> str:
        return f"poisson:rate={self.rate:g}" if self.kind == "poisson" else f"clients:{self.clients}"

    def times(self, n: int, seed: int) -> list[float] | None:
        """Arrival times of ``n`` requests for an open loop (from 0); None for a closed loop, whose arrivals
        follow the finishes (the runner releases request i + N when a request finishes)."""
        if self.kind != "poisson":
            return None
        rng = random.Random(f"arrivals/{seed}/{self.rate!r}")
        out, t = [], 0.0
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


def parse_arrivals(spec: str) -> Arrivals:
    """``poisson:rate=20`` (requests/s) or ``clients:16`` (also ``clients:n=16``)."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name == "clients":
        value = rest.strip()
        if value.startswith("n="):
            value = value[2:]
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise InvalidRequestError(
                f"bad arrivals {spec!r}: write clients:N with N >= 1 (e.g. clients:16)", "arrivals"
            )
        return Arrivals("clients", clients=n)
    if name == "poisson":
        _, settings = parse_policy_spec(spec)  # the same key=value reading as policy specs
        rate = settings.pop("rate", None)
        if settings or not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
            raise InvalidRequestError(
                f"bad arrivals {spec!r}: write poisson:rate=R with R > 0 requests per second (e.g. poisson:rate=20)",
                "arrivals",
            )
        return Arrivals("poisson", rate=float(rate))
    raise InvalidRequestError(f"unknown arrivals {spec!r}: use poisson:rate=R or clients:N", "arrivals")
