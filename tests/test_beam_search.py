"""Beam search: the hypotheses of transformers' beam search, in its order, with beams sharing blocks."""

from __future__ import annotations

import json

import pytest
import torch

from minigpt import LLM, BeamSearchParams, SamplingParams

from conftest import assert_all_free, hf_model, random_prompts, write_hf_checkpoint

VOCAB = 32
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory):
    """A 32-id vocabulary whose EOS is the model's 5th most likely id on average over random contexts: its
    hypotheses end in EOS at many lengths, some run to max_tokens."""
    path = write_hf_checkpoint(tmp_path_factory.mktemp("beam"), vocab_size=VOCAB)
    contexts = torch.tensor(random_prompts([64] * 8, vocab=VOCAB, seed=5))
    with torch.no_grad():
        mean_probs = hf_model(path)(contexts).logits.softmax(-1).mean((0, 1))
    eos = int(mean_probs.topk(5).indices[-1])
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = config["bos_token_id"] = eos
        (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def ref(eos_checkpoint):
    return hf_model(eos_checkpoint)


@pytest.fixture(scope="module")
def llm(eos_checkpoint):
    with LLM(str(eos_checkpoint), dtype="float32", block_size=4) as llm:
        yield llm


PROMPTS = random_prompts([1, 5, 17, 30], vocab=VOCAB, seed=1)


def hf_beams(ref, prompt: list[int], params: BeamSearchParams) -> list[list[int]]:
    """transformers' num_return_sequences=beam_width hypotheses, best first, without their padding."""
    ids = torch.tensor([prompt])
    eos = {"eos_token_id": None} if params.ignore_eos else {}
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=params.beam_width,
                           num_return_sequences=params.beam_width, length_penalty=params.length_penalty,
                           early_stopping=params.early_stopping, max_new_tokens=params.max_tokens, pad_token_id=0,
                           return_dict_in_generate=True, **eos)
    generated = out.sequences[:, len(prompt):].tolist()
    if params.beam_width == 1:  # greedy search: up to the first EOS
        tokens, eos_id = generated[0], ref.generation_config.eos_token_id
        return [tokens[: tokens.index(eos_id) + 1] if eos_id in tokens and not params.ignore_eos else tokens]
    lengths = (out.beam_indices >= 0).sum(-1).tolist()
    return [tokens[:n] for tokens, n in zip(generated, lengths, strict=True)]


@pytest.mark.parametrize(("beam_width", "length_penalty", "early_stopping"), [
    (1, 1.0, False), (2, 1.0, False), (4, 1.0, False), (4, 0.0, True), (3, 1.0, True),
    (4, 2.0, "never"), (4, 0.0, "never"), (5, -1.0, False),
])
def test_beams_equal_transformers(llm, ref, beam_width, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert [seq.token_ids for seq in out.sequences] == hf_beams(ref, prompt, params)
        scores = [seq.score for seq in out.sequences]
        assert scores == sorted(scores, reverse=True)
        eos = ref.generation_config.eos_token_id
        for seq in out.sequences:
            assert seq.finish_reason == ("stop" if seq.token_ids[-1] == eos else "length")
            assert seq.score == pytest.approx(seq.cumulative_logprob / len(seq.token_ids) ** length_penalty)
    assert_all_free(llm)


def test_hypotheses_end_in_eos_at_many_lengths(llm, ref):
    """The checkpoint above makes the EOS cases of the comparison count."""
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.0))
    stopped = {len(seq.token_ids) for out in outs for seq in out.sequences if seq.finish_reason == "stop"}
    assert len(stopped) >= 3


def test_ignore_eos_equals_transformers(llm, ref):
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True, length_penalty=0.0)
    outs = llm.beam_search(PROMPTS, params)
    eos = ref.generation_config.eos_token_id
    assert any(eos in seq.token_ids for out in outs for seq in out.sequences)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert [seq.token_ids for seq in out.sequences] == hf_beams(ref, prompt, params)
        assert all(seq.finish_reason == "length" and len(seq.token_ids) == MAX_TOKENS for seq in out.sequences)
    assert_all_free(llm)


