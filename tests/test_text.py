"""Incremental detokenisation: the cached text of a growing sequence equals decoding it whole, every step."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from specdec.api import default_target, load_tokenizer
from specdec.text import (
    OutputText,
    StopMatcher,
    TextDecoder,
    _byte_level_chars,
    byte_level_pieces,
    fast_decoder,
    fast_encoder,
)


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


def byte_tokens(tok: Any) -> list[int]:
    """Each byte's own token (byte-level vocabularies have all 256)."""
    chars = _byte_level_chars()
    return [int(tok.backend_tokenizer.token_to_id(c)) for c in sorted(chars, key=chars.__getitem__)]


@pytest.mark.parametrize("seed", [0, 1])
def test_byte_level_pieces_give_the_library_s_text(tiny_models: dict[str, Path], seed: int) -> None:
    """A byte-level tokenizer's text from its tokens' bytes (``BytePieces``, one decoding in Python) equals the
    ``tokenizers`` library's decode: every id alone (special ones skipped), random runs of ids, and runs of byte tokens
    that cut characters, carry lone continuation bytes or bytes UTF-8 never uses (each invalid sequence one U+FFFD, as
    the library replaces them)."""
    rng = random.Random(seed)  # deterministic: no false failures
    for tok in tokenizers(tiny_models):
        pieces, decode = byte_level_pieces(tok), fast_decoder(tok)
        assert pieces is not None and decode is not None, tok.name_or_path
        vocab = tok.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        for i in range(vocab):
            assert pieces.text([i]) == decode([i], skip_special_tokens=True), i
        for _ in range(2000):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            assert pieces.text(ids) == decode(ids, skip_special_tokens=True), ids
        tricky = [0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x99, 0x82, 0x80, 0xBF, 0xC0, 0xC1, 0xED, 0xA0, 0xF4, 0x90]
        tricky += [0xF5, 0xFF, 0x41]
        byte_ids = byte_tokens(tok)
        for _ in range(3000):
            run = [rng.choice(tricky) if rng.random() < 0.7 else rng.randrange(256) for _ in range(rng.randint(1, 9))]
            ids = [byte_ids[b] for b in run]
            assert pieces.text(ids) == decode(ids, skip_special_tokens=True), run


