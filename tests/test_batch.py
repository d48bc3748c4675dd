"""`python -m minigpt.batch`: each line's response is what the server answers its body (the server started for
real on loopback, on the same checkpoint), lines that are no request are error lines, a job killed part way
(SIGKILL or SIGTERM) and run again ends with every custom_id once and the lines of an uninterrupted run, a torn
last line is redone, repeated custom_ids are refused, stdin/stdout work, --quiet is quiet, --summary-json counts."""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server import MODEL, run_server
from test_server_chat import CHATML

from minigpt import AsyncLLM
from minigpt.batch import main
from minigpt.batch_jobs.window import Window
from minigpt.common.progress import Progress
from minigpt.server.app import build_app
from minigpt.server.chat_template import ChatTemplate

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Hello!"}]
# (url, body): completions, chat, scoring and bodies the server refuses
BODIES = [
    ("/v1/completions", {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"prompt": ["The quick", "x"], "max_tokens": 4, "n": 2, "seed": 7, "temperature": 0.8}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 3, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "The quick brown fox jumps", "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": [[464, 2068], [40, 588, 6]], "max_tokens": 0, "echo": True, "logprobs": 0}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "use_beam_search": True, "n": 2, "best_of": 3}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("/v1/completions", {"prompt": "x", "bogus": 1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"model": "other", "prompt": "x"}),
    ("/v1/completions", [1, 2]),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}),
]
# lines that are no request: (the line, the param its 400 names, words of its message)
NOT_REQUESTS = [
    ("not json {", None, "is not valid JSON"),
    (json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {}}), "url", "url must be"),
    (json.dumps({"custom_id": "g", "method": "GET", "url": "/v1/completions", "body": {}}), "method", "POST"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), "custom_id", "a string"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions"}), "body", "body is required"),
]


def request_line(custom_id: str, url: str, body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory(n_positions=256)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(CHATML, encoding="utf-8")
    return path


def batch_args(checkpoint: Path, template_file: Path, source: str, output: str, *more: str) -> list[str]:
    return ["--model", str(checkpoint), "-i", source, "-o", output, "--served-model-name", MODEL,
            "--chat-template", str(template_file), "--kv-cache-tokens", "8192", *more]


def results(path: Path) -> dict[str, dict]:
    """The output lines by custom_id (by id for a line without one), asserting each appears once."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    ids = [line["custom_id"] or line["id"] for line in lines]
    assert len(ids) == len(set(ids)), f"a custom_id written twice: {ids}"
    return dict(zip(ids, lines, strict=True))


def without_times(value):
    """`value` less what differs from run to run: `created` (the time of an answer)."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k != "created"}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def assert_same(got, want, where: str = "") -> None:
    """Equal, floats (logprobs) to 1e-4: the same body in other batches sums in another order."""
    if isinstance(want, float) and isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4), f"{where}: {got} != {want}"
    elif isinstance(want, dict) and isinstance(got, dict):
        assert got.keys() == want.keys(), f"{where}: {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_each_response_is_what_the_server_answers(checkpoint, template_file, tmp_path):
    lines = [request_line(f"r{i}", url, body) for i, (url, body) in enumerate(BODIES)]
    lines += [line for line, _, _ in NOT_REQUESTS]
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # a blank line is no request
    assert main(batch_args(checkpoint, template_file, str(source), str(output), "--quiet")) == 0
    got = results(output)
    assert len(got) == len(lines)
    with AsyncLLM(str(checkpoint), kv_cache_tokens=8192) as llm:
        with run_server(build_app(llm, MODEL, chat_template=ChatTemplate(CHATML))) as url:
            for i, (path, body) in enumerate(BODIES):
                answer = httpx.post(f"{url}{path}", json=body, timeout=60)
                line = got[f"r{i}"]
                assert line["response"]["status_code"] == answer.status_code, (body, line)
                assert_same(without_times(line["response"]["body"]), without_times(
                    {**answer.json(), "id": line["response"]["body"].get("id")} if answer.status_code == 200
                    else answer.json()), f"r{i}")
                assert (line["error"] is None) == (answer.status_code == 200)
    ok = got["r0"]
    assert ok["id"].startswith("batch_req_") and ok["response"]["request_id"].startswith("req_")
    assert ok["response"]["body"]["id"].startswith("cmpl-") and ok["response"]["body"]["model"] == MODEL
    assert got["r6"]["response"]["body"]["id"].startswith("chatcmpl-")
    assert got["r7"]["response"]["body"]["error"]["param"] == "max_completion_tokens"
    scored = got["r3"]["response"]["body"]
    assert scored["usage"]["completion_tokens"] == 0 and scored["choices"][0]["text"] == "The quick brown fox jumps"
    failed = [line for line in got.values() if line["custom_id"] not in {f"r{i}" for i in range(len(BODIES))}]
    for text, param, says in NOT_REQUESTS:
        match = [line for line in failed if says in line["response"]["body"]["error"]["message"]]
        assert len(match) == 1 and match[0]["response"]["body"]["error"]["param"] == param, (text, failed)
        assert match[0]["response"]["status_code"] == 400
        assert match[0]["error"]["message"] == match[0]["response"]["body"]["error"]["message"]


