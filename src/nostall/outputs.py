"""What `LLM.generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Logprob:
    """Log-probability of one token under the model's raw distribution (before sampling knobs)."""

    logprob: float
    # 1-based rank of the token among the whole vocabulary (1 = most likely).
    rank: int
    decoded_token: str | None = None


# One generated (or prompt) position: token id -> Logprob, holding the chosen token and the top-N.
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    # The stop string or stop token id that ended generation, if one did.
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # None for the first prompt token (nothing precedes it), then one entry per prompt token.
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
