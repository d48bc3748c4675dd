"""The torch range: pyproject.toml declares the releases the suite has run on, and the features that
lean on torch internals refuse any other release at start, in one line."""

from pathlib import Path
from unittest import mock

import pytest
import torch

from minigpt import LLM
from minigpt.common.torch_support import check_torch_for, pip_requirement, release
from minigpt.generate import main

ROOT = Path(__file__).parent.parent


def test_pyproject_declares_the_tested_releases():
    assert f'"{pip_requirement()}"' in (ROOT / "pyproject.toml").read_text()
    assert pip_requirement() == "torch>=2.13,<2.15"


@pytest.mark.parametrize(("version", "want"), [("2.13.0+cpu", (2, 13)), ("2.14.1", (2, 14)), ("2.15.0a0+git", (2, 15)),
                                               ("3.0.0", (3, 0))])
def test_release_of_a_version(version, want):
    assert release(version) == want


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.14.1"])
def test_tested_releases_pass(version):
    with mock.patch.object(torch, "__version__", version):
        check_torch_for("compile", True)


@pytest.mark.parametrize("version", ["2.4.0", "2.12.1+cu126", "2.15.0", "3.0.0"])
@pytest.mark.parametrize(("kwargs", "feature"), [({"compile": True}, "compile=True"),
                                                 ({"quantize": "w8a8"}, "quantize='w8a8'")])
def test_compile_and_quantize_refuse_other_releases_at_start(tiny_checkpoint, version, kwargs, feature):
    with mock.patch.object(torch, "__version__", version), pytest.raises(RuntimeError) as refused:
        LLM(str(tiny_checkpoint), **kwargs)
    assert str(refused.value) == (f"{feature} needs torch>=2.13,<2.15 (it relies on torch internals that change "
                                  f"between releases); this is torch {version}")


def test_eager_runs_on_other_releases(tiny_checkpoint):
    with mock.patch.object(torch, "__version__", "2.12.0"), LLM(str(tiny_checkpoint)) as llm:
        assert llm.generate([[1, 2, 3]])[0].token_ids


def test_the_cli_says_it_in_one_line(tiny_checkpoint, capsys):
    with mock.patch.object(torch, "__version__", "2.12.0"):
        assert main(["--model", str(tiny_checkpoint), "--compile", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--compile needs torch>=2.13,<2.15" in err, err  # the flag, not the field
