"""Loading real checkpoint shapes: sharded, .bin only, both key layouts, and clear errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import minigpt.model.checkpoint
from minigpt import LLM
from minigpt.model.checkpoint import random_model, write_checkpoint
from minigpt.model.config import ConfigError, GPT2Config
from minigpt.model.gpt2 import GPT2, load_model
from minigpt.model.weights import CheckpointError, _mapped_safetensors, resolve_checkpoint
from minigpt.tokenizer.tokenizer import gpt2_vocab_files

from conftest import TINY, hf_model, write_hf_checkpoint


def _logits_match(path: Path) -> None:
    ids = torch.randint(0, 50257, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = hf_model(path)(ids).logits, GPT2.from_pretrained(path)(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_safetensors(tmp_path):
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(HFConfig(**TINY)).eval()
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        torch.testing.assert_close(GPT2.from_pretrained(tmp_path)(ids), model(ids).logits, rtol=1e-5, atol=1e-5)


def test_pytorch_model_bin_only(tmp_path, tiny_checkpoint):
    state = load_file(tiny_checkpoint / "model.safetensors")
    torch.save(state, tmp_path / "pytorch_model.bin")
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(GPT2.from_pretrained(tmp_path)(ids), GPT2.from_pretrained(tiny_checkpoint)(ids))


class _RunsCode:
    """Pickles as a call to os.system: what a hostile .bin carries."""

    def __reduce__(self):
        return os.system, ("echo this must never run",)


def test_pytorch_model_bin_with_code_is_refused_without_running_it(tmp_path, tiny_checkpoint):
    state = load_file(tiny_checkpoint / "model.safetensors")
    state["payload"] = _RunsCode()
    torch.save(state, tmp_path / "pytorch_model.bin")
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="pickled Python objects") as refused:
        load_model(tmp_path)
    assert "system" in str(refused.value) and "weights_only" not in str(refused.value)  # not torch's advice


def test_lm_head_in_file_of_a_tied_model_is_accepted(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    state["lm_head.weight"] = state["transformer.wte.weight"].clone()
    save_file(state, path / "model.safetensors")
    _logits_match(path)


def test_hub_style_config_without_newer_keys(checkpoint_factory):
    path = checkpoint_factory(layout="openai")
    config = json.loads((path / "config.json").read_text())
    assert "n_ctx" in config and "reorder_and_upcast_attn" not in config
    _logits_match(path)


@pytest.mark.parametrize("layout", ["hf", "openai"])
def test_make_checkpoint_output_loads_in_transformers(tmp_path, layout):
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64)
    path = write_checkpoint(random_model(config, seed=1), tmp_path / layout, gpt2_vocab_files(), layout=layout)
    _logits_match(path)


def test_a_failed_checkpoint_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """safetensors' writer failing (numpy not installed, a full disk) neither creates the directory nor
    touches the files of one written before."""
    model = random_model(GPT2Config(**TINY))

    def fail(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'numpy'")

    with monkeypatch.context() as patched:
        patched.setattr(minigpt.model.checkpoint, "save_file", fail)
        with pytest.raises(ModuleNotFoundError):
            write_checkpoint(model, tmp_path / "new", gpt2_vocab_files())
        assert list(tmp_path.iterdir()) == []
    written = write_checkpoint(model, tmp_path / "old", gpt2_vocab_files())
    before = {f.name: f.read_bytes() for f in written.iterdir()}
    monkeypatch.setattr(minigpt.model.checkpoint, "save_file", fail)
    with pytest.raises(ModuleNotFoundError):
        write_checkpoint(random_model(GPT2Config(**TINY), seed=5), written, gpt2_vocab_files())
    assert [p.name for p in tmp_path.iterdir()] == ["old"]
    assert {f.name: f.read_bytes() for f in written.iterdir()} == before


def test_writing_over_a_checkpoint_replaces_its_files(tmp_path):
    """Every file a loader would read is the new checkpoint's: stale shards, an index (which a loader could
    prefer), generation_config.json and tokenizer.json go; other files stay. The directory gets the
    mode a plain mkdir gives."""
    path = write_checkpoint(random_model(GPT2Config(**TINY)), tmp_path / "ckpt", gpt2_vocab_files())
    (tmp_path / "plain").mkdir()
    assert path.stat().st_mode == (tmp_path / "plain").stat().st_mode
    stale = ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "pytorch_model.bin",
             "generation_config.json", "tokenizer.json"]
    for name in stale:
        (path / name).write_text("{}")
    (path / "notes.txt").write_text("kept")
    write_checkpoint(random_model(GPT2Config(**TINY), seed=5), path, gpt2_vocab_files())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "plain"]
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "merges.txt", "model.safetensors", "notes.txt",
                                                       "vocab.json"]
    assert (path / "notes.txt").read_text() == "kept"
    _logits_match(path)
    reloaded = load_file(path / "model.safetensors")["transformer.wte.weight"]
    assert torch.equal(reloaded, random_model(GPT2Config(**TINY), seed=5).wte.weight)


def test_safetensors_are_read_as_safetensors_writes_them(tmp_path):
    """minigpt's own reader of the format (one tensor of the file in memory at a time): every dtype,
    odd sizes that leave later tensors unaligned, an empty tensor, the header's metadata skipped."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "half": torch.randn(3, 5, generator=generator).half(),
        "float": torch.randn(7, 3, generator=generator),
        "bf16": torch.randn(1, 9, generator=generator).bfloat16(),
        "empty": torch.zeros(0, 4),
        "flags": torch.rand(5, generator=generator) > 0.5,
        "bytes": torch.randint(-128, 128, (3,), dtype=torch.int8, generator=generator),
        "ids": torch.randint(0, 1 << 40, (4,), generator=generator),
        "double": torch.randn(2, 2, generator=generator, dtype=torch.float64),
    }
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    read = {name: tensor.clone() for name, tensor in _mapped_safetensors(tmp_path / "t.safetensors")}
    want = load_file(tmp_path / "t.safetensors")
    assert read.keys() == want.keys() == tensors.keys()
    for name, tensor in want.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, "F8_E4M3, which minigpt does not"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "w lies outside the file"),
        ({"w": {"dtype": "F32", "shape": "four", "data_offsets": [0, 4]}}, "truncated or corrupt"),
        ([1, 2], "truncated or corrupt"),
    ],
)
def test_a_safetensors_header_minigpt_cannot_read_says_why(tmp_path, header, match):
    encoded = json.dumps(header).encode()
    (tmp_path / "w.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(4))
    with pytest.raises(CheckpointError, match=match):
        list(_mapped_safetensors(tmp_path / "w.safetensors"))


def test_truncated_weights_file(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


def test_garbage_weights_file(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"), "missing keys.*h.1.mlp.c_fc.bias"),
        (lambda s: s.update({"transformer.h.9.attn.c_attn.weight": torch.zeros(2)}), "unexpected keys.*h.9"),
        (lambda s: s.update({"transformer.wpe.weight": torch.zeros(3, 64)}), "wpe.weight has shape"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_key_and_shape_errors_name_the_key(tmp_path, tiny_checkpoint, edit, match):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
        load_model(path)


def test_missing_keys_are_named_in_layer_order(tmp_path):
    """h.2 before h.10, as a reader counts layers (text order would put h.10 first)."""
    path = write_hf_checkpoint(tmp_path / "ckpt", n_layer=11)
    state = load_file(path / "model.safetensors")
    for layer in (10, 2):
        state.pop(f"transformer.h.{layer}.ln_1.bias")
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing keys.*: h\.2\.ln_1\.bias, h\.10\.ln_1\.bias"):
        load_model(path)


@pytest.mark.parametrize("n_layer", [None, 3, 1])
def test_a_config_whose_n_layer_differs_from_the_weights_says_so(tmp_path, tiny_checkpoint, n_layer):
    """A config.json that leaves n_layer out gets GPT-2's 12; the 2-layer weights then lack layers 2-11.
    The error counts the layers on each side instead of listing missing (or unexpected) keys."""
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config.pop("n_layer")
    if n_layer is not None:
        config["num_hidden_layers"] = n_layer
    (path / "config.json").write_text(json.dumps(config))
    told = 12 if n_layer is None else n_layer
    with pytest.raises(CheckpointError, match=f"the weights hold 2 layers \\(h.0 to h.1\\) but config.json's n_layer "
                                              f"is {told}: is config.json another model's, or are layers missing\\?"
                                              + (" \\(12 is also GPT-2's default" if told == 12 else "$")):
        load_model(path)


def test_weights_that_lost_a_shard_list_what_is_missing(tmp_path, tiny_checkpoint):
    """The last layer gone and ln_f with it (a shard lost): the missing keys, not a layer count."""
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    for key in [k for k in state if k.startswith(("transformer.h.1.", "transformer.ln_f."))]:
        del state[key]
    save_file(state, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing keys .*: h\.1\.attn\.c_attn\.bias, .* and 4 more$"):
        load_model(path)


def test_untied_model_without_lm_head_is_refused(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(path)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"model_type": "gpt_neo"}, "not GPT-2"),
        ({"activation_function": "swiglu"}, "activation_function"),
        ({"n_head": 5}, "divisible"),
        ({"add_cross_attention": True}, "cross_attention"),
        ({"n_layer": 0}, "n_layer"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, tiny_checkpoint, change, match):
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        load_model(path)


def test_missing_files_and_dirs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")


def test_hub_id_without_network_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="local checkpoint directory"):
        resolve_checkpoint("minigpt-test/surely-not-cached")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_loads_straight_into_dtype(tiny_checkpoint, dtype):
    model = load_model(tiny_checkpoint, dtype=dtype)
    for name, param in model.named_parameters():
        assert param.dtype == (torch.float32 if ".ln_" in name or name.startswith("ln_f") else dtype), name
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("file_name", ["model.safetensors", "pytorch_model.bin"])
def test_loaded_model_does_not_depend_on_its_file(tmp_path, tiny_checkpoint, file_name):
    """Overwriting the weights file in place (same inode, as `cp` does) must not reach a loaded model."""
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    if file_name == "pytorch_model.bin":
        torch.save(load_file(path / "model.safetensors"), path / file_name)
        (path / "model.safetensors").unlink()
    model = GPT2.from_pretrained(path)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        before = model(ids)
        with open(path / file_name, "r+b") as f:  # zero everything past the first KiB of headers
            size = f.seek(0, 2)
            f.seek(1024)
            f.write(bytes(size - 1024))
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)


def test_safetensors_preferred_over_a_bin_index(tmp_path, tiny_checkpoint):
    """A repo shipping both formats, downloaded without its .bin shards, loads from its safetensors."""
    path = _copy(tiny_checkpoint, tmp_path / "ckpt")
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": "pytorch_model-00001-of-00002.bin"}}
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    _logits_match(path)


def test_hub_patterns_fetch_only_the_root_files():
    from huggingface_hub.utils import filter_repo_objects

    from minigpt.model.weights import HUB_FALLBACK_FILES, HUB_FILES

    repo = ["config.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json",
            "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
            "pytorch_model.bin", "checkpoint-500/model.safetensors", "onnx/model.safetensors",
            "checkpoint-500/pytorch_model.bin", "checkpoint-500/tokenizer_config.json", "flax_model.msgpack"]
    picked = set(filter_repo_objects(repo, allow_patterns=HUB_FILES + HUB_FALLBACK_FILES))
    assert picked == {"config.json", "vocab.json", "merges.txt", "added_tokens.json", "tokenizer_config.json",
                      "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                      "pytorch_model.bin"}


def test_an_incomplete_directory_names_all_it_lacks(tmp_path, tiny_checkpoint):
    """A directory left by a write or download that stopped part way: every missing part, and the likely cause."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as empty:
        LLM(str(tmp_path / "empty"))
    assert str(empty.value) == (
        f"{tmp_path / 'empty'} is not a complete checkpoint: it has no config.json; no weights "
        "(model.safetensors or model.safetensors.index.json or pytorch_model.bin or pytorch_model.bin.index.json); "
        "no tokenizer (tokenizer.json, or vocab.json and merges.txt). A write or download that stopped part way "
        "leaves such a directory: write or download it again"
    )
    no_merges = _copy(tiny_checkpoint, tmp_path / "no-merges")
    (no_merges / "merges.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"it has no tokenizer \(tokenizer.json, or vocab.json and merges"):
        LLM(str(no_merges))
