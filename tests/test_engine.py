"""The paged engine: continuous batching, preemption, chunked prefill and prefix caching must
give exactly what transformers' greedy `generate` gives for each request alone (fp32)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minigpt import LLM, BeamSearchParams, SamplingParams
from minigpt.engine.runner import ModelRunner
from minigpt.engine.scheduler import Scheduler

from conftest import assert_all_free, hf_greedy, hf_model, random_prompts


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return hf_model(tiny_checkpoint)


# Lengths around the 16-token block: exactly on a boundary, one past it, one short; and long ones.
LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 60, 100]
MAX_TOKENS = [12, 5, 20, 1, 16, 9, 24, 3, 28, 28]


@pytest.fixture(scope="module")
def expected(reference):
    prompts = random_prompts(LENGTHS)
    return prompts, [hf_greedy(reference, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]


def _run(llm: LLM, prompts) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert [len(o.token_ids) for o in outs] == MAX_TOKENS
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"block_size": 8},
        {"block_size": 32, "enable_prefix_caching": False},
        {"max_num_batched_tokens": 24},  # long prompts prefilled in chunks, mixed with decodes
        {"max_num_batched_tokens": 2},  # one-token prompt chunks of partly computed prompts
        {"max_num_seqs": 3},
        {"kv_cache_tokens": 160},  # far too small for all at once: preemption and recompute
    ],
    ids=["default", "block8", "block32-nocache", "chunked", "chunked-by-1", "few-seqs", "tiny-pool"],
)
@pytest.mark.parametrize("batched_prefill", [False, True], ids=["prompts-one-by-one", "prompts-in-one-call"])
def test_batched_greedy_equals_transformers(tiny_checkpoint, expected, engine_args, batched_prefill):
    """Prompts starting in a step attend one by one (the CPU's way) or in one call under a block-diagonal
    mask (the GPU's way, taken here on the CPU), mixed with chunks of prompts already begun."""
    prompts, want = expected
    with LLM(str(tiny_checkpoint), **engine_args) as llm:
        runner, in_one_call = llm.engine.runner, []
        runner.batched_prefill, prepare = batched_prefill, runner.prepare

        def recording(chunks, decodes=(), ahead=None):
            inputs = prepare(chunks, decodes, ahead)
            in_one_call.append(inputs.meta.num_fresh)
            return inputs

        runner.prepare = recording
        assert _run(llm, prompts) == want
        assert_all_free(llm)
        assert (max(in_one_call) > 1) == batched_prefill


def test_tiny_pool_really_preempts(tiny_checkpoint, expected):
    prompts, want = expected
    with LLM(str(tiny_checkpoint), kv_cache_tokens=160) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS])
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        assert [o.token_ids for o in outs] == want


def test_each_request_alone_equals_batched(tiny_checkpoint, expected):
    prompts, want = expected
    with LLM(str(tiny_checkpoint)) as llm:
        for prompt, m, tokens in zip(prompts, MAX_TOKENS, want, strict=True):
            assert llm.generate([prompt], SamplingParams(max_tokens=m, ignore_eos=True))[0].token_ids == tokens


@pytest.mark.parametrize("batched_prefill", [False, True], ids=["prompts-one-by-one", "prompts-in-one-call"])
@pytest.mark.parametrize("budget", [2048, 3], ids=["default", "one-token-chunks"])
def test_prefix_cache_hits_give_the_same_tokens(tiny_checkpoint, reference, budget, batched_prefill):
    """With a budget of 3 tokens a step, a prompt admitted after a hit is computed in chunks that
    include single tokens of a partly computed prompt: those are prompt positions, not decodes."""
    shared = random_prompts([40], seed=7)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 17], seed=8)] + [shared]
    want = [hf_greedy(reference, p, 10) for p in prompts]
    with LLM(str(tiny_checkpoint), max_num_batched_tokens=budget) as llm:
        llm.engine.runner.batched_prefill = batched_prefill
        first = llm.generate(prompts[:1], SamplingParams(max_tokens=10, ignore_eos=True))
        rest = llm.generate(prompts[1:], SamplingParams(max_tokens=10, ignore_eos=True))
        assert llm.engine.blocks.num_hit_blocks >= 3 * 2  # 40 shared tokens = 2 full blocks of 16
        assert [o.token_ids for o in first + rest] == want
        assert_all_free(llm)


