"""Speculative decoding: greedy outputs token for token those without speculation, sampled outputs from the
target's distribution (seeded: the same draws), both pools fully free after every run."""

from __future__ import annotations

import json
import math
import re
import shutil
import time

import pytest
import torch

from minigpt import LLM, AsyncLLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from minigpt.engine.config import EngineConfig
from minigpt.generate import main
from minigpt.speculative.ngram import ngram_draft

from conftest import assert_all_free, hf_greedy, hf_model, random_prompts

# patterned prompts (the n-gram lookup finds them) among random ones, around the 16-token block
PROMPTS = [[5, 6, 7, 8, 9] * 6, [100, 200, 300] * 5 + [100], *random_prompts([1, 15, 17, 33, 60])]
MAX_TOKENS = [40, 24, 30, 16, 20, 33, 28]


def ngram(k: int = 4, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1, **extra}


def draft(path, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, **extra}


def _greedy(llm: LLM, **params) -> list:
    return llm.generate(PROMPTS, [SamplingParams(max_tokens=m, ignore_eos=True, **params) for m in MAX_TOKENS])


def assert_spec_free(llm: LLM) -> None:
    assert_all_free(llm)
    draft_model = llm.engine.speculator.draft_model
    if draft_model is not None:
        assert draft_model.blocks.num_used == 0 and not draft_model.seqs


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    with LLM(str(tiny_checkpoint)) as llm:
        return _greedy(llm, logprobs=3)


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"block_size": 8, "enable_prefix_caching": False},
        {"max_num_batched_tokens": 24},  # drafts verified beside prompt chunks, some cut by the budget
        {"kv_cache_tokens": 160},  # preemption and recompute: drafts use spare blocks only
    ],
    ids=["default", "block8-nocache", "chunked", "tiny-pool"],
)
@pytest.mark.parametrize("method", ["ngram", "draft", "draft-adaptive"])
def test_greedy_equals_no_speculation(tiny_checkpoint, plain, engine_args, method):
    config = {"ngram": ngram(adaptive=False), "draft": draft(tiny_checkpoint, adaptive=False),
              "draft-adaptive": draft(tiny_checkpoint)}[method]
    with LLM(str(tiny_checkpoint), speculative_config=config, **engine_args) as llm:
        outs = _greedy(llm, logprobs=3)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        for got, want in zip(outs, plain, strict=True):  # the target's logprobs, whatever was drafted
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert a.top.keys() == b.top.keys() and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert_spec_free(llm)
        if method != "draft-adaptive":
            assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
        if "kv_cache_tokens" in engine_args:
            assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_greedy_equals_transformers(tiny_checkpoint):
    ref = hf_model(tiny_checkpoint)
    with LLM(str(tiny_checkpoint), speculative_config=ngram()) as llm:
        outs = _greedy(llm)
    for prompt, m, out in zip(PROMPTS, MAX_TOKENS, outs, strict=True):
        assert out.token_ids == hf_greedy(ref, prompt, m)


def test_ngram_speculation_accepts_on_repeating_outputs(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), speculative_config=ngram()) as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    m = out.metrics
    assert m.num_spec_steps > 0 and m.num_accepted_tokens > 0
    assert m.acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens
    assert m.mean_accepted_tokens == m.num_accepted_tokens / m.num_spec_steps


def test_prefix_cache_and_n_completions(tiny_checkpoint):
    shared = PROMPTS[0] + [1, 2, 3]
    prompts = [shared + [4], shared + [5], shared + [4]]
    params = SamplingParams(max_tokens=20, n=2, temperature=0.8, seed=7, ignore_eos=True)
    with LLM(str(tiny_checkpoint)) as llm:
        want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    with LLM(str(tiny_checkpoint), speculative_config=ngram(adaptive=False)) as llm:
        assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)] == want
        assert llm.engine.blocks.num_hit_blocks > 0
        assert_spec_free(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_equals_no_speculation_and_ignores_the_batch(tiny_checkpoint, method):
    config = ngram(adaptive=False) if method == "ngram" else draft(tiny_checkpoint, adaptive=False)
    params = [SamplingParams(max_tokens=m, temperature=t, top_k=k, seed=s, ignore_eos=True, repetition_penalty=r)
              for m, t, k, s, r in zip(MAX_TOKENS, [1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 0.5], [0, 0, 40, 0, 5, 0, 0],
                                       range(7), [1.0, 1.0, 1.0, 1.2, 1.0, 1.0, 1.0], strict=True)]
    with LLM(str(tiny_checkpoint)) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(tiny_checkpoint), speculative_config=config) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        assert llm.generate([PROMPTS[3]], params[3])[0].token_ids == want[3]  # alone
        assert_spec_free(llm)


