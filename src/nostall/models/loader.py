"""From a model path to a loaded model: resolve the ModelConfig, build on the device, stream the weights.

A model is a local Hugging Face directory (config.json, model.safetensors or shards listed in
model.safetensors.index.json) or a single .gguf file. Nothing is downloaded. Weights stream one tensor
at a time (memory-mapped, dequantized or cast on the way) into parameters created empty on the device
in the target dtype: besides the model itself, host memory holds about one tensor at a time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig

from nostall.config import ModelConfig
from nostall.errors import ConfigError, ModelLoadError
from nostall.models.registry import SUPPORTED_ARCHITECTURES, CausalLM, get_model_class
from nostall.models.weight_loading import checkpoint_names

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_HALF_DTYPES = (torch.bfloat16, torch.float16)

# GGUF general.architecture -> architecture; llama.cpp files Mistral models under "llama".
_GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# GGUF general.file_type values whose tensors are mostly half precision.
_GGUF_HALF_FILE_TYPES: dict[int, torch.dtype] = {
    int(gguf.LlamaFileType.MOSTLY_F16): torch.float16,
    int(gguf.LlamaFileType.MOSTLY_BF16): torch.bfloat16,
}
LOAD_FORMATS = ("auto", "dummy")
_ACCEPTED_MODELS = (
    "a local Hugging Face model directory (config.json + *.safetensors) or a .gguf file"
)


def resolve_model_config(
    model: str,
    dtype: str | torch.dtype = "auto",
    max_model_len: int | None = None,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
) -> ModelConfig:
    """Read the model's configuration and fill in every "auto"; reads no weights.

    load_format "dummy" fills the weights with random values on the device instead of reading
    them (a directory then needs only config.json): speed does not depend on weight values.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(
            f"load_format={load_format!r} is invalid; accepted: {', '.join(LOAD_FORMATS)}"
        )
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {model!r} does not exist; accepted: {_ACCEPTED_MODELS}")
    checkpoint_dtype: torch.dtype | None
    if path.is_dir():
        architecture = _read_architecture(path)
        if load_format != "dummy":
            _safetensors_files(path)
        hf_config = _auto_config(path)
        model_dir, gguf_file = path, None
        checkpoint_dtype = _config_dtype(hf_config)
    elif path.suffix == ".gguf":
        reader = _open_gguf(path)
        gguf_architecture = _gguf_string(reader, "general.architecture")
        if gguf_architecture not in _GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"GGUF architecture {gguf_architecture!r} of {path} is not supported; accepted: "
                f"{', '.join(_GGUF_ARCHITECTURES)}"
            )
        hf_config = _auto_config(path.parent, gguf_file=path.name)
        is_mistral = hf_config.model_type == "mistral"
        architecture = (
            "MistralForCausalLM" if is_mistral else _GGUF_ARCHITECTURES[gguf_architecture]
        )
        model_dir, gguf_file = path.parent, path.name
        checkpoint_dtype = _GGUF_HALF_FILE_TYPES.get(_gguf_int(reader, "general.file_type", -1))
    else:
        raise ModelLoadError(
            f"model path {model!r} is a file but not a .gguf; accepted: {_ACCEPTED_MODELS}"
        )

    return ModelConfig(
        model_dir=str(model_dir),
        gguf_file=gguf_file,
        hf_config=hf_config,
        architecture=architecture,
        dtype=_resolve_dtype(dtype, checkpoint_dtype, torch.device(device)),
        max_model_len=_resolve_max_model_len(max_model_len, hf_config),
        tokenizer_dir=str(model_dir),
        eos_token_ids=_eos_token_ids(hf_config, model_dir),
        load_format=load_format,
    )


def load_model(cfg: ModelConfig, device: torch.device | str) -> CausalLM:
    """Build the model on `device` in cfg.dtype and load every parameter; returns it in eval mode."""
    model_cls = get_model_class(cfg.architecture)
    with torch.device(device), _default_dtype(cfg.dtype):
        model = model_cls(cfg)
    module = cast(nn.Module, model)
    if cfg.load_format == "dummy":
        _fill_dummy_weights(module)
        module.eval()
        return model
    model_dir = Path(cfg.model_dir)
    if cfg.gguf_file is not None:
        source = model_dir / cfg.gguf_file
        names = checkpoint_names(module, model.packed_modules)
        weights = _gguf_weights(source, cfg.hf_config, names)
    else:
        source = model_dir
        weights = _safetensors_weights(_safetensors_files(model_dir))
    with torch.no_grad():
        loaded = model.load_weights(weights)
    missing = [name for name, _ in module.named_parameters() if name not in loaded]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ModelLoadError(
            f"checkpoint {source} has no weights for {len(missing)} parameters of "
            f"{cfg.architecture}: {shown}; accepted: a checkpoint holding every parameter"
        )
    module.eval()
    return model


