"""scripts/bench_host.py runs end to end on its own tiny checkpoint, with steps of equal lengths and with churn:
the table and the JSON it promises."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def bench_host(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_host

    logger = logging.getLogger("minigpt")
    level = logger.level
    yield bench_host
    logger.setLevel(level)  # main quiets the tiny vocabulary's warning


@pytest.mark.parametrize("churn", [False, True])
def test_bench_host_prints_and_records_each_batch(bench_host, tmp_path, capsys, churn):
    out = tmp_path / "host.json"
    args = ["--batches", "1,3", "--steps", "3", "--repeats", "1", "--threads", "1", "--json", str(out)]
    first = next(bench_host.CHURN_NUMBERS)
    assert bench_host.main(args + ["--churn"] * churn) == 0
    made = next(bench_host.CHURN_NUMBERS) - first - 1
    assert made > 1 + 3 if churn else made == 0  # churn: requests finished and were replaced
    printed = capsys.readouterr().out
    assert "batch    1: host" in printed and "batch    3: host" in printed
    assert printed.rstrip().endswith("steps" + " (churn)" * churn)
    results = json.loads(out.read_text())
    assert results["churn"] is churn and results["threads"] == 1
    for batch in ("1", "3"):
        timing = results["batches"][batch]
        assert 0 < timing["host_min_us"] <= timing["host_us"] <= timing["host_max_us"]
        assert timing["model_us"] > 0 and 0 < timing["sampler_us"] < timing["host_us"]


def test_churn_and_overlap_are_not_measured_together(bench_host):
    with pytest.raises(SystemExit):
        bench_host.main(["--churn", "--device-us", "100"])