def test_prompt_at_full_context(tiny_checkpoint, reference):
    n_positions = 128
    prompt = random_prompts([n_positions - 8], seed=3)[0]
    with LLM(str(tiny_checkpoint)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(reference, prompt, 8)


def test_default_pool_holds_a_full_context_whatever_the_block_size(tiny_checkpoint, reference):
    """One sequence at a time and 48-token blocks: 128 positions need 3 blocks, not the 2 that fit in 128 tokens."""
    prompt = random_prompts([120], seed=4)[0]
    with LLM(str(tiny_checkpoint), max_num_seqs=1, block_size=48) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert llm.kv_cache_info["num_blocks"] == 3
    assert out.token_ids == hf_greedy(reference, prompt, 8)


def test_text_prompts_and_token_prompts_agree(tiny_checkpoint):
    with LLM(str(tiny_checkpoint)) as llm:
        text = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        ids = llm.generate([llm.tokenizer.encode("Hello, my name is")], SamplingParams(max_tokens=6, ignore_eos=True))
    assert text.prompt_token_ids == ids[0].prompt_token_ids
    assert text.token_ids == ids[0].token_ids
    assert text.text == llm.tokenizer.decode(text.token_ids)


def test_outputs_in_input_order_with_timings(tiny_checkpoint):
    with LLM(str(tiny_checkpoint)) as llm:
        prompts = random_prompts([30, 1, 12])
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 9, 5)])
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [2, 9, 5]
    for o in outs:
        assert o.metrics.time_to_first_token > 0 and o.metrics.time_per_output_token >= 0


def test_pool_is_allocated_once(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), kv_cache_tokens=512) as llm:
        pool = llm.engine.runner.pool.kv
        ptr, shape = pool.data_ptr(), pool.shape
        for seed in range(3):
            llm.generate(random_prompts([5, 40, 70], seed=seed), SamplingParams(max_tokens=20, ignore_eos=True))
        assert llm.engine.runner.pool.kv.data_ptr() == ptr and llm.engine.runner.pool.kv.shape == shape
        assert llm.kv_cache_info["num_tokens"] == 512
        assert_all_free(llm)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([50257], SamplingParams(), "outside the vocabulary"),
        ([-1], SamplingParams(), "outside the vocabulary"),
        ("hi", SamplingParams(max_tokens=200), "exceeds the model's context"),
        ("hi", SamplingParams(logit_bias={5: 1.0, 50257: -2.0}),
         r"SamplingParams\.logit_bias has token id 50257, outside the vocabulary \[0, 50257\)"),
        ("hi", SamplingParams(allowed_token_ids=[1, 60000]), r"SamplingParams\.allowed_token_ids has token id 60000"),
        ("hi", SamplingParams(stop_token_ids=[50257]), r"SamplingParams\.stop_token_ids has token id 50257"),
    ],
)
def test_bad_requests_are_refused_clearly(tiny_checkpoint, prompt, params, match):
    with LLM(str(tiny_checkpoint)) as llm:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], params)
        assert_all_free(llm)
        assert llm.generate(["still works"], SamplingParams(max_tokens=2))[0].token_ids


def test_bytes_are_no_prompt_though_a_sequence_of_ints(tiny_checkpoint):
    with LLM(str(tiny_checkpoint)) as llm:
        for prompts in (b"Hello", [b"Hello"], [bytearray(b"Hi")]):
            with pytest.raises(TypeError, match=r"bytes: \.decode\(\)"):
                llm.generate(prompts, SamplingParams(max_tokens=2))
        assert_all_free(llm)


def test_pool_too_small_for_one_request(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), kv_cache_tokens=32) as llm:
        with pytest.raises(ValueError, match="kv_cache_tokens"):
            llm.generate([[1] * 30], SamplingParams(max_tokens=10))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_half_kv_pool_holds_twice_the_tokens(tiny_checkpoint, dtype):
    memory = 4 * 2**20
    with LLM(str(tiny_checkpoint), dtype=dtype, kv_cache_memory=memory) as same:
        assert same.engine.runner.pool.kv.dtype == getattr(torch, dtype)
        same_tokens = same.engine.runner.pool.num_tokens
    for kv_cache_dtype in ("float16", "bfloat16"):
        with LLM(str(tiny_checkpoint), dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=memory) as half:
            assert half.engine.runner.pool.kv.dtype == getattr(torch, kv_cache_dtype)
            assert half.engine.runner.model.wte.weight.dtype == getattr(torch, dtype)
            assert half.engine.runner.pool.num_tokens == (same_tokens if dtype != "float32" else 2 * same_tokens)
            assert half.generate(["a half pool"], SamplingParams(max_tokens=3))[0].token_ids


