"""The decode step as one pure function, compiled with torch.compile (`EngineConfig.compile`).

Eager PyTorch pays for every op: GPT-2's ~40 small ops a layer cost more than its matrix-vector
products at batch 1, and eager decode attention copies each sequence's pages (`index_select`)
before SDPA reads them again. Compiled as one graph, inductor fuses the elementwise work
(layernorms, activation quantization, GELU, residuals) and its attention loops read K/V straight
from the pages, so the pool is read once and never copied. `prefill_step` does the same for a
lone request's whole prompt, the step that decides its time to first token. Every other step
(batched prompts, prompts next to decodes) runs eagerly around the paged attention, which loops over
its prompt segments in Python, but the two halves of each block around that attention run compiled,
and so does the attention of the decodes among the prompts (`paged_decode`).

The function is pure: it reads the pool and returns the step's new K/V, which `DecodeGraph`
writes into the pool after the call. A graph that wrote into its input pool would make inductor
copy the whole pool back on every call. So the new token's own K/V is not in the pages yet: each
query attends to the cached tokens (`context_len - 1` of them) and to itself, one softmax over
both.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import logging
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch

from minigpt.attention import store_kv, token_attention
from minigpt.kv_cache import KVPool
from minigpt.model import GPT2, attention_inputs, attention_outputs
from minigpt.progress import announce

logger = logging.getLogger("minigpt")

# The sizes the steps are first compiled for. Dynamic sizes still compile to one graph each, but
# inductor decides which loops run on several threads from these: compiled for 2 sequences of 2
# pages, the softmax over keys ran on one thread, and a step at batch 100 took 4% longer.
WARMUP_BATCH, WARMUP_PAGES, WARMUP_PROMPT = 32, 8, 16

# The longest prompt `prefill_step` takes. Its attention is SDPA's math form, which inductor fuses but
# which holds [H, T, T] scores: past ~150 tokens a lone prompt's first token comes sooner from the
# engine's paged step, whose eager SDPA calls the flash kernel (w8a8 + compile, 2 cores: 128 tokens
# 38.5 ms here against 40.5 paged, 256 tokens 77.9 against 71.2, 1,000 tokens 654 against 346).
PREFILL_MAX_TOKENS = 128

# inductor's generated code checks the size and strides of every input on every call: 205 checks,
# 0.15 ms a call, nearly all on weights. Dynamo's guards check the step's own tensors, and the
# weights are those of the one model each engine compiles its private copies for (see `DecodeGraph`).
CODEGEN_OPTIONS = {"size_asserts": False}


def decode_step(
    model: GPT2,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scales: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence -> (logits [B, vocab], new K/V [n_layer, 2, B, H, D] in the pool's dtype);
    reads, never writes, the pool.

    kv_pool: (n_layer, 2, blocks, block_size, H, D); block_tables: [B, W] pages of each sequence;
    context_lens: [B] tokens including this step's; scales: [n_layer] each layer's attention scale.
    Scores, softmax and the weighted sum run in fp32.
    Written as products and sums, not SDPA: that is the form inductor fuses with the page reads.
    The pages stay a dimension of their own (B, W, block_size, ...) and the weighted sum of values
    adds up each page before adding the pages: summed over all W * block_size tokens at once, inductor
    loops over tokens innermost, looking up the page and striding across rows for every 8 floats
    (measured 1.9x slower for one layer's attention at batch 100, ~110 tokens, 2 AVX2 cores).

    The scale multiplies the query once, and comes as a tensor rather than a Python number for a
    reason of inductor's: the extra buffer it reads makes inductor store the layer's dequantized
    q/k/v (w8a8) once instead of recomputing them inside the loop over keys, for every key. That
    recomputation cost 5% of a step at batch 100, and with a half-precision pool, whose loads widen
    inductor's vectors to 32 lanes, it ran a scalar int32 -> float conversion per key (the step 25%
    slower than with a float32 pool, instead of 10% faster).
    """
    batch = input_ids.shape[0]
    pages = block_tables.long()
    cached = _in_context(block_tables, context_lens - 1, kv_pool.shape[3])  # the new token is not in the pages
    x = model.embed(input_ids, positions)
    new_kv = []
    for layer, block in enumerate(model.h):
        q, k, v = attention_inputs(block, x)
        new_kv.append(torch.stack([k, v]))
        q, k, v = q.float() * scales[layer], k.float(), v.float()
        y = _attend(q, kv_pool[layer, 0][pages].float(), kv_pool[layer, 1][pages].float(), cached, k, v)
        x = attention_outputs(block, x, y.to(block.dtype).reshape(batch, -1))
    return model.head(x), torch.stack(new_kv).to(kv_pool.dtype)  # cast here, fused: not a pass of its own


