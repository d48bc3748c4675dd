"""`--replicas N` on a local Ray cluster whose every address is 127.0.0.1. Batch: two replicas of a tiny checkpoint
write what one process writes (greedy, seeded, chat, scoring, beams and error lines), resume an output part written,
and a replica killed part way is replaced, its lines retried, the output holding each custom_id once. Serve: the
openai client gets what one process answers (streaming, chat, auth, errors), a shared prompt prefix lands on one
replica, and a replica killed under load is replaced while every request is answered.
Marked `ray` and slow (Ray starts in seconds); skipped without the ray extra."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from test_batch import BODIES, NOT_REQUESTS, assert_same, batch_args, job_lines, request_line, results, without_times
from test_server import MODEL, free_port, run_server
from test_server_chat import CHATML

from minigpt import AsyncLLM
from minigpt.batch import main
from minigpt.cli import engine_args_from
from minigpt.replicas.batch import ACTOR_NAME
from minigpt.replicas.cluster import LOCAL
from minigpt.serve import build_parser as serve_parser
from minigpt.server.app import build_app
from minigpt.server.chat_template import ChatTemplate

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")]  # Ray Serve's models

REPLICAS = ["--replicas", "2", "--cpus-per-replica", "0.5"]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module, on loopback, with room for two batch and two served replicas of half a
    CPU each at once (the served ones stay up between tests)."""
    ray.init(num_cpus=2, log_to_driver=False, **LOCAL)
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


def test_replicas_in_the_fast_mode_write_one_process_s_bits(cluster, checkpoint, template_file, tmp_path):
    """The fast mode is batch-invariant (docs/batch-invariance.md): each replica, serving its share of the lines
    among other company, writes the tokens and logprobs bit for bit that one process of as many threads writes."""
    lines = [request_line(f"r{i}", "/v1/completions",
                          {"prompt": f"Line {i} says " * (1 + i % 5), "max_tokens": 8, "temperature": 0,
                           "logprobs": 3, "ignore_eos": True}) for i in range(12)]
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    fast = ("--quiet", "--quantize", "w8a8", "--compile", "--kv-cache-dtype", "float16", "--threads", "1")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main(batch_args(checkpoint, template_file, str(source), str(one), *fast)) == 0
    assert main(batch_args(checkpoint, template_file, str(source), str(two), *fast, *REPLICAS)) == 0
    got, want = results(two), results(one)
    assert {key: without_times(line) for key, line in got.items()} == {key: without_times(line)
                                                                      for key, line in want.items()}


def wait_until(ready, tries: int, seconds: float) -> bool:
    """A bounded poll: True once `ready()` holds, False after `tries` tries `seconds` apart."""
    for _ in range(tries):
        if ready():
            return True
        time.sleep(seconds)
    return False


def kill_a_replica_after(output: Path, at_least: int, seen: dict) -> None:
    """Once `output` holds `at_least` lines (a bounded poll), SIGKILL replica 0's process, then wait (bounded)
    for Ray to answer from its replacement; what it saw goes into `seen`."""
    if not wait_until(lambda: output.exists() and output.read_bytes().count(b"\n") >= at_least, 6000, 0.02):
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


KEY = "sk-replicas"
SHARED = "You are a terse assistant who answers every question in one line. " * 5  # past the router's prefix


@pytest.fixture(scope="module")
def served(cluster, checkpoint, template_file):
    """The Serve application of two replicas on the module's cluster; yields its base URL."""
    from ray import serve

    from minigpt.replicas.serving import deploy

    args = serve_parser().parse_args(["--model", str(checkpoint), "--chat-template", str(template_file),
                                      "--kv-cache-tokens", "8192", "--port", str(free_port()), *REPLICAS])
    deploy(args, engine_args_from(args), MODEL, KEY)
    url = f"http://127.0.0.1:{args.port}"
    try:

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 600, 0.1)
        yield url
    finally:
        serve.shutdown()


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def answers(api: openai.OpenAI) -> list:
    prompts = ["Hello, my name is", "The quick brown fox", SHARED + "Why?"]
    texts = [api.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in prompts]
    stream = api.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0, stream=True)
    texts.append("".join(chunk.choices[0].text for chunk in stream))
    seeded = api.completions.create(model=MODEL, prompt=prompts[1], max_tokens=12, temperature=0.9, seed=3)
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0)
    return [*texts, seeded.choices[0].text, chat.choices[0].message.content]


def test_two_served_replicas_answer_the_openai_client_as_one_process(served, checkpoint):
    got = answers(client(served))
    with AsyncLLM(str(checkpoint), kv_cache_tokens=8192) as llm:
        with run_server(build_app(llm, MODEL, KEY, chat_template=ChatTemplate(CHATML))) as url:
            want = answers(client(url))
    assert got == want
    with pytest.raises(openai.AuthenticationError):
        client(served, "sk-wrong").models.list()
    with pytest.raises(openai.BadRequestError) as refused:
        client(served).completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert refused.value.body["param"] == "max_tokens"
    assert "minigpt_" in httpx.get(f"{served}/metrics", timeout=30).text


def replica_of(url: str, prompt: str) -> str:
    answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-minigpt-replica"]


def running_engine_replicas() -> int:
    return sum(deployment.replica_states.get("RUNNING", 0) for app in serve.status().applications.values()
               for name, deployment in app.deployments.items() if "minigpt-engine" in name)


def wait_for_two_running() -> None:
    """Both engine replicas routable (a replaced one starts after its actor exists)."""
    if not wait_until(lambda: running_engine_replicas() == 2, 1200, 0.1):
        pytest.fail(f"{running_engine_replicas()} engine replicas running, not 2")


def test_requests_sharing_a_prefix_land_on_one_replica(served):
    wait_for_two_running()
    assert len({replica_of(served, f"{SHARED} Question {i}?") for i in range(8)}) == 1
    assert len({replica_of(served, f"{i} is where this prompt starts") for i in range(16)}) == 2


def engine_replicas() -> list[str]:
    return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                  if actor["name"].startswith("SERVE_REPLICA::") and "minigpt-engine" in actor["name"])


def test_a_replica_killed_under_load_is_replaced_and_every_request_answered(served):
    before = engine_replicas()
    assert len(before) == 2

    def ask(i: int) -> str:
        return client(served).completions.create(model=MODEL, prompt=f"{i} under load", max_tokens=24,
                                                 temperature=0).choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        asked = [pool.submit(ask, i) for i in range(40)]
        wait_until(lambda: sum(f.done() for f in asked) >= 4, 6000, 0.01)
        ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
        assert [f.result(timeout=300) for f in asked] == ["length"] * 40

    def replaced() -> bool:
        now = engine_replicas()
        return len(now) == 2 and before[0] not in now

    wait_until(replaced, 1200, 0.1)
    now = engine_replicas()
    assert len(now) == 2 and before[0] not in now, now
    wait_for_two_running()
    assert replica_of(served, "after the kill")
