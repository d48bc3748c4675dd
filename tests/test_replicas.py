"""`minigpt batch --replicas N` on a local Ray cluster whose every address is 127.0.0.1: two replicas of a tiny
checkpoint write what one process writes (greedy, seeded, chat, scoring, beams and error lines), resume an output
part written, and a replica killed part way is replaced, its lines retried, the output holding each custom_id once.
Marked `ray` and slow (Ray starts in seconds); skipped without the ray extra."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_batch import BODIES, NOT_REQUESTS, assert_same, batch_args, job_lines, request_line, results, without_times
from test_server_chat import CHATML

from minigpt.batch import main
from minigpt.replicas.batch import ACTOR_NAME
from minigpt.replicas.cluster import LOOPBACK_ONLY

os.environ.update(LOOPBACK_ONLY)  # before ray is imported: it reads them then
ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPLICAS = ["--replicas", "2", "--cpus-per-replica", "0.5"]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module, on loopback, one CPU: room for two replicas of half a CPU."""
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory(n_positions=256)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(CHATML, encoding="utf-8")
    return path


def assert_same_results(got: Path, want: Path) -> None:
    got_lines, want_lines = results(got), results(want)
    assert got_lines.keys() == want_lines.keys()
    for key, line in want_lines.items():
        assert_same(without_times(got_lines[key]), without_times(line), key)


def test_two_replicas_write_what_one_process_writes_and_resume(cluster, checkpoint, template_file, tmp_path):
    lines = [request_line(f"r{i}", url, body) for i, (url, body) in enumerate(BODIES)]
    lines += [line for line, _, _ in NOT_REQUESTS] + job_lines(16)
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    one, two, resumed = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "resumed.jsonl"
    assert main(batch_args(checkpoint, template_file, str(source), str(one), "--quiet")) == 0
    assert main(batch_args(checkpoint, template_file, str(source), str(two), "--quiet", *REPLICAS)) == 0
    assert len(results(two)) == len(lines)
    assert_same_results(two, one)
    resumed.write_text("".join(one.read_text(encoding="utf-8").splitlines(keepends=True)[:7]), encoding="utf-8")
    assert main(batch_args(checkpoint, template_file, str(source), str(resumed), "--quiet", *REPLICAS)) == 0
    assert_same_results(resumed, one)


def kill_a_replica_after(output: Path, at_least: int, seen: dict) -> None:
    """Once `output` holds `at_least` lines (a bounded poll), SIGKILL replica 0's process, then wait (bounded)
    for Ray to answer from its replacement; what it saw goes into `seen`."""
    for _ in range(6000):
        if output.exists() and output.read_bytes().count(b"\n") >= at_least:
            break
        time.sleep(0.02)
    else:
        seen["error"] = f"{output} never held {at_least} lines"
        return
    try:
        replica = ray.get_actor(ACTOR_NAME.format(0))
        seen["killed"] = ray.get(replica.pid.remote(), timeout=60)
        seen["lines_at_kill"] = output.read_bytes().count(b"\n")
        os.kill(seen["killed"], signal.SIGKILL)
        seen["replacement"] = ray.get(replica.pid.remote(), timeout=120)
    except Exception as err:  # reported by the test
        seen["error"] = repr(err)


def test_a_replica_killed_part_way_is_replaced_and_every_line_written_once(cluster, checkpoint, template_file,
                                                                           tmp_path):
    lines = job_lines(120, max_tokens=48)
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main(batch_args(checkpoint, template_file, str(source), str(one), "--quiet", "--max-in-flight", "4")) == 0
    seen: dict = {}
    killer = threading.Thread(target=kill_a_replica_after, args=(two, 6, seen), daemon=True)
    killer.start()
    assert main(batch_args(checkpoint, template_file, str(source), str(two), "--quiet", "--max-in-flight", "4",
                           *REPLICAS)) == 0
    killer.join(timeout=180)
    assert "error" not in seen, seen["error"]
    assert seen["lines_at_kill"] < len(lines), "the replica was killed part way"
    assert seen["replacement"] != seen["killed"]
    assert len(results(two)) == len(lines)
    assert_same_results(two, one)
