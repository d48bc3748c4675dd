"""Structured outputs on random-weight checkpoints, sampled at temperature 1 under many seeds: every output
obeys its constraint (a JSON schema validates, a regex fullmatches, a choice is one of the choices, a
grammar parses) and finishes with "stop"; seeded and greedy outputs are reproducible; requests without a
constraint are unchanged by one batched beside them; bad constraints are refused naming the field."""

from __future__ import annotations

import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from minigpt import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from minigpt.engine.seams import Step
from minigpt.sampling.bitmask import allowed_tokens, apply_bitmask, bitmask_words
from minigpt.structured.grammar import MISSING_EXTRA, compiler_for

from conftest import assert_all_free

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", None]},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{3}( (yes|no))?"
CHOICES = ["alpha", "beta gamma", 'a "quoted" one', "日本語", "back\\slash"]
LARK = """start: num " " op " " num
num: /[0-9]{1,3}/
op: "+" | "-" | "*"
"""
SEEDS = 24
PROMPTS = ["Hello, my name is", "{", "The answer is"]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), kv_cache_tokens=8192) as llm:
        yield llm


def sampled(llm: LLM, so: StructuredOutputsParams, max_tokens: int = 100, temperature: float = 1.0, **kwargs) -> list:
    """The completions of every prompt under SEEDS seeds (n samples of one seed each get their own)."""
    params = SamplingParams(n=SEEDS, max_tokens=max_tokens, temperature=temperature, seed=0, structured_outputs=so,
                            **kwargs)
    outs = llm.generate(PROMPTS, params)
    assert_all_free(llm)
    return [c for out in outs for c in out.outputs]


def test_json_schema_outputs_validate(llm):
    for c in sampled(llm, StructuredOutputsParams(json=SCHEMA)):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_is_compact(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
              "required": ["n", "b"], "additionalProperties": False}
    for c in sampled(llm, StructuredOutputsParams(json=schema)):
        assert c.finish_reason == "stop"
        assert c.text == json.dumps(json.loads(c.text), separators=(",", ":"))


def test_regex_outputs_fullmatch(llm):
    for c in sampled(llm, StructuredOutputsParams(regex=REGEX)):
        assert c.finish_reason == "stop"
        assert re.fullmatch(REGEX, c.text), c.text


def test_choice_outputs_are_one_of_the_choices(llm):
    texts = {c.text for c in sampled(llm, StructuredOutputsParams(choice=CHOICES))}
    assert texts <= set(CHOICES) and len(texts) > 1


def test_lark_grammar_outputs_parse(llm):
    for c in sampled(llm, StructuredOutputsParams(grammar=LARK)):
        assert c.finish_reason == "stop"
        assert re.fullmatch(r"[0-9]{1,3} [-+*] [0-9]{1,3}", c.text), c.text


def test_json_object_outputs_parse_as_objects(llm):
    # Random weights would write a string until max_tokens (it ends only on a token holding '"'): near the
    # end of its budget a JSON output takes closing tokens, so every output stops and parses
    outputs = sampled(llm, StructuredOutputsParams(json_object=True))
    for c in outputs:
        assert c.finish_reason == "stop", c.text
        assert isinstance(json.loads(c.text), dict)


UNBOUNDED = {"type": "object", "required": ["tags", "score", "inner"], "properties": {
    "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"},
    "inner": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "boolean"}},
              "required": ["a", "b"]}}}


@pytest.mark.parametrize("max_tokens", [30, 100])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_unbounded_strings_and_numbers_still_finish_valid(llm, max_tokens, temperature):
    """No maxLength, no number bounds, required members after them: strings and numbers of random weights
    are closed in time, greedy or sampled, within even a small max_tokens."""
    for c in sampled(llm, StructuredOutputsParams(json=UNBOUNDED), max_tokens=max_tokens, temperature=temperature):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), UNBOUNDED)


