"""Prompt lookup: draft the tokens that followed the last earlier occurrence of the context's ending."""

from __future__ import annotations

from collections.abc import Sequence


def ngram_draft(token_ids: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the last n tokens that k tokens follow
    (else the fewer after the latest occurrence), for the longest n in [lookup_min, lookup_max] that occurs;
    [] when none does."""
    length = len(token_ids)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = list(token_ids[length - n :])
        last, latest = suffix[-1], None
        for end in range(length - 2, n - 2, -1):  # end: where an earlier occurrence ends
            if token_ids[end] == last and list(token_ids[end - n + 1 : end + 1]) == suffix:
                if end + k < length:
                    return list(token_ids[end + 1 : end + 1 + k])
                latest = end if latest is None else latest
        if latest is not None:
            return list(token_ids[latest + 1 : latest + 1 + k])
    return []
