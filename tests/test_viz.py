"""Step rendering (specdec.viz) on hand-built records, in the terminal (ANSI) and plain forms, and the CLI flag."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from specdec.records import GenerationStats, StepRecord
from specdec.viz import RESET, StepRenderer, default_style, plain_token, visible_token

ANSI = re.compile(r"\x1b\[[0-9;]*m")
GREEN, STRIKE, YELLOW, CYAN, MAGENTA = "\x1b[32m", "\x1b[2;9m", "\x1b[1;33m", "\x1b[1;36m", "\x1b[1;35m"

PIECES = {1: "foo", 2: " bar", 3: "baz", 4: "\n", 5: "x", 6: "qux", 7: "y", 8: "\t"}


class FakeTokenizer:
    """decode() of single ids from a fixed table; counts calls to check the cache."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls += 1
        return "".join(PIECES[i] for i in ids)


def record(
    step: int,
    tau: int,
    draft: list[int],
    flags: list[bool],
    correction_token: int,
    kind: str,
    emitted: list[int] | None = None,
    reason: str = "fixed tau=4",
) -> StepRecord:
    n = next((i for i, f in enumerate(flags) if not f), tau)
    return StepRecord(
        request_id="r",
        step=step,
        prompt_len=3,
        context_len=3 + step,
        policy="fixed",
        reason=reason,
        tau=tau,
        draft_tokens=draft,
        accept_flags=flags,
        n_accepted=n,
        correction=kind,  # type: ignore[arg-type]
        emitted=emitted if emitted is not None else draft[:n] + [correction_token],
        draft_time=0.01,
        verify_time=0.02,
        other_time=0.001,
    )


ACCEPT_ALL = record(0, 3, [1, 2, 3], [True, True, True], 5, "bonus")
REJECT_FIRST = record(1, 3, [6, 2, 3], [False, True, True], 5, "recovered")
REJECT_MIDDLE = record(2, 4, [1, 4, 6, 3], [True, True, False, True], 7, "recovered")
FALLBACK = record(3, 0, [], [], 8, "plain", reason="acceptance too low: drafting off")


@pytest.fixture
def plain() -> StepRenderer:
    return StepRenderer(FakeTokenizer(), "plain")


@pytest.fixture
def ansi() -> StepRenderer:
    return StepRenderer(FakeTokenizer(), "ansi")


def test_plain_accept_all(plain: StepRenderer) -> None:
    assert plain.step(ACCEPT_ALL) == "step 0 τ=3 [accepted: 'foo' ' bar' 'baz'] [bonus: 'x'] (reason: fixed tau=4)"


def test_plain_reject_first(plain: StepRenderer) -> None:
    line = plain.step(REJECT_FIRST)
    assert line == "step 1 τ=3 [rejected: ~~'qux'~~ ~~' bar'~~ ~~'baz'~~] [recovered: 'x'] (reason: fixed tau=4)"
    assert "accepted" not in line


def test_plain_reject_middle_escapes_newline(plain: StepRenderer) -> None:
    line = plain.step(REJECT_MIDDLE)
    assert (
        line
        == "step 2 τ=4 [accepted: 'foo' '\\n'] [rejected: ~~'qux'~~ ~~'baz'~~] [recovered: 'y'] (reason: fixed tau=4)"
    )
    assert "\n" not in line


def test_plain_fallback_tau_zero(plain: StepRenderer) -> None:
    line = plain.step(FALLBACK)
    assert line == "step 3 τ=0 [plain: '\\t'] (reason: acceptance too low: drafting off)"
    assert "\t" not in line


def test_plain_has_no_escape_codes(plain: StepRenderer) -> None:
    stats = GenerationStats(new_tokens=9, target_passes=4, drafted=10, accepted=5, steps=4, latency=1.0)
    text = "\n".join(plain.step(r) for r in (ACCEPT_ALL, REJECT_FIRST, REJECT_MIDDLE, FALLBACK))
    assert "\x1b" not in text + plain.footer(stats) + plain.legend()


def test_stop_cut_step_marks_dropped_tokens(plain: StepRenderer) -> None:
    # All three drafts accepted, but a stop condition kept only the first: the rest and the bonus never reached output.
    rec = record(4, 3, [1, 2, 3], [True, True, True], 5, "bonus", emitted=[1])
    assert plain.step(rec) == (
        "step 4 τ=3 [accepted: 'foo'] [accepted, cut by stop: ' bar' 'baz'] (reason: fixed tau=4)"
    )


def test_ansi_accept_all_is_green_with_cyan_bonus(ansi: StepRenderer) -> None:
    line = ansi.step(ACCEPT_ALL)
    for piece in ("foo", "·bar", "baz"):
        assert f"{GREEN}{piece}{RESET}" in line
    assert f"{CYAN}x{RESET}" in line
    assert STRIKE not in line and YELLOW not in line
    assert ANSI.sub("", line) == "   0 τ=3  │ foo ·bar baz x │ fixed tau=4"