def test_a_short_budget_leaves_the_model_half_of_it_before_closing(llm):
    """/v1/completions' default max_tokens is 16: a string is the model's for the first half, not closed at once."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    a = llm.tokenizer.encode("a")[0]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, logit_bias={a: 30.0}, structured_outputs=(
        StructuredOutputsParams(json=schema))))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 16
    assert "aaaa" in json.loads(out.text)["city"]


@pytest.mark.parametrize("so", [StructuredOutputsParams(choice=["<|endoftext|>"]),
                                StructuredOutputsParams(choice=["a<|endoftext|>", "b<|endoftext|>"]),
                                StructuredOutputsParams(regex=r"(a|b)<\|endoftext\|>"),
                                StructuredOutputsParams(json={"const": "x<|endoftext|>"})])
def test_a_constraint_spelling_a_special_token_writes_its_text(llm, so):
    """"<|endoftext|>" in a constraint is text: its pieces' tokens, never the end-of-text token."""
    for c in sampled(llm, so, max_tokens=20):
        assert c.finish_reason == "stop" and "<|endoftext|>" in c.text, c.text
        assert llm.tokenizer.eos_token_id not in c.token_ids


def test_seeded_and_greedy_outputs_are_reproducible(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    for params in (SamplingParams(max_tokens=60, temperature=1.0, seed=7, structured_outputs=so),
                   SamplingParams(max_tokens=60, structured_outputs=so)):
        first = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
        again = [out.outputs[0].token_ids for out in llm.generate(PROMPTS[::-1], params)][::-1]
        assert first == again


def test_unconstrained_requests_batched_with_constrained_ones_are_unchanged(llm):
    plain = [SamplingParams(max_tokens=24, temperature=1.0, seed=3), SamplingParams(max_tokens=24, logprobs=2)]
    alone = llm.generate(PROMPTS[:2], plain)
    constrained = SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                                 structured_outputs=StructuredOutputsParams(regex=REGEX))
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [plain[0], constrained, plain[1]])
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)
    for a, m in zip(alone, [mixed[0], mixed[2]], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids
        assert (a.outputs[0].logprobs is None) == (m.outputs[0].logprobs is None)
        # a batch's size moves fp32 bits
        for x, y in zip(a.outputs[0].logprobs or [], m.outputs[0].logprobs or [], strict=True):
            assert x.top.keys() == y.top.keys()
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert list(x.top.values()) == pytest.approx(list(y.top.values()), abs=1e-5)


def test_max_tokens_cuts_a_constrained_output_with_length(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(
        json=SCHEMA)))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith('{"name"')
    assert_all_free(llm)


def test_grammar_ends_the_sequence_even_with_ignore_eos(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs=(
        StructuredOutputsParams(choice=["yes", "no"]))))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


@pytest.mark.parametrize(("kwargs", "field"), [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "StructuredOutputsParams.json"),
    ({"json": [1, 2]}, "StructuredOutputsParams.json"),
    ({"regex": ""}, "StructuredOutputsParams.regex"),
    ({"choice": []}, "StructuredOutputsParams.choice"),
    ({"choice": ["a", 1]}, "StructuredOutputsParams.choice"),
    ({"grammar": 5}, "StructuredOutputsParams.grammar"),
    ({"json_object": "yes"}, "json_object"),
])
def test_bad_params_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(("so", "field"), [
    (StructuredOutputsParams(regex="(unclosed"), "StructuredOutputsParams.regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "StructuredOutputsParams.grammar"),
    (StructuredOutputsParams(json={"type": "no-such-type"}), "StructuredOutputsParams.json"),
    (StructuredOutputsParams(json={"$ref": "#/nowhere"}), "StructuredOutputsParams.json"),
    # valid, but past llguidance's limits at the first token: its lexer, its parser's row of items
    (StructuredOutputsParams(regex="a{1000}{1000}"), "StructuredOutputsParams.regex cannot be generated: lexer"),
    (StructuredOutputsParams(grammar="start: " + " | ".join(f'"o{i}"' for i in range(2500))),
     "StructuredOutputsParams.grammar cannot be generated: Parser Error: Current row has"),
    # the first token allowed ("!") fits; "zoo" would not: the bound is on the options
    (StructuredOutputsParams(choice=["!", *(f"zoo {i}" for i in range(2500))]),
     "StructuredOutputsParams.choice has 2501 options; llguidance's parser can generate at most 1999"),
])
def test_invalid_grammars_are_refused_at_submission(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate("x", SamplingParams(structured_outputs=so))
    assert_all_free(llm)


def test_sampling_fields_that_could_leave_no_token_are_refused():
    so = StructuredOutputsParams(choice=["a"])
    with pytest.raises(ValueError, match="SamplingParams.min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=so)
    with pytest.raises(ValueError, match="SamplingParams.allowed_token_ids"):
        SamplingParams(allowed_token_ids=[1], structured_outputs=so)
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_equal_constraints_share_one_compiled_grammar(llm):
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    assert a.key == b.key
    compiler = compiler_for(llm.tokenizer)
    assert compiler.compile(a) is compiler.compile(b)


def test_properties_come_in_their_schema_s_order_whatever_was_compiled_before(llm):
    def schema(*names: str) -> dict:
        return {"type": "object", "properties": {name: {"type": "integer"} for name in names},
                "required": sorted(names), "additionalProperties": False}

    for order in [("b", "a"), ("a", "b"), ("b", "a")]:
        params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema(*order)))
        assert list(json.loads(llm.generate(["X:"], params)[0].text)) == list(order)


def test_missing_extra_names_the_install(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    compiler_for.cache_clear()
    try:
        with pytest.raises(ImportError, match=re.escape("pip install minigpt[structured]")):
            llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    finally:
        compiler_for.cache_clear()
    assert "minigpt[structured]" in MISSING_EXTRA
    assert_all_free(llm)


def test_bitmask_unpacks_bit_j_of_word_i_as_token_32i_plus_j():
    vocab = 50257
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(vocab)), dtype=torch.int32)
    expected = torch.tensor([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(3)])
    assert torch.equal(allowed_tokens(bitmask, vocab), expected.bool())
    logits = torch.randn(3, vocab)
    masked = apply_bitmask(logits, bitmask)
    assert torch.equal(masked[expected.bool()], logits[expected.bool()])
    assert torch.isneginf(masked[~expected.bool()]).all()


