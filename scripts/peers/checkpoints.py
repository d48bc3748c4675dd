"""What the peers need from a checkpoint: a cache folder for its conversions, its EOS id, its decode bytes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def peers_dir() -> Path:
    """Where peers are built and conversions cached: $MINIGPT_PEERS_DIR, else /work/peers, else ~/.cache."""
    env = os.environ.get("MINIGPT_PEERS_DIR")
    if env:
        return Path(env)
    if Path("/work/peers").is_dir():
        return Path("/work/peers")
    return Path.home() / ".cache" / "minigpt" / "peers"


def checkpoint_cache_dir(checkpoint_dir: str | Path) -> Path:
    """A cache folder unique to this checkpoint's path and its files' sizes and mtimes."""
    ckpt = Path(checkpoint_dir).resolve()
    h = hashlib.sha256(str(ckpt).encode())
    for f in sorted(ckpt.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    d = peers_dir() / "cache" / f"{ckpt.name}-{h.hexdigest()[:12]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def eos_id(checkpoint_dir: Path) -> int:
    cfg = json.loads((checkpoint_dir / "config.json").read_text())
    return int(cfg.get("eos_token_id", 50256))


def gpt2_decode_bytes(checkpoint_dir: str | Path, bytes_per_param: float) -> float:
    """Bytes of weights one batch-1 decode step must read: every matrix once, the tied embedding
    as the LM head, one row of the position table (so ``/ bandwidth`` is the step's lower bound)."""
    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    d, n_layer, vocab = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    inner = cfg.get("n_inner") or 4 * d
    per_layer = d * 3 * d + 3 * d + d * d + d + d * inner + inner + inner * d + d + 4 * d
    params = n_layer * per_layer + vocab * d + 2 * d + d
    return params * bytes_per_param
