"""The request bodies as OpenAI and vLLM's extensions define them, and their plan of engine requests. Types are
checked strictly by pydantic; values once, by the params built from them, whose errors name the body's field."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from minigpt.beam.params import BeamSearchParams
from minigpt.common.errors import Named, ParamError
from minigpt.sampling import SamplingParams, StructuredOutputsParams
from minigpt.server.errors import APIError, invalid

Prompt = str | list[int]
# OpenAI's limit on completions per prompt; ours on a request's (prompts x n), so no request queues thousands
MAX_N = 128
MAX_CHOICES = 2048
# OpenAI's logit_bias: token ids as strings of digits -> a bias in [-100, 100]
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]
Bias = Annotated[float, Field(ge=-100, le=100)]
MAX_TOKENS = 16  # OpenAI's default


@dataclass(frozen=True)
class Sampled:
    """Marks a body field that reaches SamplingParams, under its own name unless `param` gives one: `default`
    where the body leaves it out (None: SamplingParams' own), `convert` from the body's spelling. `beam`:
    use_beam_search reads the field itself; it refuses every other sampled field."""

    default: Any = None
    convert: Callable[[Any], Any] | None = None
    param: str | None = None
    beam: bool = False

    def given(self, sent: Any) -> Any:
        """The SamplingParams value for what a body sent (None: it left the field out)."""
        if sent is None:
            return self.default
        return sent if self.convert is None else self.convert(sent)


@functools.cache
def sampled_fields(body: type[BaseModel]) -> dict[str, Sampled]:
    """The fields of `body` that reach SamplingParams, in the order declared, each with how it gets there."""
    return {name: mark for name, info in body.model_fields.items() for mark in info.metadata
            if isinstance(mark, Sampled)}


def _token_keys(bias: dict[str, float]) -> dict[int, float] | None:
    return {int(k): v for k, v in bias.items()} or None


def _vllm_top_k(top_k: int) -> int:
    return 0 if top_k == -1 else top_k  # vLLM spells "no top-k" as -1


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

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_schema, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=bool(self.json_object))


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

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise invalid('response_format of type "json_schema" needs json_schema.schema', "response_format")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


class SamplingFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share; null is the default, as OpenAI clients send it.
    Those marked Sampled reach SamplingParams (CompletionRequest.sampling_params), the one list of them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: Annotated[float | None, Sampled(default=1.0, beam=True)] = None  # OpenAI's default
    top_p: Annotated[float | None, Sampled()] = None
    n: Annotated[int | None, Sampled(beam=True)] = None
    stop: Annotated[str | list[str] | None, Sampled()] = None
    seed: Annotated[int | None, Sampled()] = None
    presence_penalty: Annotated[float | None, Sampled()] = None
    frequency_penalty: Annotated[float | None, Sampled()] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: Annotated[dict[TokenIdKey, Bias] | None, Sampled(convert=_token_keys), Field(
        description="token id (a string of digits) -> bias in [-100, 100], added to that token's logit")] = None
    user: str | None = None
    # vLLM's extensions
    top_k: Annotated[int | None, Sampled(convert=_vllm_top_k)] = None
    min_p: Annotated[float | None, Sampled()] = None
    repetition_penalty: Annotated[float | None, Sampled()] = None
    ignore_eos: Annotated[bool | None, Sampled(beam=True)] = None
    stop_token_ids: Annotated[list[int] | None, Sampled()] = None
    min_tokens: Annotated[int | None, Sampled()] = None
    allowed_token_ids: Annotated[list[int] | None, Sampled(),
                                 Field(description="only these token ids may be generated")] = None
    structured_outputs: Annotated[StructuredOutputs | None, Sampled(convert=StructuredOutputs.params)] = None
    # OpenAI's spelling of a structured output; not given with structured_outputs (sampling_params checks)
    response_format: Annotated[ResponseFormat | None, Sampled(convert=ResponseFormat.params,
                                                              param="structured_outputs", beam=True)] = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; `content` is text or a list of text parts (joined with newlines, as vLLM does)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        return message


@dataclass(frozen=True)
class FieldNames:
    """A body's names for the fields of the params made from it, so that a refusal names what the client sent."""

    structured: str = "structured_outputs"  # the field a structured-output constraint came from
    renames: Mapping[str, str] = field(default_factory=dict)  # params field -> the body's name for it
    prompt: str = "prompt"  # the body's field the prompts came from (chat: `messages`), a refusal's param

    def refusal(self, err: ParamError, where: str = "") -> APIError:
        """A 400 for `err`, its fields named as the body names them; `where` ("prompt 2: ") goes first."""
        if err.owner == "StructuredOutputsParams":
            return invalid(where + err.worded(self._structured), self.structured)
        param = self.prompt if err.field == "prompt" else self.renames.get(err.field, err.field)
        return invalid(where + err.worded(lambda n: self.renames.get(n.field, n.field) + _setting(n)), param)

    def _structured(self, named: Named) -> str:
        if self.structured == "response_format" and named.field == "json":
            return "response_format.json_schema.schema"
        return ".".join(filter(None, (self.structured, named.field)))


def _setting(named: Named) -> str:
    return "" if named.value is ... else f"={named.value!r}"


@dataclass(frozen=True)
class EnginePlan:
    """A request per prompt with `params`; the answer shows `n` completions per prompt. The HTTP endpoints and
    batch jobs both submit it (minigpt.server.submit)."""

    prompts: list[Prompt]
    params: SamplingParams | BeamSearchParams
    n: int
    names: FieldNames = FieldNames()


def completion_plan(body: CompletionRequest) -> EnginePlan:
    """The engine requests a /v1/completions body asks for; a 400 for a body the engine cannot run."""
    prompts = body.prompts()
    if body.max_tokens == 0 and not body.echo:
        raise invalid("max_tokens=0 scores a prompt only with echo=true (OpenAI's scoring call; add logprobs for "
                      "each prompt token's alternatives); else max_tokens must be >= 1", "max_tokens")
    if body.use_beam_search:  # one beam search per prompt; its n best hypotheses are its choices
        return EnginePlan(prompts, body.beam_search_params(), 1 if body.n is None else body.n, body.beam_names())
    params = body.sampling_params()
    return EnginePlan(prompts, params, params.n, body.field_names())


class CompletionRequest(SamplingFields):
    """OpenAI's completions body."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int | None, Sampled(default=MAX_TOKENS, beam=True)] = None
    best_of: int | None = None
    logprobs: Annotated[int | None, Sampled()] = None
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

    def sampling_params(self, renames: Mapping[str, str] | None = None) -> SamplingParams:
        """OpenAI's defaults (each Sampled field's) where the request leaves a field out; `renames`: the
        body's names for the fields, where they are not this request's (chat's max_completion_tokens)."""
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
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise invalid("give structured_outputs or response_format, not both", "response_format")
        prompt_logprobs = self.logprobs if self.echo else None
        if self.echo and self.max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # OpenAI's scoring call: the prompt echoed, nothing generated
        given: dict[str, Any] = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
        try:
            for name, mark in sampled_fields(type(self)).items():
                value = mark.given(getattr(self, name))
                if value is not None:
                    given[mark.param or name] = value
            return SamplingParams(**given)
        except ParamError as err:
            raise self.field_names(renames).refusal(err) from None

    def field_names(self, renames: Mapping[str, str] | None = None) -> FieldNames:
        structured = "structured_outputs" if self.structured_outputs is not None else "response_format"
        return FieldNames(structured, {"prompt_logprobs": "logprobs", **(renames or {})})  # set from logprobs on echo

    def beam_names(self) -> FieldNames:
        return FieldNames(renames={"beam_width": "n" if self.best_of is None else "best_of"})

    def beam_search_params(self) -> BeamSearchParams:
        """use_beam_search: beam width best_of (else n), the n best hypotheses returned; the sampling fields
        are refused, and so is streaming."""
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.stream or self.stream_options is not None:
            raise invalid("streaming is not supported with use_beam_search",
                          "stream" if self.stream else "stream_options")
        for name, mark in sampled_fields(type(self)).items():
            if not mark.beam and getattr(self, name) is not None:
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
        given = {"max_tokens": MAX_TOKENS if self.max_tokens is None else self.max_tokens,
                 "length_penalty": self.length_penalty, "early_stopping": self.early_stopping,
                 "ignore_eos": self.ignore_eos}
        try:
            return BeamSearchParams(beam_width=width, **{k: v for k, v in given.items() if v is not None})
        except ParamError as err:
            raise self.beam_names().refusal(err) from None
