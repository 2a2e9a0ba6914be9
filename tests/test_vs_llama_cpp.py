"""benchmarks/vs_llama_cpp.py without llama.cpp: its readings of llama-bench's and llama-batched-bench's output, the
two things it tells llama.cpp's converter (run against a stand-in tree that behaves as the real one does on the
shipped tokenizer), the table, and one-line errors for a missing tree, missing binaries and a server that will not
start. The measurements themselves need a built llama.cpp (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specdec.testing import import_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_llama_cpp.py"


def _module() -> Any:
    return import_script(SCRIPT, "vs_llama_cpp_under_test")


def test_llama_bench_and_batched_bench_outputs_are_read_as_seconds_per_pass() -> None:
    mod = _module()
    bench = json.dumps(
        [
            {"n_prompt": 4, "n_gen": 0, "n_depth": 64, "samples_ns": [3_000_000, 2_000_000, 9_000_000]},
            {"n_prompt": 0, "n_gen": 16, "n_depth": 64, "samples_ns": [16_000_000, 17_600_000]},
        ]
    )
    assert mod.parse_llama_bench(bench) == pytest.approx({(4, 0): 0.003, (0, 16): 0.0168})
    jsonl = "\n".join(
        [
            "main: n_kv_max = 1280",
            json.dumps({"pp": 64, "tg": 16, "pl": 1, "t_tg": 0.016, "speed_tg": 1000.0}),
            json.dumps({"pp": 64, "tg": 16, "pl": 8, "t_tg": 0.064, "speed_tg": 2000.0}),
            "llama_perf_context_print: ...",
        ]
    )
    assert mod.parse_batched_bench(jsonl) == pytest.approx({1: 0.001, 8: 0.004})


FAKE_BASE = """
class TextModel:
    def __init__(self, dir_model):
        self.dir_model = dir_model
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
    def _set_vocab_sentencepiece(self):
        import sentencepiece_that_is_not_installed  # noqa: F401
"""

FAKE_CONVERT = """
import sys
from conversion.base import TextModel
src, out = sys.argv[1], sys.argv[sys.argv.index("--outfile") + 1]
m = TextModel(src)
try:
    pre = m.get_vocab_base_pre(None)
except NotImplementedError as e:
    pre = "refused: " + str(e)
try:
    m._set_vocab_sentencepiece()
    spm = "sentencepiece"
except FileNotFoundError:
    spm = "next vocabulary"
