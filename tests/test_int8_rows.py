"""The AVX2 int8 kernel of a few rows (kernels/int8_rows_avx2.cpp): exact integer products against its torch
reference at every shape it takes; and how minigpt/compile/native.py builds, signs, reuses and refuses its library."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from minigpt.common import cpu_class
from minigpt.compile import native
from minigpt.quant import fbgemm_int8, int8_rows
from minigpt.quant.quantize import W8A8Linear


def kernel_or_skip() -> None:
    if "avx2" not in (cpu_class.x86_flags() or ()):
        pytest.skip("the kernel is AVX2 code; this CPU has no AVX2")
    if not int8_rows.loaded():
        pytest.skip("the kernel's library did not build here (no C++ compiler?)")


@pytest.mark.parametrize("outputs", [1, 4, 7, 96, 50257])
@pytest.mark.parametrize("inputs", [32, 768, 3072])
def test_rows_mm_gives_the_exact_integer_products(outputs, inputs):
    """Rows 0-5, the full int8 range (-127..127) and its extremes: every product exact, outputs past a multiple
    of 4 included."""
    kernel_or_skip()
    if outputs * inputs > 50257 * 768:
        pytest.skip("larger than gpt2's head")
    generator = torch.Generator().manual_seed(outputs * inputs)
    weight = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=generator)
    weight[0] = 127
    weight[-1] = -127
    packed = int8_rows.pack(weight)
    assert packed.shape == (-(-outputs // 4), inputs // 32, 4, 32)
    for rows in range(6):
        x = torch.randint(-127, 128, (rows, inputs), dtype=torch.int8, generator=generator)
        if rows:
            x[0] = 127
        want = (x.double() @ weight.double().t()).float()
        assert torch.equal(int8_rows.reference(x, packed, outputs), want)
        assert torch.equal(int8_rows.rows_mm(x, packed, outputs), want)


def test_rows_mm_refuses_shapes_it_cannot_take():
    kernel_or_skip()
    packed = int8_rows.pack(torch.ones(8, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="inputs"):
        int8_rows.rows_mm(torch.ones(1, 32, dtype=torch.int8), packed, 8)
    with pytest.raises(RuntimeError, match="int8"):
        int8_rows.rows_mm(torch.ones(1, 64), packed, 8)
    with pytest.raises(RuntimeError, match="fit"):
        int8_rows.rows_mm(torch.ones(1, 64, dtype=torch.int8), packed, 9)


@pytest.mark.skipif(not fbgemm_int8.built_in(), reason="torch without fbgemm's quantized ops")
def test_w8a8_takes_the_kernel_for_a_few_rows_and_fbgemm_beyond(monkeypatch):
    """Where the kernel is used (AVX2), a linear's rows give the same bits alone (the kernel) as in a batch
    (fbgemm); the switch turns the kernel off."""
    kernel_or_skip()
    monkeypatch.setattr(fbgemm_int8, "available", lambda device: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200)
    layer = W8A8Linear(linear)
    assert layer.few_rows and layer.packed.shape == (50, 3, 4, 32)
    calls = []
    monkeypatch.setattr(int8_rows, "rows_mm", lambda *args: calls.append(args) or int8_rows.reference(*args))
    x = torch.randn(8, 96)
    batched = layer(x)
    assert not calls
    for i in range(8):
        assert torch.equal(layer(x[i : i + 1]), batched[i : i + 1])
    for i in range(6):
        assert torch.equal(layer(x[i : i + int8_rows.ROWS]), batched[i : i + int8_rows.ROWS])
    assert len(calls) == 8 + 6
    monkeypatch.setenv(cpu_class.NATIVE_SWITCH, "0")
    assert not W8A8Linear(linear).few_rows


def test_w8a8_takes_the_kernel_for_a_few_rows_where_int_mm_takes_the_batch(monkeypatch):
    """Where fbgemm is not used (the AVX-512 class), every batch goes through the op that sends up to
    `INT_MM_ROWS` rows through the kernel and more through `torch._int_mm` (up to `ROWS` the kernel directly): the
    same bits whatever the batch (full 8-bit activations)."""
    kernel_or_skip()
    monkeypatch.setattr(fbgemm_int8, "available", lambda device: False)
    torch.manual_seed(0)
    layer = W8A8Linear(torch.nn.Linear(96, 200))
    assert layer.few_rows and not layer.fbgemm and layer.levels == 127
    calls = []
    routed = int8_rows.rows_or_int_mm
    monkeypatch.setattr(int8_rows, "rows_or_int_mm", lambda *args: calls.append(len(args[0])) or routed(*args))
    x = torch.randn(12, 96)
    batched = layer(x)
    for rows in range(1, 12):
        assert torch.equal(layer(x[:rows]), batched[:rows])
    assert calls == [12, *range(int8_rows.ROWS + 1, 12)]


@pytest.mark.parametrize("rows", [0, 1, 5, int8_rows.INT_MM_ROWS, int8_rows.INT_MM_ROWS + 1, 40])
def test_rows_or_int_mm_gives_the_exact_integer_products(rows):
    kernel_or_skip()
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randint(-127, 128, (4 * 9 + 1, 96), dtype=torch.int8, generator=generator)
    x = torch.randint(-127, 128, (rows, 96), dtype=torch.int8, generator=generator)
    packed = int8_rows.pack(weight)
    got = int8_rows.rows_or_int_mm(x, weight, packed)
    assert got.dtype == torch.int32  # as torch._int_mm gives them
    assert torch.equal(got.float(), int8_rows.reference(x, packed, len(weight)))


def test_rows_mm_bits_do_not_depend_on_the_threads_or_the_streams():
    """Each thread reads 2 or 4 streams of its outputs' blocks (the blocks left over alone): on 1, 2 or 3 threads,
    with either count, the same products."""
    kernel_or_skip()
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(-127, 128, (4 * 37 + 3, 256), dtype=torch.int8, generator=generator)
    x = torch.randint(-127, 128, (3, 256), dtype=torch.int8, generator=generator)
    packed = int8_rows.pack(weight)
    want = int8_rows.reference(x, packed, len(weight))
    threads, setting = torch.get_num_threads(), int8_rows.tuned()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for streams in int8_rows.STREAMS:
                int8_rows.configure(streams)
                assert torch.equal(int8_rows.rows_mm(x, packed, len(weight)), want)
    finally:
        torch.set_num_threads(threads)
        int8_rows.configure(setting)


def test_the_streams_are_timed_once_and_a_count_the_kernel_lacks_refused():
    kernel_or_skip()
    setting = int8_rows.tuned()
    try:
        assert setting in int8_rows.STREAMS
        assert int8_rows.tuned.cache_info().misses == 1
        assert int8_rows.tune(rounds=1) in int8_rows.STREAMS
        with pytest.raises(RuntimeError, match="streams must be 2 or 4"):
            int8_rows.configure(3)
    finally:
        int8_rows.configure(setting)


@pytest.mark.skipif(not fbgemm_int8.built_in(), reason="torch without fbgemm's quantized ops")
def test_fbgemm_s_op_sends_a_few_rows_through_the_kernel_given_its_packing(monkeypatch):
    """A program of any batch calls fbgemm's op: with the kernel's packing, a few rows go through the kernel
    (the same integers); more rows, or no packing, through fbgemm."""
    kernel_or_skip()
    generator = torch.Generator().manual_seed(1)
    weight = torch.randint(-127, 128, (50, 96), dtype=torch.int8, generator=generator)
    fbgemm_int8.pack(weight)
    packed = int8_rows.pack(weight)
    calls = []
    monkeypatch.setattr(int8_rows, "rows_mm", lambda *args: calls.append(len(args[0])) or int8_rows.reference(*args))
    for rows in range(7):
        x = torch.randint(-63, 64, (rows, 96), generator=generator).float()
        assert torch.equal(fbgemm_int8.int8_mm(x, weight, packed), fbgemm_int8.int8_mm(x, weight))
    assert calls == list(range(int8_rows.ROWS + 1))


SOURCE = """
#include <torch/library.h>
at::Tensor twice(const at::Tensor& x) { return x.add(x); }
TORCH_LIBRARY(NAMESPACE, m) { m.def("twice(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("twice", &twice); }
"""


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "cache" / native.FOLDER


def test_a_library_is_built_once_signed_and_rebuilt_if_altered(tmp_path, private_cache, monkeypatch):
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE.replace("NAMESPACE", "minigpt_test_twice"))
    built, loaded = [], []
    real_build = native._build
    monkeypatch.setattr(native, "_build", lambda *args: built.append(args[-1]) or real_build(*args))
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(Path(path)))
    native.load_library(source, ())
    assert len(built) == 1 and loaded[-1].parent == private_cache and loaded[-1].suffix == ".so"
    assert stat.S_IMODE(private_cache.stat().st_mode) == 0o700
    native.load_library(source, ())
    assert len(built) == 1 and loaded[-1] == loaded[0]  # signed, reused
    library = loaded[0]
    library.write_bytes(library.read_bytes() + b"\0")  # altered after signing: never loaded, rebuilt
    native.load_library(source, ())
    assert len(built) == 2 and loaded[-1] == library
    native.load_library(source, ("-O1",))  # other flags: another library
    assert len(built) == 3 and loaded[-1] != library


def test_a_built_library_runs_its_ops(tmp_path, private_cache):
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE.replace("NAMESPACE", "minigpt_test_run"))
    native.load_library(source, ())
    assert torch.equal(torch.ops.minigpt_test_run.twice(torch.arange(3)), torch.tensor([0, 2, 4]))


def test_a_cache_others_may_write_is_not_used(tmp_path, private_cache, monkeypatch):
    private_cache.mkdir(parents=True)
    os.chmod(private_cache, 0o777)
    source = tmp_path / "twice.cpp"
    source.write_text(SOURCE.replace("NAMESPACE", "minigpt_test_shared"))
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(Path(path)))
    native.load_library(source, ())
    assert loaded and loaded[0].parent != private_cache and not list(private_cache.iterdir())


def test_a_failed_build_says_the_compiler_s_error(tmp_path, private_cache):
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++;\n")
    with pytest.raises(RuntimeError, match="building broken.cpp failed: .*error"):
        native.load_library(source, ())
