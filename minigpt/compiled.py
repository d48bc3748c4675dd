"""The compiled steps of `compile=True`: the model's one layer loop run through torch.compile.

Compiled as one graph, inductor fuses the elementwise work (layernorms, activation quantization,
GELU, residuals) and its attention loops read K/V straight from the pages. Two pure functions run
`GPT2.run` with an attention that reads the pool and never writes it, and return the step's new K/V,
which `CompiledSteps` stores after the call (a graph that wrote into its input pool would make
inductor copy the whole pool back on every call):
- `decode_step`: one token per sequence, batch 1 and batch >= 2 (torch specializes size 1);
- `prefill_step`: a lone request's whole prompt, nothing cached (its time to first token).
Every other step (batched prompts, prompts beside decodes) runs the same loop eagerly, around a
compiled version of each block's two halves and of the decodes' attention.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import time
import warnings
import weakref

import torch

from minigpt.attention import PoolAttention, PromptAttention, paged_decode
from minigpt.attention_backends import store_kv
from minigpt.kv_cache import KVPool
from minigpt.model import GPT2, attention_inputs, attention_outputs
from minigpt.progress import announce
from minigpt.torch_compat import CompiledCode, guard_options, mark_dynamic, missing_internals, private_copy

logger = logging.getLogger("minigpt")

# The sizes the steps are first compiled for: inductor picks which loops run on several threads from
# them, so they are typical of a busy step rather than the smallest.
WARMUP_BATCH, WARMUP_PAGES, WARMUP_PROMPT = 32, 8, 16
# The longest prompt `prefill_step` takes: its attention holds [H, T, T] scores, and past this a lone
# prompt's first token comes sooner from the eager step's flash attention.
PREFILL_MAX_TOKENS = 128
# inductor's generated code checks every input's size and strides on every call, nearly all of them
# weights: dynamo's guards already check the step's own tensors.
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
    """One token per sequence -> (logits [B, vocab], new K/V [n_layer, 2, B, H, D] in the pool's dtype).

    kv_pool: (n_layer, 2, blocks, block_size, H, D), read only; block_tables: [B, W];
    context_lens: [B] tokens including this step's; scales: [n_layer] each layer's attention scale."""
    attention = PoolAttention(kv_pool, block_tables, context_lens, scales)
    logits, new_kv = model.run(input_ids, positions, attention, return_kv=True)
    return logits, new_kv.to(kv_pool.dtype)  # cast here, fused: not a pass of its own


def prefill_step(
    model: GPT2, input_ids: torch.Tensor, positions: torch.Tensor, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole prompt of one sequence, nothing cached -> (logits of its last token [1, vocab], its K/V
    [n_layer, 2, T, H, D] in the pool's `kv_dtype`); reads no pool."""
    attention = PromptAttention(model.attention_scales(), model.config.reorder_and_upcast_attn)
    logits, new_kv = model.run(input_ids, positions, attention, logits_rows=slice(-1, None), return_kv=True)
    return logits, new_kv.to(kv_dtype)


def attention_scales(model: GPT2) -> torch.Tensor:
    """Each layer's attention scale as `decode_step` takes them: [n_layer] fp32 on the model's device."""
    return torch.tensor(model.attention_scales(), device=model.wte.weight.device)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the bytes of every parameter and buffer of `model`: the disk-cache key tag of its
    frozen graphs, which hold packed copies of the weights (pytorch#143563) yet are keyed by shapes."""
    digest = hashlib.sha256()
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        tensor = tensor.detach().cpu()
        tensor = (tensor.to_dense() if tensor.is_mkldnn else tensor).contiguous()  # PackedLinear's weights
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr()))
    return digest.hexdigest()


def dynamic_decode_sizes(block_tables: torch.Tensor, *per_sequence: torch.Tensor) -> torch.Tensor:
    """A decode graph's inputs readied so that one graph serves every batch >= 2 and every width: the
    block tables padded to at least 2 pages, their width marked dynamic, and the batch too (on them and
    `per_sequence`) unless it is 1: torch specializes a size of 1, so those would be graphs of their own."""
    if block_tables.shape[1] < 2:
        block_tables = torch.cat([block_tables, torch.zeros_like(block_tables)], dim=1)
    if block_tables.shape[0] > 1:
        mark_dynamic(block_tables, *per_sequence, dim=0)
    mark_dynamic(block_tables, dim=1)
    return block_tables


