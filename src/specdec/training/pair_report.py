"""Figures for docs/models.md: α of distilled vs CE-only draft, validation loss, latency, samples, curves.

``python -m specdec.training.default_pair --work runs/default --stages report`` writes ``report.json`` in the
work directory and (with matplotlib) ``docs/models_curves.png``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# No trailing newline: the tokenizer merges "\n" with the next line's indentation (see docs/models.md).
SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_python_files(root):",
)


def per_token_latency(path: Path, dtype: torch.dtype, context: int = 100, repeats: int = 60) -> float:
    """Median seconds of one single-token forward with ``context`` tokens already cached (default runtime)."""
    from specdec.runtime import load_runner

    runner = load_runner(path, device=torch.device("cpu"), dtype=dtype)
    cache = runner.new_cache()
    runner.forward(torch.arange(1, context + 1), cache)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        runner.forward(torch.tensor([(i % 100) + 5]), cache, last_only=True)
        times.append(time.perf_counter() - t0)
        cache.crop(context)
    return statistics.median(times[5:])


def draft_val_loss(path: Path, windows: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    from specdec.training.pretrain import evaluate

    return evaluate(AutoModelForCausalLM.from_pretrained(str(path)).eval(), windows)


def throughput(target: Path, draft: Path | None, prompts: list[list[int]], new: int = 64) -> float:
    """Decode tokens/s over ``prompts`` (greedy), speculative with τ=4 when a draft is given."""
    import specdec

    engine = specdec.load(target, draft, tau=4 if draft else 0)
    engine.generate(prompts[0], max_new_tokens=8)  # warm-up
    tokens, seconds = 0, 0.0
    for p in prompts:
        s = engine.generate(p, max_new_tokens=new).stats
        tokens, seconds = tokens + s.new_tokens, seconds + s.latency - s.prefill_time
    return tokens / seconds


def samples(target: Path, draft: Path) -> list[dict[str, Any]]:
    import specdec

    engine = specdec.load(target, draft, tau=4)
    out = []
    for p in SAMPLE_PROMPTS:
        r = engine.generate(p, max_new_tokens=64)
        out.append({"prompt": p, "completion": r.text, "alpha": round(r.stats.acceptance_rate, 3)})
    return out


def build(work: Path, eval_windows: int = 128, n_prompts: int = 32) -> dict[str, Any]:
    from specdec.training.distill_data import prompts_from_stream
    from specdec.training.distill_run import measure_acceptance
    from specdec.training.pretrain import eval_windows as windows_of

    target, drafts = work / "target_hf", {"distilled": work / "draft_hf", "ce_only": work / "baseline_hf"}
    drafts = {k: v for k, v in drafts.items() if (v / "model.safetensors").exists()}
    val = np.load(work / "val.npy")
    prompts = prompts_from_stream(val, n_prompts, 64, eos_id=0)
    windows = windows_of(val, 512, eval_windows)
    report: dict[str, Any] = {"prompts": len(prompts), "prompt_tokens": 64, "new_tokens": 64, "tau": 4, "drafts": {}}
    report["target"] = json.loads((target / "specdec_training.json").read_text())
    report["target_latency_ms"] = {d: 1e3 * per_token_latency(target, dt) for d, dt in _DTYPES.items()}
    for name, path in drafts.items():
        loss = draft_val_loss(path, windows)
        report["drafts"][name] = {
            "meta": json.loads((path / "specdec_training.json").read_text()),
            "val_loss": round(loss, 4),
            "val_perplexity": round(float(np.exp(loss)), 2),
            "greedy": measure_acceptance(target, path, prompts),
            "temperature_1": measure_acceptance(target, path, prompts, temperature=1.0),
            "latency_ms": {d: 1e3 * per_token_latency(path, dt) for d, dt in _DTYPES.items()},
        }
    if "distilled" in drafts:
        fast = prompts[:8]
        plain, spec = throughput(target, None, fast), throughput(target, drafts["distilled"], fast)
        report["throughput"] = {"plain_tok_s": plain, "speculative_tok_s": spec, "ratio": spec / plain}
        report["samples"] = samples(target, drafts["distilled"])
    (work / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot_curves(work: Path, out: Path) -> bool:
    """Training curves of the target and both drafts; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    tgt = [e for e in _read_log(work / "target" / "log.jsonl") if e.get("event") == "step"]
    a.plot([e["tokens"] / 1e6 for e in tgt], [e["loss"] for e in tgt], lw=0.6, alpha=0.5, label="train loss")
    tv = [e for e in tgt if "val_loss" in e]
    a.plot([e["tokens"] / 1e6 for e in tv], [e["val_loss"] for e in tv], "o-", label="validation loss")
    a.set(title="target (23.4M, 4 layers)", xlabel="training tokens (M)", ylabel="nats/token")
    a.legend()
    plot_draft_curves(b, work / "onpolicy" / "log.jsonl")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return True


def plot_draft_curves(ax: Any, log: Path) -> None:
    """Validation KL(target‖draft) and top-1 agreement of every draft of an on-policy run, by tokens."""
    rows = [e for e in _read_log(log) if "val" in e]
    if not rows:
        return
    twin = ax.twinx()
    for name in rows[0]["val"]:
        steps = [e["step"] for e in rows]
        ax.plot(steps, [e["val"][name]["kl"] for e in rows], "o-", ms=3, label=f"{name}: KL")
        twin.plot(steps, [e["val"][name]["agree"] for e in rows], "x--", ms=3, label=f"{name}: top-1 agree")
    ax.set(
        title="drafts (on-policy distillation; _ce = corpus CE only)",
        xlabel="step (32,768 tokens each)",
        ylabel="validation KL (nats/token)",
    )
    twin.set_ylabel("top-1 agreement with the target")
    ax.legend(loc="upper left", fontsize=7)
    twin.legend(loc="upper right", fontsize=7)
