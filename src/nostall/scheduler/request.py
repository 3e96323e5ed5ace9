"""A request as the scheduler and the KV cache manager see it: token ids and progress."""

from __future__ import annotations

import enum
import time

from nostall.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    """One sequence being generated.

    Invariants:
    - `all_token_ids == prompt_token_ids + output_token_ids`.
    - `num_computed_tokens` counts the leading tokens whose KV is (or, once the step that the
      scheduler just planned has run, will be) in the cache. The scheduler advances it when it
      schedules tokens; preemption resets it to 0 (recompute).
    - `block_hashes[i]` is the chained hash of full block i of `all_token_ids` (prefix caching);
      the KV cache manager extends it as blocks fill.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        seed: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        # Key of the request's random stream (the user's seed, or one the engine drew).
        self.seed = seed
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled on the device whose ids the host has not received yet (asynchronous
        # scheduling): they count as tokens to compute, but are not in all_token_ids yet.
        self.num_pending_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[int] = []
        # Prompt tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens},"
            f" out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
