"""GPT-2: embeddings -> n_layer x (attention, MLP) -> layernorm -> tied head, with Hugging Face's parameter
names; linear weights [out, in]. `GPT2.run` is the one layer loop: every forward differs only in its attention."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from minigpt.model.activations import ACTIVATIONS, gelu_tanh
from minigpt.model.attention import Attention, CausalAttention, FusedKernels
from minigpt.model.config import GPT2Config
from minigpt.model.weights import load_state_into, resolve_checkpoint, resolve_device, resolve_dtype


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.scale = config.attention_scale(layer_idx)
        self.upcast = config.reorder_and_upcast_attn
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, C) flat tokens -> q, k, v, each (N, nh, hs)."""
        return self.c_attn(x).view(x.shape[0], 3, self.n_head, self.head_dim).unbind(1)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.inner_dim)
        self.c_proj = nn.Linear(config.inner_dim, config.n_embd)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor, fused: FusedKernels | None = None) -> torch.Tensor:
        if fused is not None and self.act is gelu_tanh and type(self.c_fc) is nn.Linear:  # not a quantized one
            return self.c_proj(fused.bias_gelu(F.linear(x, self.c_fc.weight), self.c_fc.bias))
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm block: residual stream and layernorms in fp32 (GPT-2's activations overflow fp16)."""

    def __init__(self, config: GPT2Config, layer_idx: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, attention: Attention, layer: int,
                rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """x (N, C) -> x + attn(ln_1 x) -> x + mlp(ln_2 x); only `rows` go on past the attention (the last layer's
        logits rows). The norms and the MLP's bias + GELU go through the attention's `fused` kernels where it has
        them."""
        fused = attention.fused
        y = attention(layer, *self.attention_inputs(x, fused))  # (N, C)
        if rows is not None:
            x, y = x[rows], y[rows]
            if not len(x):
                return x
        return self.attention_outputs(x, y, fused)

    def attention_inputs(self, x: torch.Tensor, fused: FusedKernels | None = None) -> tuple[torch.Tensor, ...]:
        """The half before the attention: x (N, C) -> q, k, v (N, nh, hs)."""
        ln = self.ln_1
        h = ln(x).to(self.dtype) if fused is None else fused.layernorm(x, ln.weight, ln.bias, ln.eps, self.dtype)
        return self.attn.qkv(h)

    def attention_outputs(self, x: torch.Tensor, y: torch.Tensor, fused: FusedKernels | None = None) -> torch.Tensor:
        """The half after it: x and the attention's output y (N, C) -> the next x."""
        ln = self.ln_2
        if fused is None:
            x = x + self.attn.c_proj(y)
            return x + self.mlp(ln(x).to(self.dtype))
        x, h = fused.add_layernorm(x, self.attn.c_proj(y), ln.weight, ln.bias, ln.eps, self.dtype)
        return x + self.mlp(h, fused)


class Programs(Protocol):
    """Compiled stand-ins for the blocks and the head (minigpt.compile): `block` as `Block.forward` with its own
    attention, `head` as `GPT2.head`."""

    def block(self, layer: int, block: Block, x: torch.Tensor, rows: torch.Tensor | slice | None) -> torch.Tensor: ...

    def head(self, model: GPT2, x: torch.Tensor) -> torch.Tensor: ...


def final_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`GPT2.head` of a GPT2, or of a module holding its `ln_f`, `lm_head` and `dtype`."""
    return model.lm_head(model.ln_f(x).to(model.dtype))


class GPT2(nn.Module):
    """GPT2LMHeadModel's math, inference only; linears and attention in `dtype`."""

    def __init__(self, config: GPT2Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, i, dtype) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
    ) -> GPT2:
        return load_model(name_or_path, dtype=dtype, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab) logits, no cache; a left-padded row gets the logits it gets alone."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__} "
                            "(torch.tensor(ids))")
        if input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be (batch, time), neither empty, got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        B, T = input_ids.shape
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
                )
            keep = attention_mask.to(device=input_ids.device, dtype=torch.bool)
            causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
            # a padding query sees itself: a row with no key would give NaN
            eye = torch.eye(T, dtype=torch.bool, device=input_ids.device)
            mask = ((causal & keep[:, None, :]) | eye)[:, None]  # (B, 1, T, T)
            if position_ids is None:
                position_ids = (keep.long().cumsum(-1) - 1).clamp(min=0)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        self._check_ranges(input_ids, position_ids)
        attention = CausalAttention(B, mask, self.attention_scales(), self.config.reorder_and_upcast_attn)
        return self.run(input_ids.flatten(), position_ids.flatten(), attention).view(B, T, -1)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention | None,
        logits_rows: torch.Tensor | slice | None = None,
        programs: Programs | None = None,
    ) -> torch.Tensor:
        """The layer loop: (N,) token ids and positions -> logits (N, vocab), or of `logits_rows` only; each block
        attends through `attention`, or runs as `programs` runs it."""
        x = self.embed(input_ids, positions)  # (N, C) fp32
        last = len(self.h) - 1
        for layer, block in enumerate(self.h):
            rows = logits_rows if layer == last else None
            x = block(x, attention, layer, rows) if programs is None else programs.block(layer, block, x, rows)
        return self.head(x) if programs is None else programs.head(self, x)

    def attention_scales(self) -> list[float]:
        return [block.attn.scale for block in self.h]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids).float() + self.wpe(positions).float()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return final_logits(self, x)

    def _check_ranges(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must be in [0, {self.config.vocab_size}) (the model's vocab_size)")
        if position_ids.numel() and int(position_ids.max()) >= self.config.n_positions:
            raise ValueError(
                f"sequence of {int(position_ids.max()) + 1} positions exceeds n_positions={self.config.n_positions}"
            )


class _SkipInit(TorchFunctionMode):
    """No random init: the checkpoint fills every parameter, and init on meta would import torch._dynamo."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


class WeightLayout(Protocol):
    """The part of a checkpoint a model holds (a tensor-parallel shard): `resize` shrinks the meta model to it,
    `take` gives that part of checkpoint tensor `key`."""

    def resize(self, model: GPT2) -> None: ...

    def take(self, key: str, source: Any) -> torch.Tensor: ...


def load_model(
    name_or_path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    layout: WeightLayout | None = None,
) -> GPT2:
    """GPT2 from a checkpoint (hub id or directory) in eval mode, built on meta then filled: the part `layout` holds."""
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    path = resolve_checkpoint(name_or_path)
    config = GPT2Config.from_json_file(path / "config.json")
    with torch.device("meta"), _SkipInit():
        model = GPT2(config, torch_dtype)
        if layout is not None:
            layout.resize(model)
    load_state_into(model, path, torch_dtype, torch_device, None if layout is None else layout.take)
    return model.eval().requires_grad_(False)
