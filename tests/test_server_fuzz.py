"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis): valid and invalid requests
alike must never get a 5xx, and every error must be in OpenAI's shape.

Deterministic (hypothesis ``derandomize``), so a failure reproduces; the model has a 32-token context so valid
requests stay cheap and the whole run is bounded (40 examples per POST operation and generation mode).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from specdec.server import ServerSettings, create_app  # noqa: E402

pytestmark = pytest.mark.server

CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def fuzz_app(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    import specdec
    from specdec.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("fuzz")
    target = tiny_checkpoint(root / "target", "llama", seed=7, tokenizer_from=tiny_models["llama"], max_positions=32)
    tok = AutoTokenizer.from_pretrained(str(target))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(target))
    draft = root / "draft"
    shutil.copytree(tiny_models["draft"], draft)
    engine = specdec.load(target, draft)
    app = create_app(engine, ServerSettings(model_name="tiny", max_body_bytes=64 * 1024, request_timeout=30))
    yield app
    app.state.scheduler.stop()


MODES = ["positive", "negative"]


@pytest.mark.parametrize("mode", MODES)
def test_no_server_errors(fuzz_app: Any, mode: str) -> None:
    api = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    for op in operations:
        post = op.method.upper() == "POST"
        if mode == "negative" and not post:
            continue  # GET operations take no body: there is no invalid input to generate
        examples = 40 if post else 5

        @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: Any) -> None:
            response = case.call()
            assert response.status_code < 500, (case.path, case.body, response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text

        check()
