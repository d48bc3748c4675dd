"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info) on a real server: ids equal
minigpt's Tokenizer and transformers' on the same checkpoint files, and lm-eval's remote tokenizer
finds what it reads (an eos_token that tokenizes to EOS, a list of tokens)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import MODEL, N_POSITIONS, Served, run_server

from minigpt import AsyncLLM
from minigpt.server.app import build_app
from minigpt.server.tokenization import Tokenization, TokenizeRequest
from minigpt.tokenizer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello, my name is", "日本語のテキスト 🎉", "a<|endoftext|>b", "<|endoftext|>", "  tabs\tand\nlines  ", ""]


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory(n_positions=N_POSITIONS)


@pytest.fixture(scope="module")
def served(checkpoint) -> Iterator[Served]:
    with AsyncLLM(str(checkpoint), kv_cache_tokens=4096) as llm, run_server(build_app(llm, MODEL)) as url:
        yield Served(url, llm)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.GPT2TokenizerFast.from_pretrained(checkpoint)


def post(served: Served, path: str, body) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return httpx.post(f"{served.url}{path}", content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_and_detokenize_agree_with_both_tokenizers(served, checkpoint, hf, text):
    ids = Tokenizer.from_dir(checkpoint).encode(text)
    assert ids == hf(text).input_ids
    got = post(served, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert got == {"count": len(ids), "max_model_len": N_POSITIONS, "tokens": ids,
                   "token_strs": hf.convert_ids_to_tokens(ids)}
    assert post(served, "/tokenize", {"prompt": text}).json() == {"count": len(ids), "max_model_len": N_POSITIONS,
                                                                    "tokens": ids}
    back = post(served, "/detokenize", {"tokens": ids}).json()
    assert back == {"prompt": text} and back["prompt"] == hf.decode(ids)


def test_detokenize_replaces_a_cut_character(served, hf):
    ids = hf("🎉").input_ids[:1]  # the emoji's first bytes only
    assert post(served, "/detokenize", {"tokens": ids}).json() == {"prompt": hf.decode(ids)}


def test_tokenizer_info_is_what_lm_eval_reads(served):
    """lm-eval (lm_eval/utils.py: check_remote_tokenizer_support, RemoteTokenizer) uses the remote tokenizer
    when /tokenizer_info has eos_token and /tokenize returns tokens; EOS's id is eos_token's first token."""
    info = httpx.get(f"{served.url}/tokenizer_info").json()
    assert info["eos_token"] == info["bos_token"] == "<|endoftext|>" and info["pad_token"] is None
    assert info["tokenizer_class"] == "GPT2Tokenizer" and info["model_max_length"] == N_POSITIONS
    assert info["add_bos_token"] is False
    tokens = post(served, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert tokens == [served.llm.tokenizer.eos_token_id]


def test_add_special_tokens_with_a_bos_tokenizer(checkpoint, tmp_path):
    """A checkpoint whose tokenizer_config.json sets add_bos_token: the BOS id comes first unless
    add_special_tokens is false, as with transformers."""
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(checkpoint / name, tmp_path / name)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<|endoftext|>"}))
    hf = transformers.GPT2Tokenizer.from_pretrained(tmp_path)
    tokenization = Tokenization(Tokenizer.from_dir(tmp_path), MODEL, N_POSITIONS)
    for add in (True, False):
        got = tokenization.tokenize(TokenizeRequest(prompt="Hello there", add_special_tokens=add))["tokens"]
        assert got == hf("Hello there", add_special_tokens=add).input_ids
    assert got != tokenization.tokenize(TokenizeRequest(prompt="Hello there"))["tokens"]
    assert tokenization.tokenizer_info()["add_bos_token"] is True


@pytest.mark.parametrize(("path", "body", "status", "param", "says"), [
    ("/tokenize", '{"prompt": "hi",', 400, None, "not valid JSON"),
    ("/tokenize", "[1]", 400, None, "JSON object"),
    ("/tokenize", {}, 400, "prompt", "required"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "string"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt", "string"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens", "boolean"),
    ("/tokenize", {"prompt": "hi", "max_tokens": 3}, 400, "max_tokens", "unknown field"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "--chat-template FILE"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "not both"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("/detokenize", {}, 400, "tokens", "required"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens", "list"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens", "integer"),
    ("/detokenize", {"tokens": [1, 50257]}, 400, "tokens", "50257 is outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "-1 is outside the vocabulary"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model", "gpt-4"),
])
def test_bad_requests_get_openai_errors(served, path, body, status, param, says):
    response = post(served, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"


def test_openapi_schema_describes_the_request_fields(served):
    schema = httpx.get(f"{served.url}/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith(f"/{model}")
    assert set(components["TokenizeRequest"]["properties"]) == {
        "model", "prompt", "messages", "add_generation_prompt", "chat_template_kwargs", "add_special_tokens",
        "return_token_strs"}
    assert set(components["DetokenizeRequest"]["properties"]) == {"model", "tokens"}
    assert "get" in schema["paths"]["/tokenizer_info"]


def test_api_key_guards_the_tokenizer_endpoints(served):
    with run_server(build_app(served.llm, MODEL, api_key="sesame")) as url:
        auth = {"Authorization": "Bearer sesame"}
        assert httpx.get(f"{url}/tokenizer_info").status_code == 401
        assert httpx.post(f"{url}/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(f"{url}/tokenizer_info", headers=auth).status_code == 200
        assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}, headers=auth).json() == {"prompt": '"'}