def test_kv_cache_dtype_takes_what_dtype_takes(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), kv_cache_dtype=torch.float16) as llm:
        assert llm.engine.runner.pool.kv.dtype == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be None, float32, float16 or bfloat16, got 'int8'"):
        LLM(str(tiny_checkpoint), kv_cache_dtype="int8")


def test_stop_token_and_eos(tiny_checkpoint, reference):
    prompt = random_prompts([10], seed=11)[0]
    tokens = hf_greedy(reference, prompt, 12)
    with LLM(str(tiny_checkpoint)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[tokens[4]]))[0]
        assert out.finish_reason == "stop" and out.token_ids == tokens[: tokens.index(tokens[4]) + 1]
        assert_all_free(llm)


def test_logit_bias_greedy_equals_transformers_sequence_bias(tiny_checkpoint, reference):
    """transformers' sequence_bias on one-token sequences is minigpt's logit_bias; both apply it first, to the
    raw logits, so they agree with a repetition penalty too. -100 on the greedy token takes the next one."""
    prompts = random_prompts([4, 9, 20], seed=3)
    first = [hf_greedy(reference, p, 1)[0] for p in prompts]
    bias = {first[0]: -100.0, first[1]: -100.0, 7: 2.0, 300: 3.0, 4000: -1.0}
    with LLM(str(tiny_checkpoint)) as llm:
        for extra in ({}, {"repetition_penalty": 1.3}):
            outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, logit_bias=bias, **extra))
            for prompt, out in zip(prompts, outs, strict=True):
                ids = torch.tensor([prompt])
                with torch.no_grad():
                    want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                              do_sample=False, eos_token_id=None, pad_token_id=0,
                                              sequence_bias={(t,): b for t, b in bias.items()}, **extra)
                assert out.token_ids == want[0, len(prompt):].tolist()
            assert outs[0].token_ids[0] != first[0] and outs[1].token_ids[0] != first[1]
        forced = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={123: 100.0}))
        assert [o.token_ids for o in forced] == [[123] * 6] * 3
        assert_all_free(llm)


def test_allowed_token_ids_restrict_greedy_and_seeded_samples(tiny_checkpoint):
    allowed = [11, 220, 464, 50256]
    with LLM(str(tiny_checkpoint)) as llm:
        greedy = SamplingParams(max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
        params = [greedy] + [SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.5, seed=s,
                                            allowed_token_ids=allowed, logit_bias={220: 1.0}) for s in range(24)]
        outs = llm.generate(["Hello"] * len(params), params)
        drawn = {t for o in outs for t in o.token_ids}
        assert drawn <= set(allowed) and len(drawn) > 1
        again = llm.generate(["Hello", "another prompt beside them", "Hello"], [params[5], SamplingParams(), params[9]])
        assert [again[0].token_ids, again[2].token_ids] == [outs[5].token_ids, outs[9].token_ids]  # seeded
        assert_all_free(llm)


def test_stop_string_truncates_text(tiny_checkpoint):
    with LLM(str(tiny_checkpoint)) as llm:
        full = llm.generate(["Once upon a time"], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        stop = full.text[5:9]
        assert stop.strip()
        out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0]
        assert out.finish_reason == "stop"
        assert out.text == full.text[: full.text.index(stop)]
        assert stop not in out.text


def test_stream_deltas_join_to_generate_text(tiny_checkpoint):
    with LLM(str(tiny_checkpoint)) as llm:
        params = SamplingParams(max_tokens=25, ignore_eos=True)
        full = llm.generate(["日本語のテキスト 🎉"], params)[0].text
        deltas = list(llm.stream("日本語のテキスト 🎉", params))
        assert "".join(deltas) == full
        assert all("\ufffd" not in d for d in deltas) or "\ufffd" in full
        assert_all_free(llm)


