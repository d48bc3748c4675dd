"""scripts/bench.py runs end to end (minigpt only, tiny checkpoint): the tables and JSON it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke(checkpoint_factory, tmp_path):
    checkpoint = checkpoint_factory(n_positions=512)  # serving prompts reach 300 + 128 tokens
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--model", str(checkpoint), "--engines", "minigpt",
         "--dtypes", "float32", "--workloads", "stream,seed000,seed002,serving", "--queries", "6",
         "--baseline-queries", "2", "--batch-sizes", "1,4", "--sweep-tokens", "4", "--rates", "20",
         "--serving-requests", "4", "--repeats", "1", "--starts", "1", "--no-wait", "--out", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    for heading in ("Start and memory", "One stream", "Seed 000", "Seed 002", "Serving"):
        assert heading in result.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    batched = [r for r in data["seed000"] if r["mode"].startswith("continuous")][0]
    assert batched["tokens_generated"] == 6 * 64 and batched["avg_batch"] > 1
    assert all(r["tokens_generated"] == 128 for r in data["stream"])
    [start] = data["start"]
    assert start["label"] == "minigpt float32" and start["first_start_s"] == start["start_s"] > 0
    assert len(data["serving"]) == 1 and data["serving"][0]["requests"] == 4
    assert "  20 req/s: TTFT p50 " in result.stderr  # progress for each serving rate, as for each batch size


def test_start_probe_times_a_fresh_minigpt_and_its_peak_memory(tiny_checkpoint):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "start_probe.py"), "--engine", "minigpt", "--mode", "w8a8",
         "--model", str(tiny_checkpoint)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["start_s"] > 0
    assert 100 < probe["peak_rss_mb"] < 100_000  # torch alone is ~100s of MB resident; MB, not KiB or bytes


def test_bench_refuses_a_mode_no_engine_has(tiny_checkpoint, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--model", str(tiny_checkpoint), "--engines", "minigpt",
         "--dtypes", "minigpt:bfloat16+compile,minigpt:float8", "--no-wait", "--out", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode != 0
    assert "no engine has minigpt:float8;" in result.stderr  # bfloat16+compile is a mode: not listed


def test_bench_refuses_an_unknown_workload_or_engine_before_preparing_any(tiny_checkpoint, tmp_path):
    bench = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--model", str(tiny_checkpoint), "--no-wait",
             "--out", str(tmp_path)]
    typo = subprocess.run(bench + ["--workloads", "stream,seed0"], capture_output=True, text=True, check=False)
    assert typo.returncode != 0
    assert "no workload 'seed0'; known: stream, seed000, seed002, serving" in typo.stderr
    engine = subprocess.run(bench + ["--engines", "minigpt,llamacpp"], capture_output=True, text=True, check=False)
    assert engine.returncode != 0
    assert "--engines: no engine llamacpp; known: minigpt, transformers" in engine.stderr
    assert "preparing" not in typo.stderr + engine.stderr


def test_mode_names_map_to_engine_settings(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench

    peer = bench.MinigptPeer()
    common = {"device": "cpu", "num_threads": bench.P.THREADS, "enforce_eager": False, "batch_invariant": False,
              "overlap": "auto"}
    assert peer._engine_args("w8a8+compile+kv-bfloat16") == {
        "dtype": "float32", "quantize": "w8a8", "compile": True, "kv_cache_dtype": "bfloat16", **common,
    }
    assert peer._engine_args("bfloat16") == {"dtype": "bfloat16", "compile": False, **common}
    assert peer._engine_args("bfloat16+invariant") == {"dtype": "bfloat16", "compile": False, **common,
                                                       "batch_invariant": True}
    peer.device = "cuda"
    assert peer._engine_args("bfloat16+eager") == {**common, "dtype": "bfloat16", "compile": False, "device": "cuda",
                                                   "enforce_eager": True}
    assert peer._engine_args("bfloat16+no-overlap") == {**common, "dtype": "bfloat16", "compile": False,
                                                        "device": "cuda", "overlap": "off"}
    assert "w8a8+compile+kv-float16" in peer.extra_dtypes and "w8a8+kv-float16" not in peer.extra_dtypes


def test_bench_refuses_a_cpu_class_this_cpu_lacks(monkeypatch):
    """--cpu-class of a class the CPU cannot run stops with why, before re-running itself."""
    from minigpt.common import cpu_class

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from peers import machine

    monkeypatch.setattr(cpu_class, "x86_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(machine.os, "execve", lambda *args: pytest.fail("re-ran itself"))
    with pytest.raises(SystemExit, match="--cpu-class avx2_vnni: this CPU lacks avx_vnni"):
        machine.run_at_cpu_class("avx2_vnni")


def test_bench_runs_forced_to_a_lower_cpu_class_and_says_so(checkpoint_factory, tmp_path):
    """--cpu-class avx2 re-runs the bench with the variables that force AVX2; the tables and JSON record it."""
    from minigpt.common.cpu_class import unusable

    if unusable("avx2"):
        pytest.skip(unusable("avx2"))
    checkpoint = checkpoint_factory(n_positions=512)  # the stream's 8 + 128 tokens
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--model", str(checkpoint), "--engines", "minigpt",
         "--dtypes", "w8a8", "--workloads", "stream", "--repeats", "1", "--starts", "0", "--no-wait",
         "--cpu-class", "avx2", "--out", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    recorded = json.loads((tmp_path / "bench.json").read_text())["cpu_class"]
    assert recorded.startswith("AVX2") and "ATEN_CPU_CAPABILITY=avx2" in recorded
    assert f"CPU class {recorded}" in result.stdout