def job_lines(count: int, max_tokens: int = 12) -> list[str]:
    """Greedy and seeded completions, and a chat."""
    lines = []
    for i in range(count):
        body: dict = {"prompt": f"Line {i} says", "max_tokens": max_tokens, "ignore_eos": True}
        body |= {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i}
        lines.append(request_line(f"job-{i}", "/v1/completions", body))
    lines.append(request_line("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0}))
    return lines


def start_batch(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "minigpt.batch", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def wait_for_lines(path: Path, at_least: int, process: subprocess.Popen) -> None:
    """Until `path` holds `at_least` lines (bounded poll); the process must still be running."""
    for _ in range(12000):
        if path.exists() and path.read_bytes().count(b"\n") >= at_least:
            return
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.01)
    raise AssertionError(f"{path} never held {at_least} lines")


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM])
def test_a_job_stopped_part_way_resumes_to_what_an_uninterrupted_run_writes(checkpoint, template_file, tmp_path,
                                                                            stop):
    lines = job_lines(80)
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    assert main(batch_args(checkpoint, template_file, str(source), str(whole), "--quiet", "--max-in-flight", "2")) == 0
    process = start_batch(batch_args(checkpoint, template_file, str(source), str(resumed), "--max-in-flight", "2"))
    try:
        wait_for_lines(resumed, 4, process)
        process.send_signal(stop)
        assert process.wait(timeout=120) == (-signal.SIGKILL if stop == signal.SIGKILL else 128 + signal.SIGTERM)
    finally:
        process.kill()
        process.wait()
    stderr = process.stderr.read()
    written = resumed.read_bytes()
    assert 0 < written.count(b"\n") < len(lines), "the job was stopped part way"
    if stop == signal.SIGTERM:  # stopped cleanly: whole lines, and a summary that says how to go on
        assert written.endswith(b"\n") and "stopped by SIGTERM: run it again to finish" in stderr
    assert main(batch_args(checkpoint, template_file, str(source), str(resumed), "--quiet", "--max-in-flight",
                           "8")) == 0
    want, got = results(whole), results(resumed)
    assert got.keys() == want.keys() and len(got) == len(lines)
    for custom_id in want:
        assert without_times(got[custom_id]) == without_times(want[custom_id]), custom_id