def test_big_vocab_never_samples_past_the_tokenizer(checkpoint_factory):
    path = checkpoint_factory(vocab_size=50304)
    with LLM(str(path)) as llm:
        assert llm.engine.sampler.vocab_limit == 50257
        out = llm.generate(["abc"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
        assert max(out.token_ids) < 50257
        with pytest.raises(ValueError, match=r"token id 50300 is outside the vocabulary \[0, 50257\)"):
            llm.generate([[1, 50300]])  # an embedding row of the padding, no token: it could not be decoded


def test_text_prompt_with_ids_past_a_small_model_vocab_is_refused(checkpoint_factory):
    path = checkpoint_factory(vocab_size=1000)  # GPT-2's tokenizer, a 1000-row embedding
    with LLM(str(path)) as llm:
        with pytest.raises(ValueError, match=r"token id 15496 is outside the vocabulary \[0, 1000\)"):
            llm.generate("Hello world")
        assert llm.generate("!", SamplingParams(max_tokens=2))[0].token_ids  # id 0: fine
        assert_all_free(llm)


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_every_eos_id_of_a_list_ends_generation(tmp_path, tiny_checkpoint, file):
    """As in transformers: generation_config.json's eos ids when it names them, else config.json's."""
    prompt = [5, 6, 7]
    with LLM(str(tiny_checkpoint)) as llm:
        free = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    path = shutil.copytree(tiny_checkpoint, tmp_path / "two_eos")
    if file == "config.json":
        (path / "generation_config.json").unlink()
    config = json.loads((path / file).read_text())
    config["eos_token_id"] = [50256, free[3]]
    (path / file).write_text(json.dumps(config))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        expected = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                           do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    with LLM(str(path)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=8))[0].outputs[0]
    assert out.token_ids == expected == free[: free.index(free[3]) + 1]
    assert out.finish_reason == "stop"


def test_an_eos_a_fine_tune_added_ends_generation_as_in_transformers(tmp_path, checkpoint_factory, caplog):
    """An end-of-turn token added by a fine-tune (added_tokens.json, beside vocab.json + merges.txt) that
    generation_config.json makes the EOS: sampled, decoded and stopped on as transformers does. Without its
    file the tokenizer does not know the id: the engine says generation will never stop on it."""
    path = checkpoint_factory(vocab_size=50258, tie_word_embeddings=False)
    prompt = [5, 6, 7]
    with LLM(str(path)) as llm:
        free = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    path = shutil.copytree(path, tmp_path / "added_eos")
    (path / "added_tokens.json").write_text(json.dumps({"<|end|>": 50257}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 50257}))
    state = load_file(path / "model.safetensors")
    state["lm_head.weight"][50257] = 1.05 * state["lm_head.weight"][free[3]]  # the model ends where it said free[3]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    expected = hf_greedy(hf_model(path), prompt, 4)
    with LLM(str(path)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=8))[0]
        assert out.token_ids == expected == [*free[:3], 50257]
        assert out.finish_reason == "stop"
        assert llm.tokenizer.decode(out.token_ids).endswith("<|end|>")
    (path / "added_tokens.json").unlink()
    with caplog.at_level("WARNING", logger="minigpt"), LLM(str(path)) as llm:
        assert llm.generate([prompt], SamplingParams(max_tokens=8))[0].finish_reason == "length"
    assert "EOS id 50257 is past the 50257 ids the tokenizer and the model share" in caplog.text


def test_close_and_context_manager(tiny_checkpoint):
    a = LLM(str(tiny_checkpoint), kv_cache_tokens=256)
    with LLM(str(tiny_checkpoint), kv_cache_tokens=256) as b:
        x = a.generate(["two engines"], SamplingParams(max_tokens=4))[0].token_ids
        assert b.generate(["two engines"], SamplingParams(max_tokens=4))[0].token_ids == x
    with pytest.raises(RuntimeError, match="closed"):
        b.generate(["x"])
    a.close()
    a.close()


def test_stream_resumed_after_close_says_closed(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kv_cache_tokens=256)
    deltas = llm.stream("abc", SamplingParams(max_tokens=20, ignore_eos=True))
    next(deltas)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(deltas)


def test_num_threads_is_restored_on_close(tiny_checkpoint):
    before = torch.get_num_threads()
    with LLM(str(tiny_checkpoint), kv_cache_tokens=256, num_threads=before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


def test_num_threads_is_restored_when_the_engine_cannot_be_built(tmp_path):
    before = torch.get_num_threads()
    with pytest.raises(Exception):  # noqa: B017 - whichever error a missing checkpoint raises
        LLM(str(tmp_path / "missing"), num_threads=before + 1)
    assert torch.get_num_threads() == before


def test_params_of_the_wrong_type_are_named(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), kv_cache_tokens=256) as llm:
        with pytest.raises(TypeError, match="SamplingParams or a list of them, got dict"):
            llm.generate(["x"], {"max_tokens": 2})
        for params in ({"max_tokens": 2}, {}, BeamSearchParams(beam_width=2, max_tokens=2)):
            with pytest.raises(TypeError, match=f"params must be SamplingParams, got {type(params).__name__}"):
                llm.stream("x", params)
        with pytest.raises(ValueError, match="SamplingParams.n must be 1"):
            llm.stream("x", SamplingParams(max_tokens=2, n=2))
        assert llm.engine.requests == {}  # nothing was queued by the refused streams