def test_ansi_reject_first_strikes_whole_draft(ansi: StepRenderer) -> None:
    line = ansi.step(REJECT_FIRST)
    assert GREEN not in line
    assert [m for m in re.findall(r"\x1b\[2;9m([^\x1b]*)", line)] == ["qux", "·bar", "baz"]
    assert f"{YELLOW}x{RESET}" in line


def test_ansi_reject_middle(ansi: StepRenderer) -> None:
    line = ansi.step(REJECT_MIDDLE)
    assert re.findall(r"\x1b\[32m([^\x1b]*)", line) == ["foo", "↵"]
    assert re.findall(r"\x1b\[2;9m([^\x1b]*)", line) == ["qux", "baz"]
    assert f"{YELLOW}y{RESET}" in line
    assert "\n" not in line


def test_ansi_fallback_is_distinct_from_corrections(ansi: StepRenderer) -> None:
    line = ansi.step(FALLBACK)
    assert f"{MAGENTA}→{RESET}" in line
    assert YELLOW not in line and CYAN not in line and GREEN not in line
    assert "acceptance too low: drafting off" in ANSI.sub("", line)


def test_ansi_spans_are_closed(ansi: StepRenderer) -> None:
    for rec in (ACCEPT_ALL, REJECT_FIRST, REJECT_MIDDLE, FALLBACK):
        line = ansi.step(rec)
        assert line.count("\x1b[") == 2 * line.count(RESET), line


def test_footer_reports_alpha_length_passes_speed(plain: StepRenderer, ansi: StepRenderer) -> None:
    stats = GenerationStats(
        new_tokens=12,
        target_passes=4,
        drafted=10,
        accepted=8,
        steps=4,
        latency=2.5,
        prefill_time=0.5,
        finish_reason="length",
    )
    text = plain.footer(stats)
    assert "α 0.80 (8/10" in text
    assert "mean accepted length 3.00" in text and "incl. correction token" in text
    assert "4 target passes" in text and "6.0 tok/s" in text
    assert ANSI.sub("", ansi.footer(stats)) == text


def test_token_text_is_decoded_once(plain: StepRenderer) -> None:
    tok = FakeTokenizer()
    r = StepRenderer(tok, "plain")
    r.step(ACCEPT_ALL)
    r.step(ACCEPT_ALL)
    assert tok.calls == 4  # 3 drafts + 1 correction, cached afterwards


def test_visible_and_plain_token_forms() -> None:
    assert visible_token(" a\nb\t") == "·a↵b→"
    assert visible_token("") == "∅"
    assert visible_token("\x07") == "\\x07"
    assert plain_token("it's\n") == "'it\\'s\\n'"
    assert plain_token("\x1b[31m") == "'\\x1b[31m'"  # a token can never inject escape codes into a log


def test_unknown_style_and_default_style(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown step style"):
        StepRenderer(FakeTokenizer(), "html")  # type: ignore[arg-type]

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert default_style(io.StringIO()) == "plain"
    assert default_style(Tty()) == "ansi"
    monkeypatch.setenv("NO_COLOR", "1")
    assert default_style(Tty()) == "plain"


def test_cli_show_steps(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The llama drafting for itself accepts every draft token: each step ends in a bonus token."""
    from specdec.cli import main

    llama = str(tiny_models["llama"])
    rc = main(
        [
            "generate",
            "hello world",
            "--target",
            llama,
            "--draft",
            llama,
            "--max-new-tokens",
            "9",
            "--tau",
            "3",
            "--show-steps",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "\x1b" not in out  # captured stdout is not a terminal: plain form
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert steps and steps[0].startswith("step 0 τ=3 [accepted: ") and "[bonus: " in steps[0]
    assert "--- output ---" in out and "mean accepted length" in out and "target passes" in out

    rc = main(["generate", "hello", "--target", llama, "--max-new-tokens", "2", "--show-steps=ansi"])
    out = capsys.readouterr().out
    assert rc == 0 and "\x1b[1;35m" in out  # no drafter: plain target steps

    assert main(["generate", "hello", "--target", llama, "--show-steps", "--json"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


@pytest.mark.parametrize("draft", ["llama", "draft"])
def test_parts_of_real_steps_rebuild_the_output(tiny_models: dict[str, Path], draft: str) -> None:
    """On real steps (self-draft: all accepted; random draft: mostly rejected), accepted + correction = emitted."""
    import specdec
    from specdec.viz import StepParts

    engine = specdec.load(tiny_models["llama"], tiny_models[draft], tau=3)
    result = engine.generate("hello world", max_new_tokens=16)
    rebuilt: list[int] = []
    for rec in result.records:
        parts = StepParts.of(rec)
        assert parts.rejected == rec.draft_tokens[rec.n_accepted :]
        assert not parts.cut or rec is result.records[-1]  # only a stop can cut a step, and it ends the request
        rebuilt += parts.accepted + ([parts.correction] if parts.correction is not None else [])
    assert rebuilt == result.token_ids
    kinds = {r.correction for r in result.records}
    if draft == "llama":
        assert kinds <= {"bonus", "plain"}
    else:
        assert "recovered" in kinds
