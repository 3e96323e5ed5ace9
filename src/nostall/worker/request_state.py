"""Request state that lives on the device, in persistent buffers indexed by a request slot.

The host uploads deltas only: a new (or resumed) request's known token ids, sampling parameters
and block table once; later, newly allocated block ids. Sampled tokens are written into
`token_ids` on the device by the step itself, so the next step reads its input ids there and the
host never needs a sampled id to launch it.

Slot `pad_slot` (the last row) never holds a request: padded rows of a captured decode batch point
to it. Its block table is all null block (0), so whatever padded rows compute lands in the null
block, which no real request reads.
"""

from __future__ import annotations

import torch

from nostall.sampling_params import SamplingParams
from nostall.scheduler.request import Request


def to_device(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host list on the device through pinned memory and a non-blocking copy (no host sync)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class RequestState:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.pad_slot = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        rows = max_num_reqs + 1
        # One more column than max_model_len: a request finishing at the limit may still have one
        # extra token sampled by the step that was already in flight (asynchronous scheduling).
        self.width = max_model_len + 1
        self.max_blocks = max_blocks_per_req
        self.token_ids = torch.zeros(rows, self.width, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(rows, max_blocks_per_req, dtype=torch.int32, device=device)
        self.prompt_len = torch.zeros(rows, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_k = torch.full((rows,), vocab_size, dtype=torch.int64, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(rows, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        self.repetition_penalty = torch.ones(rows, dtype=torch.float32, device=device)
        self.presence_penalty = torch.zeros(rows, dtype=torch.float32, device=device)
        self.frequency_penalty = torch.zeros(rows, dtype=torch.float32, device=device)
        # Allocated when the first request with penalties arrives ([rows, vocab] each).
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

        self._free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.slot_of: dict[str, int] = {}
        self.params_of: dict[str, SamplingParams] = {}
        self.num_blocks_of: dict[str, int] = {}

    # ---- host bookkeeping -----------------------------------------------------------------

    def remove(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            del self.params_of[request_id]
            del self.num_blocks_of[request_id]

    def add(self, requests: list[tuple[Request, list[int]]]) -> None:
        """Give each (request, block table) a slot and upload its tokens, table and parameters.

        Used for new requests and for requests resumed after preemption (the runner forgot them).
        """
        if not requests:
            return
        dev = self.device
        slots: list[int] = []
        token_idx: list[int] = []
        token_val: list[int] = []
        for req, _ in requests:
            self.remove(req.request_id)
            if not self._free_slots:
                raise RuntimeError(
                    f"no free request slot for {req.request_id!r} (max {self.max_num_reqs})"
                )
            slot = self._free_slots.pop()
            self.slot_of[req.request_id] = slot
            self.params_of[req.request_id] = req.sampling_params
            self.num_blocks_of[req.request_id] = 0
            slots.append(slot)
            base = slot * self.width
            token_idx.extend(range(base, base + req.num_tokens))
            token_val.extend(req.all_token_ids)
        slot_t = to_device(slots, torch.int64, dev)
        self.token_ids.view(-1).index_copy_(
            0, to_device(token_idx, torch.int64, dev), to_device(token_val, torch.int64, dev)
        )
        self.block_table[slot_t] = 0
        self.append_blocks([(req.request_id, ids) for req, ids in requests])

        reqs = [r for r, _ in requests]
        params = [r.sampling_params for r in reqs]

        def put(dst: torch.Tensor, values: list[float] | list[int]) -> None:
            dst.index_copy_(0, slot_t, to_device(values, dst.dtype, dev))

        put(self.prompt_len, [r.num_prompt_tokens for r in reqs])
        put(self.temperature, [p.temperature for p in params])
        put(self.top_k, [p.top_k if p.top_k > 0 else self.vocab_size for p in params])
        put(self.top_p, [p.top_p for p in params])
        put(self.min_p, [p.min_p for p in params])
        put(self.seeds, [r.seed for r in reqs])
        put(self.repetition_penalty, [p.repetition_penalty for p in params])
        put(self.presence_penalty, [p.presence_penalty for p in params])
        put(self.frequency_penalty, [p.frequency_penalty for p in params])
        if any(uses_penalties(p) for p in params) or self.output_counts is not None:
            self._init_penalty_rows(reqs, slots)

    def _init_penalty_rows(self, reqs: list[Request], slots: list[int]) -> None:
        rows = self.max_num_reqs + 1
        if self.output_counts is None:
            self.output_counts = torch.zeros(
                rows, self.vocab_size, dtype=torch.float32, device=self.device
            )
            self.prompt_mask = torch.zeros(
                rows, self.vocab_size, dtype=torch.bool, device=self.device
            )
        assert self.prompt_mask is not None
        dev = self.device
        slot_t = to_device(slots, torch.int64, dev)
        self.output_counts[slot_t] = 0
        self.prompt_mask[slot_t] = False
        p_rows = [s for r, s in zip(reqs, slots, strict=True) for _ in r.prompt_token_ids]
        p_cols = [t for r in reqs for t in r.prompt_token_ids]
        self.prompt_mask[
            to_device(p_rows, torch.int64, dev), to_device(p_cols, torch.int64, dev)
        ] = True
        o_rows = [s for r, s in zip(reqs, slots, strict=True) for _ in r.output_token_ids]
        if o_rows:
            o_cols = [t for r in reqs for t in r.output_token_ids]
            self.output_counts.index_put_(
                (to_device(o_rows, torch.int64, dev), to_device(o_cols, torch.int64, dev)),
                torch.ones(len(o_rows), device=dev),
                accumulate=True,
            )

    def append_blocks(self, updates: list[tuple[str, list[int]]]) -> None:
        """Append (request id, block ids) to the requests' device block tables."""
        idx: list[int] = []
        val: list[int] = []
        for request_id, new in updates:
            if not new:
                continue
            have = self.num_blocks_of[request_id]
            base = self.slot_of[request_id] * self.max_blocks + have
            idx.extend(range(base, base + len(new)))
            val.extend(new)
            self.num_blocks_of[request_id] = have + len(new)
        if idx:
            self.block_table.view(-1).index_copy_(
                0,
                to_device(idx, torch.int64, self.device),
                to_device(val, torch.int32, self.device),
            )


def uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
