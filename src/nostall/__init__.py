"""nostall: an LLM inference and serving engine where the GPU never waits for the host."""

from nostall.outputs import CompletionOutput, Logprob, RequestOutput
from nostall.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; import it on first use only.
    if name == "LLM":
        from nostall.llm import LLM

        return LLM
    raise AttributeError(f"module 'nostall' has no attribute {name!r}")
