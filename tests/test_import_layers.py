"""The package's imports point down only: each module imports its own layer or the layers below it (every
import counts, a type-checking or function-local one too), and no set of modules imports itself in a circle.
The layers are ARCHITECTURE.md's; README's "Architecture" names them."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# bottom first; a module's layer is that of its longest listed prefix
LAYERS = [
    ("base", ["minigpt.common", "minigpt.tokenizer", "minigpt.sampling", "minigpt.kernels"]),
    ("model", ["minigpt.model"]),
    ("engine", ["minigpt.engine"]),
    ("features", ["minigpt.beam", "minigpt.speculative", "minigpt.structured", "minigpt.tensor_parallel",
                  "minigpt.compile", "minigpt.quant"]),
    ("assembly", ["minigpt.assemble"]),
    ("serving", ["minigpt.async_llm", "minigpt.server", "minigpt.batch_jobs", "minigpt.replicas"]),
    ("front", ["minigpt", "minigpt.llm", "minigpt.generate", "minigpt.serve", "minigpt.batch", "minigpt.precompile",
               "minigpt.cli"]),
]


def module_files() -> dict[str, Path]:
    files = {}
    for source, package in (("minigpt", "minigpt"), ("kernels", "minigpt.kernels")):
        for path in sorted((ROOT / source).rglob("*.py")):
            parts = path.relative_to(ROOT / source).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            files[name] = path
    return files


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The minigpt modules `name` imports (a `from package import module` counts as the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known}


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports(path, name, set(files)) - {name} for name, path in files.items()}


def test_every_import_points_down_or_sideways():
    up = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
          for module, targets in graph().items() for target in sorted(targets)
          if layer_of(target) > layer_of(module)]
    assert not up, "imports that point up:\n" + "\n".join(up)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_in_a_circle():
    edges = graph()
    # a package's __init__ that re-exports its own modules is not a circle with them
    for module, targets in edges.items():
        edges[module] = {t for t in targets if not (module.startswith(t + ".") and t != "minigpt")}
    assert not cycles(edges), f"import circles: {cycles(edges)}"


def test_no_folders_import_each_other_in_a_circle():
    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for module, targets in graph().items():
        edges.setdefault(folder(module), set()).update(folder(t) for t in targets if folder(t) != folder(module))
    assert not cycles(edges), f"folders that import each other: {cycles(edges)}"


@pytest.mark.parametrize(("module", "target", "up"), [("minigpt.model.gpt2", "minigpt.engine.runner", True),
                                                       ("minigpt.engine.runner", "minigpt.model.gpt2", False),
                                                       ("minigpt.llm", "minigpt.async_llm.async_engine", False)])
def test_the_check_sees_direction(module, target, up):
    assert (layer_of(target) > layer_of(module)) is up


def test_a_circle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
