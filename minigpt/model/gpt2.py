"""GPT-2, written by hand: embeddings -> n_layer x (attention, MLP) -> layernorm -> tied head.

Parameter names line up with Hugging Face's (`wte`, `h.0.attn.c_attn`, ...) so loading is a
loop. Linear weights are stored [out, in] (HF's Conv1D stores [in, out]; the loader transposes
once). `GPT2.run` is the one layer loop every forward goes through: the plain causal
`model(input_ids)`, the engine's paged step and the compiled steps differ only in the attention
they pass it (minigpt/model/attention.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from minigpt.model.activations import ACTIVATIONS
from minigpt.model.attention import CausalAttention
from minigpt.model.config import GPT2Config
from minigpt.model.weights import load_state_into, resolve_checkpoint, resolve_device, resolve_dtype

if TYPE_CHECKING:
    from minigpt.tensor_parallel.shard import Shard


class Attention(Protocol):
    """How a forward's tokens attend: q, k, v (N, H, D) of `layer` -> (N, H * D) (minigpt/model/attention.py)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block. The residual stream and layernorms stay in fp32 whatever the
    model's dtype (GPT-2's activations overflow fp16); attention and MLP run in `dtype`."""

    def __init__(self, config: GPT2Config, layer_idx: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The block's second half: the residual stream plus the MLP of its normalized self."""
        return x + self.mlp(self.ln_2(x).to(self.dtype))


def final_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`GPT2.head` of a GPT2, or of a module holding its `ln_f`, `lm_head` and `dtype` (a compiled head's)."""
    return model.lm_head(model.ln_f(x).to(model.dtype))


def attention_inputs(block: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block up to its attention: residual stream (N, C) -> q, k, v (N, nh, hs)."""
    return block.attn.qkv(block.ln_1(x).to(block.dtype))


def attention_outputs(block: Block, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A block after its attention: residual stream x and attention output y (N, C) -> the next stream."""
    return block.add_mlp(x + block.attn.c_proj(y))


class GPT2(nn.Module):
    """GPT-2 language model (GPT2LMHeadModel's math), inference only: no dropout anywhere.

    `dtype` is what the linears, attention and KV pool compute in; layernorm parameters and
    the residual stream are fp32 (see Block)."""

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
        """Load a Hugging Face GPT-2 checkpoint (hub id or local directory), in eval mode."""
        return load_model(name_or_path, dtype=dtype, device=device)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T) token ids -> (B, T, vocab) logits; plain causal forward, no cache.

        With an `attention_mask` (1 = token, 0 = padding) padded rows get positions counted
        from their first real token, so a left-padded row gets the logits it gets alone.
        """
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
            # A padding query may see only itself: a row with no key at all would give NaN.
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
        attention: Attention,
        logits_rows: torch.Tensor | slice | None = None,
        halves: tuple[Callable, Callable] = (attention_inputs, attention_outputs),
    ) -> torch.Tensor:
        """The layer loop: (N,) token ids and positions -> logits (N, vocab), or of `logits_rows` only.

        `attention(layer, q, k, v)` is how the tokens attend (minigpt/model/attention.py). Once the last
        layer has attended, only `logits_rows` go on through its projection and MLP: for a prompt, one
        row instead of all of them. `halves`: a block's two halves around its attention (compiled ones
        in a compiled engine's eager steps)."""
        before, after = halves
        x = self.embed(input_ids, positions)  # (N, C) fp32
        last = len(self.h) - 1
        for layer, block in enumerate(self.h):
            q, k, v = before(block, x)  # (N, H, D) each
            y = attention(layer, q, k, v)  # (N, C)
            if layer == last and logits_rows is not None:
                x, y = x[logits_rows], y[logits_rows]
                if not len(x):  # a prompt chunk that samples nothing: no logits to compute
                    break
            x = after(block, x, y)
        return self.head(x)

    def attention_scales(self) -> list[float]:
        return [block.attn.scale for block in self.h]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings: the fp32 residual stream every forward starts from."""
        return self.wte(input_ids).float() + self.wpe(positions).float()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final layernorm and LM head: residual stream -> logits."""
        return final_logits(self, x)

    def _check_ranges(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must be in [0, {self.config.vocab_size}) (the model's vocab_size)")
        if position_ids.numel() and int(position_ids.max()) >= self.config.n_positions:
            raise ValueError(
                f"sequence of {int(position_ids.max()) + 1} positions exceeds n_positions={self.config.n_positions}"
            )


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Swap every nn.Linear of `model` in place for `make(linear)` (quantized, packed, ...)."""
    parents = [module for module in model.modules() if not isinstance(module, nn.Linear)]  # not the linears:
    for module in parents:  # each replaced one is freed at once, not when all are (gigabytes for gpt2-xl)
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    return model


class _SkipInit(TorchFunctionMode):
    """Skip random initialisation while building the model: the checkpoint fills every parameter,
    and torch's init on the meta device would import torch._dynamo (and with it Triton, ~1 s)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def load_model(
    name_or_path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    shard: Shard | None = None,
) -> GPT2:
    """Build GPT2 from a checkpoint (hub id or directory) in eval mode, on `device` in `dtype`:
    built on the meta device, then filled by `minigpt.model.weights`. With a tensor-parallel `shard`, only
    that rank's part of the weights (minigpt/tensor_parallel/shard.py)."""
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    path = resolve_checkpoint(name_or_path)
    config = GPT2Config.from_json_file(path / "config.json")
    with torch.device("meta"), _SkipInit():
        model = GPT2(config, torch_dtype)
        if shard is not None:
            shard.resize(model)
    load_state_into(model, path, torch_dtype, torch_device, None if shard is None else shard.take)
    return model.eval().requires_grad_(False)
