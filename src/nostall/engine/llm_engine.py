"""The request lifecycle: validate and tokenize, schedule, execute, detokenize, stop."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterable
from typing import Any

from nostall.engine.args import EngineArgs, EngineConfig
from nostall.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from nostall.engine.tokenizer import Tokenizer, load_tokenizer
from nostall.errors import InvalidRequestError
from nostall.kv.kv_cache_manager import KVCacheManager
from nostall.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from nostall.sampling_params import SamplingParams
from nostall.scheduler.request import Request, RequestStatus
from nostall.scheduler.scheduler import Scheduler
from nostall.worker.model_runner import ModelRunner, ModelRunnerOutput, StepOutput
from nostall.worker.sampler import LogprobsTensors

logger = logging.getLogger("nostall")

# Most top alternatives a request may ask for per position (vLLM's default max_logprobs).
MAX_LOGPROBS = 20

# A prompt: text, token ids, or a vLLM-style dict {"prompt": ...} / {"prompt_token_ids": ...}.
PromptType = str | list[int] | dict[str, Any]


@dataclasses.dataclass
class _Sequence:
    """One of the n samples of a request, as the engine tracks it."""

    index: int
    request: Request
    # None when the engine runs without a tokenizer (skip_tokenizer_init): no text, only ids.
    detokenizer: IncrementalDetokenizer | None
    # max_tokens, capped by the room max_model_len leaves after the prompt.
    max_tokens: int
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    prompt_logprobs: list[PositionLogprobs | None] | None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.perf_counter()
        self.tokenizer: Tokenizer | None = (
            None if config.skip_tokenizer_init else load_tokenizer(config.model)
        )
        eos = set(config.model.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))
        self.runner = ModelRunner(
            config.model,
            config.cache,
            config.scheduler,
            config.device,
            self.eos_token_ids,
            attention_backend=config.attention_backend,
            enforce_eager=config.enforce_eager,
        )
        # The launched step whose results have not been processed yet (asynchronous scheduling).
        self._in_flight: StepOutput | None = None
        num_blocks = self.runner.determine_num_blocks()
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.cache.block_size, enable_caching=config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        self.runner.initialize_kv_cache(num_blocks)
        self._rng = random.Random(config.seed)
        self._requests: dict[str, _RequestState] = {}
        # Scheduler request id -> (engine request id, sample index).
        self._seq_owner: dict[str, tuple[str, int]] = {}
        mc = config.model
        logger.info(
            "nostall engine ready in %.1fs: %s (%s) %s on %s, max_model_len=%d, KV cache %d blocks x %d"
            " tokens (%.2f GiB), prefix caching %s",
            time.perf_counter() - t0,
            mc.architecture,
            mc.gguf_file or mc.model_dir,
            str(mc.dtype).removeprefix("torch."),
            config.device,
            config.scheduler.max_model_len,
            num_blocks,
            config.cache.block_size,
            num_blocks * self.runner.kv_bytes_per_block / 2**30,
            "on" if config.cache.enable_prefix_caching else "off",
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # ---- requests in ----------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, validated against the vocabulary and max_model_len."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise InvalidRequestError(
                    f"prompt dict keys {sorted(prompt)} are invalid; accepted: exactly one of"
                    " 'prompt' (text) or 'prompt_token_ids' (list of ints)"
                )
            prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "a text prompt needs a tokenizer, and this engine runs with skip_tokenizer_init;"
                    " accepted: token ids"
                )
            text: str | None = prompt
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            text, ids = None, list(prompt)
            vocab = self.config.model.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token id(s) {bad[:5]} are out of range; accepted: 0 <= id < {vocab}"
                )
        else:
            raise InvalidRequestError(
                f"prompt of type {type(prompt).__name__} is invalid; accepted: a string, a list of token"
                " ids, or {'prompt': str} / {'prompt_token_ids': list[int]}"
            )
        if not ids:
            raise InvalidRequestError("the prompt is empty; accepted: at least one token")
        limit = self.config.scheduler.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {limit}: it must be shorter,"
                " leaving room for at least one generated token"
            )
        return text, ids

    def validate_params(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params of type {type(params).__name__} are invalid; accepted: SamplingParams"
            )
        params.validate()
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"{name}={v} is invalid; accepted: at most {MAX_LOGPROBS}"
                )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                f"stop={params.stop!r} needs a tokenizer, and this engine runs with"
                " skip_tokenizer_init; accepted: stop_token_ids"
            )
        return params

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises InvalidRequestError (and changes nothing) on bad input."""
        if request_id in self._requests:
            raise InvalidRequestError(
                f"request_id={request_id!r} is already in use; accepted: a new id"
            )
        params = self.validate_params(params)
        text, prompt_ids = self.tokenize_prompt(prompt)
        room = self.config.scheduler.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        sequences = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(seq_id, prompt_ids, params, arrival_time, seed=self._seed_for(params, i))
            detok = (
                None
                if self.tokenizer is None
                else IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                )
            )
            logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
            sequences.append(_Sequence(i, req, detok, max_tokens, logprobs))
        state = _RequestState(
            request_id,
            text,
            prompt_ids,
            params,
            sequences,
            [None] if params.prompt_logprobs is not None else None,
        )
        self._requests[request_id] = state
        for seq in sequences:
            self._seq_owner[seq.request.request_id] = (request_id, seq.index)
            self.scheduler.add_request(seq.request)

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._rng.getrandbits(63)
        if params.n == 1:
            return params.seed
        # Distinct, reproducible streams for the n samples of one seeded request.
        return random.Random(f"nostall:{params.seed}:{index}").getrandbits(63)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests at any point and free their KV blocks. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            state = self._requests.pop(rid, None)
            if state is None:
                continue
            seq_ids = [s.request.request_id for s in state.sequences]
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
            for sid in seq_ids:
                self._seq_owner.pop(sid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan and launch one step; return the current output of every request that advanced.

        With asynchronous scheduling the outputs are those of the previous step: this step was
        planned and launched before the host looked at them, so the device never waits for it.
        A request that finished in the previous step may compute one extra token in this one;
        that token is dropped.
        """
        sched = self.scheduler.schedule()
        launched: StepOutput | None = None
        if not sched.is_empty:
            launched = self.runner.execute(sched)
            for seq_id in launched.req_ids:
                rid, index = self._seq_owner[seq_id]
                self._requests[rid].sequences[index].request.num_pending_tokens += 1
        elif self._in_flight is None and self.scheduler.has_unfinished_requests():
            # Every request fits the cache alone (checked at start-up), so an idle step with
            # work queued means the scheduler is broken; fail loudly rather than spin.
            raise RuntimeError(
                f"the scheduler planned nothing with {self.scheduler.num_waiting} waiting and"
                f" {self.scheduler.num_running} running requests"
            )
        if self.config.async_scheduling:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        if done is None:
            return []
        touched = self._process(done.result())
        outputs = [
            self._make_output(state)
            for state in (self._requests[rid] for rid in touched)
            if state.finished or state.params.output_kind == "cumulative"
        ]
        for out in outputs:
            if out.finished:
                state = self._requests.pop(out.request_id)
                for seq in state.sequences:
                    self._seq_owner.pop(seq.request.request_id, None)
        return outputs

    def _process(self, result: ModelRunnerOutput) -> list[str]:
        touched: dict[str, None] = {}
        for seq_id, chunk in result.prompt_logprobs.items():
            if seq_id not in self._seq_owner:
                continue  # aborted while its step was in flight
            rid, index = self._seq_owner[seq_id]
            state = self._requests[rid]
            if index == 0 and state.prompt_logprobs is not None:
                num_top = state.params.prompt_logprobs or 0
                entries = [self._logprob_entry(*row, num_top) for row in _rows(chunk.logprobs)]
                # After a preemption the prompt is recomputed: keep only entries not made yet.
                skip = len(state.prompt_logprobs) - chunk.start
                state.prompt_logprobs.extend(entries[max(skip, 0) :])
        sampled = result.sampled_token_ids.tolist()
        logprob_rows = _rows(result.logprobs) if result.logprobs is not None else None
        for row, (seq_id, token) in enumerate(zip(result.req_ids, sampled, strict=True)):
            if seq_id not in self._seq_owner:
                continue  # aborted, or finished, while its step was in flight
            rid, index = self._seq_owner[seq_id]
            state = self._requests[rid]
            seq = state.sequences[index]
            if seq.finish_reason is not None:
                continue  # the extra token of a sample that already ended
            seq.request.num_pending_tokens -= 1
            seq.request.append_output_token_ids(token)
            if seq.logprobs is not None and logprob_rows is not None:
                entry = self._logprob_entry(*logprob_rows[row], state.params.logprobs or 0)
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[token].logprob
            new_text = seq.detokenizer.update(token) if seq.detokenizer is not None else ""
            self._check_stop(state, seq, new_text, token)
            touched[rid] = None
        return list(touched)

    def _logprob_entry(
        self, ids: list[int], logprobs: list[float], rank: int, num_top: int
    ) -> PositionLogprobs:
        """The chosen token (first in `ids`) with its rank, then the top `num_top` tokens."""
        entry: PositionLogprobs = {ids[0]: Logprob(logprobs[0], rank, self._token_text(ids[0]))}
        for r, (tid, lp) in enumerate(
            zip(ids[1 : num_top + 1], logprobs[1 : num_top + 1], strict=True)
        ):
            entry.setdefault(tid, Logprob(lp, r + 1, self._token_text(tid)))
        return entry

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        assert isinstance(text, str)
        return text

    def _check_stop(self, state: _RequestState, seq: _Sequence, new_text: str, token: int) -> None:
        """Decide whether `seq` ends after `token`; if so finish it in the scheduler."""
        params, req = state.params, seq.request
        if seq.detokenizer is not None:
            seq.text = seq.detokenizer.output_text
        reason: str | None = None
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif token in (params.stop_token_ids or []):
                reason, seq.stop_reason = "stop", token
            elif params.stop and new_text:
                hit = find_stop_string(seq.text, len(new_text), list(params.stop))
                if hit is not None:
                    stop, at = hit
                    seq.text = (
                        seq.text[: at + len(stop)]
                        if params.include_stop_str_in_output
                        else seq.text[:at]
                    )
                    reason, seq.stop_reason = "stop", stop
        if reason is None and (
            req.num_output_tokens >= seq.max_tokens
            or req.num_tokens >= self.config.scheduler.max_model_len
        ):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            status = (
                RequestStatus.FINISHED_STOPPED
                if reason == "stop"
                else RequestStatus.FINISHED_LENGTH
            )
            self.scheduler.finish_requests(req.request_id, status)

    def _make_output(self, state: _RequestState) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.request.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in state.sequences
        ]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=list(state.prompt_logprobs)
            if state.prompt_logprobs is not None
            else None,
            outputs=outputs,
            finished=state.finished,
            num_cached_tokens=max(state.sequences[0].request.num_cached_tokens, 0),
        )


def _rows(t: LogprobsTensors) -> list[tuple[list[int], list[float], int]]:
    """Per-row host values of logprob tensors: (token ids, logprobs, rank of the chosen token)."""
    return list(
        zip(t.token_ids.tolist(), t.logprobs.tolist(), t.sampled_rank.tolist(), strict=True)
    )
