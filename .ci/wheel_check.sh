#!/usr/bin/env bash
# minigpt as its users install it: an sdist and a wheel built from this checkout (`python -m build`, the wheel
# from the sdist), the wheel with its extras in a second fresh virtual environment, then, from a folder outside
# the source tree: every module imports from site-packages, both command forms generate text from a
# checkpoint, and the console command, serve, precompile and batch answer. Run by .ci/run, in its environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source_tree=$PWD
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

pip install --quiet build -c requirements-dev.lock
python -m build --quiet --outdir "$work/dist" .
wheel=$(echo "$work"/dist/minigpt-*.whl)
python .ci/wheel_contents.py "$wheel"
modules=$(python .ci/wheel_contents.py --modules)

python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
pip install --quiet "$(grep -m1 -o 'torch==[0-9.]*' README.md)"  # the README's torch first: never PyPI's CUDA build
pip install --quiet "$wheel[vocab,triton,server,structured,eval,plots,ray]" -c requirements-dev.lock

cd "$work"  # nothing of the source tree is importable from here
# shellcheck disable=SC2086  # one argument a module
python - $modules <<'EOF'
import importlib
import importlib.metadata
import sys

for name in sys.argv[1:]:
    module = importlib.import_module(name)
    assert "site-packages" in module.__file__, f"{name} imported from {module.__file__}, not the installed wheel"
print(f"imported {len(sys.argv) - 1} modules from {sys.modules['minigpt'].__path__[0]}")
assert sys.modules["minigpt"].__version__ == importlib.metadata.version("minigpt"), "__version__ is not the wheel's"
EOF
python "$source_tree/scripts/make_checkpoint.py" ckpt --n-layer 2 --n-head 4 --n-embd 64
generate=(--model ckpt --prompt "Hello, my name is" --max-new-tokens 8 --quiet)
by_module=$(python -m minigpt.generate "${generate[@]}")
by_command=$(minigpt generate "${generate[@]}")
printf '%s\n' "$by_module"
if [[ -z "${by_module//[[:space:]]/}" || "$by_module" != "$by_command" ]]; then
    echo "CI: 'minigpt generate' printed '$by_command', 'python -m minigpt.generate' '$by_module'" >&2
    exit 1
fi
# the C++ kernel of the AVX2 class, built from the wheel's source (the class forced where the CPU is higher)
if grep -qw avx2 /proc/cpuinfo; then
    ATEN_CPU_CAPABILITY=avx2 MINIGPT_CACHE_DIR="$work/cache" python - <<'EOF'
import torch
from minigpt.quant import int8_rows
from minigpt.quant.quantize import W8A8Linear
assert "site-packages" in str(int8_rows.SOURCE), int8_rows.SOURCE
layer = W8A8Linear(torch.nn.Linear(64, 8))
assert layer.few_rows, "the AVX2 int8 kernel did not build from the installed wheel"
x = torch.randn(1, 64)
assert torch.equal(layer(x), layer(torch.cat([x, torch.randn(7, 64)]))[:1])
print("CI: the AVX2 int8 kernel builds from the wheel and gives fbgemm's bits")
from minigpt.compile import pool_attention
from minigpt.compile.pool_attention import NativePoolAttention
from minigpt.compile.attention import PoolAttention
assert "site-packages" in str(pool_attention.SOURCE), pool_attention.SOURCE
pool = torch.randn(1, 2, 8, 16, 4, 64).half()
assert pool_attention.usable(pool), "the C++ decode attention did not build from the installed wheel"
tables, lens, scales = torch.tensor([[3, 5], [1, 0]], dtype=torch.int32), torch.tensor([20, 9]), torch.tensor([0.125])
q, k, v = (torch.randn(2, 4, 64) for _ in range(3))
torch.testing.assert_close(NativePoolAttention(pool, tables, lens, scales)(0, q, k, v),
                           PoolAttention(pool, tables, lens, scales)(0, q, k, v), rtol=1e-5, atol=1e-5)
print("CI: the C++ decode attention builds from the wheel and attends as PoolAttention does")
EOF
fi
minigpt --version
minigpt --help >/dev/null
for command in serve precompile batch; do
    python -m "minigpt.$command" --help >/dev/null
    minigpt "$command" --help >/dev/null
done
echo "CI: the wheel installs, imports and runs outside the source tree"
