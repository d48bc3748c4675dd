"""/v1/chat/completions: templates render as transformers' apply_chat_template renders them, the endpoint
answers the official openai client (streaming and not) with what LLM.generate makes of the rendered
prompt, and a model without a template gets a 400 that says how to give one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_server import MODEL, N_POSITIONS, Served, generate, run_server, streamed_chunks, wait_idle

from minigpt import LLM, AsyncLLM
from minigpt.server.app import build_app
from minigpt.server.chat_template import ChatTemplate, ChatTemplateError

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-2's shape: roles must alternate, the system prompt folds into the first user turn, BOS/EOS variables
ALTERNATING = """{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}
{% else %}
    {% set system = none %}{% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + ((system + '\n\n') if loop.first and system else '') + message['content'] | trim
           + ' [/INST]' }}
    {% else %}
        {{ ' ' + message['content'] | trim + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""
# tojson (no HTML escaping), namespace, loop controls, a {% generation %} block, whitespace control
FEATURES = """{%- set ns = namespace(users=0) -%}
{%- for message in messages -%}
    {%- if message.role == 'tool' %}{% continue %}{% endif -%}
    {%- if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
<{{ message.role }} n={{ ns.users }}>{{ message | tojson }}
    {%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% endif %}
{% endfor -%}
{%- if add_generation_prompt -%}<assistant>{%- endif -%}"""
TEMPLATES = {"chatml": CHATML, "alternating": ALTERNATING, "features": FEATURES}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief & <polite>."}, {"role": "user", "content": "日本語 🎉 \"quoted\""},
     {"role": "assistant", "content": "  Sure.  "}, {"role": "user", "content": "Again?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|endoftext|>x"},
     {"role": "tool", "content": "skipped"}, {"role": "user", "content": "x\ty"}],
]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory(n_positions=N_POSITIONS)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.GPT2TokenizerFast.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint) -> Iterator[LLM]:
    with LLM(str(checkpoint)) as llm:
        yield llm


@pytest.fixture(scope="module")
def engine(checkpoint) -> Iterator[AsyncLLM]:
    with AsyncLLM(str(checkpoint), kv_cache_tokens=8192) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(engine) -> Iterator[Served]:
    with run_server(build_app(engine, MODEL, chat_template=ChatTemplate(CHATML))) as url:
        yield Served(url, engine)


@pytest.fixture(scope="module")
def untemplated(engine) -> Iterator[Served]:
    with run_server(build_app(engine, MODEL)) as url:
        yield Served(url, engine)


