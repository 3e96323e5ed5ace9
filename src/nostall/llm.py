"""Offline inference, shaped like vLLM's `LLM` class."""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from nostall.engine.args import EngineArgs
from nostall.engine.llm_engine import LLMEngine, PromptType
from nostall.engine.tokenizer import Tokenizer, apply_chat_template
from nostall.errors import InvalidRequestError
from nostall.outputs import RequestOutput
from nostall.sampling_params import SamplingParams, as_list

Message = dict[str, Any]


def _setup_logging() -> None:
    log = logging.getLogger("nostall")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S")
        )
        log.addHandler(handler)
        log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


class LLM:
    """Generate text from a local model directory or GGUF file.

    >>> llm = LLM(model="path/to/model.gguf")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].outputs[0].text

    Keyword arguments are the engine options of `EngineArgs` (named like vLLM's: dtype,
    max_model_len, max_num_seqs, max_num_batched_tokens, block_size, enable_prefix_caching,
    enable_chunked_prefill, gpu_memory_utilization, kv_cache_memory_bytes,
    num_gpu_blocks_override, device, seed). Unknown ones raise an error listing the accepted ones.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        _setup_logging()
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        if self.llm_engine.tokenizer is None:
            raise InvalidRequestError("this LLM runs with skip_tokenizer_init: it has no tokenizer")
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in the order given.

        `prompts` is a string, a list of token ids, a {"prompt": ...} / {"prompt_token_ids": ...}
        dict, or a list of those. Every prompt is validated before any is queued: a bad one raises
        InvalidRequestError and nothing runs.
        """
        prompt_list = _as_prompt_list(prompts)
        # Only finished outputs are returned: the engine need not build the intermediate ones.
        final: dict[int, SamplingParams] = {}
        params = []
        for sp in as_list(sampling_params, len(prompt_list)):
            if id(sp) not in final:
                final[id(sp)] = sp.clone(output_kind="final_only")
            params.append(final[id(sp)])
        engine = self.llm_engine
        for p, sp in zip(prompt_list, params, strict=True):
            engine.tokenize_prompt(p)
            engine.validate_params(sp)
        ids = []
        for p, sp in zip(prompt_list, params, strict=True):
            rid = str(next(self._counter))
            engine.add_request(rid, p, sp)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError(
                f"messages={messages!r} is invalid; accepted: a non-empty list of {{'role', 'content'}} dicts,"
                " or a list of such lists"
            )
        conversations = messages if isinstance(messages[0], list) else [messages]
        tok = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            text = apply_chat_template(
                tok, conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt
            )
            # The template already holds the special tokens it wants.
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            dynamic_ncols=True,
            disable=not use_tqdm,
        )
        in_toks = out_toks = 0
        try:
            while len(finished) < len(request_ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        in_toks += len(out.prompt_token_ids)
                        out_toks += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"in: {in_toks / elapsed:.0f} tok/s, out: {out_toks / elapsed:.0f} tok/s",
                            refresh=False,
                        )
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise InvalidRequestError("prompts is an empty list; accepted: at least one prompt")
        return list(prompts)
    raise InvalidRequestError(
        f"prompts of type {type(prompts).__name__} are invalid; accepted: a string, a list of token ids,"
        " a prompt dict, or a list of those"
    )