def _in_context(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which slots of each sequence's pages (B, W, block_size) hold one of its first `lengths` tokens."""
    width = block_tables.shape[1]
    slots = torch.arange(width * block_size, device=block_tables.device).view(1, width, block_size)
    return slots < lengths[:, None, None]


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cached: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """One fp32 query per sequence (B, H, D), already scaled, over the keys and values of its pages
    (B, W, block_size, H, D) where `cached` (B, W, block_size) holds, and over its own key and value
    k, v (B, H, D) when they are not in the pages: one softmax over both -> (B, H, D)."""
    scores = (q[:, None, None] * keys).sum(-1).masked_fill(~cached[..., None], float("-inf"))
    top = scores.amax((1, 2))
    if k is not None:
        own = (q * k).sum(-1)  # (B, H): the query against its own key
        top = torch.maximum(top, own)
    weights = torch.exp(scores - top[:, None, None])
    total = weights.sum((1, 2))
    by_page = (weights[..., None] * values).sum(2)  # (B, W, H, D)
    if k is None:
        return by_page.sum(1) / total[..., None]
    own_weight = torch.exp(own - top)
    return (by_page.sum(1) + own_weight[..., None] * v) / (total + own_weight)[..., None]


def paged_decode(
    query: torch.Tensor,
    pages: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    first_pages: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """Decode attention of the engine's eager paged step (a step that also holds prompts), in the form
    inductor fuses with the page reads: one query per sequence (B, H, D) over the first `context_lens`
    tokens of its pages, this step's own K/V already stored among them -> (B, H, D) in the query's dtype.

    pages: the whole pool as pages, (n_layer * 2 * blocks, block_size, H, D); first_pages: [2] int64,
    where this layer's key and value pages start in it; scale: the layer's attention scale. Both are
    tensors so that every layer runs the same graph."""
    tables = block_tables.long()
    keys = pages[tables + first_pages[0]].float()
    values = pages[tables + first_pages[1]].float()
    cached = _in_context(block_tables, context_lens, pages.shape[1])
    return _attend(query.float() * scale, keys, values, cached).to(query.dtype)


def attention_scales(model: GPT2) -> torch.Tensor:
    """Each layer's attention scale, as `decode_step` takes them: [n_layer] fp32 on the model's device."""
    return torch.tensor([block.attn.scale for block in model.h], device=model.wte.weight.device)


def prefill_step(
    model: GPT2, input_ids: torch.Tensor, positions: torch.Tensor, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole prompt of one sequence with nothing cached -> (logits of its last token [1, vocab],
    its K/V [n_layer, 2, T, H, D] in the pool's `kv_dtype`): plain causal attention among its own
    tokens; reads no pool. Past the last layer's K/V only the last token goes on (as in
    `GPT2.forward_step`). The cast to `kv_dtype` is fused, as in `decode_step`: eagerly, a 1,000-token
    prompt's K/V took 11 ms to cast to float16."""
    length = input_ids.shape[0]
    x = model.embed(input_ids, positions)
    new_kv = []
    last = len(model.h) - 1
    for layer, block in enumerate(model.h):
        q, k, v = attention_inputs(block, x)
        new_kv.append(torch.stack([k, v]))
        y = token_attention(q, k, v, block.attn.scale, block.attn.upcast).to(block.dtype).reshape(length, -1)
        if layer == last:
            x, y = x[-1:], y[-1:]
        x = attention_outputs(block, x, y)
    return model.head(x), torch.stack(new_kv).to(kv_dtype)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the bytes of every parameter and buffer of `model`, for the key under which torch
    caches its frozen graphs on disk (`torch.compiler.config.cache_key_tag`).

    inductor keys a frozen graph by its weights' shapes, not their values, yet the cached graph holds
    the packed copies its C++ GEMM kernels make of them (pytorch#143563): without this, a second
    checkpoint of the same shape (a fine-tune of gpt2 after gpt2) would run on the first one's weights.
    0.2 s for gpt2 int8 (280 MB of weights) on 2 cores, against minutes of compiling."""
    digest = hashlib.sha256()
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr()))
    return digest.hexdigest()


def _private_copy(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a code object of its own: dynamo keeps compiled graphs per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _inductor_code_cache() -> type:
    """inductor's cache of the Python modules of its compiled graphs, kept for the life of the process.
    A frozen graph's module holds the graph's constants (packed copies of the weights) as attributes."""
    from torch._inductor.codecache import PyCodeCache

    return PyCodeCache


def _drop_compiled(codes: tuple[types.CodeType, ...], modules: list[types.ModuleType]) -> None:
    """Free dynamo's graphs for these code objects (its log of guard failures keeps the codes alive),
    and inductor's modules loaded for them that hold constants: each engine's frozen graphs load their
    own, which inductor would keep until the process ends (~600 MB of copies of the weights for each
    compiled w8a8 gpt2 engine closed). Modules without constants are inductor's to share."""
    for code in codes:
        torch._C._dynamo.eval_frame.reset_code(code)
    cache = _inductor_code_cache()
    shared = {id(module) for module in getattr(cache, "modules_no_attr", {}).values()}
    loaded = getattr(cache, "modules", [])
    for module in modules:
        if id(module) in shared:
            continue
        with contextlib.suppress(ValueError):
            loaded.remove(module)
        if sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]
    modules.clear()


def _dynamic_decode_sizes(block_tables: torch.Tensor, *per_sequence: torch.Tensor) -> torch.Tensor:
    """A decode graph's inputs readied so that one graph serves every batch >= 2 and every width: the block
    tables padded to at least 2 pages, their width marked dynamic, and the batch too (on them and on
    `per_sequence`) unless it is 1. torch specializes a size of 1, so those would each be graphs of their own."""
    if block_tables.shape[1] < 2:
        block_tables = torch.cat([block_tables, torch.zeros_like(block_tables)], dim=1)
    if block_tables.shape[0] > 1:
        for tensor in (block_tables, *per_sequence):
            torch._dynamo.mark_dynamic(tensor, 0)
    torch._dynamo.mark_dynamic(block_tables, 1)
    return block_tables


class CompiledDecodeBackend:
    """The torch backend's decode attention as a compiled graph (`paged_decode`), for the eager paged
    steps of a compiled engine: those that mix prompts with decodes. The torch reference copies every
    decoding sequence's pages and runs SDPA over the copy: with a float16 pool under a float32 model,
    97 sequences of ~25 / ~60 / ~100 tokens took 2.7 / 5.1 / 9.7 ms a layer (2 cores), where the
    decode graph reads the pages in place. Prompts keep SDPA (`prefill_attention`)."""

    name = "torch"
    store_kv = staticmethod(store_kv)

    def __init__(self, pool: KVPool, attend: Callable[..., torch.Tensor]) -> None:
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
        """The torch backend's `decode` (see `reference.paged_decode_attention`), k_cache and v_cache being
        one layer's pages of the engine's pool."""
        kv = self.pool.kv
        pages = kv.view(-1, *kv.shape[3:])
        page = k_cache[0].numel()
        key = (k_cache.storage_offset() // page, v_cache.storage_offset() // page)
        if key not in self._first_pages:
            self._first_pages[key] = torch.tensor(key, device=kv.device)
        if scale not in self._scales:
            self._scales[scale] = torch.tensor(scale, device=kv.device)
        block_tables = _dynamic_decode_sizes(block_tables, query, context_lens)
        return self._attend(query, pages, block_tables, context_lens, self._first_pages[key], self._scales[scale])

    def close(self) -> None:
        """Nothing to free: the pool is the engine's."""


class DecodeGraph:
    """`decode_step` and `prefill_step` compiled for a model and pool, plus the write of their new K/V
    into the pool.

    Two graphs cover every decode batch: batch 1 (torch specializes size-1 dimensions) and
    batch >= 2, both dynamic in the block-table width (padded to >= 2 pages for the same reason).
    A third, `prefill_step`, takes a step that is one whole prompt of 2 to `PREFILL_MAX_TOKENS` tokens
    with nothing cached (a lone request's first step: its time to first token). `warmup()` compiles
    all three up front so no request waits for a compile.
    """

    def __init__(self, model: GPT2, pool: KVPool, options: dict[str, object] | None = None) -> None:
        """`options`: inductor config for the step graphs (see `quantize.compile_options`)."""
        self.model, self.pool = model, pool  # the pool, not its tensor: Engine.close() frees that
        options = {**CODEGEN_OPTIONS, **(options or {})}
        # Dynamo reads `freezing` itself, while tracing, from the global config: `_freezing_set` sets it
        # around each call, where any compile or recompile happens. inductor gets the rest with the graphs.
        self._freezing = bool(options.get("freezing", False))
        self._cache_key_tag = weights_fingerprint(model) if self._freezing else ""
        # Each engine compiles private copies of the two functions, called only with its own model, and
        # drops their graphs when it goes. Compiled from the shared functions, every engine's graphs
        # would pile up on them (a frozen graph holds its engine's weights as constants: never freed),
        # and dynamo's recompile limit (8) would send later engines to eager. With one model per copy,
        # dynamo's guards on the model's modules can only ever pass: they are skipped (0.5 ms a step
        # at batch 1 on 2 cores). Guards on the step's tensors stay: they pick the batch-1 graph.
        step, prefill = _private_copy(decode_step), _private_copy(prefill_step)
        before, after = _private_copy(attention_inputs), _private_copy(attention_outputs)
        attend = _private_copy(paged_decode)
        self._modules: list[types.ModuleType] = []  # inductor's modules loaded by the step graphs' compiles
        self._loaded = getattr(_inductor_code_cache(), "modules", [])  # inductor's list of them all, kept in place
        codes = tuple(fn.__code__ for fn in (step, prefill, before, after, attend))
        weakref.finalize(self, _drop_compiled, codes, self._modules)
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # torch >= 2.7
        guards = {"guard_filter_fn": skip} if skip is not None else {}
        # A dict of its own for each call: torch.compile pops guard_filter_fn from the one it is given.
        self._step = torch.compile(step, options={**guards, **options})
        self._prefill = torch.compile(prefill, options={**guards, **options})
        self._scales = attention_scales(model)
        # Never frozen: one layer's weights would be constants of the graph every layer runs.
        self.around_attention = tuple(
            torch.compile(fn, dynamic=True, options={**guards, **CODEGEN_OPTIONS}) for fn in (before, after)
        )
        self.decode_backend = CompiledDecodeBackend(pool, torch.compile(attend, options=dict(CODEGEN_OPTIONS)))

    @torch.inference_mode()
    def warmup(self) -> None:
        start = time.perf_counter()
        announce(
            logger,
            "compiling the steps for batch 1, batch >= 2 and lone prompts "
            "(two to four minutes the first time, the most with quantize='int8'; torch caches them on disk, "
            "except w8a8's frozen graphs on CPUs with AVX-512 VNNI, compiled at every start)"
        )
        device = self.pool.kv.device
        try:
            with warnings.catch_warnings():
                # inductor's autotuning (quantize="int8") calls a deprecated storage API: not the user's concern
                warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
                for batch in (WARMUP_BATCH, 1):
                    tokens = torch.zeros(batch, dtype=torch.int64, device=device)
                    tables = torch.zeros(batch, WARMUP_PAGES, dtype=torch.int32, device=device)
                    lens = torch.full((batch,), 2, dtype=torch.int32, device=device)
                    self._run(tokens, tokens + 1, tables, lens)
                length = min(WARMUP_PROMPT, self.model.config.n_positions)
                prompt = torch.zeros(length, dtype=torch.int64, device=device)
                self._run_prefill(prompt, torch.arange(length, device=device))
                before, after = self.around_attention
                block, kv = self.model.h[0], self.pool.kv[0]
                for tokens in (length, 1):  # torch specializes a dimension of size 1: its own graph
                    x = torch.zeros(tokens, self.model.config.n_embd, device=device)
                    q, _, _ = before(block, x)
                    # contiguous, as paged attention's output is: the graph is guarded on the strides
                    after(block, x, torch.zeros_like(x, dtype=q.dtype))
                    tables = torch.zeros(tokens, WARMUP_PAGES, dtype=torch.int32, device=device)
                    lens = torch.full((tokens,), 2, dtype=torch.int32, device=device)
                    self.decode_backend.decode(q, kv[0], kv[1], tables, lens, block.attn.scale)
        except Exception as err:  # e.g. no C++ compiler for inductor's CPU code
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise RuntimeError(
                "compile=True could not compile the decode steps; run without it, or install what "
                f"torch.compile needs (a C++ compiler on the CPU): {detail}"
            ) from err
        announce(logger, "compiled in %.0f s", time.perf_counter() - start)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step; the step's K/V land in the pool at `slot_mapping`."""
        logits, new_kv = self._run(input_ids, positions, block_tables, context_lens)
        self._store(new_kv, slot_mapping)
        return logits

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Logits [1, vocab] of the last token of a whole prompt (2 to `PREFILL_MAX_TOKENS` tokens, nothing
        cached); its K/V land in the pool at `slot_mapping`."""
        logits, new_kv = self._run_prefill(input_ids, positions)
        self._store(new_kv, slot_mapping)
        return logits

    def _store(self, new_kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kv = self.pool.kv
        slots = kv.view(*kv.shape[:2], kv.shape[2] * kv.shape[3], *kv.shape[4:])  # pages as token slots
        slots.index_copy_(2, slot_mapping, new_kv)  # both steps return K/V in the pool's dtype

    def _run_prefill(self, input_ids, positions) -> tuple[torch.Tensor, torch.Tensor]:
        for tensor in (input_ids, positions):
            torch._dynamo.mark_dynamic(tensor, 0)
        with self._freezing_set():
            return self._prefill(self.model, input_ids, positions, self.pool.kv.dtype)

    def _run(self, input_ids, positions, block_tables, context_lens) -> tuple[torch.Tensor, torch.Tensor]:
        block_tables = _dynamic_decode_sizes(block_tables, input_ids, positions, context_lens)
        with self._freezing_set():
            return self._step(
                self.model, input_ids, positions, self.pool.kv, block_tables, context_lens, self._scales
            )

    @contextlib.contextmanager
    def _freezing_set(self) -> Iterator[None]:
        """inductor's global `freezing` set to this graph's for the call, then restored, and with it the
        disk cache's key tag (a frozen graph's cache entry is only good for these weights). By hand: the
        config's `patch()` took 49 us a call with the w8a8 options (~1% of a token at batch 1), this 5 us.
        Modules inductor loads meanwhile (a call that compiled) are noted as this engine's, to drop with it."""
        config, compiler_config = torch._inductor.config, torch.compiler.config
        before, tag_before, count = config.freezing, compiler_config.cache_key_tag, len(self._loaded)
        config.freezing, compiler_config.cache_key_tag = self._freezing, tag_before + self._cache_key_tag
        try:
            yield
        finally:
            config.freezing, compiler_config.cache_key_tag = before, tag_before
            self._modules.extend(self._loaded[count:])  # a call that compiled: its modules are this engine's
