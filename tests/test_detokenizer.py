"""Incremental detokenization and stop-string search with the real SmolLM2 tokenizer."""

from __future__ import annotations

import os
import random

import pytest
from transformers import AutoTokenizer

from nostall.engine.detokenizer import IncrementalDetokenizer, find_stop_string


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: str):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_gguf),
        gguf_file=os.path.basename(smollm2_gguf),
        local_files_only=True,
    )


TEXTS = [
    "Hello world! Ünïcödé 🎉 test, with emoji 👩‍👩‍👧 and CJK 漢字かな.",
    "def f(x):\n    return x ** 2  # squares\n\n\tTabs\tand  double  spaces.",
    "<|im_start|>user\nHi there<|im_end|>\n",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_text_equals_full_decode(tokenizer, text: str, skip_special: bool) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("Say something:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special)
    pieces = [detok.update(t) for t in ids]
    full = tokenizer.decode(
        ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
    )
    assert "".join(pieces) == detok.output_text == full
    # No piece ever holds half a character.
    assert all("\ufffd" not in p for p in pieces)


def test_random_token_streams_never_lose_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, [rng.randrange(3, 1000)])
        for t in ids:
            detok.update(t)
        full = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        # Held-back bytes may only be a trailing incomplete character.
        assert full.startswith(detok.output_text)
        assert full[len(detok.output_text) :].strip("\ufffd") == ""


def test_stop_string_spanning_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "The answer is forty-two, obviously."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "forty-two"
    # The stop string covers several tokens.
    assert sum(1 for t in ids if tokenizer.decode([t]).strip() in stop) >= 2
    detok = IncrementalDetokenizer(tokenizer, [])
    hit = None
    for t in ids:
        new = detok.update(t)
        if new:
            hit = find_stop_string(detok.output_text, len(new), [stop, "zebra"])
            if hit:
                break
    assert hit == (stop, text.index(stop))


def test_find_stop_string_picks_earliest_and_ignores_old_text() -> None:
    assert find_stop_string("abcXYdefZ", 4, ["Z", "XYd"]) == ("XYd", 3)
    assert find_stop_string("abcXYdefZ", 3, ["Z", "XYd"]) == ("Z", 8)
    # A stop that ended before the new characters was already seen (and would have stopped).
    assert find_stop_string("stop here, then more", 4, ["stop"]) is None
    assert find_stop_string("ab", 1, ["abc"]) is None
