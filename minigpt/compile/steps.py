"""The compiled steps of `compile=True`: programs of one block's shape, exported and compiled ahead of
time by AOTInductor, built once per model shape and mode and loaded from disk on later starts
(`compile_cache`). Every program takes its layer's tensors as inputs: none holds a copy of them, and one
program serves every layer, so a program costs as much to build for gpt2-xl's 48 layers as for gpt2's 12.

- `decode_layer`: a block's whole decode, one token per sequence, any batch: its attention reads the
  layer's pages and never writes them; it returns the tokens' new K/V, which `decode_step` stores
  after the call. `decode_step` runs the layers, the embedding and the head around it.
- A decode step of one sequence runs `decode_layer` and the head (`model.final_logits`) as programs
  of a batch of exactly one, where a linear may take a product made for one row
  (`quantize.one_row_products`).
- Every other step (prompts, prompts beside decodes, verification of drafts) runs the model's layer
  loop eagerly, around one program for each block's half before and after attention and one for the
  decodes' attention."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import Dim

from minigpt.compile.cache import ProgramCache, ProgramSpec, build_environment
from minigpt.compile.torch_compat import missing_internals
from minigpt.engine.config import error_line
from minigpt.engine.kv_cache import KVPool
from minigpt.model.attention import PoolAttention, paged_decode
from minigpt.model.backends import store_kv
from minigpt.model.gpt2 import GPT2, Block, attention_inputs, attention_outputs, final_logits

logger = logging.getLogger("minigpt")

# Sizes of the examples the programs are exported with: every one is dynamic, so only their being
# unlike each other (and not 0 or 1, which export specializes) matters.
EXAMPLE_BATCH, EXAMPLE_PAGES, EXAMPLE_TOKENS, EXAMPLE_BLOCKS = 5, 7, 11, 3


def decode_layer(
    block: Block,
    x: torch.Tensor,
    pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of a decode step, one token per sequence: x [B, C] -> (the next x, the tokens' new K/V
    [2, B, H, D] in the pool's dtype). pool: this layer's pages (2, blocks, block_size, H, D), read
    only; block_tables: [B, W]; context_lens: [B] tokens including this step's; scale: a 0-d tensor."""
    q, k, v = attention_inputs(block, x)
    y = PoolAttention(pool[None], block_tables, context_lens, scale[None])(0, q, k, v)
    return attention_outputs(block, x, y), torch.stack([k, v]).to(pool.dtype)  # the cast fused: no pass of its own


def decode_step(
    model: GPT2,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: torch.Tensor,
    layer: Callable = decode_layer,
    head: Callable = final_logits,
) -> torch.Tensor:
    """One token per sequence -> logits [B, vocab]; each layer's new K/V stored at `slot_mapping` once
    that layer has attended. `layer`: `decode_layer`, or its compiled program (`LayerProgram`); `head`:
    `final_logits`, or its compiled program (`HeadProgram`).

    kv_pool: (n_layer, 2, blocks, block_size, H, D); scales: [n_layer] each layer's attention scale.
    A program that wrote into its input pool would copy the whole pool on every call: the program
    returns the K/V, stored here."""
    x = model.embed(input_ids, positions)
    slots = kv_pool.flatten(2, 3)  # pages as token slots: (n_layer, 2, blocks * block_size, H, D)
    for index, block in enumerate(model.h):
        x, new_kv = layer(block, x, kv_pool[index], block_tables, context_lens, scales[index])
        slots[index].index_copy_(1, slot_mapping, new_kv)
    return head(model, x)


def attention_scales(model: GPT2) -> torch.Tensor:
    """Each layer's attention scale as `decode_step` takes them: [n_layer] fp32 on the model's device."""
    return torch.tensor(model.attention_scales(), device=model.wte.weight.device)


def named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `module` by name (a tied one once)."""
    return list(itertools.chain(module.named_parameters(), module.named_buffers()))


def tensors_of(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """What a `TensorsAsInputs` program of `module`'s shape takes first."""
    return tuple(tensor for _, tensor in named_tensors(module))


class _Call(torch.nn.Module):
    def __init__(self, fn: Callable, module: torch.nn.Module) -> None:
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, *inputs):
        return self.fn(self.module, *inputs)


