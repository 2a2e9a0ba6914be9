"""The wait a refusal asks (``specdec.retry_after``): written in whole seconds and in milliseconds, read back as the
OpenAI SDKs read it (milliseconds first)."""

from __future__ import annotations

import pytest

from specdec.retry_after import MAX_RETRY_AFTER, retry_delay, retry_headers


@pytest.mark.parametrize(
    ("seconds", "whole", "ms"),
    [(0.026, "1", "26"), (0.0, "1", "1"), (1.0, "1", "1000"), (1.2, "2", "1200"), (600.0, "60", "60000")],
)
def test_a_refusal_asks_its_wait_in_whole_seconds_and_in_milliseconds(seconds: float, whole: str, ms: str) -> None:
    assert retry_headers(seconds) == {"Retry-After": whole, "retry-after-ms": ms}


@pytest.mark.parametrize(
    ("headers", "delay"),
    [
        ({"Retry-After": "2", "retry-after-ms": "250"}, 0.25),  # the milliseconds first
        ({"retry-after": "3"}, 3.0),
        ({"RETRY-AFTER-MS": "40"}, 0.04),  # names in any case
        ({"retry-after-ms": "soon", "retry-after": "1"}, 1.0),  # a bad one skipped
        ({"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}, None),  # a date: another clock's
        ({"retry-after": "-1"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "3600"}, MAX_RETRY_AFTER),
        ({}, None),
    ],
)
def test_a_client_reads_the_wait_a_refusal_asks(headers: dict[str, str], delay: float | None) -> None:
    assert retry_delay(headers) == (pytest.approx(delay) if delay is not None else None)


def test_what_is_written_reads_back() -> None:
    for seconds in (0.003, 0.4, 1.5, 59.0):
        assert retry_delay(retry_headers(seconds)) == pytest.approx(seconds, abs=1e-3)
