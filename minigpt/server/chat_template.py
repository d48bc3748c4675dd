"""Chat templates: a conversation rendered as transformers' `apply_chat_template` renders it (a Jinja sandbox
set up as transformers sets up its own), from --chat-template FILE or the checkpoint's own."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from minigpt.server.errors import invalid
from minigpt.server.protocol import ChatMessage
from minigpt.tokenizer.files import END_OF_TEXT, read_json_object

TEMPLATE_FILE = "chat_template.jinja"
NO_TEMPLATE = ("this model has no chat template: start the server with --chat-template FILE (a Jinja template, "
               "as transformers' apply_chat_template takes), or use /v1/completions")
# transformers' GPT2Tokenizer: <|endoftext|> is BOS, EOS and UNK unless tokenizer_config.json says otherwise
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GPT2_SPECIAL_TOKENS = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT}


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or failed while rendering it."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(GPT2_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        import jinja2

        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template is not valid Jinja: {err} (line {err.lineno})") from None

    @classmethod
    def for_checkpoint(cls, checkpoint: Path, template_file: str | Path | None = None) -> ChatTemplate | None:
        """`template_file`'s template, else the checkpoint's own; None when neither exists."""
        config_file = checkpoint / "tokenizer_config.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        special = special_tokens_of(config)
        if template_file is not None:
            return cls(Path(template_file).read_text(encoding="utf-8"), special)
        if (checkpoint / TEMPLATE_FILE).is_file():
            return cls((checkpoint / TEMPLATE_FILE).read_text(encoding="utf-8"), special)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates, as transformers saves several: take "default"
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{config_file}: chat_template must be a string or a list of named templates")
        return cls(source, special)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               variables: dict[str, Any] | None = None) -> str:
        """The prompt text for `messages` (keys set to None dropped, as transformers does); `variables` (vLLM's
        chat_template_kwargs) override the special tokens, not the messages nor add_generation_prompt."""
        import jinja2

        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {**self.special_tokens, **(variables or {}), "messages": messages, "tools": None,
                   "documents": None, "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(context)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
        except Exception as err:  # whatever the messages and chat_template_kwargs make it do: 1 / 0, range(10**20)
            raise ChatTemplateError(f"the chat template failed on the messages: {type(err).__name__}: {err}") from None


def render_messages(template: ChatTemplate | None, messages: list[ChatMessage], add_generation_prompt: bool,
                    chat_template_kwargs: dict[str, Any] | None) -> str:
    """The prompt text `template` makes of `messages`; a 400 naming `messages` when it cannot."""
    if template is None:
        raise invalid(NO_TEMPLATE, "messages", code="chat_template_missing")
    try:
        return template.render([m.for_template() for m in messages], add_generation_prompt, chat_template_kwargs)
    except ChatTemplateError as err:
        raise invalid(str(err), "messages") from None


def special_tokens_of(config: dict) -> dict[str, str]:
    """The special tokens' texts that tokenizer_config.json names (an entry may be {"content": ...})."""
    special = dict(GPT2_SPECIAL_TOKENS)
    for name in SPECIAL_TOKEN_NAMES:
        if name not in config:
            continue
        value = config[name]
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
        else:
            special.pop(name, None)
    return special


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which a prompt must keep
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class GenerationBlock(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} marks the assistant's text for training masks: renders as is."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env