def test_a_prompt_that_is_not_unicode_is_refused(tiny_checkpoint):
    """A lone surrogate is no text: no output could echo the prompt."""
    with LLM(str(tiny_checkpoint), kv_cache_tokens=256) as llm:
        with pytest.raises(ValueError, match="prompt 0: prompt is not valid Unicode: U.D800 at character 2"):
            llm.generate(["hi\ud800"], SamplingParams(max_tokens=2))


def test_params_changed_after_construction_are_checked_and_copied(tiny_checkpoint):
    """A field set on a SamplingParams later is checked when it is submitted, and a request keeps the
    values it was submitted with when the caller changes its SamplingParams while it runs."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint), kv_cache_tokens=256) as llm:
        for name, value in [("temperature", float("nan")), ("max_tokens", 0), ("stop", [""])]:
            bad = SamplingParams(max_tokens=4)
            setattr(bad, name, value)
            with pytest.raises(ValueError, match=f"SamplingParams.{name} must be"):
                llm.generate("x", bad)
        four, one = (out.outputs[0].text for out in llm.generate(["x", "x"], [params, SamplingParams(max_tokens=1)]))
        stream = llm.stream("x", params)
        params.max_tokens = 1
        assert "".join(stream) == four != one


def test_unknown_engine_argument(tiny_checkpoint):
    with pytest.raises(TypeError, match="kv_cache_tokenz"):
        LLM(str(tiny_checkpoint), kv_cache_tokenz=4)


@pytest.mark.parametrize("name", ["compile", "enable_prefix_caching"])
def test_switches_take_only_booleans(tiny_checkpoint, name):
    with pytest.raises(ValueError, match=f"{name} must be True or False"):
        LLM(str(tiny_checkpoint), **{name: "no"})


def test_generate_inside_a_stream_loop(tiny_checkpoint):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_checkpoint)) as llm:
        alone = llm.generate(["inner"], params)[0].token_ids
        streamed = ""
        for delta in llm.stream("outer prompt", params):
            streamed += delta
            assert llm.generate(["inner"], params)[0].token_ids == alone
        assert streamed == llm.generate(["outer prompt"], params)[0].text
        assert_all_free(llm)


def test_n_completions_share_the_prompt_blocks(tiny_checkpoint):
    prompt = random_prompts([40], seed=21)[0]  # two full blocks of 16
    params = SamplingParams(max_tokens=6, n=3, temperature=0.8, seed=5, ignore_eos=True)
    with LLM(str(tiny_checkpoint)) as llm:
        out = llm.generate([prompt], params)[0]
        assert llm.engine.blocks.num_hit_blocks == 2 * 2  # the two siblings reuse both full blocks
        assert len(out.outputs) == 3 and all(len(c.token_ids) == 6 for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
        assert_all_free(llm)
    with LLM(str(tiny_checkpoint), enable_prefix_caching=False) as llm:
        again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_seeds_span_int64_and_a_negative_one_draws_as_its_sum_with_2_63(tiny_checkpoint):
    prompt = random_prompts([7], seed=4)[0]

    def draws(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=1.5, seed=seed, ignore_eos=True)
        return llm.generate([prompt], params)[0].token_ids

    with LLM(str(tiny_checkpoint)) as llm:
        assert draws(-1) == draws(2**63 - 1) and draws(-(2**63)) == draws(0)
        assert len({tuple(draws(seed)) for seed in (0, 1, 2**62, -5)}) == 4


def test_last_layer_goes_on_with_the_wanted_rows_only(tiny_checkpoint, reference):
    """Once the last layer has stored its K/V, only rows whose logits are wanted go through its MLP: a
    prompt's last token, none for a chunk that samples nothing, every scored row of a prompt_logprobs
    request. Those logits stay the whole forward's (prompt log-probabilities against transformers)."""
    short, chunked, scored = random_prompts([5, 30, 9], seed=3)
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    scoring = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    with LLM(str(tiny_checkpoint), block_size=8, max_num_batched_tokens=24, enable_prefix_caching=False) as llm:
        rows: list[int] = []
        hook = llm.engine.runner.model.h[-1].mlp.register_forward_hook(lambda mod, args, out: rows.append(len(args[0])))
        outs = llm.generate([short, chunked, scored], [greedy, greedy, scoring])
        hook.remove()
    # step 1: all of `short` and 19 tokens of `chunked`; step 2: the rest of `chunked`, all of `scored`
    # (8 scored rows and its last) and a decode of `short`; then decodes only
    assert rows == [1, 1 + 9 + 1, 3, 2]
    for prompt, out in zip([short, chunked, scored], outs, strict=True):
        assert out.token_ids == hf_greedy(reference, prompt, 3)
    with torch.no_grad():
        want = reference(torch.tensor([scored])).logits[0, :-1].log_softmax(-1)
    got = [entry.logprob for entry in outs[2].prompt_logprobs[1:]]
    torch.testing.assert_close(torch.tensor(got), want[torch.arange(8), torch.tensor(scored[1:])], rtol=0, atol=1e-5)


