"""The web playground in headless Chromium against a real ``specdec serve`` on 127.0.0.1.

Needs Debian's ``chromium`` (apt) and Playwright for Python (pip; its bundled browsers are not used).
Skips only when the chromium binary is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

CHROMIUM = os.environ.get("SPECDEC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PROMPT = "Once upon a time"
MAX_TOKENS = 24
TAU = 3

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        not Path(CHROMIUM).is_file(), reason=f"chromium is not installed ({CHROMIUM} missing: apt-get install chromium)"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``specdec serve`` with the tiny llama as target and as its own draft (every step: accepted + bonus)."""
    port = _free_port()
    llama = str(tiny_models["llama"])
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "specdec.cli",
        "serve",
        "--target",
        llama,
        "--draft",
        llama,
        "--tau",
        str(TAU),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"specdec serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"specdec serve did not come up in 120 s:\n{log_path.read_text()}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def page(server: str) -> Iterator[tuple[Any, list[str]]]:
    """A Chromium page on the playground, with every console error and page error collected."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1280, "height": 1000})
            pg.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            pg.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            pg.on("requestfailed", lambda r: errors.append(f"request failed: {r.url} {r.failure}"))
            # Nothing may come from anywhere but the server itself (no CDN, no fonts, no telemetry).
            pg.on("request", lambda r: None if r.url.startswith((server + "/", "data:")) else errors.append(r.url))
            pg.goto(server + "/")
            yield pg, errors
        finally:
            browser.close()


def _greedy_api(server: str, **fields: Any) -> dict[str, Any]:
    """The API's answer to the request the playground sends by default (greedy, fixed τ), with ``fields`` added."""
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "speculative": {"policy": "fixed", "tau": TAU},
        **fields,
    }
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_playground_streams_greedy_output_and_steps(server: str, page: tuple[Any, list[str]]) -> None:
    pg, errors = page
    # wait_for_selector, not wait_for_function: the page's CSP forbids eval, which polling functions need.
    pg.wait_for_selector("#model option", state="attached", timeout=30_000)
    assert "serving" in pg.text_content("#server-info")
    assert pg.eval_on_selector_all("#policy option", "os => os.map(o => o.value)")[:1] == ["fixed"]

    # Keyboard only: type into the fields, then Ctrl+Enter.
    pg.focus("#prompt")
    pg.keyboard.press("Control+A")
    pg.keyboard.press("Delete")
    pg.keyboard.type(PROMPT)
    pg.select_option("#policy", "fixed")
    for field, value in (("#tau", TAU), ("#temperature", 0), ("#max-tokens", MAX_TOKENS)):
        pg.fill(field, str(value))
    pg.focus("#prompt")
    pg.keyboard.press("Control+Enter")
    pg.wait_for_selector("body[data-state=done]", timeout=90_000)

    api = _greedy_api(server)
    assert pg.text_content("#output-text") == api["choices"][0]["text"]
    assert pg.text_content("#stat-finish") == api["choices"][0]["finish_reason"]
    spec = api["speculative"]
    assert pg.locator("#steps > li").count() == spec["target_passes"]
    assert pg.text_content("#stat-alpha").startswith(f"{spec['acceptance_rate']:.2f}")
    accepted = pg.locator("#steps .tok.accepted").count()
    corrections = pg.locator("#steps ins.tok").count()
    assert accepted >= 1 and accepted == spec["accepted"]
    assert corrections >= 1
    assert pg.locator("#chart-accept rect.bar").count() == TAU
    assert pg.locator("#chart-speed polyline").count() == 1
    assert pg.is_hidden("#error")

    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)
    assert errors == []


