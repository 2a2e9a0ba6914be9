"""specdec tune: acceptance by position, predictions, and the command end to end on tiny checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specdec.cli import main
from specdec.records import StepRecord
from specdec.simulate.costs import CostModel
from specdec.tune import load_prompts, position_rates, predict


def rec(tau: int, n: int) -> StepRecord:
    return StepRecord(
        request_id="r",
        step=0,
        prompt_len=5,
        context_len=5,
        policy="fixed",
        reason="",
        tau=tau,
        draft_tokens=[0] * tau,
        accept_flags=[k < n for k in range(tau)],
        n_accepted=n,
        correction="bonus" if n == tau else "recovered",
        emitted=[0] * (n + 1),
        draft_time=0.0,
        verify_time=0.0,
        other_time=0.0,
    )


def test_position_rates_count_only_the_accepted_prefix_and_first_rejection() -> None:
    # position 1: 4 trials, 3 passed; position 2: 3 trials, 1 passed; position 3: 1 trial, 1 passed
    rates = position_rates([rec(3, 0), rec(3, 1), rec(3, 1), rec(3, 3)], 3)
    assert rates[0] == pytest.approx((3 + 0.5) / 5)
    assert rates[1] == pytest.approx((1 + rates[0]) / 4)
    assert rates[2] == pytest.approx((1 + rates[1]) / 2)


def test_predicted_speedup_is_one_at_tau_zero_and_follows_the_formula() -> None:
    cost = CostModel("t", draft_per_token_s=1.0, verify_base_s=10.0, verify_per_extra_s=0.0)
    pred = predict([0.5, 0.5], cost)
    assert pred[0] == 1.0
    assert pred[2] == pytest.approx((1 + 0.5 + 0.25) / 12 * 10)


def test_prompts_file_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="p.jsonl:2: expected a non-empty JSON string or an object"):
        load_prompts(bad)


def test_tune_recommends_and_measures_on_tiny_checkpoints(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specdec.testing import tiny_checkpoint

    # A draft with the target's own weights agrees with it on every greedy token: α must come out as 1.
    same = tiny_checkpoint(tmp_path / "same", "llama", seed=0, tokenizer_from=tiny_models["llama"], sharpen=4.0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def fibonacci(n):"}\n{"prompt": "class Stack:"}\n')
    out, costs = tmp_path / "tune.json", tmp_path / "costs.json"
    code = main(
        [
            "tune",
            "--target",
            str(tiny_models["llama"]),
            "--draft",
            str(tiny_models["draft"]),
            "--draft",
            str(same),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--max-tau",
            "4",
            "--dtype",
            "float32",
            "--json",
            str(out),
            "--save-costs",
            str(costs),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "recommendation:" in text and "predicted" in text
    report = json.loads(out.read_text())
    by_name = {d["draft"]: d for d in report["drafts"]}
    assert by_name[str(same)]["acceptance_rate"] == 1.0
    assert all(0.0 <= a <= 1.0 for d in report["drafts"] for a in d["rates"])
    assert all(d["predicted"]["0"] == pytest.approx(1.0) for d in report["drafts"])
    if report["recommendation"]["draft"] is not None:
        assert report["measured"]["speedup"] > 0
    saved = json.loads(costs.read_text())
    assert saved["verify_base_s"] > 0
    # The batched figures (issue 15): passes of 1..128 rows over up to 16 sequences on the native runtime, lockstep
    # drafts by sequences (first forward, each further one), and what they belong to.
    assert {"1", "16", "64", "128"} <= set(saved["rows_table"]) and all(v > 0 for v in saved["rows_table"].values())
    assert set(saved["draft_lines"]) == {"1", "4", "16"}
    assert all(first > 0 and further >= 0 for first, further in saved["draft_lines"].values())
    assert saved["model"]["target"] == str(tiny_models["llama"]) and saved["model"]["target_dtype"] == "float32"
    assert CostModel.from_json(saved).verify_rows(16) == saved["rows_table"]["16"]


def test_tune_rejects_a_missing_prompts_file(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "tune",
            "--target",
            str(tiny_models["llama"]),
            "--draft",
            str(tiny_models["draft"]),
            "--prompts",
            "/nonexistent/p.jsonl",
        ]
    )
    assert code == 2
    assert "prompt file not found: /nonexistent/p.jsonl" in capsys.readouterr().err


def test_measured_batch_costs_prime_the_adaptive_policy_only_for_their_models(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from specdec.api import load
    from specdec.tune import matching_costs, model_identity, starting_costs

    engine = load(tiny_models["llama"], tiny_models["draft"], dtype="float32", policy="adaptive")
    path = tmp_path / "costs.json"
    assert not matching_costs(engine, path)[0]  # no file: nothing primed
    doc = {"verify_base_s": 1e-3, "draft_per_token_s": 1e-4, "rows_table": {"1": 0.001, "64": 0.004}}
    path.write_text(json.dumps({**doc, "model": {**model_identity(engine), "target": "/elsewhere"}}))
    costs, note = matching_costs(engine, path)
    assert not costs and "other models" in note
    # Measured with another number of compute threads, or drafts on other threads (`--draft-threads`): not
    # used, and said.
    other = model_identity(engine)["threads"] + 1
    path.write_text(json.dumps({**doc, "model": {**model_identity(engine), "threads": other}}))
    costs, note = matching_costs(engine, path)
    assert not costs and f"measured with {other} compute threads" in note and "--threads" in note
    path.write_text(json.dumps({**doc, "model": {**model_identity(engine), "draft_threads": other}}))
    costs, note = matching_costs(engine, path)
    assert not costs and f"(drafts on {other})" in note
    # Measured with caches of another type (the attention reads twice the bytes of fp32 ones): not used.
    assert model_identity(engine)["kv_dtype"] == "fp32"  # fp32 weights: fp32 caches
    path.write_text(json.dumps({**doc, "model": {**model_identity(engine), "kv_dtype": "bf16"}}))
    costs, note = matching_costs(engine, path)
    assert not costs and "other models or settings" in note
    lines = {"1": [3e-4, 1e-4], "16": [9e-4, 3e-4]}
    # Figures a busy machine left (a pass of 32 rows cheaper than one of 16; a file from before tune checked them):
    # not used, and said.
    busy = {**doc, "rows_table": {"1": 0.001, "16": 0.0182, "32": 0.0089}, "model": model_identity(engine)}
    path.write_text(json.dumps(busy))
    costs, note = matching_costs(engine, path)
    assert not costs and "implausible (a pass of 32 rows measured 8.90 ms, of 16 rows 18.20 ms" in note
    path.write_text(
        json.dumps(
            {
                **doc,
                "draft_forward_s": 2e-4,
                "draft_row_frac": 0.1,
                "draft_lines": lines,
                "model": model_identity(engine),
            }
        )
    )
    costs, note = matching_costs(engine, path)
    assert costs.passes == {1: 0.001, 64: 0.004} and costs.draft_forwards[16] == pytest.approx(2e-4 * 2.5)
    assert costs.draft_lines == {1: (3e-4, 1e-4), 16: (9e-4, 3e-4)}
    engine.prime(costs)
    batch = engine.policy.batch_costs  # type: ignore[attr-defined]
    curve = batch.verify
    assert curve(64, 1.0) == pytest.approx(0.004) and curve(32, 1.0) == pytest.approx(0.001 + 0.003 * 31 / 63)
    # Draft lines: as measured, between the counts measured linearly.
    assert batch.measured_line(16) == (9e-4, 3e-4) and batch.measured_line(6) == pytest.approx((5e-4, 1e-4 + 2e-4 / 3))
    # No file, or none for these models: a server measures its passes as it starts (``starting_costs``).
    missing = tmp_path / "none.json"
    measured, note = starting_costs(engine, missing)
    assert "measured now" in note and measured.passes and set(measured.draft_lines) == {1, 4, 16}
    assert not starting_costs(engine, missing, measure=False)[0]
    assert starting_costs(engine, path)[0] == costs  # a matching file is used as it is
    later = engine.get_policy("adaptive:max_tau=3")  # made after priming: primed too
    assert later.batch_costs.verify(64, 1.0) == pytest.approx(0.004)  # type: ignore[attr-defined]


def test_a_server_measures_its_costs_on_a_thread_that_ends(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured on the calling (main) thread, the passes left that thread's OpenMP pool alive and the server's worker
    passes ran 8-14% slower for good; on a thread of its own, which ends, they do not (``tune._on_own_thread``).
    Errors come back to the caller."""
    import threading

    import specdec.tune as tune
    from specdec.api import load

    engine = load(tiny_models["llama"], tiny_models["draft"], dtype="float32", policy="adaptive")
    ran: list[threading.Thread] = []

    def fake(*args: Any, **kwargs: Any) -> dict[str, Any]:
        ran.append(threading.current_thread())
        return {"rows_table": {1: 1e-3, 16: 2e-3}}

    monkeypatch.setattr(tune, "measure_batched_costs", fake)
    costs, note = tune.starting_costs(engine, tmp_path / "none.json")
    assert costs.passes == {1: 1e-3, 16: 2e-3} and "measured now" in note
    assert ran[0] is not threading.current_thread() and not ran[0].is_alive()

    def broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("the pass failed")

    monkeypatch.setattr(tune, "measure_batched_costs", broken)
    with pytest.raises(RuntimeError, match="the pass failed"):
        tune.starting_costs(engine, tmp_path / "none.json")


