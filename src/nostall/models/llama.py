"""The Llama family: Llama 2/3, Mistral and Qwen2.

A pre-norm decoder: x + attention(norm(x)), then x + mlp(norm(x)), with grouped-query attention, rotary
positions and a SwiGLU MLP. Members differ only in what their configs set: projection biases, head_dim,
sliding-window layers, tied embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from nostall.config import ModelConfig
from nostall.errors import ConfigError
from nostall.layers.activation import SiluAndMul
from nostall.layers.attention import Attention
from nostall.layers.attention.metadata import AttentionContext
from nostall.layers.embedding import LMHead, VocabEmbedding
from nostall.layers.linear import Linear, MergedLinear, QKVLinear
from nostall.layers.norm import RMSNorm
from nostall.layers.rotary import RotaryEmbedding, get_rope
from nostall.models.weight_loading import PackedModules, load_weights


def layer_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    """The window of layer `layer_idx`, as transformers decides it: configs with `layer_types` (Qwen2,
    Qwen3: sliding from `max_window_layers` on, if `use_sliding_window`) name each layer's kind;
    otherwise (Mistral) `sliding_window` applies to every layer when set."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hf = config.hf_config
        self.num_heads = int(hf.num_attention_heads)
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_bias, o_bias = self.projection_biases(hf)
        self.qkv_proj = QKVLinear(
            hf.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=qkv_bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, hf.hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            layer_idx,
            scale=self.head_dim**-0.5,
            sliding_window=layer_sliding_window(hf, layer_idx),
        )

    @staticmethod
    def projection_biases(hf_config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o)."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(hf_config: Any) -> tuple[bool, bool]:
        return True, False


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        if hf.hidden_act != "silu":
            raise ConfigError(f"hidden_act={hf.hidden_act!r} is not supported; accepted: silu")
        bias = bool(getattr(hf, "mlp_bias", False))
        size = hf.intermediate_size
        self.gate_up_proj = MergedLinear(hf.hidden_size, [size, size], bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(size, hf.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: LlamaAttention) -> None:
        super().__init__()
        hf = config.hf_config
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried unnormalized beside x and summed in the next norm;
        residual None: x is the embedding, the first layer's input."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        hf = config.hf_config
        self.embed_tokens = VocabEmbedding(config.vocab_size, hf.hidden_size)
        rotary_emb = get_rope(hf, config.head_dim, config.max_model_len)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_cls(config, i, rotary_emb))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    packed_modules: ClassVar[PackedModules] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.model = LlamaModel(config, self.attention_cls)
        tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        self.lm_head = LMHead(
            config.vocab_size,
            config.hf_config.hidden_size,
            tied_to=self.model.embed_tokens if tied else None,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden_size] final hidden states."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 [N, vocab_size]."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights, self.packed_modules)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on the q/k/v projections (always) and none on o."""

    attention_cls = Qwen2Attention