def test_playground_penalties_and_logprobs(server: str, page: tuple[Any, list[str]]) -> None:
    """The penalty and length controls reach the request, and the log probabilities are listed, one per token."""
    pg, errors = page
    pg.click("summary:has-text('Penalties and length')")
    pg.fill("#presence-penalty", "1.5")
    pg.fill("#repetition-penalty", "1.3")
    pg.check("#ignore-eos")
    pg.check("#want-logprobs")
    pg.focus("#prompt")
    pg.keyboard.press("Control+Enter")
    pg.wait_for_selector("body[data-state=done]", timeout=90_000)
    api = _greedy_api(server, presence_penalty=1.5, repetition_penalty=1.3, ignore_eos=True, logprobs=3)
    assert api["choices"][0]["text"] != _greedy_api(server)["choices"][0]["text"]  # the penalties took effect
    assert pg.text_content("#output-text") == api["choices"][0]["text"]
    lps = api["choices"][0]["logprobs"]["token_logprobs"]
    assert pg.locator("#logprobs > li").count() == len(lps) == MAX_TOKENS
    assert f"{lps[0]:.3f}" in pg.text_content("#logprobs > li:first-child")
    for field, value in (("#presence-penalty", "0"), ("#repetition-penalty", "1")):
        pg.fill(field, value)
    pg.uncheck("#ignore-eos")
    pg.uncheck("#want-logprobs")
    assert errors == []


def test_playground_output_format(server: str, page: tuple[Any, list[str]]) -> None:
    """A JSON schema typed into the output format section reaches the request: the output is the API's under it."""
    import json

    pg, errors = page
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
    pg.click("summary:has-text('Output format')")
    pg.select_option("#format-kind", "json_schema")
    pg.fill("#format-value", "{not json")
    pg.focus("#prompt")
    pg.keyboard.press("Control+Enter")
    assert "the schema is not JSON" in pg.text_content("#error")
    pg.fill("#format-value", json.dumps(schema))
    pg.focus("#prompt")
    pg.keyboard.press("Control+Enter")
    pg.wait_for_selector("body[data-state=done]", timeout=90_000)
    api = _greedy_api(
        server, response_format={"type": "json_schema", "json_schema": {"name": "playground", "schema": schema}}
    )
    assert api["choices"][0]["text"].startswith('{"name": "')
    assert pg.text_content("#output-text") == api["choices"][0]["text"]
    pg.select_option("#format-kind", "text")
    assert errors == []


def test_playground_narrow_and_errors(page: tuple[Any, list[str]]) -> None:
    """At phone width nothing scrolls sideways; a bad field gets a message naming it, and no request is sent."""
    pg, errors = page
    pg.set_viewport_size({"width": 360, "height": 800})
    overflow = pg.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 0
    pg.fill("#max-tokens", "0")
    pg.focus("#prompt")
    pg.keyboard.press("Control+Enter")
    assert "max tokens" in pg.text_content("#error")
    assert pg.get_attribute("#max-tokens", "aria-invalid") == "true"
    assert pg.evaluate("document.activeElement.id") == "max-tokens"
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "playground-narrow.png"), full_page=True)
    assert errors == []


def test_playground_n_samples(server: str, page: tuple[Any, list[str]]) -> None:
    """n = 2 greedy: sample 0 streams into the main output (with its steps), sample 1 below it; both are the
    API's greedy text."""
    pg, errors = page
    pg.wait_for_selector("#model option", state="attached", timeout=30_000)
    pg.fill("#prompt", PROMPT)
    pg.select_option("#policy", "fixed")
    for field, value in (("#tau", TAU), ("#temperature", 0), ("#max-tokens", MAX_TOKENS), ("#n", 2)):
        pg.fill(field, str(value))
    pg.focus("#prompt")
    pg.keyboard.press("Control+Enter")
    pg.wait_for_selector("body[data-state=done]", timeout=90_000)
    api = _greedy_api(server)
    text = api["choices"][0]["text"]
    assert pg.text_content("#output-text") == text
    assert pg.locator("#samples pre").count() == 1
    assert pg.text_content("#samples pre") == f"sample 1: {text}"
    assert pg.locator("#steps > li").count() == api["speculative"]["target_passes"]
    pg.fill("#n", "0")
    pg.focus("#prompt")
    pg.keyboard.press("Control+Enter")
    assert "n must be" in pg.text_content("#error")
    pg.fill("#n", "1")
    assert errors == []