def test_a_torn_last_line_is_redone_and_the_rest_skipped(checkpoint, template_file, tmp_path):
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(job_lines(6, max_tokens=3)) + "\n", encoding="utf-8")
    summary = tmp_path / "summary.json"
    args = batch_args(checkpoint, template_file, str(source), str(output), "--quiet", "--summary-json", str(summary))
    assert main(args) == 0
    whole = output.read_bytes()
    last = whole.rstrip(b"\n").rfind(b"\n") + 1
    output.write_bytes(whole[: last + 25])  # the last line cut mid-way, as a kill leaves it
    assert main(args) == 0
    assert json.loads(summary.read_text())["requests"] == 1 and json.loads(summary.read_text())["skipped"] == 6
    want = {k: without_times(v) for k, v in results(tmp_path / "results.jsonl").items()}
    assert len(want) == 7
    assert output.read_bytes()[:last] == whole[:last]
    torn_id = json.loads(whole[last:])["custom_id"]
    assert want[torn_id] == without_times(json.loads(whole[last:]))


def test_an_output_file_that_is_no_jobs_output_is_refused(checkpoint, template_file, tmp_path, capsys):
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(job_lines(1, max_tokens=1)) + "\n", encoding="utf-8")
    output.write_text('{"id": "batch_req_00"}\nhello\n{"id": "batch_req_01"}\n', encoding="utf-8")
    assert main(batch_args(checkpoint, template_file, str(source), str(output), "--quiet")) == 2
    assert "line 2 is not a result line of a batch job" in capsys.readouterr().err
    assert output.read_text(encoding="utf-8").count("\n") == 3


def test_an_engine_that_stops_ends_the_job_without_writing_what_it_did_not_answer(checkpoint, template_file,
                                                                                  tmp_path, monkeypatch, capsys):
    import minigpt.batch_jobs.answer as answer

    lines = job_lines(12, max_tokens=2)
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    submitted, submit = [], answer.submit_plan

    def submit_then_stop(llm, plan):
        handles = submit(llm, plan)
        submitted.append(plan)
        if len(submitted) == 6:
            llm.close()  # the engine thread ends: what runs is aborted, what comes next is refused
        return handles

    monkeypatch.setattr(answer, "submit_plan", submit_then_stop)
    args = batch_args(checkpoint, template_file, str(source), str(output), "--quiet", "--max-in-flight", "3")
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "what is left is not written: run it again" in err, err
    assert "the engine stopped" in err or "the engine is not running" in err, err
    written = results(output)
    assert len(written) < len(lines)
    assert all(line["response"]["status_code"] == 200 for line in written.values())
    assert all(c["finish_reason"] == "length" for line in written.values()
               for c in line["response"]["body"]["choices"])
    monkeypatch.setattr(answer, "submit_plan", submit)
    assert main(args) == 0
    assert len(results(output)) == len(lines)


def test_an_output_folder_that_does_not_exist_is_one_line(checkpoint, template_file, tmp_path, capsys):
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(job_lines(1, max_tokens=1)) + "\n", encoding="utf-8")
    output = tmp_path / "missing" / "results.jsonl"
    assert main(batch_args(checkpoint, template_file, str(source), str(output), "--quiet")) == 2
    assert capsys.readouterr().err == f"minigpt.batch: error: cannot write -o {output}: No such file or directory\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_output_that_cannot_be_written_ends_the_job_with_one_line(checkpoint, template_file, tmp_path, capsys):
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(job_lines(3, max_tokens=1)) + "\n", encoding="utf-8")
    assert main(batch_args(checkpoint, template_file, str(source), "/dev/full", "--quiet")) == 1
    assert capsys.readouterr().err == "minigpt.batch: error: cannot write -o /dev/full: No space left on device\n"


def test_two_jobs_never_write_one_output_at_once(checkpoint, template_file, tmp_path, capsys):
    from minigpt.batch_jobs.files import ResultWriter

    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(job_lines(1, max_tokens=1)) + "\n", encoding="utf-8")
    other = ResultWriter(str(output))  # a job running on it
    try:
        assert main(batch_args(checkpoint, template_file, str(source), str(output), "--quiet")) == 2
    finally:
        other.close()
    assert capsys.readouterr().err == f"minigpt.batch: error: another job is writing -o {output}\n"
    assert output.read_bytes() == b""
    assert main(batch_args(checkpoint, template_file, str(source), str(output), "--quiet")) == 0
    assert len(results(output)) == 2


