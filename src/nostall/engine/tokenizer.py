"""Tokenizer loading and chat templates, through transformers (HF directories and GGUF files)."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nostall.config import ModelConfig
from nostall.errors import InvalidRequestError, ModelLoadError

Tokenizer = PreTrainedTokenizerBase


def load_tokenizer(model_config: ModelConfig) -> Tokenizer:
    kwargs: dict[str, Any] = {"local_files_only": True}
    if model_config.gguf_file is not None:
        kwargs["gguf_file"] = model_config.gguf_file
    try:
        return AutoTokenizer.from_pretrained(model_config.tokenizer_dir, **kwargs)
    except Exception as e:
        raise ModelLoadError(
            f"cannot load a tokenizer from {model_config.tokenizer_dir!r}"
            f"{' (' + model_config.gguf_file + ')' if model_config.gguf_file else ''}: {e}; expected"
            " tokenizer.json / tokenizer_config.json beside config.json, or a GGUF file with tokenizer metadata"
        ) from e


def apply_chat_template(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for a conversation, from the model's own chat template."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; pass chat_template=... or use generate()"
        )
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        raise InvalidRequestError(
            f"messages={messages!r} is invalid; accepted: a list of {{'role': ..., 'content': ...}} dicts"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as e:
        raise InvalidRequestError(f"the chat template failed on these messages: {e}") from e
    assert isinstance(text, str)
    return text
