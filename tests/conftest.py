"""Shared fixtures: small GPT-2 checkpoints with random weights, written by transformers itself.

Each checkpoint directory is what the hub would serve (config.json, model.safetensors,
vocab.json, merges.txt), so minigpt is tested on files it did not write.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minigpt.replicas.cluster import prepare_local_cluster
from minigpt.tokenizer.tokenizer import gpt2_vocab_files

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
prepare_local_cluster()  # before any test module imports ray: a local cluster listens on 127.0.0.1 only

TINY = dict(n_layer=2, n_head=4, n_embd=64, n_positions=128)
# With the `cuda` marker: what scripts/gpu_check.py runs on a GPU, skipped without one
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def write_hf_checkpoint(path: Path, layout: str = "hf", seed: int = 0, **config_kwargs) -> Path:
    """A transformers GPT2LMHeadModel with random weights saved as a checkpoint directory.

    `layout="openai"` rewrites the weights as the original openai-community/gpt2 file: no
    `transformer.` prefix, no lm_head, with the attention buffers it carries."""
    from transformers import GPT2Config, GPT2LMHeadModel

    kwargs = {**TINY, "initializer_range": 0.1, **config_kwargs}
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**kwargs)).eval()
    model.save_pretrained(path, safe_serialization=True)
    if layout == "openai":
        n = model.config.n_positions
        state = {
            k.removeprefix("transformer."): v.contiguous()
            for k, v in model.state_dict().items()
            if k != "lm_head.weight" or not model.config.tie_word_embeddings
        }
        for i in range(model.config.n_layer):
            state[f"h.{i}.attn.bias"] = torch.ones(n, n).tril().view(1, 1, n, n)
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        config["n_ctx"] = config["n_positions"]
        defaults = {
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
        for key, default in defaults.items():  # old hub configs predate these keys
            if config.get(key) == default:
                config.pop(key)
        (path / "config.json").write_text(json.dumps(config))
    vocab, merges = gpt2_vocab_files()
    shutil.copyfile(vocab, path / "vocab.json")
    shutil.copyfile(merges, path / "merges.txt")
    return path


def with_residual_outliers(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` whose residual stream has one dimension past fp16's 65504, as
    GPT-2's outlier features are in engines that keep it in half precision (two-layer checkpoints)."""
    path = shutil.copytree(src, dst)
    state = load_file(path / "model.safetensors")
    state["transformer.wpe.weight"][:, 0] = 30000.0
    for layer in range(2):
        state[f"transformer.h.{layer}.mlp.c_proj.bias"][0] = 40000.0
    save_file(state, path / "model.safetensors")
    return path


def hf_model(path: Path):
    """transformers' reference model on the same files, eager attention (where
    reorder_and_upcast_attn acts), fp32, eval."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def random_prompts(lengths: list[int], vocab: int = 50257, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def hf_greedy(ref, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy `generate` continuation of one prompt, EOS ignored."""
    ids = torch.tensor([prompt], device=ref.device)
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_all_free(llm) -> None:
    """Every block is back in the pool and no request is left in the scheduler."""
    info = llm.kv_cache_info
    assert info["blocks_in_use"] == 0, info
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.fixture(scope="session", autouse=True)
def compile_cache_dir(tmp_path_factory) -> Path:
    """compile=True's cache of compiled steps, one for the session, and the key that signs its entries:
    the user's own are never touched, and the steps of a shape and mode are compiled once for all tests."""
    path = tmp_path_factory.mktemp("compile-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIGPT_CACHE_DIR", str(path))
        patch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
        yield path


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """torch's thread count back as it was after each test: an engine left open with `num_threads` would change
    it for the tests after, and the compiled steps' cache key with it."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (and cache for the session) a checkpoint for given config overrides."""
    cache: dict[str, Path] = {}

    def make(layout: str = "hf", seed: int = 0, **config_kwargs) -> Path:
        key = json.dumps([layout, seed, config_kwargs], sort_keys=True)
        if key not in cache:
            cache[key] = write_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), layout, seed, **config_kwargs)
        return cache[key]

    return make