def test_a_repeated_custom_id_is_refused_before_anything_runs(checkpoint, template_file, tmp_path, capsys):
    lines = job_lines(3, max_tokens=1)
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join([*lines, "", lines[1]]) + "\n", encoding="utf-8")
    assert main(batch_args(checkpoint, template_file, str(source), str(output), "--quiet")) == 2
    err = capsys.readouterr().err
    assert f"line 6 of {source} repeats custom_id 'job-1' of line 2" in err and err.count("\n") == 1
    assert not output.exists()


def test_stdin_to_stdout(checkpoint, template_file, tmp_path, monkeypatch, capsys):
    lines = job_lines(3, max_tokens=2)
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    file_output = tmp_path / "results.jsonl"
    assert main(batch_args(checkpoint, template_file, str(tmp_path / "requests.jsonl"), str(file_output),
                           "--quiet")) == 0
    stdout = io.TextIOWrapper(io.BytesIO())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode())))
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(batch_args(checkpoint, template_file, "-", "-", "--quiet")) == 0
    piped = [json.loads(line) for line in stdout.buffer.getvalue().decode().splitlines()]
    assert {r["custom_id"]: without_times(r) for r in piped} == {
        k: without_times(v) for k, v in results(file_output).items()}
    assert capsys.readouterr().err == ""


def test_a_repeated_custom_id_on_stdin_stops_the_job_naming_the_line(checkpoint, template_file, monkeypatch, capsys):
    lines = job_lines(2, max_tokens=1)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join([*lines, lines[0]]) + "\n").encode())))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO()))
    assert main(batch_args(checkpoint, template_file, "-", "-", "--quiet")) == 2
    assert "line 4 of stdin repeats a custom_id given before ('job-0')" in capsys.readouterr().err


def test_a_pipe_as_input_is_read_once_as_stdin_is(checkpoint, template_file, tmp_path):
    """`-i <(zcat requests.jsonl.gz)`: a pipe, which a scan before the job would empty."""
    lines = job_lines(3, max_tokens=2)
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    read_end, write_end = os.pipe()
    os.write(write_end, source.read_bytes())  # under the pipe's buffer; closed, so a second read finds it empty
    os.close(write_end)
    try:
        assert main(batch_args(checkpoint, template_file, f"/dev/fd/{read_end}", str(tmp_path / "piped.jsonl"),
                               "--quiet")) == 0
    finally:
        os.close(read_end)
    assert main(batch_args(checkpoint, template_file, str(source), str(tmp_path / "read.jsonl"), "--quiet")) == 0
    piped, read = results(tmp_path / "piped.jsonl"), results(tmp_path / "read.jsonl")
    assert len(piped) == len(lines) and {k: without_times(v) for k, v in piped.items()} == {
        k: without_times(v) for k, v in read.items()}


@pytest.mark.parametrize("where", ["missing/summary.json", "."])
def test_a_summary_json_that_cannot_be_written_is_refused_before_the_job(checkpoint, template_file, tmp_path, capsys,
                                                                         where):
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(job_lines(1, max_tokens=1)) + "\n", encoding="utf-8")
    summary = tmp_path / where
    assert main(batch_args(checkpoint, template_file, str(source), str(output), "--quiet",
                           "--summary-json", str(summary))) == 2
    problem = "no such directory" if where.startswith("missing") else "is a directory"
    assert capsys.readouterr().err == f"minigpt.batch: error: cannot write --summary-json {summary}: {problem}\n"
    assert not output.exists()


