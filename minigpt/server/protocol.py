"""The /v1/completions request as OpenAI (and vLLM's extensions) define it, mapped onto SamplingParams.

Types are checked strictly by pydantic (no "0.5" for a float, no true for a token id); value ranges
are checked once, by SamplingParams, whose errors name the field, so the 400 names it too.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from minigpt.beam.params import BeamSearchParams
from minigpt.engine.request import RequestOutput
from minigpt.sampling import SamplingParams, StructuredOutputsParams, TokenLogprobs
from minigpt.server.errors import APIError, invalid
from minigpt.tokenizer.tokenizer import IncrementalDecoder, Tokenizer

Prompt = str | list[int]
# OpenAI's limit on completions per prompt, and ours on a request's completions (prompts x n): one
# request may not queue thousands of sequences ahead of every other
MAX_N = 128
MAX_CHOICES = 2048
# OpenAI's logit_bias: token ids as strings of digits -> a bias in [-100, 100]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]
Bias = Annotated[float, Field(ge=-100, le=100)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one constraint on the output."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json",
                                                     description="a JSON schema the output validates against")
    regex: str | None = Field(None, description="a regular expression the whole output matches")
    choice: list[str] | None = Field(None, description="the output is exactly one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect) the output parses with")
    json_object: bool | None = Field(None, description="the output is a JSON object")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions take alike, with vLLM's extensions; null means
    the default, as OpenAI clients sometimes send it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[TokenIdKey, Bias] | None = Field(
        None, description="token id (a string of digits) -> bias in [-100, 100], added to that token's logit")
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    allowed_token_ids: list[int] | None = Field(None, description="only these token ids may be generated")
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None


@dataclass(frozen=True)
class EnginePlan:
    """What one request body asks of the engine: a request per prompt with `params`, of whose completions
    the answer shows `n` per prompt. The HTTP endpoints and batch jobs both submit it (minigpt.server.submit)."""

    prompts: list[Prompt]
    params: SamplingParams | BeamSearchParams
    n: int
    structured_param: str = "structured_outputs"  # the field a structured-output constraint came from
    renames: dict[str, str] = field(default_factory=dict)  # completions field -> the body's name for it

    def named(self, err: APIError) -> APIError:
        """`err` naming the fields as the body named them (chat's max_completion_tokens for max_tokens)."""
        return renamed(err, self.renames)


def renamed(err: APIError, renames: dict[str, str]) -> APIError:
    """`err` with each field of `renames` (completions field -> the body's name for it) named as the body names it."""
    for old, new in renames.items():
        err.message = err.message.replace(old, new)
        err.param = new if err.param == old else err.param
    return err


def completion_plan(body: CompletionRequest) -> EnginePlan:
    """The engine requests a /v1/completions body asks for; a 400 for a body the engine cannot run."""
    prompts = body.prompts()
    if body.use_beam_search:  # one beam search per prompt; its n best hypotheses are its choices
        return EnginePlan(prompts, body.beam_search_params(), 1 if body.n is None else body.n)
    params = body.sampling_params()
    return EnginePlan(prompts, params, params.n, body.structured_param)


def completion_body(body: CompletionRequest, plan: EnginePlan, outputs: list[RequestOutput], tokenizer: Tokenizer,
                    model: str, response_id: str) -> dict:
    """The /v1/completions answer to `body` from its engine outputs (one per prompt of `plan`)."""
    outputs = [replace(out, outputs=out.outputs[: plan.n]) for out in outputs]
    choices = [c for i, out in enumerate(outputs)
               for c in completion_choices(out, i * plan.n, bool(body.echo), tokenizer)]
    return {**header("text_completion", model, response_id), "choices": choices, "usage": usage(outputs)}


class CompletionRequest(SamplingFields):
    """OpenAI's completions body."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    use_beam_search: bool | None = Field(None, description="beam search with best_of (else n) beams; n returned")
    length_penalty: float | None = Field(None, description="beam search ranks by logprob / length ** this")
    early_stopping: bool | Literal["never"] | None = None

    def prompts(self) -> list[Prompt]:
        """The prompt(s) as a list of texts or token-id lists, one engine request each."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        per_prompt = max(self.n or 1, self.best_of or 1) if self.use_beam_search else self.n or 1  # beams that run
        choices = len(prompt) * per_prompt
        if choices > MAX_CHOICES:
            what = "prompts x beam width" if self.use_beam_search else "prompts x n"
            raise invalid(f"a request may ask for at most {MAX_CHOICES} completions ({what}), got {choices}",
                          "prompt" if per_prompt == 1 else "best_of" if self.use_beam_search and self.best_of else "n")
        return prompt

    def sampling_params(self) -> SamplingParams:
        """OpenAI defaults (max_tokens 16, temperature 1) where the request leaves a field out."""
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.n is not None and self.n > MAX_N:
            raise invalid(f"n must be at most {MAX_N} (completions per prompt), got {self.n}", "n")
        if self.best_of not in (None, self.n or 1):
            raise invalid("best_of is not supported unless it equals n (or with use_beam_search)", "best_of")
        for name in ("length_penalty", "early_stopping"):
            if getattr(self, name) is not None:
                raise invalid(f"{name} applies only with use_beam_search=true", name)
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream=true", "stream_options")
        if self.stream and self.logprobs is not None and self.echo:
            raise invalid("logprobs with echo are not supported with stream=true", "logprobs")
        top_k = self.top_k if self.top_k != -1 else 0  # vLLM spells "no top-k" as -1
        prompt_logprobs = self.logprobs if self.echo else None
        if self.echo and self.max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # OpenAI's scoring call: the prompt echoed, nothing generated
        given = {
            "max_tokens": 16 if self.max_tokens is None else self.max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": self.top_p,
            "n": self.n,
            "stop": self.stop,
            "seed": self.seed,
            "logprobs": self.logprobs,
            "prompt_logprobs": prompt_logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "allowed_token_ids": self.allowed_token_ids,
            "structured_outputs": self._structured_outputs(),
        }
        try:
            return SamplingParams(**{k: v for k, v in given.items() if v is not None})
        except ValueError as err:
            raise params_error(err, structured_param=self.structured_param) from None

    @property
    def structured_param(self) -> str:
        """The request field a structured-output constraint came from, for errors that name it."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise invalid("give structured_outputs or response_format, not both", "response_format")
        try:
            if self.structured_outputs is not None:
                so = self.structured_outputs
                return StructuredOutputsParams(json=so.json_schema, regex=so.regex, choice=so.choice,
                                               grammar=so.grammar, json_object=bool(so.json_object))
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise invalid('response_format of type "json_schema" needs json_schema.schema', "response_format")
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        except ValueError as err:
            raise invalid(structured_error(err, self.structured_param), self.structured_param) from None

    def beam_search_params(self) -> BeamSearchParams:
        """use_beam_search: beam width best_of (else n), the n best hypotheses returned; the sampling fields
        are refused, and so is streaming."""
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.stream or self.stream_options is not None:
            raise invalid("streaming is not supported with use_beam_search",
                          "stream" if self.stream else "stream_options")
        sampling_only = ("top_p", "stop", "seed", "logprobs", "presence_penalty", "frequency_penalty", "top_k",
                         "min_p", "repetition_penalty", "stop_token_ids", "min_tokens", "logit_bias",
                         "allowed_token_ids", "structured_outputs")
        for name in sampling_only:
            if getattr(self, name) is not None:
                raise invalid(f"{name} does not apply to use_beam_search", name)
        if self.response_format is not None and self.response_format.type != "text":
            raise invalid("response_format does not apply to use_beam_search", "response_format")
        if self.temperature not in (None, 0):
            raise invalid("temperature does not apply to use_beam_search (beam search is greedy)", "temperature")
        n = 1 if self.n is None else self.n
        if n < 1:
            raise invalid(f"n must be >= 1, got {n}", "n")
        width = n if self.best_of is None else self.best_of
        if width < n:
            raise invalid(f"best_of ({width}) must be >= n ({n}): the beam width, of which n are returned", "best_of")
        if width > MAX_N:
            raise invalid(f"the beam width (best_of, else n) must be at most {MAX_N}, got {width}",
                          "best_of" if self.best_of is not None else "n")
        given = {"max_tokens": 16 if self.max_tokens is None else self.max_tokens,
                 "length_penalty": self.length_penalty, "early_stopping": self.early_stopping,
                 "ignore_eos": self.ignore_eos}
        try:
            return BeamSearchParams(beam_width=width, **{k: v for k, v in given.items() if v is not None})
        except ValueError as err:
            raise invalid(str(err).replace("BeamSearchParams.", ""),
                          next((f for f in given if f"BeamSearchParams.{f} " in str(err)), None)) from None


_FIELD = re.compile(r"SamplingParams\.(\w+)")


def params_error(err: ValueError, where: str = "", default: str | None = None,
                 structured_param: str = "structured_outputs") -> APIError:
    """A 400 for an error that names a SamplingParams field (else `default`), naming the request field; a
    StructuredOutputsParams error names `structured_param`, the field the constraint came from."""
    if "StructuredOutputsParams" in str(err):
        return invalid(f"{where}{structured_error(err, structured_param)}", structured_param)
    field = _FIELD.search(str(err))
    param = field.group(1) if field else default
    message = str(err).replace("SamplingParams.", "")
    if param == "prompt_logprobs":  # set from logprobs when echo is on
        param, message = "logprobs", message.replace("prompt_logprobs", "logprobs")
    return invalid(f"{where}{message}", param)


def structured_error(err: ValueError, param: str) -> str:
    """A StructuredOutputsParams error in the words of `param`, the request field the constraint came from
    ("response_format.json_schema.schema is not valid: ...")."""
    text = str(err)
    if param == "response_format":
        text = text.replace("StructuredOutputsParams.json ", "response_format.json_schema.schema ")
    return text.replace("StructuredOutputsParams.", f"{param}.").replace("StructuredOutputsParams", param)


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def header(kind: str, model: str, response_id: str) -> dict:
    """The fields every answer (and every chunk of a stream) opens with; `kind` is OpenAI's `object`."""
    return {"id": response_id, "object": kind, "created": now(), "model": model}


def now() -> int:
    return int(time.time())


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_choices(out: RequestOutput, first_index: int, echo: bool, tokenizer: Tokenizer) -> list[dict]:
    """The choices of one prompt, indexed prompt-major as OpenAI does (prompt i, sample j -> i * n + j)."""
    prompt_text = prompt_as_text(out, tokenizer) if echo else ""
    choices = []
    for c in out.outputs:
        logprobs = None
        if c.logprobs is not None:
            ids, lps = list(c.token_ids), list(c.logprobs)
            if echo:
                ids, lps = out.prompt_token_ids + ids, list(out.prompt_logprobs) + lps
            logprobs = LogprobsWriter(tokenizer).write(ids, lps)
        choices.append(choice(first_index + c.index, prompt_text + c.text, c.finish_reason, logprobs))
    return choices


def prompt_as_text(out: RequestOutput, tokenizer: Tokenizer) -> str:
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


class LogprobsWriter:
    """OpenAI's legacy logprobs object for one choice: tokens, token_logprobs, top_logprobs (the chosen
    token always among them) and text_offset, the character where each token starts in the choice's
    text. A stream writes one object per chunk, and the offsets run on across its chunks."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text_offset = 0
        self._decoder = IncrementalDecoder(tokenizer)

    def write(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            token = token_string(self.tokenizer, token_id)
            tokens.append(token)
            offsets.append(self.text_offset)
            self.text_offset += len(self._decoder.feed(token_id))
            if lp is None:  # a prompt's first token has nothing before it to predict it
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(lp.logprob)
            top = {token_string(self.tokenizer, i): v for i, v in lp.top.items()}
            top.setdefault(token, lp.logprob)
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def token_string(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text; a token that ends inside a UTF-8 character is shown as its bytes, OpenAI's way."""
    raw = tokenizer.decode_bytes([token_id])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