def test_logprobs_of_generated_tokens_equal_transformers(tiny_checkpoint, reference):
    """`out.logprobs` (the first completion's, as `outputs[0].logprobs`): one entry per generated token,
    the log-probability transformers gives it and its k most likely alternatives, the greedy pick first."""
    prompt = random_prompts([11], seed=5)[0]
    with LLM(str(tiny_checkpoint)) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))[0]
    assert out.logprobs is out.outputs[0].logprobs and len(out.logprobs) == len(out.token_ids) == 6
    with torch.no_grad():
        want = reference(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    got = torch.tensor([entry.logprob for entry in out.logprobs])
    torch.testing.assert_close(got, want[torch.arange(6), torch.tensor(out.token_ids)], rtol=0, atol=1e-5)
    for entry, token, row in zip(out.logprobs, out.token_ids, want, strict=True):
        assert list(entry.top) == row.topk(3).indices.tolist() and next(iter(entry.top)) == token


def test_max_tokens_zero_scores_the_prompt_without_sampling(tiny_checkpoint, reference):
    """`max_tokens=0` with `prompt_logprobs`: the prompt's log-probabilities (transformers' log-softmax),
    nothing generated and no sampling step; scoring requests batch with each other and with generating
    ones, chunked or not, and give their blocks back."""
    prompts = random_prompts([9, 30, 1, 17], seed=11)
    score = SamplingParams(max_tokens=0, prompt_logprobs=1)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    with LLM(str(tiny_checkpoint), block_size=8, max_num_batched_tokens=24) as llm:
        sampled_rows: list[int] = []
        sampler = llm.engine.sampler
        llm.engine.sampler = lambda logits, rows: sampled_rows.append(len(rows)) or sampler(logits, rows)
        outs = llm.generate(prompts, [score, score, score, greedy])
        assert sum(sampled_rows) == 4  # the greedy request's tokens only
        alone = llm.generate(prompts[:3], score)
        assert_all_free(llm)
    for prompt, out in zip(prompts[:3], outs[:3], strict=True):
        assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        if len(prompt) > 1:
            with torch.no_grad():
                want = reference(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
            got = torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]])
            torch.testing.assert_close(got, want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])],
                                       rtol=0, atol=1e-5)
    assert outs[3].token_ids == hf_greedy(reference, prompts[3], 4)
    for a, b in zip(alone, outs[:3], strict=True):  # the same scores batched otherwise (fp32 rounding aside)
        scores = [[e and e.logprob for e in out.prompt_logprobs] for out in (a, b)]
        assert scores[0] == pytest.approx(scores[1], abs=1e-5)