def test_a_request_of_more_prompts_than_the_window_or_the_queue_runs_alone(checkpoint, template_file, tmp_path):
    lines = [request_line("many", "/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}),
             *job_lines(1, max_tokens=2)]
    source, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(batch_args(checkpoint, template_file, str(source), str(output), "--quiet", "--max-in-flight", "2",
                           "--max-waiting", "2")) == 0
    answers = results(output)
    assert len(answers) == len(lines) and all(a["response"]["status_code"] == 200 for a in answers.values())
    assert len(answers["many"]["response"]["body"]["choices"]) == 5


def test_quiet_silences_stderr_and_the_summary_counts_what_was_done(checkpoint, template_file, tmp_path, capsys):
    lines = [*job_lines(4, max_tokens=3), "not json", request_line("bad", "/v1/completions", {"prompt": 1.5})]
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    summary = tmp_path / "summary.json"
    assert main(batch_args(checkpoint, template_file, str(source), str(tmp_path / "a.jsonl"), "--quiet",
                           "--summary-json", str(summary))) == 0
    assert capsys.readouterr().err == ""
    report = json.loads(summary.read_text())
    bodies = [line["response"]["body"] for line in results(tmp_path / "a.jsonl").values()]
    assert report["requests"] == len(lines) and report["failed"] == 2 and report["skipped"] == 0
    assert report["prompt_tokens"] == sum(b["usage"]["prompt_tokens"] for b in bodies if "usage" in b)
    assert report["completion_tokens"] == sum(b["usage"]["completion_tokens"] for b in bodies if "usage" in b) >= 12
    assert report["stopped_by"] is None and report["wall_time_s"] > 0
    assert main(batch_args(checkpoint, template_file, str(source), str(tmp_path / "b.jsonl"))) == 0
    assert (f"{len(lines)} requests (2 failed), {report['prompt_tokens']} prompt + {report['completion_tokens']} "
            "completion tokens in ") in capsys.readouterr().err


def test_progress_shows_failures_and_the_time_left(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress = Progress(10, enabled=True)
    progress.update(5, 100, 1)
    progress.close()
    assert terminal.getvalue().startswith("\r[minigpt] 5/10 requests, ")
    assert ", 1 failed, ETA 0:0" in terminal.getvalue() and terminal.getvalue().endswith("\n")


def test_the_window_serves_in_order_and_never_starves_a_large_request():
    async def run() -> list[str]:
        window, order = Window(4), []

        async def take(name: str, units: int) -> None:
            got = await window.acquire(units)
            order.append(name)
            await asyncio.sleep(0)
            window.release(got)

        first = await window.acquire(3)
        tasks = [asyncio.create_task(take("large", 9)), asyncio.create_task(take("small", 1))]
        await asyncio.sleep(0)
        assert order == [] and window.free == 1  # small waits behind large, though one unit is free
        cancelled = asyncio.create_task(take("cancelled", 1))
        await asyncio.sleep(0)
        cancelled.cancel()
        window.release(first)
        await asyncio.gather(*tasks)
        assert window.free == 4
        return order

    assert asyncio.run(run()) == ["large", "small"]


def test_help_names_the_server_extra():
    result = subprocess.run([sys.executable, "-m", "minigpt.batch", "--help"], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0 and 'pip install "minigpt[server]"' in result.stdout


@pytest.mark.slow
def test_bench_batch_smoke(checkpoint_factory):
    checkpoint = checkpoint_factory(n_positions=512)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_batch.py"), "--model", str(checkpoint), "--queries", "4",
         "--max-tokens", "2", "--docs", "2", "--doc-tokens", "8,16", "--rss-lines", "10,20"],
        capture_output=True, text=True, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| generate")
            or line.startswith("| score")]
    assert [(row[0], row[1]) for row in rows] == [(f"| {name}", way) for name in ("generate", "score")
                                                  for way in ("batch", "serve", "transformers")]
    assert [row[3] for row in rows[:3]] == ["8"] * 3  # 4 queries x 2 tokens each way
    assert len({row[3] for row in rows[3:]}) == 1 and int(rows[3][3]) >= 2 * 8  # the same prompt tokens scored
    assert "| 20 | " in result.stdout
