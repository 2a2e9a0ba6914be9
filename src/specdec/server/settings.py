"""Server settings (the ``specdec serve`` flags that are not about models)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdec.engine import DEFAULT_CHAIN_PLAIN, DEFAULT_PREFILL_IN_STEP

STATIC_DIR = Path(__file__).resolve().parent / "static"


@dataclass
class ServerSettings:
    model_name: str = "specdec"  # the id clients pass as "model" (GET /v1/models)
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer KEY"
    max_active: int = 16  # requests in flight at once (each holds a cache slot)
    max_batch: int = 16  # requests sharing one step's draft and target passes (1: one request per pass)
    max_queue: int = 64  # requests waiting beyond those; more get 429
    # Prompt tokens each batched step takes in, at most: joining prompts are prefilled by the steps, in the passes they
    # share with the batch (a longer one in pieces), not in passes of their own between steps (None: 256 when
    # max_batch > 1, else 0; 0: every prompt in a pass of its own).
    prefill_in_step: int | None = None
    # Target passes a plain step chains (``Engine.chain_plain``), each pass's token the next one's row, before
    # the step's commit: the engine's Python between passes paid once per chain (None: DEFAULT_CHAIN_PLAIN when
    # max_batch > 1, else 1).
    chain_plain: int | None = None
    request_timeout: float = 600.0  # seconds from arrival; then the request is cancelled (408)
    # Tokens a streamed choice gathers before its text is sent (its first text and its last at once): fewer, larger
    # chunks for the event loop and the clients under load, against a smoother stream at 1.
    stream_interval: int = 1
    # Milliseconds a streamed choice's text waits after its last chunk before the next is sent (its first text and its
    # last at once): at most one chunk per this long a choice, however fast the steps come. 0: every step's text.
    stream_interval_ms: float = 20.0
    max_body_bytes: int = 2 * 1024 * 1024
    static_dir: Path | None = field(default=STATIC_DIR)  # the web playground, served at / when present
    # Where the batch plans' pass costs start from (``tune.prime_for_serving``): None, a cost file measured on the served
    # models ($SPECDEC_COSTS or ~/.cache/specdec/costs.json), else measured as the server starts; "none": learnt from
    # steps alone; a path: that cost file, which must have been measured on the served models.
    costs: str | None = None
    # The chat template's text (``--chat-template``) for /v1/chat/completions; None: the tokenizer's own, if any.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        from specdec.errors import InvalidRequestError

        checks = {
            "max_active": self.max_active >= 1,
            "max_batch": self.max_batch >= 1,
            "max_queue": self.max_queue >= 0,
            "prefill_in_step": self.prefill_in_step is None or self.prefill_in_step >= 0,
            "chain_plain": self.chain_plain is None or self.chain_plain >= 1,
            "request_timeout": self.request_timeout > 0,
            "stream_interval": self.stream_interval >= 1,
            "stream_interval_ms": 0 <= self.stream_interval_ms <= 10_000,
            "max_body_bytes": self.max_body_bytes > 0,
            "model_name": bool(self.model_name),
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(f"invalid server setting {name}={getattr(self, name)!r}", name)

    @property
    def prefill_tokens_in_step(self) -> int:
        """``prefill_in_step`` resolved: 256 tokens when batching, 0 for one request per pass."""
        if self.prefill_in_step is not None:
            return self.prefill_in_step
        return DEFAULT_PREFILL_IN_STEP if self.max_batch > 1 else 0

    @property
    def chain_passes(self) -> int:
        """``chain_plain`` resolved: DEFAULT_CHAIN_PLAIN when batching, 1 for one request per pass."""
        if self.chain_plain is not None:
            return self.chain_plain
        return DEFAULT_CHAIN_PLAIN if self.max_batch > 1 else 1
