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


TRAFFIC = {(): "steps", ("--churn",): "steps (churn)",
           ("--churn", "--same-prompts"): "steps (churn, the same prompts again)"}


@pytest.mark.parametrize("flags", list(TRAFFIC))
def test_bench_host_prints_and_records_each_batch(bench_host, tmp_path, capsys, flags):
    out = tmp_path / "host.json"
    args = ["--batches", "1,3", "--steps", "3", "--repeats", "2", "--threads", "1", "--json", str(out)]
    first = next(bench_host.CHURN_NUMBERS)
    assert bench_host.main(args + list(flags)) == 0
    made = next(bench_host.CHURN_NUMBERS) - first - 1
    if flags == ("--churn",):
        assert made > 2 * (1 + 3)  # requests finished and were replaced, numbered across repetitions
    else:
        assert made == 0
    printed = capsys.readouterr().out
    assert "batch    1: host" in printed and "batch    3: host" in printed
    assert printed.rstrip().endswith(TRAFFIC[flags])
    results = json.loads(out.read_text())
    assert results["churn"] is ("--churn" in flags) and results["same_prompts"] is ("--same-prompts" in flags)
    assert results["threads"] == 1
    for batch in ("1", "3"):
        timing = results["batches"][batch]
        assert 0 < timing["host_min_us"] <= timing["host_us"] <= timing["host_max_us"]
        assert timing["model_us"] > 0 and 0 < timing["sampler_us"] < timing["host_us"]


@pytest.mark.parametrize(("flags", "error"), [
    (["--churn", "--device-us", "100"], "--churn measures host time"),
    (["--same-prompts"], "--same-prompts goes with --churn"),
])
def test_flags_that_do_not_go_together_are_refused(bench_host, capsys, flags, error):
    with pytest.raises(SystemExit):
        bench_host.main(["--batches", "1", "--steps", "1", "--repeats", "1", *flags])
    assert error in capsys.readouterr().err
