"""The compiled steps of `compile=True`: AOTInductor programs of one block's shape, each layer's tensors among
their inputs (one program serves every layer). A decode-only step runs `decode_layer` per block; every other step
runs the layer loop of `CompiledRows`. A position's bits never depend on its step (batch invariance): every row
generated (a decode, a drafted token verified, an output recomputed after preemption) goes through `decode_layer`,
every prompt row through the compiled halves around `prompt_attention`, every logits row through the head program;
programs of batch 1 give the same bits as the batched ones (their variance is Welford's, see `build`)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import Dim

from minigpt.common.errors import error_line
from minigpt.compile import pool_attention
from minigpt.compile.attention import PROMPT_PIECE, PoolAttention, causal_mask, prompt_attention
from minigpt.compile.cache import ProgramCache, ProgramSpec, build_environment
from minigpt.compile.torch_compat import missing_internals
from minigpt.engine.kv_cache import KVPool
from minigpt.model.attention import StepMetadata
from minigpt.model.backends import store_kv
from minigpt.model.gpt2 import GPT2, Block, final_logits

logger = logging.getLogger("minigpt")

# example sizes to export with: all dynamic, so only their being distinct and not 0 or 1 (specialized) matters
EXAMPLE_BATCH, EXAMPLE_WIDTH, EXAMPLE_TOKENS, EXAMPLE_BLOCKS = 5, 7, 11, 3  # EXAMPLE_WIDTH: a table's blocks


def decode_layer(
    block: Block,
    x: torch.Tensor,
    pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: torch.Tensor,
    attention: type[PoolAttention] = PoolAttention,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block of a decode step: x [B, C] -> (the next x, the new K/V [2, B, H, D] to store, or None where the
    attention stored them in `pool`, this layer's)."""
    attend = attention(pool[None], block_tables, context_lens, scale[None])
    return block(x, attend, 0), attend.new_kv


