"""Token embedding and the LM head that maps hidden states back to vocabulary logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nostall.layers.parameter import new_parameter


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden_size]."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, hidden_size] -> float32 logits [N, vocab_size]; shares the embedding matrix when tied."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None
    ) -> None:
        super().__init__()
        self.weight = (
            tied_to.weight if tied_to is not None else new_parameter(vocab_size, hidden_size)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype == torch.float32:
            return F.linear(hidden, self.weight)
        if hidden.is_cuda:
            # Half inputs, float32 accumulation and output, without a float32 copy of the weight.
            return torch.mm(hidden, self.weight.t(), out_dtype=torch.float32)
        return F.linear(hidden.float(), self.weight.float())
