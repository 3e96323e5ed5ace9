"""Per-request generation parameters, named as in vLLM."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from nostall.errors import InvalidRequestError

# Names a user may pass; anything else is rejected with this list.
_ACCEPTED = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "output_kind",
)

# What LLMEngine.step returns for a request: its whole output after every step that advanced
# it ("cumulative"), or only the finished output ("final_only", what offline generate uses).
OUTPUT_KINDS = ("cumulative", "final_only")

# Greedy is temperature below this (vLLM uses the same threshold).
GREEDY_EPS = 1e-5


@dataclasses.dataclass
class SamplingParams:
    """How to sample the continuation of one prompt.

    The fields and their meaning follow vLLM's `SamplingParams`. Unknown keyword arguments and
    out-of-range values raise `InvalidRequestError` naming the value and what is accepted.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: str = "cumulative"

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(_ACCEPTED))
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter(s) {unknown}; accepted: {', '.join(_ACCEPTED)}"
            )
        for f in dataclasses.fields(self):
            setattr(self, f.name, kwargs.get(f.name, f.default))
        self._normalize()
        self.validate()

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])

    def validate(self) -> None:
        def bad(name: str, value: object, accepted: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}={value!r} is invalid; accepted: {accepted}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "a number in (0, 1]")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", self.top_k, "-1 (no limit) or an integer >= 1")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "a number in [0, 1]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)")
        if not _is_number(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        if not _is_number(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", self.seed, "an integer or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(
                "max_tokens",
                self.max_tokens,
                "an integer >= 1, or None for up to the context length",
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", self.min_tokens, f"an integer <= max_tokens ({self.max_tokens})"
            )
        assert isinstance(self.stop, list)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        assert isinstance(self.stop_token_ids, list)
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise bad(name, v, "None or an integer >= 0 (number of top alternatives)")
        if self.output_kind not in OUTPUT_KINDS:
            raise bad("output_kind", self.output_kind, ", ".join(OUTPUT_KINDS))
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def clone(self, **changes: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(changes)
        return SamplingParams(**values)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN


def as_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: a single value is shared, a list must match the prompts."""
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(
            f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt"
        )
    return params