def _chi_square_bound(df: int) -> float:
    """The chi-square value a fit exceeds with probability ~1e-4 (Wilson-Hilferty)."""
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_keep_the_target_distribution(checkpoint_factory):
    """A 64-id model: the second token's empirical distribution over many seeds (drafted by the
    n-gram lookup, accepted or rejected) against its exact marginal from the plain forward."""
    path = checkpoint_factory(vocab_size=64, initializer_range=0.3)
    prompt = list(range(64)) + [3, 4]  # every token occurs earlier: each position after the first is drafted
    runs = 500
    with LLM(str(path), speculative_config=ngram(adaptive=False), max_num_seqs=runs) as llm:
        params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s) for s in range(runs)]
        outs = llm.generate([prompt] * runs, params)
        assert sum(o.metrics.num_draft_tokens for o in outs) >= runs
        assert 0 < sum(o.metrics.num_accepted_tokens for o in outs) < runs  # drafts both accepted and rejected
    ref = hf_model(path)
    with torch.no_grad():
        first = ref(torch.tensor([prompt])).logits[0, -1].softmax(-1).double()  # [64]
        second = ref(torch.tensor([prompt + [t] for t in range(64)])).logits[:, -1].softmax(-1).double()
    marginal = first @ second  # p(token 2) = sum over token 1
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=64).double()
    expected = marginal * runs
    bins = expected >= 5
    observed, expect = torch.cat([counts[bins], counts[~bins].sum()[None]]), torch.cat(
        [expected[bins], expected[~bins].sum()[None]])
    chi2 = float(((observed - expect) ** 2 / expect.clamp(min=1e-9)).sum())
    assert chi2 < _chi_square_bound(len(observed) - 1), chi2


def test_stop_strings_and_max_tokens_are_never_passed(tiny_checkpoint):
    with LLM(str(tiny_checkpoint)) as llm:
        full = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 :][:3]
    with LLM(str(tiny_checkpoint), speculative_config=ngram(adaptive=False)) as llm:
        for m in (1, 2, 5, 13):
            out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=m, ignore_eos=True))[0]
            assert out.token_ids == full.token_ids[:m]
        params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
        out = llm.generate([PROMPTS[0]], params)[0]
        assert out.finish_reason == "stop" and stop not in out.text and full.text.startswith(out.text)
        stop_id = full.token_ids[7]
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, stop_token_ids=[stop_id]))[0]
        assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
        assert_spec_free(llm)


def test_stream_equals_generate(tiny_checkpoint):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with LLM(str(tiny_checkpoint), speculative_config=ngram()) as llm:
        text = llm.generate([PROMPTS[0]], params)[0].text
        assert "".join(llm.stream(PROMPTS[0], params)) == text
        assert_spec_free(llm)


def test_async_engine_metrics(tiny_checkpoint):
    with AsyncLLM(str(tiny_checkpoint), speculative_config=ngram(adaptive=False)) as llm:
        out = llm.submit(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True)).result()
        for _ in range(200):  # the engine thread counts a finished request just after handing it out
            m = llm.metrics()
            if m.requests_finished:
                break
            time.sleep(0.01)
    assert m.spec_draft_tokens_total == out.metrics.num_draft_tokens > 0
    assert m.spec_accepted_tokens_total == out.metrics.num_accepted_tokens
    assert m.generation_tokens_total == 30
    text = m.to_prometheus()
    assert "minigpt_spec_acceptance_rate" in text and "minigpt_spec_mean_accepted_tokens" in text


def test_ngram_lookup():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 4, 1, 2], 3, 1, 4) == [3, 4, 1]  # the latest "1 2" with 3 after it
    assert ngram_draft([1, 2, 3, 1, 2], 3, 1, 4) == [3, 1, 2]
    assert ngram_draft([7, 7, 7], 4, 1, 4) == [7]
    assert ngram_draft([1, 2, 3], 2, 1, 4) == []
    assert ngram_draft([5, 1, 2, 6, 2], 2, 2, 4) == []  # only a 1-gram matches
    assert ngram_draft([5, 1, 2, 6, 2], 2, 1, 4) == [6, 2]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, r"\['model'\]"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "min"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
        ("ngram", "dict"),
    ],
)
def test_bad_configs_are_refused_clearly(config, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=config)


