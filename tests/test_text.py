"""Incremental detokenisation: the cached text of a growing sequence equals decoding it whole, every step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from specdec.api import default_target, load_tokenizer
from specdec.text import TextDecoder, fast_decoder, fast_encoder


def tokenizers(tiny_models: dict[str, Path]) -> list[Any]:
    out = [load_tokenizer(tiny_models["llama"])]
    if (default_target() / "tokenizer.json").exists():
        out.append(load_tokenizer(default_target()))  # byte-level BPE: ids can cut UTF-8 sequences
    return out


class Counting:
    """A tokenizer proxy that counts the tokens it is asked to decode."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.tokens = tok, 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.tokens += len(ids)
        text: str = self.tok.decode(ids, **kwargs)
        return text


def whole(tok: Any, ids: list[int], final: bool) -> str:
    text: str = tok.decode(ids, skip_special_tokens=True)
    return text if final else text.rstrip("\ufffd")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_text_equals_whole_decode(tiny_models: dict[str, Path], seed: int) -> None:
    rng = random.Random(seed)  # deterministic: no false failures
    for tok in tokenizers(tiny_models):
        vocab = len(tok)
        # Real text (spaces, punctuation, newlines, non-ASCII) plus random ids, appended 1-5 at a time.
        ids = tok.encode("def f(x):\n    return x  # naïve café, 東京 ✓ .,;", add_special_tokens=False)
        ids += [rng.randrange(vocab) for _ in range(150)]
        counting = Counting(tok)
        dec, pos, steps = TextDecoder(counting), 0, 0
        while pos < len(ids):
            pos = min(len(ids), pos + rng.randint(1, 5))
            final = pos == len(ids)
            assert dec.text_for(ids[:pos], final) == whole(tok, ids[:pos], final), (seed, pos)
            steps += 1
        # Incremental, not quadratic: whole decodes would have cost ~steps·len/2 tokens.
        assert counting.tokens < 0.25 * steps * len(ids) / 2, (counting.tokens, steps, len(ids))


def test_a_sequence_that_does_not_extend_the_cached_one_is_decoded_whole(tiny_models: dict[str, Path]) -> None:
    """The engine also asks for trial sequences (stop-string search), which need not extend the last one."""
    tok = load_tokenizer(tiny_models["llama"])
    ids = tok.encode("hello world, this is a test", add_special_tokens=False)
    dec = TextDecoder(tok)
    assert dec.text_for(ids, final=False) == whole(tok, ids, False)
    other = ids[:3] + tok.encode(" something else", add_special_tokens=False)
    assert dec.text_for(other, final=False) == whole(tok, other, False)
    assert dec.text_for(ids[:2], final=True) == whole(tok, ids[:2], True)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fast_decode_path_gives_the_wrapper_s_text(tiny_models: dict[str, Path], seed: int) -> None:
    """TextDecoder calls the ``tokenizers`` library directly where the transformers wrapper would return the same
    text (no clean-up of tokenization spaces); step by step, its text is the wrapper's, special tokens included."""
    rng = random.Random(seed)  # deterministic: no false failures
    for tok in tokenizers(tiny_models):
        assert fast_decoder(tok) is not None, tok.name_or_path  # the tokenizers these tests ship run the fast path
        specials = sorted(set(tok.all_special_ids))
        ids = tok.encode("class A:\n    x = 'ünïcode ✓'\n", add_special_tokens=False)
        ids += [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(120)]
        dec, pos = TextDecoder(tok), 0
        while pos < len(ids):
            pos = min(len(ids), pos + rng.randint(1, 4))
            final = pos == len(ids)
            assert dec.text_for(ids[:pos], final) == whole(tok, ids[:pos], final), (seed, pos)


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_wrapper(tiny_models: dict[str, Path]) -> None:
    tok = load_tokenizer(tiny_models["llama"])
    tok.clean_up_tokenization_spaces = True
    assert fast_decoder(tok) is None
    ids = tok.encode("a , b . c", add_special_tokens=False)
    assert TextDecoder(tok).text_for(ids, final=True) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fast_encode_path_gives_the_wrapper_s_ids(tiny_models: dict[str, Path], seed: int) -> None:
    """Engine.encode calls the ``tokenizers`` library directly (no thread pool) where it gives the wrapper's ids:
    on random texts of code, spaces, special-token text and non-ASCII, its ids are the wrapper's."""
    rng = random.Random(seed)  # deterministic: no false failures
    pieces = ["def", " ", "  ", "\n", "\t", "x", "(", "):", "ü", "漢", "🙂", "0", "'", "return", "</s>", "<s>", "é"]
    for tok in tokenizers(tiny_models):
        encode = fast_encoder(tok)
        assert encode is not None, tok.name_or_path
        for _ in range(40):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
            assert encode(text) == list(tok(text)["input_ids"]), (tok.name_or_path, text)


def test_a_tokenizer_that_truncates_keeps_the_wrapper(tiny_models: dict[str, Path]) -> None:
    tok = load_tokenizer(tiny_models["llama"])
    tok.backend_tokenizer.enable_truncation(4)
    assert fast_encoder(tok) is None
    assert fast_encoder(object()) is None