def test_added_tokens_and_other_decoders(tmp_path: Path) -> None:
    """Added tokens (a special one skipped; plain ones with spaces and non-ASCII, written as they are) keep the
    library's text through the pieces; a tokenizer whose decoder is not byte-level alone decodes through the library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specdec.testing import tiny_tokenizer

    tok = tiny_tokenizer(tmp_path / "bpe")
    tok.add_tokens(["<tool call>", "ünï ✓", "x"])
    tok.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    pieces, decode = byte_level_pieces(tok), fast_decoder(tok)
    assert decode is not None
    vocab = tok.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    rng = random.Random(3)  # deterministic: no false failures
    runs = [[i] for i in range(vocab)] + [[rng.randrange(vocab) for _ in range(8)] for _ in range(500)]
    for ids in runs:  # the pieces where their probes agreed, else the library: the library's text either way
        assert TextDecoder(tok).text_for(ids, final=True) == decode(ids, skip_special_tokens=True), ids
    # With tokenizers 0.2x the pieces hold (an added token decodes as itself); a release that decoded them otherwise
    # would fail the probes and leave the library's decode, which the loop above checks either way.
    assert pieces is not None
    assert pieces.text(tok.convert_tokens_to_ids(["<tool call>", "<|sep|>", "ünï ✓"])) == "<tool call>ünï ✓"

    wordpiece = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    other = PreTrainedTokenizerFast(tokenizer_object=wordpiece, clean_up_tokenization_spaces=False)
    assert fast_decoder(other) is not None and byte_level_pieces(other) is None
    assert TextDecoder(other).text_for([1, 2, 1], final=True) == other.decode([1, 2, 1])


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


class NaiveStops:
    """The reference: every step decodes the whole output and searches all of it (what ``OutputText`` must equal)."""

    def __init__(self, tok: Any, stops: list[str]) -> None:
        self.tok, self.stops, self.ids, self.released = tok, stops, [], ""

    def hit(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def stop_in(self, tokens: list[int]) -> int | None:
        for i in range(len(tokens)):
            if self.hit(whole(self.tok, self.ids + tokens[: i + 1], False)) is not None:
                return i + 1
        return None

    def extend(self, tokens: list[int], final: bool) -> str:
        self.ids += tokens
        text = whole(self.tok, self.ids, final)
        i = self.hit(text)
        safe = text if i is None else text[:i]
        if not final and i is None:
            hold = max((k for s in self.stops for k in range(1, len(s)) if safe.endswith(s[:k])), default=0)
            safe = safe[: len(safe) - hold]
        if len(safe) <= len(self.released) or not safe.startswith(self.released):
            return ""
        piece, self.released = safe[len(self.released) :], safe
        return piece


@pytest.mark.parametrize("seed", range(6))
def test_output_text_streams_what_whole_decodes_and_searches_stream(tiny_models: dict[str, Path], seed: int) -> None:
    """``OutputText`` (the engine's per-request text: appended ids, overlap decodes, stop search near the end) cuts
    at the same token and streams the same pieces as decoding and searching the whole output every step, over
    random outputs (real text, random ids cutting UTF-8 sequences, special tokens), random step sizes and stop
    strings taken from the output itself (so they are met, at varied depths) or never met."""
    rng = random.Random(seed)  # deterministic: no false failures
    for tok in tokenizers(tiny_models):
        ids = tok.encode(
            "def f(x):\n    return x  # naïve café, 東京は首都です。ひらがな ✓ 🙂 .,;\n", add_special_tokens=False
        )
        ids += [rng.randrange(len(tok)) for _ in range(120)]
        text = whole(tok, ids, True)
        stops = ["\x00never"]
        for _ in range(rng.randint(0, 3)):
            a = rng.randrange(len(text) // 2, len(text))
            stops.append(text[a : a + rng.randint(1, 6)].strip("\ufffd") or "zz")
        out, ref = OutputText(tok, stops), NaiveStops(tok, stops)
        pos, pieces, finish = 0, [], None
        while finish is None:
            chunk = ids[pos : pos + rng.randint(1, 5)]
            pos += len(chunk)
            cut = out.stop_in(chunk)
            assert cut == ref.stop_in(chunk), (seed, pos, stops)
            if cut is not None:
                chunk, finish = chunk[:cut], "stop"
            elif pos >= len(ids):
                finish = "length"
            piece = out.extend(chunk, final=finish is not None)
            assert piece == ref.extend(chunk, final=finish is not None), (seed, pos, stops)
            pieces.append(piece)
        assert "".join(pieces) == out.text() == ref.released, (seed, stops)
        assert out.ids == ref.ids
        assert (finish == "stop") == any(s in text for s in stops)


def test_output_text_decodes_each_step_s_tokens_not_the_output(tiny_models: dict[str, Path]) -> None:
    """A step decodes a few ids before the settled end and its own: over 600 ids appended 2 at a time (random ids,
    and CJK text whose characters span several byte tokens), a step's peeks for a stop string and its text decode
    ~30 ids (two peeks and the step's text, each its overlap and tokens twice), where decoding the output each
    step would be ~300 on average."""
    rng = random.Random(0)  # deterministic: no false failures
    for tok in tokenizers(tiny_models):
        cjk = tok.encode("東京は日本の首都です。漢字とひらがな、カタカナ 🙂 " * 40, add_special_tokens=False)
        for ids in ([rng.randrange(len(tok)) for _ in range(600)], cjk[:600]):
            counting = Counting(tok)
            out = OutputText(counting, ["\x00never"])
            out._decoder._backend = None  # count through the wrapper's decode
            for i in range(0, len(ids), 2):
                out.stop_in(ids[i : i + 2])
                out.extend(ids[i : i + 2], final=i + 2 >= len(ids))
            assert out.text() == whole(tok, ids, True)
            assert counting.tokens < 40 * len(ids) // 2, (tok.name_or_path, counting.tokens / (len(ids) // 2))


def test_a_stop_search_on_rewritten_text_looks_at_all_of_it() -> None:
    """Released text holds no stop, so a text extending it is searched from the longest stop's reach of its end;
    a text that does not start with it (a tokenizer rewrote its end) is searched whole."""
    m = StopMatcher(["STOP", "xy"])
    assert m.release("abc STO", final=False) == "abc "  # "STO" may start a stop: held back
    assert m.find("abc STOP") == 4
    assert m.find("aSTOP" + "b" * 3) == 1  # does not start with "abc ": searched whole
    assert m.release("abc STOP and more", final=False) == ""  # cut at the stop: nothing new to stream
    assert m.cut("abc STOP and more") == "abc "
    m2 = StopMatcher(["xy"])
    assert m2.release("a" * 50, final=False) == "a" * 50
    assert m2.find("a" * 50 + "xy") == 50 and m2.find("a" * 49 + "xy") == 49
