"""GPT-2 checkpoints with random weights, in the layouts and files the hub serves (minigpt with no network)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from minigpt.model.config import GPT2Config
from minigpt.model.gpt2 import GPT2
from minigpt.model.weights import CONV1D_WEIGHTS, HUB_FALLBACK_FILES, HUB_FILES, is_layernorm

PRESETS = {  # n_layer, n_head, n_embd
    "distilgpt2": (6, 12, 768),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}
LAYOUTS = ("hf", "openai")


def preset_config(name: str, **overrides) -> GPT2Config:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    n_layer, n_head, n_embd = PRESETS[name]
    return GPT2Config(**{"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, **overrides})


def random_model(config: GPT2Config, seed: int = 0) -> GPT2:
    """Initialised as transformers does: N(0, 0.02), residual projections / sqrt(2 n_layer)."""
    torch.manual_seed(seed)
    model = GPT2(config)
    std = 0.02
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.zeros_(param)
        elif is_layernorm(name):
            torch.nn.init.ones_(param)
        elif name.endswith("c_proj.weight"):
            torch.nn.init.normal_(param, std=std / (2 * config.n_layer) ** 0.5)
        else:
            torch.nn.init.normal_(param, std=std)
    return model.eval()


def hf_state_dict(model: GPT2, layout: str = "hf") -> dict[str, torch.Tensor]:
    """Conv1D weights as [in, out]; `openai`: no `transformer.` prefix, with the mask buffers."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    prefix = "transformer." if layout == "hf" else ""
    config = model.config
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        tensor = param.detach()
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        key = name if name == "lm_head.weight" else prefix + name
        out[key] = tensor.contiguous()
    if layout == "openai":
        n = config.n_positions
        causal = torch.ones(n, n, dtype=torch.float32).tril().view(1, 1, n, n)
        for layer in range(config.n_layer):
            out[f"h.{layer}.attn.bias"] = causal.clone()  # safetensors refuses shared storage
            out[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


def write_checkpoint(
    model: GPT2,
    path: str | Path,
    vocab_files: tuple[Path, Path],
    layout: str = "hf",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Written beside `path`, then moved in (a failed write leaves `path` as it was); other files a loader would
    read there go."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        tensors = {k: v.to(dtype) for k, v in hf_state_dict(model, layout).items()}
        save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        vocab, merges = vocab_files
        shutil.copyfile(vocab, partial / "vocab.json")
        shutil.copyfile(merges, partial / "merges.txt")
        if not path.exists():
            partial.rename(path)
            return path
        path.mkdir(exist_ok=True)  # a file at `path` fails here, before anything is moved
        written = {file.name for file in partial.iterdir()}
        for file in path.iterdir():
            stale = any(fnmatch.fnmatch(file.name, pattern) for pattern in HUB_FILES + HUB_FALLBACK_FILES)
            if stale and file.name not in written and file.is_file():
                file.unlink()
        for name in written:
            os.replace(partial / name, path / name)
        return path
    finally:
        shutil.rmtree(partial, ignore_errors=True)