def test_text_prompt_equals_its_ids(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    by_text = llm.beam_search("1+2=3,(4*5)", params)[0]
    by_ids = llm.beam_search([llm.tokenizer.encode("1+2=3,(4*5)")], params)[0]
    assert by_text.prompt == "1+2=3,(4*5)"
    assert [s.token_ids for s in by_text.sequences] == [s.token_ids for s in by_ids.sequences]
    assert by_text.sequences[0].text == llm.tokenizer.decode(by_text.sequences[0].token_ids)


def test_beams_share_blocks_and_copy_on_write(llm):
    """One 30-token prompt, 4 beams, 4-token blocks: the prompt's blocks once, a partial block copied when the
    beams sharing it diverge, far fewer blocks than 4 separate sequences."""
    held, copies = [], []

    def watch(batch, sampled, num_tokens):
        held.append(llm.kv_cache_info["blocks_in_use"])
        copies.extend(batch.copies)

    llm.engine.on_step = watch
    try:
        llm.beam_search([PROMPTS[3]], BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, ignore_eos=True))
    finally:
        llm.engine.on_step = None
    separate = 4 * -(-(30 + MAX_TOKENS) // 4)
    assert copies
    assert max(held) <= 8 + 4 * (-(-MAX_TOKENS // 4) + 1) < separate
    assert_all_free(llm)


@pytest.mark.parametrize(("kv_cache_tokens", "prefix_caching"), [(48, True), (64, False)])
def test_small_pool_preempts_and_gives_the_same_beams(eos_checkpoint, llm, kv_cache_tokens, prefix_caching):
    """48 tokens hold one 30-token prompt and its 16 tokens, not 4 beams of it: beams are preempted, also
    while they wait for their siblings, and recomputed."""
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.0, ignore_eos=True)
    expected = [[s.token_ids for s in out.sequences] for out in llm.beam_search(PROMPTS, params)]
    with LLM(str(eos_checkpoint), dtype="float32", block_size=4, kv_cache_tokens=kv_cache_tokens,
             enable_prefix_caching=prefix_caching) as small:
        preempted = []
        small.engine.on_step = lambda batch, sampled, num_tokens: preempted.extend(batch.preempted)
        outs = small.beam_search(PROMPTS, params)
        assert preempted
        assert [[s.token_ids for s in out.sequences] for out in outs] == expected
        assert_all_free(small)


def test_beams_batch_with_ordinary_requests(llm):
    """Beam requests and sampled or greedy requests in the same engine steps give what each gives alone."""
    beam_params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS)
    sampling = [SamplingParams(max_tokens=12, temperature=0.8, seed=7), SamplingParams(max_tokens=12)]
    beams_alone = [[s.token_ids for s in out.sequences] for out in llm.beam_search(PROMPTS, beam_params)]
    generated_alone = [out.token_ids for out in llm.generate(PROMPTS[:2], sampling)]
    engine = llm.engine
    groups = [engine.make_request(p, beam_params) for p in PROMPTS]
    requests = [engine.make_request(p, sp) for p, sp in zip(PROMPTS[:2], sampling, strict=True)]
    for request in [groups[0], requests[0], groups[1], groups[2], requests[1], groups[3]]:
        engine.add(request)
    mixed_steps = 0
    while not all(r.finished for r in groups + requests):
        batch_ids = {seq.request_id for seq in engine.step()}
        mixed_steps += bool(batch_ids & {g.request_id for g in groups}) and bool(
            batch_ids & {r.request_id for r in requests})
    assert mixed_steps > 0
    assert [[s.token_ids for s in g.output().sequences] for g in groups] == beams_alone
    assert [r.output().token_ids for r in requests] == generated_alone
    assert_all_free(llm)


def test_abort_returns_every_block(llm):
    engine = llm.engine
    group = engine.make_request(PROMPTS[3], BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS))
    engine.add(group)
    for _ in range(4):
        engine.step()
    assert len(group.seqs) > 1
    engine.abort(group)
    assert not engine.requests
    assert_all_free(llm)


@pytest.mark.parametrize(("field", "value"), [
    ("beam_width", 0), ("beam_width", 2.0), ("max_tokens", 0), ("length_penalty", float("nan")),
    ("length_penalty", "1"), ("early_stopping", "always"), ("early_stopping", None), ("ignore_eos", 1),
    ("beam_width", 1025),
])
def test_bad_params_are_refused(field, value):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field} must be"):
        BeamSearchParams(**{field: value})


def test_bad_requests_are_refused(llm):
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.beam_search([[1], []], BeamSearchParams())
    with pytest.raises(ValueError, match="exceeds the model's context"):
        llm.beam_search([[1]], BeamSearchParams(max_tokens=1000))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([[1]], SamplingParams())
    assert_all_free(llm)


