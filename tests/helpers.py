"""Test helpers: build the attention context of one step over a paged KV cache, the way a runner would."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import torch
from transformers import PreTrainedModel

from nostall.layers.attention.backend import get_attention_backend
from nostall.layers.attention.metadata import AttentionContext, KVCache, build_metadata


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[KVCache]:
    """One cache per layer, filled with NaN so that reading a slot nobody wrote poisons the output."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        KVCache(
            key=torch.full(shape, float("nan"), dtype=dtype, device=device),
            value=torch.full(shape, float("nan"), dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


def random_block_tables(
    max_seq_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> list[list[int]]:
    """Disjoint, shuffled (non-contiguous) block ids for requests of at most max_seq_lens tokens."""
    needed = [-(-n // block_size) for n in max_seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, only {num_blocks} allocated")
    ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start : start + n])
        start += n
    return tables


@dataclasses.dataclass
class PagedRequests:
    """A fixed set of requests with their KV blocks and caches, stepped through prefill and decode."""

    kv_caches: list[KVCache]
    block_tables: list[list[int]]
    block_size: int
    backend_name: str = "torch"
    device: torch.device | str = "cpu"

    @classmethod
    def allocate(
        cls,
        max_seq_lens: list[int],
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        spare_blocks: int = 7,
    ) -> PagedRequests:
        """Caches with `spare_blocks` more blocks than needed, so assignments leave gaps."""
        generator = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-n // block_size) for n in max_seq_lens) + spare_blocks
        tables = random_block_tables(max_seq_lens, block_size, num_blocks, generator)
        caches = allocate_kv_caches(
            num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device
        )
        return cls(caches, tables, block_size, device=device)

    def step(
        self, tokens: list[list[int]], num_cached: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """One step for every request: tokens[r] is request r's sequence through this step, and its
        first num_cached[r] tokens are already in the cache. Returns (input_ids, positions, ctx)."""
        ids, positions, query_lens = [], [], []
        for seq, cached in zip(tokens, num_cached, strict=True):
            ids.extend(seq[cached:])
            positions.extend(range(cached, len(seq)))
            query_lens.append(len(seq) - cached)
        metadata = build_metadata(
            query_lens,
            [len(seq) for seq in tokens],
            self.block_tables,
            self.block_size,
            self.device,
        )
        ctx = AttentionContext(metadata, self.kv_caches, get_attention_backend(self.backend_name))
        return (
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            ctx,
        )


def write_gguf(hf_model: PreTrainedModel, path: Path) -> None:
    """Save a float32 transformers Llama/Qwen2/Qwen3 model as an F32 GGUF file the way llama.cpp's
    converter lays it out: gguf's tensor names, and for "llama" the Q/K rows permuted per head."""
    config = hf_model.config
    arch_name = config.model_type
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module, _, suffix = name.rpartition(".")
        data = tensor.numpy()
        num_heads = heads.get(module.rpartition(".")[2])
        if arch_name == "llama" and num_heads is not None:
            # llama.cpp's permutation: per head, interleave the two rotary halves row by row.
            data = (
                data.reshape(num_heads, 2, data.shape[0] // num_heads // 2, *data.shape[1:])
                .swapaxes(1, 2)
                .reshape(data.shape)
            )
        writer.add_tensor(f"{name_map.get_name(module)}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
