"""A GPT-2 checkpoint found (hub id or local directory) and its weights read into a meta-device model, each
tensor straight to its dtype and device: both key layouts, HF's Conv1D [in, out] transposed, no pickle code."""

from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minigpt.model.config import GPT2Config

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# the repo's root only: fnmatch's * crosses "/", and "*.safetensors" would fetch every checkpoint-*/ folder
HUB_FILES = ["config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.json",
             "added_tokens.json", "tokenizer_config.json",
             "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json"]
HUB_FALLBACK_FILES = ["pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json"]
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",  # in transformers' order
                "pytorch_model.bin", "pytorch_model.bin.index.json")
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BLOCK = re.compile(r"h\.(\d+)\.")  # a transformer block's key, without the "transformer." prefix
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old GPT-2 files

# (key without "transformer.", a tensor or safetensors slice) -> the part of it a model holds
Take = Callable[[str, Any], torch.Tensor]


class CheckpointError(ValueError):
    """A checkpoint missing, corrupt or not matching its config."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, float16, bfloat16") from None


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available here; use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device.type!r}; use 'cpu' or 'cuda'")
    return device


def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{path} is a file; pass the checkpoint directory that holds config.json")
    text = str(name_or_path)
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or not text:
        raise FileNotFoundError(f"no checkpoint directory at {text!r}")
    return _download(text)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
        if not _weight_files_present(path):
            path = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES + HUB_FALLBACK_FILES))
    except (RepositoryNotFoundError, HFValidationError):
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local directory nor a model on the Hugging Face hub"
        ) from None
    except Exception as err:  # network down, offline mode without a cached copy, ...
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        raise FileNotFoundError(
            f"{repo_id!r} is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(err).__name__}: {reason}). With no network, pass a local checkpoint directory instead "
            "(python scripts/make_checkpoint.py writes one)"
        ) from None
    return path


def check_complete(path: Path) -> None:
    """Names every part a checkpoint directory lacks at once, not the first file looked for."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not _weight_files_present(path):
        missing.append(f"weights ({' or '.join(WEIGHT_FILES)})")
    if not (path / "tokenizer.json").is_file() and not all((path / f).is_file() for f in ("vocab.json", "merges.txt")):
        missing.append("tokenizer (tokenizer.json, or vocab.json and merges.txt)")
    if missing:
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint: it has no {'; no '.join(missing)}. A write or download that "
            "stopped part way leaves such a directory: write or download it again"
        )


def _weight_files_present(path: Path) -> bool:
    return any((path / name).exists() for name in WEIGHT_FILES)


def weight_files(path: Path) -> list[Path]:
    for name in WEIGHT_FILES:
        file = path / name
        if not file.exists():
            continue
        if not name.endswith(".index.json"):
            return [file]
        try:
            weight_map = json.loads(file.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{file} is not a valid shard index: {err}") from None
        shards = [path / shard for shard in sorted(set(weight_map.values()))]
        missing = [str(s) for s in shards if not s.exists()]
        if missing:
            raise CheckpointError(f"{file} lists shards that are missing: {', '.join(missing)}")
        return shards
    raise FileNotFoundError(
        f"no weights in {path}: expected model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def _read_tensors(file: Path, take: Take | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    if file.suffix == ".safetensors":
        for name, tensor in _mapped_safetensors(file):
            yield name, tensor if take is None else take(name.removeprefix("transformer."), tensor)
        return
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) format cannot be mmap'd
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # torch's advice (weights_only=False) would run the file's code
        found = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), "")  # what it names
        raise CheckpointError(
            f"{file} holds pickled Python objects besides tensors, which minigpt does not run"
            + (f" ({found})" if found else "") + "; save the checkpoint as safetensors"
        ) from None
    except Exception as err:
        raise CheckpointError(f"cannot read {file}: {err}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} does not hold a state dict")
    for name, tensor in state.items():
        yield name, tensor if take is None else take(name.removeprefix("transformer."), tensor)