def test_a_width_whose_candidates_outnumber_the_vocabulary_is_refused(checkpoint_factory):
    """Each step ranks 2 x beam_width tokens of every beam (more with several EOS ids): a vocabulary of
    500 takes a width of 250 at most."""
    with LLM(str(checkpoint_factory(vocab_size=500)), kv_cache_tokens=512) as llm:
        vocab = llm.engine.vocab_limit
        per_beam = max(2, 1 + len(llm.engine.eos_token_ids))
        with pytest.raises(ValueError, match=f"beam_width must be at most {vocab // per_beam} "):
            llm.beam_search([[1, 2]], BeamSearchParams(beam_width=vocab // per_beam + 1, max_tokens=2))
        assert_all_free(llm)
        assert len(llm.beam_search([[1, 2]], BeamSearchParams(beam_width=vocab // per_beam,
                                                              max_tokens=2))[0].sequences) == vocab // per_beam


def test_cli_prints_the_best_hypothesis_or_all_as_json(eos_checkpoint, llm, tmp_path, capsys):
    from minigpt.generate import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1+2=3\n(4*5)\n")
    expected = llm.beam_search(["1+2=3", "(4*5)"], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.0))
    argv = ["--model", str(eos_checkpoint), "--prompts-file", str(prompts), "--beam-width", "3", "--max-new-tokens",
            "6", "--length-penalty", "0", "--quiet", "--dtype", "float32"]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [out.prompt + out.sequences[0].text for out in expected]
    assert main([*argv, "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [[s["token_ids"] for s in line["sequences"]] for line in lines] == [
        [s.token_ids for s in out.sequences] for out in expected]


@pytest.mark.parametrize(("args", "message"), [
    (["--beam-width", "0"], "--beam-width must be an int >= 1, got 0"),
    (["--beam-width", "2", "--temperature", "0.7"], "--temperature does not apply to beam search"),
    (["--beam-width", "2", "--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1"),
    (["--length-penalty", "2"], "--length-penalty applies to beam search only (add --beam-width)"),
    (["--early-stopping", "true"], "--early-stopping applies to beam search only (add --beam-width)"),
])
def test_cli_refuses_bad_beam_flags(tiny_checkpoint, capsys, args, message):
    from minigpt.generate import main

    assert main(["--model", str(tiny_checkpoint), "--quiet", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(eos_checkpoint):
    from fastapi.testclient import TestClient

    from minigpt import AsyncLLM
    from minigpt.server.app import build_app

    with AsyncLLM(str(eos_checkpoint), dtype="float32", block_size=4) as engine:
        yield TestClient(build_app(engine, "beam")), engine


def test_server_returns_the_n_best_of_best_of_beams(server, llm):
    client, engine = server
    body = {"prompt": [PROMPTS[1], PROMPTS[2]], "max_tokens": 10, "use_beam_search": True, "n": 2, "best_of": 3,
            "length_penalty": 0.5, "early_stopping": "never"}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5, early_stopping="never")
    expected = llm.beam_search(PROMPTS[1:3], params)
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [
        (s.text, s.finish_reason) for out in expected for s in out.sequences[:2]]
    generated = sum(len(s.token_ids) for out in expected for s in out.sequences[:2])
    assert reply.json()["usage"]["completion_tokens"] == generated
    assert engine.kv_cache_info["blocks_in_use"] == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"stream": True}, "stream"), ({"n": 3, "best_of": 2}, "best_of"), ({"temperature": 0.7}, "temperature"),
    ({"logprobs": 1}, "logprobs"), ({"early_stopping": "always"}, "early_stopping"),
    ({"max_tokens": 0}, "max_tokens"), ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [[1, 2]] * 100, "best_of": 64}, "best_of"),  # 6,400 beams: past the 2,048 a request may run
])
def test_server_refuses_what_beam_search_cannot_do(server, body, param):
    client, _ = server
    reply = client.post("/v1/completions", json={"prompt": [1, 2], "use_beam_search": True, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize("beam_left_out", ["idle", "unscheduled"])
def test_a_failed_step_fails_the_whole_beam_search_and_the_engine_goes_on(tiny_checkpoint, beam_left_out):
    """A step that raises fails its sequences; the beams it did not hold (idle, waiting for their siblings, or
    left out by the token budget) fail with them: every block back, the engine serving the next request."""
    from minigpt import AsyncLLM

    with AsyncLLM(str(tiny_checkpoint), kv_cache_tokens=1024, block_size=16, max_num_batched_tokens=2) as llm:
        engine, run = llm.engine, llm.engine.runner.run
        failed = []

        def flaky(inputs):
            stepping = set(map(id, inputs.sample_seqs))
            beams = [s for s in engine.scheduler.running if s.request_id in engine.requests]
            if beam_left_out == "idle":
                left_out = [s for s in beams if not s.num_uncomputed_tokens]
            else:
                left_out = [s for s in beams if s.num_uncomputed_tokens and id(s) not in stepping]
            if not failed and left_out and inputs.sample_seqs:
                failed.append(True)
                raise RuntimeError("injected failure")
            return run(inputs)

        engine.runner.run = flaky
        handle = llm.submit_beam_search("Hello world, this is", BeamSearchParams(beam_width=3, max_tokens=8))
        out = handle.result(timeout=120)
        assert failed and [c.finish_reason for c in out.outputs] == ["error"]
        assert "injected failure" in handle.error
        engine.runner.run = run
        after = llm.submit("Hello", SamplingParams(max_tokens=4, temperature=0)).result(timeout=120)
        assert after.outputs[0].finish_reason == "length"
        assert not engine.requests and not engine.has_work()
        assert engine.kv_cache_info()["blocks_in_use"] == 0
