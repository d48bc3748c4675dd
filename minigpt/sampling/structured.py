"""StructuredOutputsParams: the one constraint a request's output must satisfy, checked when built."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from minigpt.common.errors import ParamError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


_bad = functools.partial(ParamError.must_be, "StructuredOutputsParams")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` a JSON schema (a dict or its text), `regex` the whole output matches, `choice` among
    strings, `grammar` in llguidance's Lark dialect, or `json_object=True`. JSON is generated compact."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ParamError("StructuredOutputsParams", "", f"takes exactly one of {', '.join(KINDS)}, got "
                                                            f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.json_object, bool):
            raise _bad("json_object", self.json_object, "a bool")
        if self.json is not None:
            object.__setattr__(self, "json", self._schema(self.json))
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(field, value, "a non-empty str")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise _bad("choice", self.choice, "a non-empty list of non-empty str")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> str:
        """The constraint as compact text; a schema's keys stay in their order (its properties are generated in
        that order, so schemas equal as dicts but ordered apart are different constraints)."""
        return json.dumps([self.kind, getattr(self, self.kind)], separators=(",", ":"))

    @staticmethod
    def _schema(schema: Any) -> dict:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise _bad("json", schema, f"a JSON schema (the text is not JSON: {err})") from None
        if not isinstance(schema, dict):
            raise _bad("json", schema, "a JSON schema object (a dict, or its JSON text)")
        try:
            json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise _bad("json", schema, f"a JSON-serialisable dict ({err})") from None
        return schema