def test_a_scored_prompt_whose_last_chunk_is_one_token_is_not_sampled(tiny_checkpoint):
    """A scoring request's prompt cut by the token budget to a last chunk of one token is still a prompt
    chunk, not a decode: its last position is scored and nothing is drawn."""
    prompt = random_prompts([25], seed=5)[0]
    with LLM(str(tiny_checkpoint), block_size=8, max_num_batched_tokens=24) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
        assert_all_free(llm)
    assert out.token_ids == [] and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == len(prompt) and all(out.prompt_logprobs[1:])


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1, got 0"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_allowed_ids_that_min_tokens_holds_back_are_refused(tiny_checkpoint):
    """Every allowed id an EOS or stop id under min_tokens: nothing could be picked, so the request is
    refused instead of producing ids outside the allowed set."""
    with LLM(str(tiny_checkpoint)) as llm:
        for params in (SamplingParams(max_tokens=3, allowed_token_ids=[50256], min_tokens=2),
                       SamplingParams(max_tokens=3, allowed_token_ids=[42], stop_token_ids=[42], min_tokens=3,
                                      ignore_eos=True)):
            with pytest.raises(ValueError, match="allowed_token_ids holds only stop or EOS ids"):
                llm.generate("hi", params)
        out = llm.generate("hi", SamplingParams(max_tokens=3, allowed_token_ids=[42, 50256], min_tokens=2))[0]
        assert out.token_ids[:2] == [42, 42]
        assert_all_free(llm)


def test_check_context_gives_the_tokens_a_request_may_generate():
    from minigpt.engine.input_processor import check_context

    assert check_context(5, 5, 10) == 5
    assert check_context(5, None, 10) == 5  # the rest of the context
    with pytest.raises(ValueError, match=r"prompt of 5 tokens \+ max_tokens=6 exceeds the model's context of 10"):
        check_context(5, 6, 10)
    with pytest.raises(ValueError, match="a prompt of 10 tokens leaves no room in the model's context of 10"):
        check_context(10, None, 10)


def test_steps_count_every_token_the_outputs_hold(tiny_checkpoint):
    """The tokens each step reports (on_step, num_generated_tokens) add up to the outputs' tokens: sampled and
    greedy completions, stops, a prompt only scored, chunked prompts."""
    prompts = random_prompts([5, 30, 9, 12], seed=8)
    params = [SamplingParams(max_tokens=7, n=2, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=0, prompt_logprobs=1),
              SamplingParams(max_tokens=9, stop_token_ids=[7, 70, 700], temperature=1.2, seed=1)]
    with LLM(str(tiny_checkpoint), max_num_batched_tokens=24) as llm:
        reported: list[int] = []
        llm.engine.on_step = lambda batch, sampled, num_tokens: reported.append(num_tokens)
        outs = llm.generate(prompts, params)
        held = sum(len(c.token_ids) for out in outs for c in out.outputs)
        assert sum(reported) == llm.engine.num_generated_tokens == held > 0


@pytest.mark.parametrize("engine_args", [{}, {"max_num_seqs": 3}, {"kv_cache_tokens": 96, "block_size": 8},
                                         {"max_num_batched_tokens": 20, "block_size": 8}],
                         ids=["default", "admissions", "tiny-pool", "chunked"])
def test_a_step_after_one_token_each_schedules_what_the_loop_over_rows_does(tiny_checkpoint, monkeypatch,
                                                                              engine_args):
    """After a step in which every running sequence took one token, the next decodes them all without a loop over
    rows (growing the tables that need a block): the same batches, tokens and blocks as through the loop, with
    requests finishing and admitted between, prompts chunked, and a pool too small for all (then the loop runs)."""
    prompts = random_prompts([5, 30, 9, 17, 3, 12], seed=6)
    lengths, stops, temperatures = [20, 7, 33, 12, 26, 9], [1, 2, 3, 4, 5, 50256], [0, 1, 0, 1.3, 0, 0.7]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, stop_token_ids=[s], temperature=t, seed=i)
              for i, (m, s, t) in enumerate(zip(lengths, stops, temperatures, strict=True))]

    def record(steps: list, batch) -> None:
        steps.append(([(s.request_id, c) for s, c in batch.chunks],
                      [(s.request_id, list(s.block_table)) for s in batch.decodes],
                      [s.request_id for s in batch.preempted]))

    def run() -> tuple[list, list, int]:
        with LLM(str(tiny_checkpoint), **engine_args) as llm:
            steps: list = []
            llm.engine.on_step = lambda batch, sampled, num_tokens: record(steps, batch)
            outs = [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]
            assert_all_free(llm)
            return outs, steps, llm.engine.blocks.num_hit_blocks

    taken = []
    decode_all = Scheduler._decode_all

    def counted(self, batch) -> bool:
        taken.append(decode_all(self, batch))
        return taken[-1]

    monkeypatch.setattr(Scheduler, "_decode_all", counted)
    steady = run()
    monkeypatch.setattr(Scheduler, "_decode_all", lambda self, batch: False)
    assert steady == run()
    assert taken.count(True) > len(taken) // 2
    if "kv_cache_tokens" in engine_args:
        assert False in taken and any(preempted for _, _, preempted in steady[1])