def test_tune_does_not_save_costs_a_busy_machine_measured_each_time(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``specdec tune --save-costs`` measures its batched passes again while they are implausible (as a server's
    start does), and where they are implausible each time writes no file (a server would refuse it) and says why in
    one line, exit 1. Plausible on a later try: saved, the tries said."""
    import specdec.tune as tune

    monkeypatch.setattr(tune, "START_PAUSE_S", 0.0)
    tries: list[int] = []
    busy = {"rows_table": {1: 1.4e-3, 16: 18.2e-3, 32: 8.9e-3}}
    quiet = {"rows_table": {1: 1.4e-3, 16: 3.0e-3, 32: 4.9e-3}, "draft_lines": {1: (3.6e-4, 1e-4)}}
    answers: list[dict[str, Any]] = []

    def measure(*args: Any, **kwargs: Any) -> dict[str, Any]:
        tries.append(1)
        return answers.pop(0)

    monkeypatch.setattr(tune, "measure_batched_costs", measure)
    costs, prompts = tmp_path / "costs.json", tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def fibonacci(n):"}\n')
    argv = [
        "tune",
        "--prompts",
        str(prompts),
        "--target",
        str(tiny_models["llama"]),
        "--draft",
        str(tiny_models["draft"]),
        "--max-new-tokens",
        "4",
        "--max-tau",
        "2",
        "--dtype",
        "float32",
        "--no-measure",
        "--save-costs",
        str(costs),
    ]
    answers[:] = [busy] * tune.START_ATTEMPTS
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(tries) == tune.START_ATTEMPTS and not costs.exists()
    line = next(x for x in err.splitlines() if "error" in x)
    assert "implausibly 4 times (a pass of 32 rows measured 8.90 ms, of 16 rows 18.20 ms)" in line
    assert f"{costs} not written" in line and "Traceback" not in err
    answers[:] = [busy, quiet]
    assert main(argv) == 0
    assert "2 tries, the machine was busy" in capsys.readouterr().err
    assert json.loads(costs.read_text())["rows_table"] == {"1": 1.4e-3, "16": 3.0e-3, "32": 4.9e-3}


def test_costs_a_busy_machine_measured_are_refused() -> None:
    """What a pass pre-empted by another process leaves, seen on two servers started together (tune.implausible_costs):
    a bigger pass measured cheaper, a pass of twice the rows more than twice as dear, a draft's further forwards free."""
    from specdec.tune import implausible_costs

    alone = {"rows_table": {1: 1.4e-3, 16: 3.0e-3, 32: 4.9e-3, 64: 9.0e-3}, "draft_lines": {1: (3.6e-4, 1e-4)}}
    assert implausible_costs(alone) is None
    assert implausible_costs({}) is None
    cheaper = {"rows_table": {1: 1.4e-3, 16: 18.2e-3, 32: 8.9e-3}}
    assert "a pass of 32 rows measured 8.90 ms, of 16 rows 18.20 ms" in str(implausible_costs(cheaper))
    dearer = {"rows_table": {16: 2.7e-3, 32: 8.4e-3}}
    assert "32 rows" in str(implausible_costs(dearer))
    assert implausible_costs({"rows_table": {16: 2.7e-3, 32: 6.2e-3}}) is None  # 2.3x: within 15% of twice
    free = {"rows_table": alone["rows_table"], "draft_lines": {1: (3.6e-4, 1e-4), 16: (8.5e-3, 0.0)}}
    assert implausible_costs(free) == "a draft over 16 sequences measured no cost per further forward"


def test_a_pass_past_a_row_group_may_cost_a_whole_further_group() -> None:
    """On the AMX build a pass of 17 rows runs a second row group of tiles and can cost what 32 rows do (1.3-1.5x 16
    rows, measured): with the target's row groups in the measurement (``row_granule``) that is no sign of a busy
    machine; without them it still is."""
    from specdec.tune import implausible_costs

    grouped = {"rows_table": {8: 1.58e-3, 16: 1.86e-3, 17: 2.80e-3, 32: 2.82e-3, 64: 4.9e-3}, "row_granule": 16}
    assert implausible_costs(grouped) is None
    assert "17 rows" in str(implausible_costs({**grouped, "row_granule": 0}))
    assert "17 rows" in str(
        implausible_costs({**grouped, "rows_table": {16: 1.86e-3, 17: 4.6e-3}})
    )  # > 2 groups' worth


def test_the_measured_passes_take_the_first_row_past_a_group_and_say_the_groups(tiny_models: dict[str, Path]) -> None:
    """Where the target runs its passes in row groups (``row_granule``: the CPU kernel's AMX build, 16 rows), the costs
    measured for a batching policy include the first row past a group (what a further group costs) and say the
    groups, and the policy reads its passes by them; elsewhere neither."""
    from specdec.api import load
    from specdec.tune import costs_of, measure_batched_costs

    engine = load(tiny_models["llama"], tiny_models["draft"], dtype="float32", policy="adaptive")
    assert engine.target.row_granule == 0  # fp32 weights: no tiles
    plain = measure_batched_costs(engine, rows=(1, 8, 32), rounds=1, min_seconds=0.0)
    assert sorted(plain["rows_table"]) == [1, 8, 32] and plain["row_granule"] == 0
    engine.target.row_granule = 16  # as a bf16 target on the AMX build
    grouped = measure_batched_costs(engine, rows=(1, 8, 32), rounds=1, min_seconds=0.0)
    assert sorted(grouped["rows_table"]) == [1, 8, 17, 32] and grouped["row_granule"] == 16
    costs = costs_of(grouped)
    assert costs.row_granule == 16 and costs_of(plain).row_granule == 0
    engine.prime(costs)
    policy = engine.policy
    assert policy.batch_costs.granule == 16  # type: ignore[attr-defined]


def test_a_server_measures_again_while_the_machine_is_busy(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Implausible start costs are measured again after a pause, and after START_ATTEMPTS tries not used at all (the
    curves then learn from the steps); every try takes the least of START_ROUNDS rounds."""
    import specdec.tune as tune
    from specdec.api import load

    engine = load(tiny_models["llama"], tiny_models["draft"], dtype="float32", policy="adaptive")
    busy = {"rows_table": {1: 5e-3, 16: 2e-3}}
    quiet = {"rows_table": {1: 1e-3, 16: 2e-3}}
    answers: list[dict[str, Any]] = []
    asked: list[dict[str, Any]] = []
    pauses: list[float] = []

    def fake(*args: Any, **kwargs: Any) -> dict[str, Any]:
        asked.append(kwargs)
        return answers.pop(0)

    monkeypatch.setattr(tune, "measure_batched_costs", fake)
    monkeypatch.setattr(tune.time, "sleep", pauses.append)
    answers[:] = [busy, busy, quiet]
    costs, note = tune.starting_costs(engine, tmp_path / "none.json")
    assert costs.passes == {1: 1e-3, 16: 2e-3} and "measured now" in note and "3 tries: the machine was busy" in note
    assert len(pauses) == 2 and all(0 < p <= tune.START_PAUSE_S for p in pauses)
    assert asked[0]["pick"] is min and asked[0]["rounds"] == tune.START_ROUNDS
    answers[:] = [busy] * tune.START_ATTEMPTS
    costs, note = tune.starting_costs(engine, tmp_path / "none.json")
    assert not costs and "learnt from steps" in note and "a pass of 16 rows measured 2.00 ms" in note
    assert not answers  # every try was made


def test_a_server_primes_its_costs_as_its_costs_setting_says(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdec.api import load
    from specdec.errors import InvalidRequestError
    from specdec.server.settings import ServerSettings
    from specdec.tune import model_identity, prime_for_serving

    def engine() -> Any:
        return load(tiny_models["llama"], tiny_models["draft"], dtype="float32", policy="adaptive")

    none = engine()
    assert "learnt from steps" in prime_for_serving(none, ServerSettings(costs="none"))
    assert not none.measured_costs and none.costs_note.endswith("(--costs none)")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows_table": {"1": 1e-3}, "model": {"target": "/elsewhere"}}))
    with pytest.raises(InvalidRequestError, match="--costs: .*other models"):
        prime_for_serving(engine(), ServerSettings(costs=str(other)))
    mine = tmp_path / "mine.json"
    e = engine()
    mine.write_text(json.dumps({"rows_table": {"1": 1e-3, "16": 2e-3}, "model": model_identity(e)}))
    assert "batch costs from" in prime_for_serving(e, ServerSettings(costs=str(mine)))
    assert e.measured_costs.passes == {1: 1e-3, 16: 2e-3}
    with pytest.raises(InvalidRequestError, match="--costs: no measured costs"):
        prime_for_serving(engine(), ServerSettings(costs=str(tmp_path / "missing.json")))
    monkeypatch.setenv("SPECDEC_COSTS", str(tmp_path / "missing.json"))  # the default file: none here
    unbatched = engine()  # one request per pass: no batch plans to measure for
    note = prime_for_serving(unbatched, ServerSettings(max_batch=1))
    assert note.endswith("batch costs learnt from steps") and not unbatched.measured_costs
    batched = engine()
    assert "measured now" in prime_for_serving(batched, ServerSettings()) and batched.measured_costs.draft_lines
