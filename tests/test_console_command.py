"""The `minigpt` console command: `minigpt generate|serve|precompile` are the `python -m` forms' own parsers."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import minigpt
from minigpt import cli


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_help_lists_every_command_with_its_line(capsys):
    code, out, _ = run_cli(capsys, ["--help"])
    assert code == 0 and out.startswith("usage: minigpt ")
    lines = out.splitlines()
    for name, (_, summary) in cli.COMMANDS.items():
        assert any(line.split() == [name, *summary.split()] for line in lines), (name, out)


def test_version_is_the_installed_distributions(capsys):
    assert minigpt.__version__ == importlib.metadata.version("minigpt")
    assert run_cli(capsys, ["--version"]) == (0, f"minigpt {minigpt.__version__}\n", "")


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_a_commands_help_is_its_python_m_forms(capsys, name):
    """The same flags, defaults and help; only the program's name differs (and where argparse wraps for it)."""
    code, out, _ = run_cli(capsys, [name, "--help"])
    with pytest.raises(SystemExit):
        importlib.import_module(cli.COMMANDS[name][0]).main(["--help"])
    module_form = capsys.readouterr().out
    assert code == 0 and out.startswith(f"usage: minigpt {name} [-h]")
    assert out.split() == module_form.replace(f"usage: python -m minigpt.{name}", f"usage: minigpt {name}", 1).split()


@pytest.mark.parametrize(
    "argv,line",
    [
        ([], "minigpt: error: the following arguments are required: command (see --help)"),
        (["chat"], "minigpt: error: argument command: invalid choice: 'chat' (choose from "),
        (["generate", "--no-such-flag"], "minigpt generate: error: unrecognized arguments: --no-such-flag"),
        (["serve", "--port", "x"], "minigpt serve: error: argument --port: a port is a number in [0, 65535], got 'x'"),
    ],
)
def test_a_bad_command_line_is_one_line_naming_the_command(capsys, argv, line):
    code, out, err = run_cli(capsys, argv)
    assert code == 2 and out == "" and err.startswith(line) and err.count("\n") == 1, err


def test_a_commands_own_errors_name_it(capsys):
    assert cli.main(["generate", "--model", "/no/such/dir", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minigpt generate: error: ") and "no checkpoint directory" in err and err.count("\n") == 1


def test_the_installed_script_generates_as_python_m_does(tiny_checkpoint):
    script = Path(sysconfig.get_path("scripts")) / "minigpt"
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "Hello", "--max-new-tokens", "6", "--quiet"]
    by_script = subprocess.run([str(script), *argv], capture_output=True, text=True, check=False)
    by_module = subprocess.run([sys.executable, "-m", "minigpt.generate", *argv[1:]], capture_output=True, text=True,
                               check=False)
    assert by_script.returncode == 0, by_script.stderr
    assert by_script.stdout == by_module.stdout and by_script.stdout.startswith("Hello")