@torch.no_grad()
def _fill_dummy_weights(module: nn.Module) -> None:
    """Random weights drawn on the parameters' device: matrices N(0, 1/fan_in), vectors near 1
    (norm weights) so activations keep a sane scale through every layer."""
    for name, p in module.named_parameters():
        if p.ndim >= 2:
            p.normal_(0.0, p.shape[-1] ** -0.5)
        elif "bias" in name:
            p.normal_(0.0, 0.02)
        else:
            p.normal_(1.0, 0.02)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _read_architecture(model_dir: Path) -> str:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        ggufs = sorted(p.name for p in model_dir.glob("*.gguf"))
        hint = f" (for GGUF, pass the file itself: {model_dir / ggufs[0]})" if ggufs else ""
        raise ModelLoadError(
            f"model directory {str(model_dir)!r} has no config.json{hint}; accepted: {_ACCEPTED_MODELS}"
        )
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(
            f"config file {str(config_file)!r} is unreadable ({e}); accepted: a JSON object"
        ) from None
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    if not architectures:
        raise ModelLoadError(
            f"config file {str(config_file)!r} names no architectures; accepted: one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = str(architectures[0])
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {architecture!r} in {str(config_file)!r} is not supported; accepted: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _auto_config(model_dir: Path, gguf_file: str | None = None) -> Any:
    source = model_dir / gguf_file if gguf_file else model_dir / "config.json"
    try:
        if gguf_file is None:
            return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        return AutoConfig.from_pretrained(
            str(model_dir), gguf_file=gguf_file, local_files_only=True
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(
            f"transformers cannot read the configuration in {str(source)!r}: {e}"
        ) from None


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those listed in model.safetensors.index.json, else model.safetensors, else
    every *.safetensors in the directory."""
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(
                f"safetensors index {str(index_file)!r} is unreadable ({e!r}); accepted: a JSON "
                "object with a weight_map of tensor name -> file name"
            ) from None
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(
                f"safetensors index {str(index_file)!r} lists missing files: {', '.join(absent)}"
            )
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"model directory {str(model_dir)!r} has no safetensors weights; accepted: "
            "model.safetensors, or shards listed in model.safetensors.index.json"
        )
    return files


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(
                f"safetensors file {str(file)!r} is corrupt or truncated: {e}"
            ) from None


def _open_gguf(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    # gguf reports a malformed or truncated file with assorted exception types.
    except Exception as e:
        raise ModelLoadError(f"GGUF file {str(path)!r} is corrupt or truncated: {e}") from None


def _gguf_string(reader: gguf.GGUFReader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        raise ModelLoadError(f"GGUF file {reader.data.filename!r} has no {key!r} field")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _gguf_int(reader: gguf.GGUFReader, key: str, default: int) -> int:
    field = reader.fields.get(key)
    return default if field is None else int(field.parts[field.data[0]][0])


def _gguf_weights(
    path: Path, hf_config: Any, names: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors of a GGUF file under their Hugging Face names.

    Names map through gguf's own table (HF module -> GGUF tensor, reversed here). GGUF lists dims
    fastest-first; the numpy data is already [rows, cols] like the HF tensor. llama.cpp stores the
    Q and K rows of "llama" files permuted for its interleaved rotary; they are put back in the
    half-split order transformers uses.
    """
    reader = _open_gguf(path)
    gguf_architecture = _gguf_string(reader, "general.architecture")
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_architecture)
    name_map = gguf.get_tensor_name_map(arch, int(hf_config.num_hidden_layers))
    to_hf: dict[str, str] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        gguf_module = name_map.get_name(module)
        if gguf_module is not None:
            to_hf[f"{gguf_module}.{suffix}"] = name
    permuted_heads = {
        "attn_q": int(hf_config.num_attention_heads),
        "attn_k": int(hf_config.num_key_value_heads),
    }
    for tensor in reader.tensors:
        hf_name = to_hf.get(tensor.name)
        if hf_name is None:
            continue
        try:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be "
                f"dequantized: {e}"
            ) from None
        data = data.reshape(tuple(reversed(tensor.shape.tolist())))
        kind = tensor.name.split(".")[-2]
        if gguf_architecture == "llama" and kind in permuted_heads:
            data = _unpermute_rotary_rows(data, permuted_heads[kind])
        yield hf_name, torch.from_numpy(data if data.flags.writeable else data.copy())


def _unpermute_rotary_rows(data: np.ndarray, num_heads: int) -> np.ndarray:
    """Per head, rows [r0, r_half, r1, r_half+1, ...] (llama.cpp) -> [r0, r1, ..., r_half, ...] (HF)."""
    half = data.shape[0] // num_heads // 2
    rows = data.reshape(num_heads, half, 2, *data.shape[1:])
    return rows.swapaxes(1, 2).reshape(data.shape)


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        return _DTYPES.get(dtype)
    return dtype if isinstance(dtype, torch.dtype) else None


def _resolve_dtype(
    dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None, device: torch.device
) -> torch.dtype:
    """dtype "auto" is float32 off CUDA; on CUDA the checkpoint's half dtype, else bfloat16."""
    accepted = "auto, " + ", ".join(_DTYPES) + " (or the torch dtypes)"
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype={dtype} is not supported; accepted: {accepted}")
        return dtype
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in _HALF_DTYPES else torch.bfloat16
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; accepted: {accepted}")
    return _DTYPES[dtype]


def _resolve_max_model_len(max_model_len: int | None, hf_config: Any) -> int:
    limit = int(hf_config.max_position_embeddings)
    if max_model_len is None:
        return limit
    if not 1 <= max_model_len <= limit:
        raise ConfigError(
            f"max_model_len={max_model_len} is outside the model's range; accepted: 1 to "
            f"max_position_embeddings={limit}"
        )
    return max_model_len


def _eos_token_ids(hf_config: Any, model_dir: Path) -> tuple[int, ...]:
    """The config's eos_token_id, then generation_config.json's, without repeats."""
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    generation_file = model_dir / "generation_config.json"
    if generation_file.is_file():
        try:
            generation = json.loads(generation_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(
                f"generation config {str(generation_file)!r} is unreadable ({e}); accepted: a JSON object"
            ) from None
        if isinstance(generation, dict):
            ids += _as_ids(generation.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
