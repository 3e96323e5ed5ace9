"""Qwen3: the Llama family plus an RMSNorm over each query and key head before the rotary embedding."""

from __future__ import annotations

import torch

from nostall.config import ModelConfig
from nostall.layers.attention.metadata import AttentionContext
from nostall.layers.norm import RMSNorm
from nostall.layers.rotary import RotaryEmbedding
from nostall.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary_emb)
        eps = config.hf_config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q.view(num_tokens, -1), k.view(num_tokens, -1))
        return self.o_proj(self.attn(q, k, v, ctx))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
