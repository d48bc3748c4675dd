"""Where llama.cpp lives: its source and build dir, its tools, its Python bindings, its GGUF converter.

The bindings are ``llama_cpp`` (``pip install llama-cpp-python``), or the bindings' source beside a
llama.cpp built with ``-DBUILD_SHARED_LIBS=ON``: ``MINIGPT_LLAMA_CPP_DIR`` = the llama.cpp source dir
with ``build/bin/libllama.so``; the bindings are looked for in ``MINIGPT_LLAMA_CPP_PYTHON`` or two
levels up, as in llama-cpp-python's sdist ``vendor/llama.cpp``.
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checkpoints import checkpoint_cache_dir, peers_dir
from .machine import THREADS


def llama_cpp_dir() -> Path | None:
    """The llama.cpp source/build dir: $MINIGPT_LLAMA_CPP_DIR, else one found under peers_dir()."""
    env = os.environ.get("MINIGPT_LLAMA_CPP_DIR")
    if env:
        return Path(env)
    candidates = sorted(glob.glob(str(peers_dir() / "llama_cpp_python-*" / "vendor" / "llama.cpp")))
    candidates += [str(peers_dir() / "llama.cpp")]
    for c in reversed(candidates):
        if (Path(c) / "convert_hf_to_gguf.py").exists():
            return Path(c)
    return None


def llama_cpp_binary(name: str) -> str | None:
    """A llama.cpp tool (e.g. ``llama-batched-bench``) from the build dir or PATH."""
    d = llama_cpp_dir()
    if d is not None and (d / "build" / "bin" / name).exists():
        return str(d / "build" / "bin" / name)
    return shutil.which(name)


def import_llama_cpp() -> Any:
    """``llama_cpp`` bindings: installed, or the sdist's python beside a shared-lib llama.cpp build."""
    try:
        return _quiet_llama(importlib.import_module("llama_cpp"))
    except ImportError:
        pass
    d = llama_cpp_dir()
    lib_dir = d / "build" / "bin" if d is not None else None
    py_dir = os.environ.get("MINIGPT_LLAMA_CPP_PYTHON") or (str(d.parent.parent) if d is not None else None)
    if lib_dir is None or not (lib_dir / "libllama.so").exists():
        raise ImportError("no llama_cpp module and no llama.cpp build with libllama.so (see MINIGPT_LLAMA_CPP_DIR)")
    if py_dir is None or not (Path(py_dir) / "llama_cpp" / "llama_cpp.py").exists():
        raise ImportError("llama_cpp python bindings not found (set MINIGPT_LLAMA_CPP_PYTHON)")
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(lib_dir))
    sys.path.insert(0, py_dir)
    return _quiet_llama(importlib.import_module("llama_cpp"))


def _quiet_llama(module: Any) -> Any:
    """The bindings print every llama.cpp log line (hundreds per context) unless their logger says not to."""
    import logging

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return module


def convert_to_gguf(checkpoint_dir: str | Path, outtype: str) -> Path:
    """The GGUF file for this checkpoint and type, made once with convert_hf_to_gguf.py."""
    out = checkpoint_cache_dir(checkpoint_dir) / f"model-{outtype}.gguf"
    if out.exists():
        return out
    d = llama_cpp_dir()
    if d is None or not (d / "convert_hf_to_gguf.py").exists():
        raise RuntimeError("convert_hf_to_gguf.py not found (set MINIGPT_LLAMA_CPP_DIR to a llama.cpp source dir)")
    ckpt = Path(checkpoint_dir)
    cfg = json.loads((ckpt / "config.json").read_text())
    src = ckpt
    if "n_ctx" not in cfg:  # the converter reads GPT-2's context size from n_ctx
        src = checkpoint_cache_dir(checkpoint_dir) / "hf-with-n_ctx"
        src.mkdir(exist_ok=True)
        for f in ckpt.iterdir():
            if f.is_file() and not (src / f.name).exists():
                os.symlink(f.resolve(), src / f.name)
        (src / "config.json").unlink()
        cfg["n_ctx"] = cfg.get("n_positions", 1024)
        (src / "config.json").write_text(json.dumps(cfg, indent=2))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(d / "gguf-py"), env.get("PYTHONPATH")]))
    tmp = out.with_suffix(".tmp")
    cmd = [sys.executable, str(d / "convert_hf_to_gguf.py"), str(src), "--outtype", outtype,
           "--outfile", str(tmp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {proc.stderr.strip().splitlines()[-1:]}")
    tmp.rename(out)
    return out


def quantize_gguf(checkpoint_dir: str | Path, ftype: str) -> Path:
    """The GGUF file for this checkpoint in a type only llama.cpp's quantizer makes (``q4_0``), made once
    from the f32 conversion through the C API's ``llama_model_quantize`` (what ``llama-quantize`` runs)."""
    out = checkpoint_cache_dir(checkpoint_dir) / f"model-{ftype}.gguf"
    if out.exists():
        return out
    lib = import_llama_cpp()
    source = convert_to_gguf(checkpoint_dir, "f32")
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = THREADS
    tmp = out.with_suffix(".tmp")
    if lib.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize to {ftype} failed for {source}")
    tmp.rename(out)
    return out


def batched_bench(gguf: Path, n_batch: int, n_ubatch: int, kv_unified: bool, npp: int, ntg: int,
                  npl: Sequence[int]) -> list[dict[str, float]]:
    """llama.cpp's own C driver (``llama-batched-bench``) on a GGUF file; [] without the tool.
    Rows: PP, TG, B, T_PP s, S_TG t/s..."""
    exe = llama_cpp_binary("llama-batched-bench")
    if exe is None:
        return []
    n_ctx = -(-max(npl) * (npp + ntg) // 256) * 256
    cmd = [exe, "-m", str(gguf), "-c", str(n_ctx), "-b", str(n_batch), "-ub", str(n_ubatch),
           "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), "-t", str(THREADS),
           "-tb", str(THREADS)] + (["--kv-unified"] if kv_unified else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = []
    cols = ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"]
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r"^\|\s*\d", line)
        if m:
            vals = [float(v) for v in line.strip().strip("|").split("|")]
            rows.append(dict(zip(cols, vals, strict=True)))
    return rows
