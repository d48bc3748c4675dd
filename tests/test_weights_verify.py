"""verify_weights (`--verify`, minigpt/model/weights_verify.py): weight files checked against the SHA-256 the hub
published, read from huggingface_hub's cache layout; a changed byte or an unknown hash is a clear error."""

from __future__ import annotations

import argparse
import hashlib
import shutil
from pathlib import Path

import pytest

from minigpt import LLM
from minigpt.cli import add_engine_arguments, engine_args_from, flag_error_line
from minigpt.model.weights import CheckpointError
from minigpt.model.weights_verify import published_sha256, verify_weights


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def hub_snapshot(checkpoint: Path, cache: Path) -> Path:
    """`checkpoint` as huggingface_hub's cache holds a download of it: each file a link from
    `snapshots/REV/` to a blob named by its ETag (an LFS file's SHA-256, a small file's git hash)."""
    repo = cache / "models--someone--tiny"
    snapshot, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in checkpoint.iterdir():
        etag = sha256(file) if file.suffix == ".safetensors" else hashlib.sha1(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blobs / etag)
        (snapshot / file.name).symlink_to(Path("../../blobs") / etag)
    return snapshot


def test_a_hub_download_is_checked_against_its_blob_names(tiny_checkpoint, tmp_path, caplog):
    snapshot = hub_snapshot(tiny_checkpoint, tmp_path)
    assert published_sha256(snapshot / "model.safetensors") == sha256(tiny_checkpoint / "model.safetensors")
    assert published_sha256(snapshot / "config.json") is None  # a git hash, not a SHA-256
    with caplog.at_level("INFO", logger="minigpt"):
        with LLM(str(snapshot), verify_weights=True) as llm:
            assert llm.generate([[1, 2, 3]])[0].token_ids
    assert "verified 1 weight file against the hub's SHA-256" in caplog.text


def test_a_changed_byte_is_a_clear_error(tiny_checkpoint, tmp_path):
    snapshot = hub_snapshot(tiny_checkpoint, tmp_path)
    blob = (snapshot / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # a weight's bit: safetensors itself reads it without a complaint
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is not the file the hub published") as raised:
        LLM(str(snapshot), verify_weights=True)
    assert len(str(raised.value).splitlines()) == 1 and str(snapshot / "model.safetensors") in str(raised.value)


def test_a_local_folder_has_no_published_hash(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="no published SHA-256 is known") as raised:
        LLM(str(tiny_checkpoint), verify_weights=True)
    assert flag_error_line(raised.value).startswith("--verify: no published SHA-256 is known for")


def test_each_weight_file_is_checked_against_the_hash_given(tiny_checkpoint):
    right = sha256(tiny_checkpoint / "model.safetensors")
    verify_weights(tiny_checkpoint, published=lambda file: right)
    with pytest.raises(CheckpointError, match=f"its SHA-256 is {right}, the hub's {'0' * 64}"):
        verify_weights(tiny_checkpoint, published=lambda file: "0" * 64)


def test_the_flag():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args_from(parser.parse_args(["--verify"]))["verify_weights"] is True
    assert engine_args_from(parser.parse_args([]))["verify_weights"] is False
