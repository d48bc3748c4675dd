"""A loaded model's tensors moved into huge-page memory: the same values, tensors, views and ties, those whose
address keys something else left in place, and the memory itself backed by 2 MiB pages where the kernel offers them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from minigpt.assemble import runner
from minigpt.common import huge_pages
from minigpt.common.huge_pages import HUGE_PAGE, huge_page_bytes, move_to_huge_pages
from minigpt.engine.config import EngineConfig
from minigpt.model.linears import PackedLinear
from minigpt.quant import fbgemm_int8
from minigpt.quant.quantize import W8A8Linear

needs_huge_pages = pytest.mark.skipif(not huge_pages.huge_pages_on(), reason="no madvise(MADV_HUGEPAGE) here")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), None where it has none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return re.search(r"\[(\w+)\]", text).group(1)


def huge_kib(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings overlapping [start, end)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            low, high = (int(part, 16) for part in span.groups())
            inside = low < end and start < high
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.randn(3, 1000), requires_grad=False)
        self.register_buffer("codes", torch.arange(-50, 50, dtype=torch.int8).repeat(7))
        self.register_buffer("view", self.big.data[1:, ::2])  # a view of the parameter's storage
        self.tied = torch.nn.Linear(1000, 3, bias=False)
        self.tied.weight = self.big  # one parameter in two places
        self.register_buffer("empty", torch.empty(0))


@needs_huge_pages
def test_the_tensors_move_with_their_values_identity_views_and_ties():
    module = Holder()
    tensors = module.state_dict(keep_vars=True)
    before = {name: (tensor, tensor.clone(), tensor.stride(), tensor.data_ptr()) for name, tensor in tensors.items()}
    moved = move_to_huge_pages(module)
    assert moved >= module.big.nbytes + module.codes.nbytes
    for name, tensor in module.state_dict(keep_vars=True).items():
        same, values, stride, address = before[name]
        assert tensor is same and torch.equal(tensor, values) and tensor.stride() == stride
        assert tensor.numel() == 0 or tensor.data_ptr() != address
    assert module.view.untyped_storage()._cdata == module.big.untyped_storage()._cdata
    assert module.view.data_ptr() == module.big.data_ptr() + 1000 * 4
    assert module.tied.weight is module.big
    assert module.codes.untyped_storage()._cdata != module.big.untyped_storage()._cdata  # apart stays apart
    module.big.mul_(2)  # still one storage for the parameter and its view
    assert torch.equal(module.view, module.big[1:, ::2])


def test_the_switch_leaves_every_tensor_in_place(monkeypatch):
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    module = Holder()
    addresses = [tensor.data_ptr() for tensor in module.state_dict(keep_vars=True).values()]
    assert move_to_huge_pages(module) == 0
    assert [tensor.data_ptr() for tensor in module.state_dict(keep_vars=True).values()] == addresses


@needs_huge_pages
def test_tensors_whose_address_is_a_key_stay_and_still_work():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    packed = PackedLinear(linear)
    module = torch.nn.Sequential(packed)
    x = torch.randn(5, 64)
    want, handle = packed(x), packed.handle.data_ptr()
    move_to_huge_pages(module)
    assert packed.handle.data_ptr() == handle
    torch.testing.assert_close(packed(x), want, rtol=0, atol=0)


@needs_huge_pages
@pytest.mark.skipif(not fbgemm_int8.built_in(), reason="torch without fbgemm's quantized ops")
def test_an_fbgemm_weight_stays_where_its_packing_is_keyed(monkeypatch):
    monkeypatch.setattr(fbgemm_int8, "available", lambda device: True)
    torch.manual_seed(0)
    linear = W8A8Linear(torch.nn.Linear(64, 96))
    x = torch.randn(9, 64)  # more rows than the kernel of a few rows takes: fbgemm's product
    want, weight = linear(x), linear.weight.data_ptr()
    move_to_huge_pages(torch.nn.Sequential(linear))
    assert linear.weight.data_ptr() == weight
    assert torch.equal(linear(x), want)


@needs_huge_pages
@pytest.mark.parametrize("quantize", [None, "int8", "w8a8"])
def test_a_loaded_model_gives_the_same_logits_from_huge_pages(tiny_checkpoint, monkeypatch, quantize):
    config = EngineConfig(quantize=quantize)
    ids = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv(huge_pages.SWITCH, "0")
    with torch.no_grad():
        want = runner.load_model_for(tiny_checkpoint, config)(ids)
    monkeypatch.setenv(huge_pages.SWITCH, "1")
    model = runner.load_model_for(tiny_checkpoint, config)
    with torch.no_grad():
        assert torch.equal(model(ids), want)


@needs_huge_pages
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="the kernel gives no transparent huge pages")
def test_the_memory_is_backed_by_huge_pages_where_the_kernel_offers_them():
    memory = huge_page_bytes(4 * HUGE_PAGE)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    assert tensor.data_ptr() % HUGE_PAGE == 0
    tensor.fill_(1)
    start = tensor.data_ptr()
    # the kernel may find no free 2 MiB page at once: most of it, not all
    assert huge_kib(start, start + tensor.numel()) >= 2 * HUGE_PAGE // 1024


@needs_huge_pages
def test_a_kernel_without_huge_pages_gives_ordinary_memory():
    class Refusing:
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    huge_pages.advise_huge_pages(Refusing(), 0, HUGE_PAGE)  # no error: the memory stays ordinary
