"""The CPU class kernels are picked for, and runs forced to a lower class: each class this machine can emulate
picks its own kernels, and its quantized paths give per-row (batch-invariant) products."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from minigpt.common import cpu_class
from minigpt.quant import fbgemm_int8, int8_rows

CLASSES = ["native", *cpu_class.FORCE]


def forced(name: str) -> dict[str, str]:
    problem = cpu_class.unusable(name) if name != "native" else None
    if problem:
        pytest.skip(problem)
    return {**os.environ, **cpu_class.FORCE.get(name, {})}


def run_forced(name: str, code: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], env=forced(name), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_x86_flags_reads_this_cpu():
    flags = cpu_class.x86_flags()
    if flags is not None:
        assert "sse2" in flags  # every x86-64 CPU has it


PICKS = """
import json, torch
from minigpt.common import cpu_class
from minigpt.model.linears import PackedLinear, cpu_linear_for, native_bf16
from minigpt.quant.quantize import W8A8Linear
usable = cpu_class.usable_flags() or frozenset()
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "describe": cpu_class.describe(),
                  "avx512": any(f.startswith("avx512") for f in usable), "avx_vnni": "avx_vnni" in usable,
                  "fbgemm": W8A8Linear(torch.nn.Linear(64, 8)).fbgemm, "native_bf16": native_bf16(),
                  "few_rows": W8A8Linear(torch.nn.Linear(64, 8)).few_rows,
                  "packed_fp32": cpu_linear_for(torch.float32, torch.device("cpu")) is PackedLinear}))
"""


@pytest.mark.parametrize("name", ["avx2", "avx2_vnni"])
def test_a_forced_class_picks_its_own_kernels(name):
    """Forced to AVX2 on any x86 CPU: torch's kernels, fbgemm's 7-bit w8a8 and the AVX2 kernel of a few rows,
    oneDNN-packed fp32 linears, no native bf16; the class is said, with what forced it."""
    got = run_forced(name, PICKS)
    assert got["capability"] == "AVX2" and not got["avx512"]
    assert got["avx_vnni"] == (name == "avx2_vnni")
    assert got["fbgemm"] == fbgemm_int8.built_in() and got["packed_fp32"] and not got["native_bf16"]
    assert got["few_rows"] == int8_rows.loaded()
    assert got["describe"].startswith("AVX2") and "forced by ATEN_CPU_CAPABILITY=avx2" in got["describe"]


def test_a_class_the_cpu_lacks_is_named_with_what_it_lacks(monkeypatch):
    monkeypatch.setattr(cpu_class, "x86_flags", lambda: frozenset({"sse2", "avx2"}))
    assert cpu_class.unusable("avx2") is None
    assert cpu_class.unusable("avx2_vnni") == "this CPU lacks avx_vnni, which the avx2_vnni class needs"
    monkeypatch.setattr(cpu_class, "x86_flags", lambda: None)
    assert "is an x86 one" in cpu_class.unusable("avx2")


def test_the_native_class_is_said_plainly():
    line = cpu_class.describe()
    assert line.startswith(torch.backends.cpu.get_cpu_capability()) and "forced" not in line


@pytest.mark.skipif(not fbgemm_int8.built_in(), reason="torch without fbgemm's quantized ops")
def test_onednn_rows_give_fbgemm_s_bits(monkeypatch):
    """With AVX-VNNI, ONEDNN_ROWS rows and more go to oneDNN: the integers fbgemm gives, as the same fp32."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (96, 3072), dtype=torch.int8, generator=generator)
    weight[0] = 127
    rows = torch.randint(-63, 64, (fbgemm_int8.ONEDNN_ROWS + 3, 3072), generator=generator).float()
    rows[0] = 63
    fbgemm_int8.pack(weight)
    monkeypatch.setattr(fbgemm_int8, "avx_vnni", lambda: False)
    want = fbgemm_int8.int8_mm(rows, weight)
    monkeypatch.setattr(fbgemm_int8, "avx_vnni", lambda: True)
    assert torch.equal(fbgemm_int8.int8_mm(rows, weight), want)
    assert torch.equal(fbgemm_int8.int8_mm(rows[:5], weight), want[:5])


ENGINE = """
import json, sys
from minigpt import LLM, SamplingParams
prompts = ["Hello there", "Another prompt, longer than the first one", "x", "one two three four five six",
           "seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen",
           "twenty twenty-one twenty-two"]
params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
def seen(out):
    return [out.token_ids, [[e.logprob, sorted(e.top.items())] for e in out.logprobs]]
with LLM(sys.argv[1], quantize="w8a8", compile=sys.argv[2] == "compile") as llm:
    batched = [seen(o) for o in llm.generate(prompts, params)]
    alone = [seen(llm.generate([p], params)[0]) for p in prompts]
print(json.dumps({"batched": batched, "alone": alone}))
"""


@pytest.mark.parametrize("name", list(CLASSES))
def test_w8a8_is_batch_invariant_at_every_class(tiny_checkpoint, name):
    """Eager w8a8 under each class: a prompt alone gives the bits it gives in a batch (tokens and logprobs);
    the batched prompts fill more than ONEDNN_ROWS rows, each alone fewer (avx2_vnni: oneDNN against fbgemm)."""
    got = run_forced(name, ENGINE, str(tiny_checkpoint), "eager")
    assert got["alone"] == got["batched"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["avx2", "avx2_vnni"])
def test_compiled_w8a8_at_avx2_is_batch_invariant(tiny_checkpoint, name):
    """The fast mode forced to AVX2: its compiled programs of one sequence run the AVX2 kernel of a few rows,
    those of a batch fbgemm's products (oneDNN's for many rows with AVX-VNNI); the same bits either way (tokens
    and logprobs)."""
    got = run_forced(name, ENGINE, str(tiny_checkpoint), "compile")
    assert got["alone"] == got["batched"]