class CompiledDecodeBackend:
    """The torch backend's decode attention as a compiled graph (`attention.paged_decode`) reading the
    pages in place instead of copying them, for the eager steps of a compiled engine."""

    name = "torch"
    store_kv = staticmethod(store_kv)

    def __init__(self, pool: KVPool, attend) -> None:
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
        # where this layer's pages start, and its scale, as tensors: every layer runs the same graph
        key = (k_cache.storage_offset() // page, v_cache.storage_offset() // page)
        if key not in self._first_pages:
            self._first_pages[key] = torch.tensor(key, device=kv.device)
        if scale not in self._scales:
            self._scales[scale] = torch.tensor(scale, device=kv.device)
        block_tables = dynamic_decode_sizes(block_tables, query, context_lens)
        return self._attend(query, pages, block_tables, context_lens, self._first_pages[key], self._scales[scale])

    def close(self) -> None:
        """Nothing to free: the pool is the engine's."""


class CompiledSteps:
    """`decode_step`, `prefill_step`, a block's halves and the decodes' attention, compiled for one model
    and pool. Each engine compiles private copies, called only with its own model, so dynamo's guards on
    the model are skipped, and drops their graphs when it goes (a frozen graph holds its weights)."""

    def __init__(self, model: GPT2, pool: KVPool, options: dict[str, object] | None = None) -> None:
        """`options`: inductor config for the step graphs (see `quantize.compile_options`)."""
        missing = missing_internals()
        if missing:
            raise RuntimeError(f"compile=True needs torch internals this torch {torch.__version__} lacks: "
                               f"{', '.join(missing)}")
        self.model, self.pool = model, pool  # the pool, not its tensor: the runner's close() frees that
        options = {**CODEGEN_OPTIONS, **(options or {})}
        freezing = bool(options.get("freezing", False))
        step, prefill = private_copy(decode_step), private_copy(prefill_step)
        before, after, attend = (private_copy(fn) for fn in (attention_inputs, attention_outputs, paged_decode))
        self.code = CompiledCode([step, prefill, before, after, attend], freezing,
                                 weights_fingerprint(model) if freezing else "")
        weakref.finalize(self, self.code.drop)
        self._step = torch.compile(step, options={**guard_options(), **options})
        self._prefill = torch.compile(prefill, options={**guard_options(), **options})
        self._scales = attention_scales(model)
        # never frozen: one layer's weights would be constants of the graph every layer runs
        self.halves = tuple(
            torch.compile(fn, dynamic=True, options={**guard_options(), **CODEGEN_OPTIONS}) for fn in (before, after)
        )
        self.decode_backend = CompiledDecodeBackend(pool, torch.compile(attend, options=dict(CODEGEN_OPTIONS)))

    @staticmethod
    def covers(inputs) -> bool:
        """A decode-only step, or one sequence's whole prompt of 2 to PREFILL_MAX_TOKENS tokens with
        nothing cached that samples its last token only."""
        meta = inputs.meta
        if not meta.prefills:
            return True
        if len(meta.prefills) != 1 or meta.decode_block_tables is not None or inputs.prompt_logprob_rows:
            return False
        segment = meta.prefills[0]
        whole = segment.context_len == segment.length
        return whole and 2 <= segment.length <= PREFILL_MAX_TOKENS and len(inputs.sample_seqs) == 1

    def __call__(self, inputs) -> torch.Tensor:
        """Logits of a step `covers` takes; the step's K/V land in the pool at its slots."""
        meta = inputs.meta
        if meta.prefills:
            logits, new_kv = self.prefill(inputs.input_ids, inputs.positions)
        else:
            logits, new_kv = self.decode(inputs.input_ids, inputs.positions, meta.decode_block_tables,
                                         meta.decode_context_lens)
        kv = self.pool.kv
        slots = kv.view(*kv.shape[:2], kv.shape[2] * kv.shape[3], *kv.shape[4:])  # pages as token slots
        slots.index_copy_(2, meta.slot_mapping, new_kv)  # both steps return K/V in the pool's dtype
        return logits

    def decode(self, input_ids, positions, block_tables, context_lens) -> tuple[torch.Tensor, torch.Tensor]:
        block_tables = dynamic_decode_sizes(block_tables, input_ids, positions, context_lens)
        with self.code.compiling():
            return self._step(self.model, input_ids, positions, self.pool.kv, block_tables, context_lens, self._scales)

    def prefill(self, input_ids, positions) -> tuple[torch.Tensor, torch.Tensor]:
        mark_dynamic(input_ids, positions, dim=0)
        with self.code.compiling():
            return self._prefill(self.model, input_ids, positions, self.pool.kv.dtype)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile every graph now, so that no request waits for a compile."""
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
                    self.decode(tokens, tokens + 1, tables, lens)
                length = min(WARMUP_PROMPT, self.model.config.n_positions)
                self.prefill(torch.zeros(length, dtype=torch.int64, device=device), torch.arange(length, device=device))
                before, after = self.halves
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
