"""What one `Scheduler.schedule()` call decided: the plan the model runner executes."""

from __future__ import annotations

import dataclasses

from nostall.scheduler.request import Request


@dataclasses.dataclass
class ScheduledRequest:
    request: Request
    # Compute `all_token_ids[num_computed_before : num_computed_before + num_new_tokens]`; >= 1.
    num_new_tokens: int
    # Tokens whose KV is already in the cache before this step, prefix-cache hits found this step
    # included (the request's `num_computed_tokens` has since been advanced by `num_new_tokens`).
    num_computed_before: int
    # For a request the runner does not hold (is_new): its whole block table after this step's
    # allocation (a copy). Empty otherwise: the runner keeps the table and appends new_block_ids,
    # so the steady step copies no table.
    block_ids: list[int]
    # The blocks appended to the request's table this step.
    new_block_ids: list[int]
    # The runner holds no state for it: first schedule, or resumed after a preemption.
    is_new: bool


@dataclasses.dataclass
class SchedulerOutput:
    # Running requests first (in running order), then newly admitted ones (FCFS).
    scheduled: list[ScheduledRequest]
    # Sum of `num_new_tokens` over `scheduled`; <= max_num_batched_tokens.
    total_num_scheduled_tokens: int
    # Preempted during this schedule() call; their blocks are freed (runners drop their state).
    preempted_request_ids: list[str]
    # Finished or aborted since the previous schedule() call (runners drop their state).
    finished_request_ids: list[str]

    @property
    def is_empty(self) -> bool:
        """Nothing to execute. The id lists may still be non-empty and must reach the runner."""
        return not self.scheduled