def test_step_take_hands_out_each_sequences_rows():
    """Step.take gives the claimed sequences their rows (a drafting one all of its), the rest keep theirs."""
    a, b, c = (SimpleNamespace(draft_token_ids=drafts) for drafts in ([], [7], []))  # rows: a 0, b 1-2, c 3
    step = Step(None, None, None, [a, b, c], [10, 11, 12, 13])
    assert step.take(lambda seq: seq is a) == ([a], [10])
    assert (step.seqs, step.rows) == ([b, c], [11, 12, 13])
    assert step.take(lambda seq: seq is c) == ([c], [13])
    assert (step.seqs, step.rows) == ([b], [11, 12])


def test_a_token_the_grammar_refuses_fails_the_sequence_and_is_no_text(llm, monkeypatch):
    from minigpt.structured.grammar import GrammarState

    monkeypatch.setattr(GrammarState, "advance", lambda self, token_id: False)
    monkeypatch.setattr(GrammarState, "error", property(lambda self: "refused here"))
    engine = llm.engine
    request = engine.make_request(PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=(
        StructuredOutputsParams(regex=REGEX))))
    engine.add(request)
    while not request.finished:
        engine.step()
    seq = request.seqs[0]
    assert seq.finish_reason == "error" and len(seq.output_token_ids) == 1 and seq.text == ""
    assert seq.error == (f"token {seq.output_token_ids[0]} does not fit the structured output's grammar: "
                         "refused here")
    assert not any(getattr(p, "states", None) for p in engine.postprocessors)  # its state went with it
    assert_all_free(llm)


def test_postprocessors_run_in_any_order(llm):
    """Beams taken out and grammars masked in one step give the same tokens in either order of the two."""
    engine = llm.engine

    def run() -> list:
        requests = [engine.make_request("Hello", BeamSearchParams(beam_width=3, max_tokens=6)),  # rows first
                    engine.make_request("The answer is", SamplingParams(
                        n=3, max_tokens=12, temperature=1.0, seed=5, structured_outputs=StructuredOutputsParams(
                            regex=REGEX)))]
        for request in requests:
            engine.add(request)
        while not all(request.finished for request in requests):
            engine.step()
        return [request.output() for request in requests]

    first = engine.postprocessors[:]
    assert {type(p).__name__ for p in first} == {"BeamPostprocessor", "GrammarPostprocessor"}
    want = run()
    engine.postprocessors.reverse()
    try:
        got = run()
    finally:
        engine.postprocessors[:] = first
    assert [s.token_ids for s in got[0].sequences] == [s.token_ids for s in want[0].sequences]
    assert [c.token_ids for c in got[1].outputs] == [c.token_ids for c in want[1].outputs]
    assert all(re.fullmatch(REGEX, c.text) for c in got[1].outputs)
    assert_all_free(llm)