def attention_inputs(block: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Block.attention_inputs` as a function a spec names (a spec loads module-level names only)."""
    return block.attention_inputs(x)


def attention_outputs(block: Block, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return block.attention_outputs(x, y)


def native_decode_layer(block: Block, x: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, None]:
    """`decode_layer` through the C++ decode attention (which stores the new K/V), where `pool_attention.usable`."""
    return decode_layer(block, x, pool, block_tables, context_lens, scale, pool_attention.NativePoolAttention)


class PoolDecode:
    """A decode step's blocks each one call of `layer` (`decode_layer` or its program), whose new K/V is stored
    after it where its attention did not store it (a program's `index_copy_` into its input pool would copy the
    pool whole); the head through `head`."""

    def __init__(self, kv_pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 slot_mapping: torch.Tensor, scales: torch.Tensor, layer: Callable = decode_layer,
                 head: Callable = final_logits) -> None:
        # each layer's pool and scale as views made at once: one op each, where indexing per layer is 12
        self.pools, self.scales = kv_pool.unbind(), scales.unbind()
        self.block_tables, self.context_lens, self.slot_mapping = block_tables, context_lens, slot_mapping
        self.layer, self._head = layer, head

    def block(self, layer: int, block: Block, x: torch.Tensor, rows=None) -> torch.Tensor:
        pool = self.pools[layer]
        x, new_kv = self.layer(block, x, pool, self.block_tables, self.context_lens, self.scales[layer])
        if new_kv is not None:
            pool.flatten(1, 2).index_copy_(1, self.slot_mapping, new_kv)  # blocks as token slots
        return x

    def head(self, model: GPT2, x: torch.Tensor) -> torch.Tensor:
        return self._head(model, x)


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
    """One token per sequence -> logits [B, vocab], through the model's layer loop (`PoolDecode`)."""
    programs = PoolDecode(kv_pool, block_tables, context_lens, slot_mapping, scales, layer, head)
    return model.run(input_ids, positions, None, programs=programs)


def attention_scales(model: GPT2) -> torch.Tensor:
    return torch.tensor(model.attention_scales(), device=model.wte.weight.device)


def named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(itertools.chain(module.named_parameters(), module.named_buffers()))


def tensors_of(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(tensor for _, tensor in named_tensors(module))


class _Call(torch.nn.Module):
    def __init__(self, fn: Callable, module: torch.nn.Module) -> None:
        super().__init__()
        self.fn, self.module = fn, module

    def forward(self, *inputs):
        return self.fn(self.module, *inputs)


class TensorsAsInputs(torch.nn.Module):
    """`fn(module, *inputs)` to export with `module`'s tensors as inputs: the program serves every such module."""

    def __init__(self, fn: Callable, module: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["call"] = _Call(fn, module)  # not a submodule: its tensors are no constants
        self.names = [name for name, _ in named_tensors(self.call)]

    def forward(self, tensors: tuple[torch.Tensor, ...], *inputs):
        return torch.func.functional_call(self.call, dict(zip(self.names, tensors, strict=True)), inputs)


class FlatProgram:
    """A loaded package called with one flat list of tensors: its own `__call__` reparses its specs each call."""

    def __init__(self, package) -> None:
        self.run = package.loader.boxed_run
        self.outputs = pytree.treespec_loads(package.loader.get_call_spec()[1])

    def __call__(self, *tensors: torch.Tensor):
        return pytree.tree_unflatten(self.run(list(tensors)), self.outputs)


class LayerProgram:
    """A program of one block's shape, called as its eager function: `program(block, *inputs)`."""

    def __init__(self, package, blocks: torch.nn.ModuleList) -> None:
        self.program = FlatProgram(package)
        self.tensors = {id(block): tensors_of(block) for block in blocks}

    def __call__(self, block: Block, *inputs: torch.Tensor):
        return self.program(*self.tensors[id(block)], *inputs)


class HeadModules(nn.Module):
    def __init__(self, model: GPT2) -> None:
        super().__init__()
        self.ln_f, self.lm_head, self.dtype = model.ln_f, model.lm_head, model.dtype


class HeadProgram:
    """A program of `final_logits`, called as the function: `program(model, x)`."""

    def __init__(self, package, head: HeadModules) -> None:
        self.program = FlatProgram(package)
        self.tensors = tensors_of(head)

    def __call__(self, model: GPT2, x: torch.Tensor) -> torch.Tensor:
        return self.program(*self.tensors, x)


class CompiledRows:
    """A step with prompt chunks: each block's halves on every row, its K/V stored, then its prompt rows through
    `prompt_attention` and the `after` half, its generated rows (past their prompts) through the decode program,
    as a decode step would run them: the K/V of the rows before each are in the pool by then."""

    def __init__(self, steps: CompiledSteps, meta: StepMetadata, num_rows: int) -> None:
        self.steps, self.meta, self.kv_pool = steps, meta, steps.pool.kv
        device = self.kv_pool.device
        prompt, generated, tables, lens = [], [], [], []
        for seg in meta.prefills:
            first = seg.context_len - seg.length
            prompt += range(seg.start, seg.start + seg.prompt_rows)
            for row in range(seg.prompt_rows, seg.length):
                generated.append(seg.start + row)
                tables.append(seg.block_table)
                lens.append(first + row + 1)
        if meta.decode_block_tables is not None:
            generated += range(meta.num_prefill_tokens, num_rows)
            tables += meta.decode_block_tables.long().unbind()
            lens += meta.decode_context_lens.tolist()
        self.generated = torch.tensor(generated, dtype=torch.long, device=device)
        self.tables = nn.utils.rnn.pad_sequence(tables, batch_first=True).int() if tables else None
        self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.is_generated = torch.zeros(num_rows, dtype=torch.bool, device=device)
        self.is_generated[self.generated] = True
        self.order = torch.empty(num_rows, dtype=torch.long, device=device)  # a row's index in its own kind
        self.order[torch.tensor(prompt, dtype=torch.long, device=device)] = torch.arange(len(prompt), device=device)
        self.order[self.generated] = torch.arange(len(generated), device=device)
        longest = max((seg.context_len for seg in meta.prefills if seg.prompt_rows), default=0)
        model = steps.model
        dtype = torch.float32 if model.config.reorder_and_upcast_attn else model.dtype
        self.causal = causal_mask(-(-longest // PROMPT_PIECE) * PROMPT_PIECE, dtype, device)

    def block(self, layer: int, block: Block, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        steps, meta = self.steps, self.meta
        before, after = steps.halves
        q, k, v = before(block, x)
        k_cache, v_cache = self.kv_pool[layer]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if not len(self.generated):  # prompts alone: every row a prompt row, in order
            y = self.prompt_attention(layer, q, k_cache, v_cache).flatten(1)
            if rows is not None:
                x, y = x[rows], y[rows]
            return after(block, x, y)
        rows = torch.arange(len(x), device=x.device) if rows is None else rows
        out = x.new_empty(len(rows), x.shape[1])
        generated = self.is_generated[rows]
        prompt_rows, generated_rows = rows[~generated], self.order[rows[generated]]
        if len(prompt_rows):
            y = self.prompt_attention(layer, q, k_cache, v_cache)[self.order[prompt_rows]]
            out[~generated] = after(block, x[prompt_rows], y.flatten(1))
        if len(generated_rows):
            program = steps.layer_for(len(generated_rows))
            out[generated] = program(block, x[self.generated[generated_rows]], self.kv_pool[layer],
                                     self.tables[generated_rows], self.lens[generated_rows], steps.scales[layer])[0]
        return out

    def prompt_attention(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> torch.Tensor:
        """[P, H, D] for the step's prompt rows, in their order."""
        scale = self.steps.attention_scales[layer]
        parts = [prompt_attention(q[seg.start : seg.start + seg.prompt_rows], k_cache, v_cache, seg.block_table,
                                  seg.context_len - seg.length, scale, self.causal)
                 for seg in self.meta.prefills if seg.prompt_rows]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def head(self, model: GPT2, x: torch.Tensor) -> torch.Tensor:
        return self.steps.head_for(len(x))(model, x)


class CompiledSteps:
    """A compiled engine's steps, every one (`ForwardPath`), its programs from `cache` (`cache_entry` None:
    untrusted)."""

    PROGRAMS = ("layer", "layer_alone", "head", "head_alone", "before", "after")
    generated_apart = True  # generated rows attend in the decode program, prompt rows by prompt_attention

    def __init__(self, model: GPT2, pool: KVPool, cache: ProgramCache) -> None:
        missing = missing_internals()
        if missing:
            raise RuntimeError(f"compile=True needs torch internals this torch {torch.__version__} lacks: "
                               f"{', '.join(missing)}")
        self.model, self.pool = model, pool  # the pool, not its tensor: close() frees that
        self.attention_scales = model.attention_scales()
        self.scales = attention_scales(model)
        self._head = HeadModules(model)
        self.decode_layer = native_decode_layer if pool_attention.usable(pool.kv) else decode_layer
        try:
            programs, self.cache_entry = cache.load(self.description(), self.PROGRAMS, self._specs)
        except Exception as err:  # e.g. no C++ compiler for inductor's CPU code
            raise RuntimeError(
                "compile=True could not compile the steps; run without it, or install what "
                f"AOTInductor needs (a C++ compiler on the CPU): {error_line(err)}"
            ) from err
        self.layer = LayerProgram(programs["layer"], model.h)
        self.head = HeadProgram(programs["head"], self._head)
        # one sequence: programs of a static batch of 1, whose linears may run one-row products
        self.alone = (LayerProgram(programs["layer_alone"], model.h), HeadProgram(programs["head_alone"], self._head))
        self.halves = (LayerProgram(programs["before"], model.h), LayerProgram(programs["after"], model.h))

    def layer_for(self, rows: int) -> LayerProgram:
        return self.alone[0] if rows == 1 else self.layer

    def head_for(self, rows: int) -> HeadProgram:
        return self.alone[1] if rows == 1 else self.head

    def description(self) -> dict:
        model, kv = self.model, self.pool.kv
        return {
            **build_environment(kv.device),
            "config": sorted(vars(model.config).items()),
            "dtype": str(model.dtype),
            "modules": sorted({type(module).__qualname__ for module in model.modules()}),
            # the programs' inputs: a linear's packing for a kernel of our own among them, or not
            "tensors": [name for module in (model.h[0], self._head) for name, _ in named_tensors(module)],
            "pool": [str(kv.dtype), *kv.shape[:2], *kv.shape[3:]],  # all but the number of blocks
            "decode_layer": self.decode_layer.__name__,  # with the C++ attention or inductor's
        }

    def _specs(self) -> list[ProgramSpec]:
        model, kv = self.model, self.pool.kv
        device, config = kv.device, model.config
        batch, tokens = Dim("batch", min=1), Dim("tokens", min=1)
        width = Dim("pages", min=1)  # a block table's width (the Dim keeps its name: the programs' signatures)
        blocks = Dim("blocks", min=1)  # the pool's
        tables = torch.zeros(EXAMPLE_BATCH, EXAMPLE_WIDTH, dtype=torch.int32, device=device)
        lens = torch.full((EXAMPLE_BATCH,), 2, dtype=torch.int32, device=device)
        x = torch.zeros(EXAMPLE_TOKENS, config.n_embd, device=device)
        block = model.h[0]
        pool = kv.new_zeros(kv.shape[1], EXAMPLE_BLOCKS, *kv.shape[3:])  # one layer's, of any number of blocks
        y = torch.zeros_like(x, dtype=model.dtype)
        block_tensors = tensors_of(block)
        weights = (None,) * len(block_tensors)
        head_tensors = tensors_of(self._head)
        return [
            ProgramSpec("layer", TensorsAsInputs(self.decode_layer, block),
                        (block_tensors, x[:EXAMPLE_BATCH], pool, tables, lens, self.scales[0]),
                        (weights, ({0: batch}, {1: blocks}, {0: batch, 1: width}, {0: batch}, None))),
            ProgramSpec("layer_alone", TensorsAsInputs(self.decode_layer, block),
                        (block_tensors, x[:1], pool, tables[:1], lens[:1], self.scales[0]),
                        (weights, (None, {1: blocks}, {1: width}, None, None))),
            ProgramSpec("head", TensorsAsInputs(final_logits, self._head), (head_tensors, x[:EXAMPLE_BATCH]),
                        ((None,) * len(head_tensors), ({0: batch},))),
            ProgramSpec("head_alone", TensorsAsInputs(final_logits, self._head), (head_tensors, x[:1]),
                        ((None,) * len(head_tensors), (None,))),
            ProgramSpec("before", TensorsAsInputs(attention_inputs, block), (block_tensors, x),
                        (weights, ({0: tokens},))),
            ProgramSpec("after", TensorsAsInputs(attention_outputs, block), (block_tensors, x, y),
                        (weights, ({0: tokens}, {0: tokens}))),
        ]

    def covers(self, inputs) -> bool:
        return True

    def __call__(self, inputs) -> torch.Tensor:
        meta = inputs.meta
        if not meta.decode_only:
            programs = CompiledRows(self, meta, len(inputs.input_ids))
            return self.model.run(inputs.input_ids, inputs.positions, None, inputs.logits_indices, programs)
        rows = len(inputs.input_ids)
        return decode_step(self.model, inputs.input_ids, inputs.positions, self.pool.kv, meta.decode_block_tables,
                           meta.decode_context_lens, meta.slot_mapping, self.scales,
                           self.layer_for(rows), self.head_for(rows))