# -- rendering, equal to transformers ---------------------------------------------------------------


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_apply_chat_template(hf, name, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    hf.chat_template = TEMPLATES[name]
    try:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as err:  # the template's raise_exception: ours must refuse the same conversation
        with pytest.raises(ChatTemplateError, match="must alternate"):
            ChatTemplate(TEMPLATES[name]).render(messages, add_generation_prompt)
        assert "must alternate" in str(err)
        return
    assert ChatTemplate(TEMPLATES[name]).render(messages, add_generation_prompt) == want


def test_template_comes_from_the_checkpoint_or_a_file(checkpoint, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert ChatTemplate.for_checkpoint(plain) is None  # GPT-2 ships none
    config = tmp_path / "config"
    config.mkdir()
    (config / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    template = ChatTemplate.for_checkpoint(config)
    assert template.source == CHATML and template.special_tokens["eos_token"] == "</s>"
    (config / "chat_template.jinja").write_text(FEATURES)  # transformers' own file wins over the config's
    assert ChatTemplate.for_checkpoint(config).source == FEATURES
    file = tmp_path / "t.jinja"
    file.write_text(ALTERNATING)
    assert ChatTemplate.for_checkpoint(config, file).source == ALTERNATING
    with pytest.raises(ValueError, match="not valid Jinja"):
        ChatTemplate("{% for %}")


# -- the endpoint -----------------------------------------------------------------------------------


def rendered_ids(reference: LLM, messages: list[dict]) -> list[int]:
    return reference.tokenizer.encode(ChatTemplate(CHATML).render(messages), add_special_tokens=False)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def test_chat_equals_generate_on_the_rendered_prompt(served, reference):
    response = served.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=12,
                                                       temperature=0)
    want = generate(reference, rendered_ids(reference, MESSAGES), max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)
    assert response.usage.completion_tokens == len(want.token_ids)
    wait_idle(served.llm)


def test_streamed_chat_joins_to_the_same_text(served, reference):
    want = generate(reference, rendered_ids(reference, MESSAGES), max_tokens=10, temperature=0, ignore_eos=True)
    stream = served.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    wait_idle(served.llm)


def test_streamed_chat_with_include_usage_carries_usage_null_until_the_last(served):
    body = {"messages": MESSAGES, "max_tokens": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    chunks = streamed_chunks(f"{served.url}/v1/chat/completions", body)
    assert [chunk["usage"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["choices"] == []
    wait_idle(served.llm)


def test_n_logprobs_and_stop(served, reference):
    prompt = rendered_ids(reference, MESSAGES)
    response = served.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=3,
                                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in response.choices] == [0, 1]
    want = generate(reference, prompt, max_tokens=6, n=2, seed=3, logprobs=2, temperature=1.0)
    for choice, out in zip(response.choices, want.outputs, strict=True):
        assert choice.message.content == out.text
        content = choice.logprobs.content
        assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-4)
        assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
                   for e in content)
        assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == out.text
    greedy = generate(reference, prompt, max_tokens=20, temperature=0, ignore_eos=True)
    stop = greedy.text[len(greedy.text) // 2:][:2]
    if stop:
        stopped = served.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                                          temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        assert stopped.choices[0].message.content == greedy.text[:greedy.text.index(stop)]
    wait_idle(served.llm)


def test_streamed_choices_and_logprobs_join_to_the_unstreamed_ones(served):
    params = dict(model=MODEL, messages=MESSAGES, max_tokens=8, n=2, seed=5, logprobs=True, top_logprobs=1)
    whole = served.client().chat.completions.create(**params)
    chunks = list(served.client().chat.completions.create(**params, stream=True))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-5)
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    wait_idle(served.llm)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "logprobs=true"),
    ({"messages": [{"role": "user"}]}, "messages", "has no attribute 'content'"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "max_completion_tokens": 1}, "max_tokens",
     "not both"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature", "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, "messages",
     " tokens + max_completion_tokens=5000 exceeds the model's context"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", "messages[0].content: Input should be a valid string"
     " or a valid list"),
    ({"messages": [{"content": "x"}]}, "messages", "messages[0].role is required"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages", "messages[0].content[0].text is"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens must be"),
    ({"messages": [{"role": "user", "content": " hi" * 1100}]}, "messages", "leaves no room in the model's context"),
])
def test_bad_chat_requests_get_openai_errors(served, body, param, says):
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error["param"] == param and says in error["message"], error


def test_template_variables_do_not_replace_the_request_fields(served, reference):
    """chat_template_kwargs add variables; messages and add_generation_prompt stay the request's."""
    import httpx

    body = {"messages": MESSAGES, "max_tokens": 1, "add_generation_prompt": False,
            "chat_template_kwargs": {"messages": 1, "add_generation_prompt": True, "eos_token": "x"}}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    want = ChatTemplate(CHATML).render(MESSAGES, add_generation_prompt=False)
    assert response.json()["usage"]["prompt_tokens"] == len(reference.tokenizer.encode(want))


def test_openapi_schema_describes_the_chat_fields(served):
    import httpx

    from minigpt.server.protocol import CompletionRequest, SamplingFields

    schema = httpx.get(f"{served.url}/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ChatCompletionRequest")
    fields = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    shared = set(SamplingFields.model_fields)
    assert {"messages", "max_completion_tokens", "max_tokens", "logprobs", "top_logprobs"} | shared <= set(fields)
    assert shared <= set(CompletionRequest.model_fields)  # each passed on under its own name


