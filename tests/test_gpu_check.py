"""scripts/gpu_check.py: its dry run on the CPU goes through every stage the GPU run takes, so a session
with a GPU never spends its few minutes on a typo; a stage that fails or overruns is recorded and the run
goes on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402 - scripts/ is not a package


@pytest.mark.slow
def test_dry_run_takes_every_stage_and_writes_what_the_device_tool_brings_back(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out), "--checkpoints",
         str(tmp_path / "checkpoints"), "--deadline-s", "3600"],
        cwd=ROOT, capture_output=True, text=True,
    )
    log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
    assert result.returncode == 0, result.stdout + result.stderr + log[-5000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["dry_run"] and summary["environment"]["device"] == "cpu"
    assert {name: s["status"] for name, s in summary["stages"].items()} == dict.fromkeys(
        ["environment", "tests", "fused-kernels", "checkpoints", "bench-gpt2", "profile", "bench-gpt2-xl"], "ok")
    assert len(summary["targets"]) == 5  # each measured, met or not
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    # the device tool brings back at most 8 files, at most 2 folders down, named in [A-Za-z0-9._-]
    assert len(files) <= 8, files
    assert all(len(f.parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in f.parts) for f in files)
    bench = json.loads((out / "bench-gpt2" / "bench.json").read_text())
    modes = {r["label"] for r in bench["stream"]}
    minigpt_modes = ("float32", "bfloat16", "bfloat16+no-overlap", "bfloat16+eager")
    assert modes == {f"minigpt {m}" for m in minigpt_modes} | {"transformers bfloat16"}
    assert "CUDA graphs" not in (out / "profile.txt").read_text()  # the CPU runs eagerly


def test_a_stage_that_fails_or_overruns_is_recorded_and_the_run_goes_on(tmp_path):
    log = (tmp_path / "log").open("w")
    failed = gpu_check.Stage("fails", 60, [[sys.executable, "-c", "raise SystemExit(3)"], ["never", "runs"]])
    assert gpu_check.run_stage(failed, log, 60, {})["returncode"] == 3
    slow = gpu_check.Stage("slow", 60, [[sys.executable, "-c", "import time; time.sleep(60)"]])
    assert gpu_check.run_stage(slow, log, 0.5, {})["status"] == "timeout"  # the run's deadline cuts its budget
    missing = gpu_check.Stage("missing", 60, [["no-such-command-here"]])
    assert gpu_check.run_stage(missing, log, 60, {})["status"] == "failed"
    ok = gpu_check.Stage("ok", 60, [[sys.executable, "-c", "print('fine')"]])
    assert gpu_check.run_stage(ok, log, 60, {})["status"] == "ok"
    log.close()
    assert "fine" in (tmp_path / "log").read_text()


def test_targets_are_read_from_the_benches(tmp_path):
    def write(name, **workloads):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text(json.dumps(workloads))

    write("bench-gpt2",
          stream=[{"label": "minigpt bfloat16", "tpot_s": 0.0004}],
          seed000=[{"label": "minigpt bfloat16", "seconds": 0.3, "extrapolated": False},
                   {"label": "minigpt bfloat16", "seconds": 9.0, "extrapolated": True},
                   {"label": "transformers bfloat16", "seconds": 2.4, "extrapolated": False}])
    write("bench-gpt2-xl", stream=[{"label": "minigpt bfloat16", "bandwidth_pct": 61.0}])
    found = gpu_check.targets(tmp_path)
    assert found["gpt2 one stream ms/token (graphs, <= 0.5)"] == {"value": pytest.approx(0.4), "met": True}
    assert found["seed 000 seconds (<= 0.25)"]["met"] is False
    assert found["seed 000 x the V100 run (>= 20)"]["value"] == pytest.approx(4.86 / 0.3)
    assert found["seed 000 x transformers' static batch (>= 5)"] == {"value": pytest.approx(8.0), "met": True}
    assert found["gpt2-xl one stream % of the bandwidth bound (>= 50)"]["met"] is True
    assert gpu_check.targets(tmp_path / "nothing") == {}
