"""The shape of the source, as the seams issue states it: few top-level modules, short modules, and prose
(comments and docstrings) a small part of the lines."""

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_TOP_LEVEL_MODULES = 12
MAX_MODULE_LINES = 350
MAX_PROSE = 0.15


def sources() -> list[Path]:
    return sorted([*(ROOT / "minigpt").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def prose_lines(source: str) -> tuple[int, int]:
    """(comment and docstring lines, non-blank lines) of one module."""
    lines = source.splitlines()
    nonblank = {i + 1 for i, line in enumerate(lines) if line.strip()}
    prose = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                  str):
                prose |= set(range(first.lineno, first.end_lineno + 1))
    return len(prose & nonblank), len(nonblank)


def test_few_modules_at_the_top_level():
    top = sorted(path.name for path in (ROOT / "minigpt").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_module_is_long():
    long = {str(path.relative_to(ROOT)): n for path in sources()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_prose_is_a_small_part_of_the_code():
    counts = [prose_lines(path.read_text()) for path in sources()]
    prose, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    assert prose / total <= MAX_PROSE, f"{prose} of {total} non-blank lines are comments or docstrings"


def test_prose_counts_comments_and_docstrings():
    source = '"""Module."""\n\n# a comment\nx = 1  # trailing\n\n\ndef f():\n    """Doc\n    more."""\n    return x\n'
    assert prose_lines(source) == (5, 7)