def test_tokenize_renders_the_chat_form(served, reference):
    """vLLM's chat form of /tokenize: the prompt ids /v1/chat/completions generates from."""
    import httpx

    got = httpx.post(f"{served.url}/tokenize", json={"messages": MESSAGES}).json()
    assert got["tokens"] == rendered_ids(reference, MESSAGES) and got["count"] == len(got["tokens"])
    bare = httpx.post(f"{served.url}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    want = ChatTemplate(CHATML).render(MESSAGES, add_generation_prompt=False)
    assert bare["tokens"] == reference.tokenizer.encode(want, add_special_tokens=False)


def test_template_errors_are_400s(served):
    alternating = ChatTemplate(ALTERNATING)
    with run_server(build_app(served.llm, MODEL, chat_template=alternating)) as url:
        client = Served(url, served.llm).client()
        with pytest.raises(openai.BadRequestError, match="must alternate") as refused:
            client.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "x"}])
        assert refused.value.body["param"] == "messages"


def test_no_template_gets_a_400_that_says_how_to_give_one(untemplated):
    with pytest.raises(openai.BadRequestError) as refused:
        untemplated.client().chat.completions.create(model=MODEL, messages=MESSAGES)
    assert refused.value.status_code == 400
    assert "--chat-template FILE" in refused.value.body["message"]
    assert refused.value.body["code"] == "chat_template_missing"


# -- the command line -------------------------------------------------------------------------------


def test_cli_serves_chat_with_a_template_file(checkpoint, tmp_path):
    from test_server_shutdown import start_server

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    proc, url = start_server(checkpoint, "--chat-template", str(template))
    try:
        client = Served(url, None).client()
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
        assert response.usage.completion_tokens == 3 or response.choices[0].finish_reason == "stop"
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize(("write", "says"), [(None, "No such file"), ("{% if %}", "not valid Jinja")])
def test_cli_refuses_a_bad_template_before_loading(checkpoint, tmp_path, capsys, write, says):
    from test_server import free_port

    from minigpt import serve

    template = tmp_path / "t.jinja"
    if write is not None:
        template.write_text(write)
    assert serve.main(["--model", str(checkpoint), "--port", str(free_port()), "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minigpt.serve: error:") and says in err[0], err


def test_response_format_constrains_chat(served):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = served.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, n=3, seed=1, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert set(json.loads(choice.message.content)) == {"ok"}
    refused = served.client().with_options(max_retries=0).chat.completions
    with pytest.raises(openai.BadRequestError) as err:
        refused.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                       extra_body={"structured_outputs": {"regex": "("}})
    assert err.value.body["param"] == "structured_outputs"
    wait_idle(served.llm)


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"divisor": 0}, "ZeroDivisionError"),
    ({"repeat": 10**20}, "OverflowError"),
    ({"repeat": "many"}, "TypeError"),
])
def test_whatever_the_template_variables_make_it_raise_is_a_400(served, kwargs, says):
    """On chat and on /tokenize's chat form alike, never a 500."""
    template = ChatTemplate("{% for i in range(repeat | default(1)) %}{{ 100 // (divisor | default(1)) }}{% endfor %}"
                            "{{ messages[0]['content'] }}")
    with run_server(build_app(served.llm, MODEL, chat_template=template)) as url:
        body = {"messages": MESSAGES, "chat_template_kwargs": kwargs}
        # one token: unbounded, random weights write to the context's end, past httpx's 5 s on a slow machine
        plain = {**body, "chat_template_kwargs": {}, "max_tokens": 1}
        assert httpx.post(f"{url}/v1/chat/completions", json=plain).status_code == 200
        for path in ("/v1/chat/completions", "/tokenize"):
            response = httpx.post(f"{url}{path}", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages" and says in error["message"], error
