"""lm-evaluation-harness scores a local task through `python -m minigpt.serve` (its local-completions model,
tokenizing with the server's /tokenize: nothing but model= and base_url=) and gets the metrics its hf backend
gets on the same checkpoint: a multiple-choice task (loglikelihood) and a perplexity one
(loglikelihood_rolling), datasets from tests/data, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_server_shutdown import start_server

DATA = Path(__file__).resolve().parent / "data"
MODEL = "tiny-gpt2"
TASKS = {
    "minigpt_mc": {
        "output_type": "multiple_choice",
        "data": "lm_eval_mc.jsonl",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    },
    "minigpt_rolling": {
        "output_type": "loglikelihood_rolling",
        "data": "lm_eval_text.jsonl",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}],
    },
}
METRICS = {"minigpt_mc": ("acc", "acc_norm"), "minigpt_rolling": ("word_perplexity", "byte_perplexity",
                                                                 "bits_per_byte")}


@pytest.fixture(scope="module")
def lm_eval(tmp_path_factory):
    """lm_eval, its datasets cache kept in a temporary directory and every hub offline."""
    cache = tmp_path_factory.mktemp("hf-datasets")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache),
                            "TOKENIZERS_PARALLELISM": "false"}.items():
            patch.setenv(name, value)
        yield pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The tasks as lm-eval YAML files (JSON is YAML), pointing at the local datasets."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, spec in TASKS.items():
        spec = dict(spec)
        data = DATA / spec.pop("data")
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **spec}
        (folder / f"{name}.yaml").write_text(json.dumps(config))
    return folder


def evaluate(lm_eval, task_dir: Path, model) -> dict[str, dict[str, float]]:
    """`model`: a name and its model_args, or an LM built already."""
    from lm_eval.tasks import TaskManager

    name, args = model if isinstance(model, tuple) else (model, None)
    out = lm_eval.simple_evaluate(model=name, model_args=args, tasks=list(TASKS),
                                  task_manager=TaskManager(include_path=str(task_dir)), batch_size=4,
                                  log_samples=False, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return {task: {m: out["results"][task][f"{m},none"] for m in METRICS[task]} for task in TASKS}


@pytest.mark.slow
def test_local_completions_through_the_server_equals_the_hf_backend(lm_eval, task_dir, checkpoint_factory):
    checkpoint = checkpoint_factory(n_positions=128)
    from lm_eval.api.registry import get_model

    want = evaluate(lm_eval, task_dir, ("hf", f"pretrained={checkpoint},dtype=float32,device=cpu"))
    proc, url = start_server(checkpoint)
    try:
        served = get_model("local-completions").create_from_arg_string(
            f"model={MODEL},base_url={url}/v1/completions,num_concurrent=2,max_retries=1")
        assert type(served.tokenizer).__name__ == "RemoteTokenizer"  # the server's /tokenize, found by itself
        got = evaluate(lm_eval, task_dir, served)
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    for task in TASKS:
        for metric in METRICS[task]:
            assert got[task][metric] == pytest.approx(want[task][metric], rel=1e-4), (task, metric, got, want)

