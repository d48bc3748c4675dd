"""ParamError: a refused value that carries its field, so each front end names fields in its own words
(`SamplingParams.max_tokens`, the request's `max_tokens`, `--max-new-tokens`) without rewriting the message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError, MemoryError)  # what a front end reports in one line


class Named(NamedTuple):
    """A field named in a problem's text; with a `value`, the setting `field=value`."""

    field: str
    value: Any = ...

    def api(self) -> str:
        return self.field if self.value is ... else f"{self.field}={self.value!r}"


class ParamError(ValueError):
    """`owner.field problem`; `problem` is text, or text and `Named` fields (naming `field` itself: nothing goes
    before it). An empty `owner` leaves the field bare; an empty `field` is the owner as a whole."""

    def __init__(self, owner: str, field: str, problem: str | tuple[str | Named, ...]) -> None:
        self.owner, self.field, self.problem = owner, field, problem
        super().__init__(self.worded(self.api))

    @classmethod
    def must_be(cls, owner: str, field: str, value: Any, expected: str) -> ParamError:
        return cls(owner, field, f"must be {expected}, got {value!r}")

    def api(self, named: Named) -> str:
        return ".".join(filter(None, (self.owner, named.field))) if named == (self.field, ...) else named.api()

    def worded(self, name: Callable[[Named], str] | str) -> str:
        """The message with each field worded by `name` (a str: the name of `field`, other fields as they are)."""
        if isinstance(name, str):
            return self.worded(lambda named, given=name: given if named.field == self.field else named.api())
        return "".join(name(part) if isinstance(part, Named) else part for part in self.parts())

    def parts(self) -> tuple[str | Named, ...]:
        parts = (" ", self.problem) if isinstance(self.problem, str) else self.problem
        if any(isinstance(part, Named) and part.field == self.field for part in parts):
            return parts
        return (Named(self.field), *parts)

    def at(self, where: str) -> ParamError:
        return type(self)(self.owner, self.field, (where, *self.parts()))

    def __reduce__(self) -> tuple:
        return type(self), (self.owner, self.field, self.problem)


def error_line(err: BaseException) -> str:
    """The first line of an error's message (its type when it has none)."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__
