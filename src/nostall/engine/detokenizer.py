"""Incremental detokenization and stop-string matching for one output sequence."""

from __future__ import annotations

from nostall.engine.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output, so the first output token gets its leading space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Invariant: `ids[prefix_offset:read_offset]` is the window whose text is already emitted; a
    new token's text is what decoding `ids[prefix_offset:]` adds beyond that window. Text that
    ends in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str)
        return text

    def update(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        emitted = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(emitted) or full.endswith("\ufffd"):
            return ""
        delta = full[len(emitted) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.output_text += delta
        return delta


def find_stop_string(text: str, new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends within the last `new_chars` characters of `text`.

    Returns (stop, index where it starts), or None. Stops that span several tokens are found
    because the search window reaches back `len(stop) - 1` characters before the new text.
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[1]):
            best = (stop, i)
    return best
