"""Prometheus metrics: vLLM-style spec-decode counters and the histograms, checked by parsing the exposition."""

from __future__ import annotations

import threading
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from specdec.metrics import SpecMetrics
from specdec.records import GenerationStats, RequestSummary, StepRecord


def _step(tau: int, n: int, emitted: int | None = None) -> StepRecord:
    flags = [True] * n + [False] * (tau - n)
    correction = "plain" if tau == 0 else ("bonus" if n == tau else "recovered")
    out = list(range(n + 1))[: emitted if emitted is not None else n + 1]
    return StepRecord(
        request_id="r",
        step=0,
        prompt_len=4,
        context_len=4,
        policy="fixed",
        reason="",
        tau=tau,
        draft_tokens=list(range(tau)),
        accept_flags=flags,
        n_accepted=n,
        correction=correction,
        emitted=out,
        draft_time=0.01,
        verify_time=0.02,
        other_time=0.005,
        policy_time=0.001,
    )


def _samples(m: SpecMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_spec_decode_counters_follow_vllm_definitions() -> None:
    m = SpecMetrics()
    for tau, n in [(4, 4), (4, 1), (4, 0), (0, 0), (2, 2)]:  # emits 5, 2, 1, 1, 3 tokens
        m.on_step(_step(tau, n))
    s = _samples(m)
    assert s[("specdec_spec_decode_num_drafts_total", ())] == 4  # the τ = 0 step is not a draft
    assert s[("specdec_spec_decode_num_draft_tokens_total", ())] == 14
    assert s[("specdec_spec_decode_num_accepted_tokens_total", ())] == 7
    per_pos = {
        i: s[("specdec_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))] for i in range(4)
    }
    assert per_pos == {0: 3, 1: 2, 2: 1, 3: 1}
    assert s[("specdec_verify_passes_total", ())] == 5
    assert s[("specdec_generation_tokens_total", ())] == 12
    # accepted length per step includes the correction token: 12 tokens over 5 passes
    assert s[("specdec_accepted_length_sum", ())] == 12 and s[("specdec_accepted_length_count", ())] == 5
    assert s[("specdec_accepted_length_bucket", (("le", "1.0"),))] == 2
    assert abs(s[("specdec_step_seconds_total", (("phase", "verify"),))] - 0.1) < 1e-9
    assert abs(s[("specdec_step_seconds_total", (("phase", "other"),))] - 0.025) < 1e-9
    assert abs(s[("specdec_policy_seconds_total", ())] - 0.005) < 1e-9  # of the other phase


def test_drafts_read_from_a_prediction_are_counted_apart_from_the_drafters() -> None:
    m = SpecMetrics()
    m.on_step(_step(4, 3))
    predicted = _step(16, 12)
    predicted.reason = "prediction"
    m.on_step(predicted)
    s = _samples(m)
    assert s[("specdec_spec_decode_num_drafts_total", ())] == 1
    assert s[("specdec_spec_decode_num_draft_tokens_total", ())] == 4
    assert s[("specdec_spec_decode_num_accepted_tokens_total", ())] == 3
    assert ("specdec_spec_decode_num_accepted_tokens_per_pos_total", (("position", "4"),)) not in s  # only τ = 4's
    assert s[("specdec_prediction_draft_tokens_total", ())] == 16
    assert s[("specdec_prediction_accepted_tokens_total", ())] == 12
    assert s[("specdec_verify_passes_total", ())] == 2 and s[("specdec_generation_tokens_total", ())] == 17


def test_per_position_zeros_are_exported_up_to_the_largest_tau() -> None:
    m = SpecMetrics()
    m.on_step(_step(3, 0))
    s = _samples(m)
    assert [
        s[("specdec_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))] for i in range(3)
    ] == [0, 0, 0]
    assert ("specdec_spec_decode_num_accepted_tokens_per_pos_total", (("position", "3"),)) not in s


def test_request_histograms_and_finish_reasons() -> None:
    m = SpecMetrics()
    for reason, latency in [("stop", 0.5), ("length", 1.5), ("length", 3.0)]:
        stats = GenerationStats(
            prompt_tokens=7, new_tokens=10, target_passes=4, latency=latency, prefill_time=0.1, finish_reason=reason
        )
        m.on_request(RequestSummary(request_id="r", policy="fixed", prompt_len=7, stats=stats))
    s = _samples(m)
    assert s[("specdec_request_success_total", (("finished_reason", "length"),))] == 2
    assert s[("specdec_request_success_total", (("finished_reason", "cancelled"),))] == 0
    assert s[("specdec_prompt_tokens_total", ())] == 21
    assert s[("specdec_request_verify_passes_count", ())] == 3
    assert abs(s[("specdec_e2e_request_latency_seconds_sum", ())] - 5.0) < 1e-9
    assert abs(s[("specdec_time_per_output_token_seconds_sum", ())] - (0.04 + 0.14 + 0.29)) < 1e-9
    assert m.content_type.startswith("text/plain")


def test_own_registry_and_thread_safety() -> None:
    a, b = SpecMetrics(), SpecMetrics()  # two instances must not collide (own registries)
    assert REGISTRY.get_sample_value("specdec_verify_passes_total") is None

    def work() -> None:
        for _ in range(500):
            a.on_step(_step(3, 2))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _samples(a)[("specdec_spec_decode_num_accepted_tokens_total", ())] == 4000
    assert _samples(b)[("specdec_verify_passes_total", ())] == 0


def test_engine_feeds_metrics(tiny_models: dict[str, Path]) -> None:
    import specdec

    m = SpecMetrics()
    engine = specdec.load(tiny_models["llama"], tiny_models["draft"], tau=3, observers=[m])
    res = engine.generate("import os", max_new_tokens=20)
    s = _samples(m)
    assert s[("specdec_generation_tokens_total", ())] == res.stats.new_tokens
    assert s[("specdec_verify_passes_total", ())] == res.stats.target_passes
    assert s[("specdec_spec_decode_num_draft_tokens_total", ())] == res.stats.drafted
    assert s[("specdec_request_success_total", (("finished_reason", res.finish_reason),))] == 1


def test_step_records_reach_the_metrics_in_bulk_and_at_every_read() -> None:
    """Step records are summed and handed to the metrics in bulk: every FLUSH_EVERY records, at a request's end and at
    every scrape, so what a scrape or a finished request sees is whole, and a registry read without either lags by
    fewer than FLUSH_EVERY records."""
    from specdec.metrics import FLUSH_EVERY

    m = SpecMetrics()
    for _ in range(FLUSH_EVERY - 1):
        m.on_step(_step(2, 1))
    assert m.registry.get_sample_value("specdec_verify_passes_total") == 0  # summed, not yet handed over
    m.on_step(_step(2, 1))
    assert m.registry.get_sample_value("specdec_verify_passes_total") == FLUSH_EVERY
    assert m.registry.get_sample_value("specdec_accepted_length_count") == FLUSH_EVERY
    m.on_step(_step(4, 4))  # one more, then a request ends: whole again
    m.on_request(RequestSummary("r", "fixed", 4, GenerationStats(prompt_tokens=4, finish_reason="length")))
    reg = m.registry
    assert reg.get_sample_value("specdec_verify_passes_total") == FLUSH_EVERY + 1
    assert reg.get_sample_value("specdec_spec_decode_num_accepted_tokens_total") == FLUSH_EVERY + 4
    assert reg.get_sample_value("specdec_spec_decode_num_accepted_tokens_per_pos_total", {"position": "3"}) == 1
    assert reg.get_sample_value("specdec_accepted_length_bucket", {"le": "2.0"}) == FLUSH_EVERY
    m.on_step(_step(0, 0))
    assert _samples(m)[("specdec_verify_passes_total", ())] == FLUSH_EVERY + 2  # a scrape sees every record