class TensorsAsInputs(torch.nn.Module):
    """`fn(module, *inputs)` as a module to export with `module`'s tensors (`tensors_of`) as its first
    input, not as constants: the program holds no weights, and one program serves every module of the
    same shape (every layer of a model)."""

    def __init__(self, fn: Callable, module: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["call"] = _Call(fn, module)  # not a submodule: its tensors are no constants
        self.names = [name for name, _ in named_tensors(self.call)]

    def forward(self, tensors: tuple[torch.Tensor, ...], *inputs):
        return torch.func.functional_call(self.call, dict(zip(self.names, tensors, strict=True)), inputs)


class PagedDecodeProgram(torch.nn.Module):
    """`attention.paged_decode` as a module to export."""

    def forward(self, query, pages, block_tables, context_lens, first_pages, scale):
        return paged_decode(query, pages, block_tables, context_lens, first_pages, scale)


class FlatProgram:
    """A loaded package called with its inputs as one flat list of tensors: the package's own `__call__`
    parses its input and output specs again and flattens its inputs at every call, a cost paid once
    per layer of every step (scripts/PERFORMANCE.md, "Start time and memory of compile=True")."""

    def __init__(self, package) -> None:
        self.run = package.loader.boxed_run
        self.outputs = pytree.treespec_loads(package.loader.get_call_spec()[1])

    def __call__(self, *tensors: torch.Tensor):
        return pytree.tree_unflatten(self.run(list(tensors)), self.outputs)


class LayerProgram:
    """A loaded program of one block's shape, called as its eager function is: `program(block, *inputs)`."""

    def __init__(self, package, blocks: torch.nn.ModuleList) -> None:
        self.program = FlatProgram(package)
        self.tensors = {id(block): tensors_of(block) for block in blocks}

    def __call__(self, block: Block, *inputs: torch.Tensor):
        return self.program(*self.tensors[id(block)], *inputs)


class HeadModules(nn.Module):
    """What `final_logits` reads of a model (its final norm, LM head and dtype), as a module to export."""

    def __init__(self, model: GPT2) -> None:
        super().__init__()
        self.ln_f, self.lm_head, self.dtype = model.ln_f, model.lm_head, model.dtype


class HeadProgram:
    """A loaded program of `final_logits` exported over `head`, called as the function is: `program(model, x)`."""

    def __init__(self, package, head: HeadModules) -> None:
        self.program = FlatProgram(package)
        self.tensors = tensors_of(head)

    def __call__(self, model: GPT2, x: torch.Tensor) -> torch.Tensor:
        return self.program(*self.tensors, x)


class CompiledDecodeBackend:
    """The torch backend's decode attention as a compiled program (`attention.paged_decode`) reading the
    pages in place instead of copying them, for the eager steps of a compiled engine."""

    name = "torch"
    store_kv = staticmethod(store_kv)

    def __init__(self, pool: KVPool, attend: Callable) -> None:
        """`attend`: `paged_decode`, compiled."""
        self.pool, self._attend = pool, attend
        self._first_pages: dict[tuple[int, int], torch.Tensor] = {}
        self._scales: dict[float, torch.Tensor] = {}

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """`TorchBackend.decode`, k_cache and v_cache being one layer's pages of the engine's pool."""
        kv = self.pool.kv
        pages = kv.view(-1, *kv.shape[3:])
        page = k_cache[0].numel()
        # where this layer's pages start, and its scale, as tensors: every layer runs the same program
        key = (k_cache.storage_offset() // page, v_cache.storage_offset() // page)
        if key not in self._first_pages:
            self._first_pages[key] = torch.tensor(key, device=kv.device)
        if scale not in self._scales:
            self._scales[scale] = torch.tensor(scale, device=kv.device)
        return self._attend(query, pages, block_tables, context_lens, self._first_pages[key], self._scales[scale])

    def close(self) -> None:
        """Nothing to free: the pool is the engine's."""


class CompiledSteps:
    """The compiled programs of one model and pool: `decode_layer`, a block's halves and the decodes'
    attention, loaded from `cache` (built there first if missing). `cache_entry`: the folder they were
    loaded from, None when the cache could not be trusted."""

    PROGRAMS = ("layer", "layer_alone", "head_alone", "before", "after", "attend")  # those `_specs` makes

    def __init__(self, model: GPT2, pool: KVPool, cache: ProgramCache) -> None:
        missing = missing_internals()
        if missing:
            raise RuntimeError(f"compile=True needs torch internals this torch {torch.__version__} lacks: "
                               f"{', '.join(missing)}")
        self.model, self.pool = model, pool  # the pool, not its tensor: the runner's close() frees that
        self._scales = attention_scales(model)
        self._head = HeadModules(model)  # what the head's program is exported over and then called with
        try:
            programs, self.cache_entry = cache.load(self.description(), self.PROGRAMS, self._specs)
        except Exception as err:  # e.g. no C++ compiler for inductor's CPU code
            raise RuntimeError(
                "compile=True could not compile the steps; run without it, or install what "
                f"AOTInductor needs (a C++ compiler on the CPU): {error_line(err)}"
            ) from err
        self.layer = LayerProgram(programs["layer"], model.h)
        # one sequence: programs of a static batch of 1, whose linears may run one-row products
        self.alone = (LayerProgram(programs["layer_alone"], model.h), HeadProgram(programs["head_alone"], self._head))
        self.halves = (LayerProgram(programs["before"], model.h), LayerProgram(programs["after"], model.h))
        self.decode_backend = CompiledDecodeBackend(pool, FlatProgram(programs["attend"]))

    def description(self) -> dict:
        """What the programs depend on: the build environment (which also decides the linears' kernels),
        the model's shape and mode, the pool's layout. Not the weights: they are inputs of every program."""
        model, kv = self.model, self.pool.kv
        return {
            **build_environment(kv.device),
            "config": sorted(vars(model.config).items()),
            "dtype": str(model.dtype),
            "modules": sorted({type(module).__qualname__ for module in model.modules()}),
            "pool": [str(kv.dtype), *kv.shape[:2], *kv.shape[3:]],  # all but the number of pages
        }

    def _specs(self) -> list[ProgramSpec]:
        """What to export, with example inputs of the pool's dtype and device: every program is of one
        block's shape (each layer's tensors are its inputs), so what it costs to build is the same for
        every depth of model."""
        model, kv = self.model, self.pool.kv
        device, config = kv.device, model.config
        batch, pages, tokens = Dim("batch", min=1), Dim("pages", min=1), Dim("tokens", min=1)
        blocks = Dim("blocks", min=1)
        tables = torch.zeros(EXAMPLE_BATCH, EXAMPLE_PAGES, dtype=torch.int32, device=device)
        lens = torch.full((EXAMPLE_BATCH,), 2, dtype=torch.int32, device=device)
        x = torch.zeros(EXAMPLE_TOKENS, config.n_embd, device=device)
        block = model.h[0]
        with torch.inference_mode():
            q = attention_inputs(block, x[:EXAMPLE_BATCH])[0]
        pool = kv.new_zeros(kv.shape[1], EXAMPLE_BLOCKS, *kv.shape[3:])  # one layer's, of any number of pages
        y = torch.zeros_like(x, dtype=q.dtype)  # the attention's output, in the query's dtype
        block_tensors = tensors_of(block)
        weights = (None,) * len(block_tensors)
        head_tensors = tensors_of(self._head)
        # every program's inputs after the tensors are its `*inputs`: one tuple to export
        return [
            ProgramSpec("layer", TensorsAsInputs(decode_layer, block),
                        (block_tensors, x[:EXAMPLE_BATCH], pool, tables, lens, self._scales[0]),
                        (weights, ({0: batch}, {1: blocks}, {0: batch, 1: pages}, {0: batch}, None))),
            ProgramSpec("layer_alone", TensorsAsInputs(decode_layer, block),
                        (block_tensors, x[:1], pool, tables[:1], lens[:1], self._scales[0]),
                        (weights, (None, {1: blocks}, {1: pages}, None, None))),
            ProgramSpec("head_alone", TensorsAsInputs(final_logits, self._head), (head_tensors, x[:1]),
                        ((None,) * len(head_tensors), (None,))),
            ProgramSpec("before", TensorsAsInputs(attention_inputs, block), (block_tensors, x),
                        (weights, ({0: tokens},))),
            ProgramSpec("after", TensorsAsInputs(attention_outputs, block), (block_tensors, x, y),
                        (weights, ({0: tokens}, {0: tokens}))),
            ProgramSpec("attend", PagedDecodeProgram(),
                        (q, pool.flatten(0, 1), tables, lens, torch.tensor([0, 1], device=device),
                         torch.tensor(1.0, device=device)),
                        ({0: batch}, {0: blocks}, {0: batch, 1: pages}, {0: batch}, None, None)),
        ]

    @staticmethod
    def covers(inputs) -> bool:
        """A decode-only step."""
        return inputs.meta.decode_only

    def __call__(self, inputs) -> torch.Tensor:
        """Logits of a step `covers` takes; the step's K/V land in the pool at its slots."""
        meta = inputs.meta
        layer, head = self.alone if len(inputs.input_ids) == 1 else (self.layer, final_logits)
        return decode_step(self.model, inputs.input_ids, inputs.positions, self.pool.kv, meta.decode_block_tables,
                           meta.decode_context_lens, meta.slot_mapping, self._scales, layer, head)