def _mapped_safetensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor as a view of the mapped file, to be copied before the next is asked for (its pages are then
    given back: one tensor in memory at a time). Format: u64 LE header size, JSON header, the bytes."""
    try:
        with open(file, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # private: views are writable
        (size,) = struct.unpack("<Q", mapped[:8])
        header = json.loads(mapped[8 : 8 + size])
        entries = [(name, e["dtype"], e["shape"], math.prod(e["shape"]), *e["data_offsets"])
                   for name, e in header.items() if name != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as err:
        raise CheckpointError(f"cannot read {file}: {err} (truncated or corrupt safetensors file?)") from None
    unknown = sorted({kind for _, kind, *_ in entries} - set(_SAFETENSORS_DTYPES))
    if unknown:
        raise CheckpointError(f"{file}: tensors of dtype {', '.join(unknown)}, which minigpt does not read "
                              f"(it reads {', '.join(_SAFETENSORS_DTYPES)})")
    base = 8 + size
    for name, kind, shape, count, start, end in entries:
        dtype = _SAFETENSORS_DTYPES[kind]
        if not 0 <= start <= end or base + end > len(mapped) or end - start != count * dtype.itemsize:
            raise CheckpointError(f"cannot read {file}: {name} lies outside the file or has the wrong size "
                                  "(truncated or corrupt safetensors file?)")
        if not count:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        yield name, torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start).view(shape)
        if _GIVE_BACK is not None:  # a view still held (never written) reads the file again: only slower
            first_page = (base + start) // mmap.PAGESIZE * mmap.PAGESIZE
            mapped.madvise(_GIVE_BACK, first_page, base + end - first_page)


_GIVE_BACK = getattr(mmap, "MADV_DONTNEED", None)  # absent on Windows
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _model_key(name: str) -> str | None:
    if name.endswith(IGNORED_SUFFIXES):
        return None
    return name.removeprefix("transformer.")


def is_layernorm(key: str) -> bool:
    """Layernorm parameters stay fp32 in every dtype."""
    return key.startswith("ln_f.") or ".ln_" in key


def _in_layer_order(name: str) -> list[str | int]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def load_state_into(
    model: nn.Module, path: Path, dtype: torch.dtype, device: torch.device, take: Take | None = None
) -> None:
    """Fills a meta-device `GPT2` strictly (every parameter, its shape, no key left over); `take` picks a shard."""
    expected = {name: p.shape for name, p in model.named_parameters(remove_duplicate=True)}
    tied = model.config.tie_word_embeddings
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in weight_files(path):
        for name, tensor in _read_tensors(file, take):
            key = _model_key(name)
            if key is None or (tied and key == "lm_head.weight"):
                continue
            if key not in expected:
                unexpected.append(name)
                continue
            if key.endswith(CONV1D_WEIGHTS):
                tensor = tensor.t()
            if tensor.shape != expected[key]:
                raise CheckpointError(
                    f"{file.name}: {name} has shape {tuple(tensor.shape)}, the config expects {tuple(expected[key])}"
                    + (" (after transposing Conv1D)" if key.endswith(CONV1D_WEIGHTS) else "")
                )
            target = torch.float32 if is_layernorm(key) else dtype
            # a copy: a view of the memory map would change (or SIGBUS) when the file is overwritten
            state[key] = tensor.to(device=device, dtype=target, memory_format=torch.contiguous_format, copy=True)
            del tensor
    missing = sorted(set(expected) - set(state), key=_in_layer_order)
    n_layer = model.config.n_layer
    layers = {int(block.group(1)) for key in (*state, *map(_model_key, unexpected)) if (block := _BLOCK.match(key))}
    # whole blocks h.0.. of another count: name the count rather than list keys
    if layers == set(range(len(layers))) and len(layers) not in (0, n_layer) and all(map(_BLOCK.match, missing)):
        found, default = len(layers), GPT2Config().n_layer
        raise CheckpointError(
            f"{path}: the weights hold {found} layer{'s' if found > 1 else ''} (h.0 to h.{found - 1}) but"
            f" config.json's n_layer is {n_layer}: is config.json another model's, or are layers missing?"
            + (f" ({default} is also GPT-2's default when config.json has no n_layer)" if n_layer == default else "")
        )
    if unexpected:
        raise CheckpointError(f"unexpected keys in {path}: {', '.join(sorted(unexpected, key=_in_layer_order)[:10])}")
    if missing:
        listed = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise CheckpointError(f"missing keys in {path} (without the 'transformer.' prefix): {listed}")
    model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.lm_head.weight = model.wte.weight
