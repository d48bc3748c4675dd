"""The server's sampling fields are one list (the Sampled marks in minigpt/server/protocol.py): each is taken by
both endpoints and reaches SamplingParams with its value; use_beam_search refuses the ones it does not read."""

import dataclasses
import re
from pathlib import Path

import pytest

from minigpt import SamplingParams, StructuredOutputsParams
from minigpt.server.chat import ChatCompletionRequest, chat_plan
from minigpt.server.chat_template import ChatTemplate
from minigpt.server.errors import APIError
from minigpt.server.protocol import CompletionRequest, completion_plan, sampled_fields

ROOT = Path(__file__).resolve().parents[1]
# body field -> (a value a client may send, what SamplingParams holds for it); none of them a default
EXAMPLES = {
    "temperature": (0.5, 0.5),
    "top_p": (0.5, 0.5),
    "n": (2, 2),
    "stop": (["x"], ("x",)),
    "seed": (7, 7),
    "presence_penalty": (0.5, 0.5),
    "frequency_penalty": (-0.5, -0.5),
    "logit_bias": ({"5": 10}, {5: 10.0}),
    "top_k": (5, 5),
    "min_p": (0.1, 0.1),
    "repetition_penalty": (1.2, 1.2),
    "ignore_eos": (True, True),
    "stop_token_ids": ([1, 2], (1, 2)),
    "min_tokens": (2, 2),
    "allowed_token_ids": ([1, 2], (1, 2)),
    "structured_outputs": ({"regex": "a+"}, StructuredOutputsParams(regex="a+")),
    "response_format": ({"type": "json_object"}, StructuredOutputsParams(json_object=True)),
    "max_tokens": (5, 5),
    "logprobs": (2, 2),
}
CHAT_SPELLING = {"logprobs": {"logprobs": True, "top_logprobs": 2}}  # chat's logprobs is a flag
NOT_SENT = {"prompt_logprobs"}  # set from logprobs when the body asks for echo
MESSAGES = [{"role": "user", "content": "hi"}]
TEMPLATE = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
MARKS = sampled_fields(CompletionRequest)


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def completion(body: dict) -> SamplingParams:
    return completion_plan(CompletionRequest.model_validate({"prompt": [1, 2], **body})).params


def chat(body: dict) -> SamplingParams:
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
    return chat_plan(request, TEMPLATE, CharTokenizer(), 1024).params


def test_every_sampled_field_has_an_example_and_every_sampling_param_a_field():
    assert set(EXAMPLES) == set(MARKS)
    reached = {mark.param or name for name, mark in MARKS.items()}
    assert reached | NOT_SENT == {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(sampled_fields(ChatCompletionRequest)) <= set(MARKS)  # chat's are completions', passed on


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("endpoint", [completion, chat])
def test_a_sampled_field_reaches_sampling_params_with_its_value(endpoint, name):
    """The field's value lands in its SamplingParams field, and nothing else changes."""
    sent, held = EXAMPLES[name]
    body = CHAT_SPELLING.get(name, {name: sent}) if endpoint is chat else {name: sent}
    params, plain = endpoint(body), endpoint({})
    param = MARKS[name].param or name
    assert getattr(params, param) == held != getattr(plain, param)
    changed = {f.name for f in dataclasses.fields(SamplingParams) if getattr(params, f.name) != getattr(plain, f.name)}
    assert changed == {param}


@pytest.mark.parametrize("name", [name for name, mark in MARKS.items() if mark.default is not None])
def test_a_left_out_field_gets_the_servers_default(name):
    assert getattr(completion({}), MARKS[name].param or name) == MARKS[name].default


@pytest.mark.parametrize("name", [name for name, mark in MARKS.items() if not mark.beam])
def test_beam_search_refuses_each_sampled_field_it_does_not_read(name):
    with pytest.raises(APIError) as refused:
        completion({"use_beam_search": True, name: EXAMPLES[name][0]})
    assert (refused.value.status, refused.value.param) == (400, name)
    assert refused.value.message == f"{name} does not apply to use_beam_search"


def test_beam_search_takes_the_sampled_fields_it_reads():
    read = {"temperature": 0, "n": 2, "ignore_eos": True, "response_format": {"type": "text"}, "max_tokens": 5}
    assert set(read) == {name for name, mark in MARKS.items() if mark.beam}
    params = completion({"use_beam_search": True, **read})
    assert (params.beam_width, params.max_tokens, params.ignore_eos) == (2, 5, True)


def test_the_docs_name_every_sampled_field_and_its_default():
    docs = (ROOT / "docs" / "serving.md").read_text() + (ROOT / "docs" / "structured-output.md").read_text()
    for name, mark in MARKS.items():
        assert f"`{name}`" in docs
        if mark.default is not None:
            assert re.search(rf"`{name}`\s+\(default {mark.default:g}\)", docs), name
