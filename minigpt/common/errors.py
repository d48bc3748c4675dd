"""ParamError: a value refused, carrying the field it belongs to, so each front end names the field in its own
vocabulary (`SamplingParams.max_tokens` for the Python API, `max_tokens` for the HTTP API, `--max-new-tokens`
for the CLI) without rewriting the message."""

from __future__ import annotations


class ParamError(ValueError):
    """`owner.field problem`, e.g. ParamError("SamplingParams", "max_tokens", "must be an int >= 0, got -1")."""

    def __init__(self, owner: str, field: str, problem: str) -> None:
        self.owner, self.field, self.problem = owner, field, problem
        super().__init__(f"{owner}.{field} {problem}")

    def worded(self, field: str) -> str:
        """The message with the field named `field` (a request key, a CLI flag)."""
        return f"{field} {self.problem}"