def _decode_inputs_check(runner: ModelRunner, inputs, ahead) -> None:
    """A decode-only step's inputs as each row's sequence calls for: its next token (its last, or the one drawn
    `ahead`) at the position after the tokens before it, its length, the slot of that position and its table."""
    seqs, bs = runner.decode_rows.seqs, runner.config.block_size
    if ahead is None:
        tokens, lengths = [seq.token_ids[-1] for seq in seqs], [len(seq.token_ids) for seq in seqs]
    else:
        drawn = dict(zip(ahead.seqs, ahead.tokens.tolist(), strict=True))
        tokens, lengths = [drawn[seq] for seq in seqs], [len(seq.token_ids) + 1 for seq in seqs]
    meta = inputs.meta
    assert inputs.input_ids.tolist() == tokens
    assert inputs.positions.tolist() == [n - 1 for n in lengths]
    assert meta.decode_context_lens.tolist() == lengths and meta.decode_context_lens.dtype == torch.int32
    assert meta.slot_mapping.tolist() == [seq.block_table[(n - 1) // bs] * bs + (n - 1) % bs
                                          for seq, n in zip(seqs, lengths, strict=True)]
    tables = meta.decode_block_tables.tolist()
    assert len(tables[0]) == max(len(seq.block_table) for seq in seqs)
    assert all(row[: len(seq.block_table)] == seq.block_table for row, seq in zip(tables, seqs, strict=True))
    assert inputs.logits_indices.tolist() == inputs.sample_rows == list(range(len(seqs)))
    assert inputs.sample_seqs == seqs and not meta.prefills and meta.num_prefill_tokens == 0


@pytest.mark.parametrize("engine_args", [{}, {"max_num_seqs": 3}, {"kv_cache_tokens": 96, "block_size": 8},
                                         {"max_num_batched_tokens": 20, "block_size": 8}, {"overlap": "on"}],
                         ids=["default", "admissions", "tiny-pool", "chunked", "overlap"])
def test_a_step_laid_out_from_the_last_gives_what_its_sequences_call_for(tiny_checkpoint, monkeypatch,
                                                                          engine_args):
    """A decode step after one in which each decode took a token (or drew it ahead) lays itself out from the last
    step's tensors, advanced on the device: each row's token, position, length, slot and table as its sequence
    says, with requests finishing and admitted, tables growing, preemption, chunked prompts, penalties and sampled
    rows; the outputs are those of steps laid out from the sequences."""
    prompts = random_prompts([5, 30, 9, 17, 3, 12, 5], seed=9)
    prompts[-1] = prompts[0]  # the prefix cache shares its block
    lengths, temperatures = [20, 7, 33, 12, 26, 9, 14], [0, 1, 0, 1.3, 0, 0.7, 0]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, stop_token_ids=[i + 1], temperature=t, seed=i,
                             repetition_penalty=1.2 if i == 2 and "overlap" not in engine_args else 1.0)
              for i, (m, t) in enumerate(zip(lengths, temperatures, strict=True))]
    prepare, advance = ModelRunner.prepare, ModelRunner._advance
    advanced, drawn_ahead = [], []

    def through_advance(self, last):
        advanced.append(last)
        return advance(self, last)

    def checked(self, chunks, decodes=(), ahead=None):
        before = len(advanced)
        inputs = prepare(self, chunks, decodes, ahead)
        if len(advanced) > before:
            _decode_inputs_check(self, inputs, ahead)
            drawn_ahead.append(ahead is not None)
        return inputs

    def run() -> list:
        with LLM(str(tiny_checkpoint), **engine_args) as llm:
            outs = [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params)]
            assert_all_free(llm)
            return outs

    monkeypatch.setattr(ModelRunner, "prepare", checked)
    monkeypatch.setattr(ModelRunner, "_advance", through_advance)
    outs = run()
    assert len(advanced) > 10 and any(drawn_ahead) == ("overlap" in engine_args)
    monkeypatch.setattr(ModelRunner, "took_tokens", lambda self, tokens: None)
    monkeypatch.setattr(ModelRunner, "_decoded", property(lambda self: None, lambda self, value: None), raising=False)
    assert outs == run()
