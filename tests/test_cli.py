"""`python -m minigpt.generate`: streaming, batches, JSON, and one clear line for bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from minigpt import LLM, SamplingParams
from minigpt.common.errors import Named, ParamError
from minigpt.generate import main


def test_streams_the_same_text_as_the_api(tiny_checkpoint):
    result = subprocess.run(
        [sys.executable, "-m", "minigpt.generate", "--model", str(tiny_checkpoint), "--prompt", "Hello world",
         "--max-new-tokens", "12", "--ignore-eos"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    with LLM(str(tiny_checkpoint)) as llm:
        text = llm.generate(["Hello world"], SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    assert result.stdout == "Hello world" + text + "\n"
    assert "KV pool" in result.stderr


def test_prompts_file_json(tiny_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond one 🎉\r\nthird\u2028part\x0cone\n", encoding="utf-8")
    assert main(["--model", str(tiny_checkpoint), "--prompts-file", str(prompts), "--json", "--quiet",
                 "--max-new-tokens", "5", "--temperature", "0.7", "--top-k", "40", "--seed", "3"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.split("\n") if line]
    assert [r["prompt"] for r in rows] == ["first prompt", "second one 🎉", "third\u2028part\x0cone"]  # lines end at \n
    for r in rows:
        assert r["finish_reason"] in ("stop", "length") and 1 <= len(r["token_ids"]) <= 5
        assert r["time_to_first_token_s"] > 0
    again = tmp_path / "again.txt"
    assert main(["--model", str(tiny_checkpoint), "--prompts-file", str(prompts), "--json", "--quiet",
                 "--max-new-tokens", "5", "--temperature", "0.7", "--top-k", "40", "--seed", "3"]) == 0
    again.write_text(capsys.readouterr().out)
    assert [json.loads(line)["token_ids"] for line in again.read_text().split("\n") if line] == [
        r["token_ids"] for r in rows
    ], "a seed makes sampling reproducible"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/no/such/dir"], "no checkpoint directory"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--max-new-tokens", "500"], "+ --max-new-tokens=500 exceeds the model's context"),
        (["--prompt", "hi", "--max-new-tokens", "500", "--beam-width", "2"], "error: prompt of"),  # no "prompt 0:"
        (["--prompt", "hi", "--threads", "0"], "--threads must be a positive integer"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1, got 0"),
        (["--top-p", "0"], "--top-p must be"),
        (["--top-p", "1.5"], "--top-p must be a finite number in (0, 1], got 1.5"),
        (["--top-k", "-1"], "--top-k must be"),
        (["--temperature", "-0.5"], "--temperature must be"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be"),
        (["--stop", ""], "--stop must be"),
        (["--dtype", "float8"], "unknown dtype"),
        (["--prompts-file", "/no/such/file.txt"], "cannot read --prompts-file"),
        (["--prompt", "hi", "--kv-cache-tokens", str(10**15)], "lower kv_cache_tokens"),  # ~1 EB: never allocated
    ],
)
def test_bad_input_is_one_clear_line(tiny_checkpoint, capsys, args, message):
    argv = ["--model", str(tiny_checkpoint), "--quiet"] + args
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minigpt.generate: error:") and message in err[0], err


def test_a_prompts_file_may_start_with_a_byte_order_mark_and_must_be_utf8(tiny_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\nsecond\n", encoding="utf-8-sig")
    assert main(["--model", str(tiny_checkpoint), "--prompts-file", str(prompts), "--json", "--quiet",
                 "--max-new-tokens", "2"]) == 0
    assert [json.loads(line)["prompt"] for line in capsys.readouterr().out.splitlines()] == ["first", "second"]
    prompts.write_bytes(b"caf\xe9\n")  # latin-1
    assert main(["--model", str(tiny_checkpoint), "--prompts-file", str(prompts), "--quiet"]) == 2
    assert f"--prompts-file {prompts} is not UTF-8 text (byte 3" in capsys.readouterr().err


def test_a_reader_that_leaves_ends_the_command_quietly(tiny_checkpoint):
    """`... | head -c 5`: the writes after the reader left end the command as SIGPIPE would, no error line."""
    buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}  # as by default
    process = subprocess.Popen([sys.executable, "-m", "minigpt.generate", "--model", str(tiny_checkpoint), "--quiet",
                                "--prompt", "Hello", "--max-new-tokens", "8"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=buffered)
    process.stdout.close()  # gone before the first write
    assert process.wait() == 128 + signal.SIGPIPE
    assert process.stderr.read() == ""
    process.stderr.close()


def test_a_refused_prompt_is_named_by_its_line(tiny_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short\n\n" + "long " * 200 + "\nshort again\n", encoding="utf-8")  # line 3: past n_positions
    assert main(["--model", str(tiny_checkpoint), "--prompts-file", str(prompts), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"minigpt.generate: error: line 3 of {prompts}: prompt of ") and "context" in err, err


def test_corrupt_weights_and_offline_hub(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    broken = shutil.copytree(tiny_checkpoint, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file at all")
    assert main(["--model", str(broken), "--quiet"]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--model", "minigpt-test/not-cached", "--quiet"]) == 2
    assert "local checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--quantize", "int4"], "argument --quantize: invalid choice: 'int4'"),
        (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
        (["--kv-cache-dtype", "float64"], "argument --kv-cache-dtype: invalid choice"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_flags_argparse_refuses_are_one_line_too(capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        main(["--quiet"] + args)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minigpt.generate: error:") and message in err[0], err
    assert err[0].endswith("(see --help)")


@pytest.mark.parametrize(("error", "says"), [
    (ParamError("", "compile", (Named("compile", True), " with ", Named("tensor_parallel_size", 2),
                                " is not supported\nmore")),
     "--compile with --tensor-parallel-size=2 is not supported"),
    (ParamError("", "num_threads", "must be a positive integer, got 0\nmore"),
     "--threads must be a positive integer, got 0"),
    (ParamError("", "prompt", (Named("prompt"), " of 3 tokens + ", Named("max_tokens", 500), " exceeds\nmore")),
     "prompt of 3 tokens + --max-new-tokens=500 exceeds"),
    (ValueError("unknown dtype 'float8'\nmore"), "unknown dtype 'float8'"),  # a field named, not set: left as it is
])
def test_errors_name_the_flags_a_command_line_took(error, says):
    from minigpt.cli import flag_error_line

    assert flag_error_line(error, {"max_tokens": "--max-new-tokens"}) == says
