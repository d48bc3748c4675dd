"""Find a GPT-2 checkpoint (hub id or local directory) and read its weights into a model's parameters.

Real checkpoints come in several shapes: transformers' `save_pretrained` (keys prefixed
`transformer.`, maybe sharded), the original `openai-community/gpt2` file (no prefix, extra
attention buffers, no `lm_head`), and older `pytorch_model.bin` files. All load here, with HF's
Conv1D weights ([in, out]) transposed once to Linear's [out, in]. The model is built on the
`meta` device (by `minigpt.model.gpt2.load_model`, which calls this module; this module never imports
the model) and each tensor is moved straight to its dtype/device, so no second full copy of the
weights is ever held. No pickle code runs: `.bin` files go through `weights_only=True`.
"""

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
# Files at the repo's root only (fnmatch's * also crosses "/": "*.safetensors" would fetch every
# checkpoint-*/ folder of a fine-tune): the tokenizer, and the weights in transformers' names.
HUB_FILES = ["config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer.json",
             "added_tokens.json", "tokenizer_config.json",
             "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json"]
HUB_FALLBACK_FILES = ["pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json"]
# What the loader reads, in the order it prefers: transformers' order
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_BLOCK = re.compile(r"h\.(\d+)\.")  # a transformer block's key, without the "transformer." prefix
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old GPT-2 files


# The part of a checkpoint tensor a model holds: (key without "transformer.", a safetensors slice or
# a tensor) -> tensor
Take = Callable[[str, Any], torch.Tensor]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: missing, corrupt or not matching its config."""


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
    """A local checkpoint directory for `name_or_path`, downloading from the hub if needed.

    A path that exists is used as is. Anything else that looks like a hub id ("gpt2",
    "openai-community/gpt2-medium") goes through `huggingface_hub.snapshot_download`, fetching
    only config, weights and tokenizer files; it honours HF_HUB_OFFLINE and the local cache.
    """
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
    """Name every part a checkpoint directory lacks to be run (config, weights, tokenizer) at once, and how
    such a directory is usually made, instead of failing on the first file looked for."""
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
    """The files holding the weights, in the order the loader prefers (`WEIGHT_FILES`): safetensors
    first, as transformers does (a repo that ships both may have been downloaded without its .bin)."""
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
    """(name, tensor) pairs of one weights file, one tensor of a safetensors file in memory at a time;
    with `take`, the part of each tensor it picks (from safetensors, only that part is read)."""
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
    """Each tensor of a safetensors file as a view of the file mapped into memory, to be copied before
    the next one is asked for: each tensor's pages are handed back as the reader moves on, so reading a
    file holds one tensor of it, not the whole file, in this process's memory (gpt2-xl: 6.2 GB).

    The format: an 8-byte little-endian header size, a JSON header (each tensor's dtype, shape and byte
    offsets after the header), the tensors' bytes."""
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
    """The GPT2 parameter a checkpoint key maps to, or None for keys to skip."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    return name.removeprefix("transformer.")


def is_layernorm(key: str) -> bool:
    """Layernorm parameters stay fp32 in every dtype (see model.Block)."""
    return key.startswith("ln_f.") or ".ln_" in key


def _in_layer_order(name: str) -> list[str | int]:
    """Sort key that puts h.2 before h.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def load_state_into(
    model: nn.Module, path: Path, dtype: torch.dtype, device: torch.device, take: Take | None = None
) -> None:
    """Fill a meta-device `model` (a `GPT2`: `config`, `wte`, `lm_head`) from the weight files in `path`,
    strictly: every parameter present with its shape, no key left over. `take(key, source)`: the part
    of each checkpoint tensor this model holds (a tensor-parallel shard), indexing `source`."""
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
            # Always a copy: a tensor read from the file may be a view of its memory map, and the model
            # must not change (or die of SIGBUS) when the file is overwritten after loading.
            state[key] = tensor.to(device=device, dtype=target, memory_format=torch.contiguous_format, copy=True)
            del tensor
    missing = sorted(set(expected) - set(state), key=_in_layer_order)
    n_layer = model.config.n_layer
    layers = {int(block.group(1)) for key in (*state, *map(_model_key, unexpected)) if (block := _BLOCK.match(key))}
    # Whole blocks h.0.. of another count, and every other tensor there: say so rather than list keys
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