def test_draft_with_another_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    other = shutil.copytree(tiny_checkpoint, tmp_path / "other")
    (other / "added_tokens.json").write_text(json.dumps({"<|pad|>": 50257}))
    with pytest.raises(ValueError, match="different tokenizer"):
        LLM(str(tiny_checkpoint), speculative_config=draft(other))


def test_cli_flag(tiny_checkpoint, capsys):
    args = ["--model", str(tiny_checkpoint), "--prompt", "Hello", "--max-new-tokens", "8", "--ignore-eos", "--quiet"]
    main(args)
    plain_out = capsys.readouterr().out
    main(args + ["--speculative-config", json.dumps(ngram())])
    assert capsys.readouterr().out == plain_out
    with pytest.raises(SystemExit):
        main(args + ["--speculative-config", "{not json"])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "JSON" in err


def test_beam_search_is_refused_with_speculation(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), speculative_config=ngram()) as llm:
        with pytest.raises(ValueError, match="beam search does not run with speculative_config"):
            llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=4))
        assert_spec_free(llm)


def test_structured_outputs_decode_without_drafts_and_equal_no_speculation(tiny_checkpoint):
    """A constrained sequence drafts nothing (its grammar takes one token a step); the unconstrained ones
    beside it still speculate, and every output equals the one without speculation."""
    pytest.importorskip("llguidance")
    so = StructuredOutputsParams(regex=r"(ab|cd){3,12}")
    params = [SamplingParams(max_tokens=24, structured_outputs=so, temperature=0.0),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)]
    prompts = [PROMPTS[0], PROMPTS[0]]
    with LLM(str(tiny_checkpoint)) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(tiny_checkpoint), speculative_config=ngram(adaptive=False)) as llm:
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        assert outs[0].metrics.num_draft_tokens == 0 < outs[1].metrics.num_draft_tokens
        assert re.fullmatch(r"(ab|cd){3,12}", outs[0].text)
        assert llm.engine.num_generated_tokens == sum(len(o.token_ids) for o in outs)  # verified drafts counted
        assert_spec_free(llm)


@pytest.mark.slow
def test_compiled_mode_verifies_eagerly_and_equals_transformers(tiny_checkpoint):
    """compile=True: plain decodes run compiled, verification steps (prompt-like segments with a cached
    context) eagerly; the tokens are transformers' greedy ones."""
    ref = hf_model(tiny_checkpoint)
    with LLM(str(tiny_checkpoint), compile=True, block_size=8, speculative_config=ngram()) as llm:
        outs = _greedy(llm)
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
        assert_spec_free(llm)
    for prompt, m, out in zip(PROMPTS, MAX_TOKENS, outs, strict=True):
        assert out.token_ids == hf_greedy(ref, prompt, m)


def test_server_with_speculation_equals_plain_and_reports_acceptance(tiny_checkpoint):
    httpx = pytest.importorskip("httpx")
    from test_server import MODEL, run_server

    from minigpt.server.app import build_app

    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with (AsyncLLM(str(tiny_checkpoint), speculative_config=ngram(adaptive=False)) as llm,
          run_server(build_app(llm, MODEL)) as url):
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert llm.engine.kv_cache_info()["blocks_in_use"] == 0
    with LLM(str(tiny_checkpoint)) as plain:
        assert got == plain.generate([PROMPTS[0]], SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    accepted = [line for line in metrics.splitlines() if line.startswith("minigpt_spec_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_draft_tokens_go_to_their_own_sequences(tiny_checkpoint):
    """One mirror with a single token to compute (its draft was rejected) and one catching up on a whole
    prompt draft in the same forward, whose rows the runner lays out catch-ups first: each sequence gets
    the draft model's greedy token for its own context."""
    ref = hf_model(tiny_checkpoint)

    def greedy_next(ids: list[int]) -> int:
        with torch.no_grad():
            return int(ref(torch.tensor([ids])).logits[0, -1].argmax())

    with LLM(str(tiny_checkpoint), speculative_config=draft(tiny_checkpoint, k=1, adaptive=False)) as llm:
        engine = llm.engine
        proposer = engine.speculator.draft_model
        a, b = (engine.make_request(p, SamplingParams(max_tokens=8)).seqs[0] for p in (PROMPTS[2], PROMPTS[3]))
        (first,) = proposer.propose([a], [1])
        a.token_ids.append((first[0] + 1) % 50)  # the target kept another token: a's mirror has one to compute
        assert proposer.propose([a, b], [1, 1]) == [[greedy_next(a.token_ids)], [greedy_next(b.token_ids)]]
        proposer.release(a)
        proposer.release(b)