open(out, "w").write(pre + "\\n" + spm + "\\n")
"""


def _fake_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "llama.cpp"
    (tree / "conversion").mkdir(parents=True)
    (tree / "gguf-py").mkdir()
    (tree / "conversion" / "__init__.py").write_text("")
    (tree / "conversion" / "base.py").write_text(FAKE_BASE)
    (tree / "convert_hf_to_gguf.py").write_text(FAKE_CONVERT)
    return tree


def _convert(mod: Any, tree: Path, src: Path, out: Path) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-c", mod.CONVERT, str(tree), str(src), "--outtype", "bf16", "--outfile", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return out.read_text().split("\n")[:2]


def test_the_converter_is_told_the_shipped_tokenizer_is_gpt2s_and_to_skip_sentencepiece(tmp_path: Path) -> None:
    """The stand-in converter refuses an unlisted tokenizer hash and imports SentencePiece, as llama.cpp's does on the
    shipped checkpoints; through the bootstrap, a byte-level BPE with GPT-2's split reads as 'gpt-2' and a checkpoint
    without tokenizer.model goes on to the next vocabulary. Any other tokenizer is still refused."""
    mod = _module()
    tree = _fake_tree(tmp_path)
    shipped = ROOT / "src" / "specdec" / "models" / "target"
    assert _convert(mod, tree, shipped, tmp_path / "a.txt") == ["gpt-2", "next vocabulary"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": {"type": "Metaspace"}}))
    assert _convert(mod, tree, other, tmp_path / "b.txt")[0].startswith("refused: BPE pre-tokenizer")


def _report(shapes: dict[str, Any]) -> dict[str, Any]:
    """A report as a part writes it, around ``shapes``."""
    return {"cpu": {"model": "CPU"}, "threads": 2, "context": 64, "kernel": "k", "llama_cpp": "v", "shapes": shapes}


def test_the_table_gives_llama_cpp_over_specdec_per_row_count() -> None:
    mod = _module()
    med = {
        "specdec": {"block": {1: 0.001, 8: 0.002}, "batch": {1: 0.001, 8: 0.0025}},
        "llama.cpp": {"block": {1: 0.0012, 8: 0.004}, "batch": {1: 0.0011, 8: 0.005}},
    }
    text = mod.render_passes(_report({"default": {"median_seconds": med}}))
    assert "| 8 | 2.00 | 4.00 | 2.00× | 2.50 | 5.00 | 2.00× |" in text
    assert "| 1 | 1.00 | 1.20 | 1.20× | 1.00 | 1.10 | 1.10× |" in text


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)


def test_a_missing_tree_or_binary_is_one_line_of_error(tmp_path: Path) -> None:
    run = _cli("--llama-cpp", str(tmp_path), "passes", "--shapes", "default")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert (
        run.stderr.strip() == f"vs_llama_cpp: error: {tmp_path}: not a llama.cpp source tree (no convert_hf_to_gguf.py)"
    )
    tree = _fake_tree(tmp_path)
    run = _cli("--llama-cpp", str(tree), "passes", "--shapes", "default")
    assert run.returncode == 2 and "llama-bench: missing; build it" in run.stderr and "Traceback" not in run.stderr
    run = _cli("--llama-cpp", str(tree), "passes", "--shapes", "gpt-5")
    assert run.returncode == 2 and "unknown shape 'gpt-5'" in run.stderr


def test_a_llama_server_that_exits_is_named_with_its_last_words(tmp_path: Path) -> None:
    mod = _module()
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    fake.chmod(0o755)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        with (
            pytest.raises(
                mod.Failure,
                match=r"the llama.cpp server \(http://127.0.0.1:\d+\) exited with 1: error: failed to load model",
            ),
            mod.llama_servers({"llama-server": fake}, tmp_path / "m.gguf", None, 4, 2, 4),
        ):
            pass
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_a_checkpoint_directory_of_ones_own_is_converted_once(tmp_path: Path) -> None:
    """`--shapes DIR` / `serve --target DIR`: the directory itself goes to the converter (here the stand-in), its GGUF
    named by the directory and a hash of where it is, and kept until its weights change."""
    mod = _module()
    tree = _fake_tree(tmp_path)
    ckpt = tmp_path / "my-model"
    ckpt.mkdir()
    shipped = ROOT / "src" / "specdec" / "models" / "target"
    for name in ("config.json", "tokenizer.json"):
        (ckpt / name).write_bytes((shipped / name).read_bytes())
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert mod.hf_dir(str(ckpt), tmp_path / "out") == ckpt.resolve()
    out = mod.gguf(str(ckpt), tree, tmp_path / "out")
    assert out.parent == tmp_path / "out" and out.name.startswith("my-model-") and out.name.endswith("-bf16.gguf")
    assert out.read_text().split("\n")[:2] == ["gpt-2", "next vocabulary"]
    out.write_text("kept")
    assert mod.gguf(str(ckpt), tree, tmp_path / "out") == out and out.read_text() == "kept"  # not converted again
    run = _cli("--llama-cpp", str(tree), "passes", "--shapes", str(tmp_path))
    assert run.returncode == 2 and "or a checkpoint directory" in run.stderr
    run = _cli("--llama-cpp", str(tree), "serve", "--target", str(tmp_path))
    assert run.returncode == 2 and "not a checkpoint directory (no config.json)" in run.stderr
    run = _cli("--llama-cpp", str(tree), "serve", "--target", str(ckpt), "--", "--serve-args", "--tau 3")
    assert run.returncode == 2 and "leave --serve-args out" in run.stderr


def test_pairs_are_classed_by_the_memorys_state_read_around_them() -> None:
    """`pairs`: a pair whose two bandwidth reads agree is classed fast or slow by the midpoint of every read (two
    states seen); a pair the memory changed state during counts in `all` only."""
    mod = _module()

    def pair(before: float, after: float, ours: float, theirs: float) -> dict[str, float]:
        return {"read_before": before * 1e9, "read_after": after * 1e9, "specdec": ours, "llama.cpp": theirs}

    pairs = [
        pair(60, 58, 0.030, 0.040),  # fast: llama.cpp 1.33x our time
        pair(61, 62, 0.032, 0.040),  # fast: 1.25x
        pair(35, 36, 0.058, 0.058),  # slow: 1.00x
        pair(34, 35, 0.056, 0.062),  # slow: ~1.11x
        pair(36, 60, 0.050, 0.045),  # changed state mid-pair: in "all" only
    ]
    s = mod.summarize_pairs(pairs)
    assert set(s) == {"all", "fast", "slow"}
    assert s["all"]["pairs"] == 5 and s["fast"]["pairs"] == 2 and s["slow"]["pairs"] == 2
    assert s["fast"]["llama_cpp_over_specdec"] == pytest.approx((4 / 3 + 1.25) / 2)
    assert s["slow"]["specdec_seconds"] == pytest.approx(0.057)
    assert (s["slow"]["ratio_min"], s["slow"]["read_max"]) == (pytest.approx(1.0), pytest.approx(36e9))
    assert s["all"]["ratio_min"] == pytest.approx(0.9)
    one_state = mod.summarize_pairs([pair(50, 52, 0.03, 0.03), pair(52, 51, 0.03, 0.036)])
    assert set(one_state) == {"all", "steady"} and one_state["steady"]["llama_cpp_over_specdec"] == pytest.approx(1.1)
    table = mod.render_pairs(_report({"llama3.2-1b": {"summary": s}}))
    assert "| fast | 2 | 58-62 | 31.00 | 40.00 | 1.29× (1.25-1.33) |" in table


def test_pairs_refuses_a_non_positive_duration(tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path)
    run = _cli("--llama-cpp", str(tree), "pairs", "--seconds", "0")
    assert run.returncode == 2 and "--seconds and --context must be positive" in run.stderr
