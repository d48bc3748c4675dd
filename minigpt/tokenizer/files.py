"""A checkpoint's tokenizer files read into vocabulary, merges and added tokens, as transformers reads
them: vocab.json + merges.txt (with added_tokens.json and tokenizer_config.json), or tokenizer.json.
Every error names the file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"
# Flags of an added token that change how it is matched; minigpt matches added tokens literally
MATCHING_FLAGS = ("lstrip", "rstrip", "single_word")

logger = logging.getLogger("minigpt.tokenizer.tokenizer")


def read_json_object(file: Path) -> dict:
    data = read_json(file)
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data


def read_added_tokens_json(file: Path) -> dict[str, int]:
    """added_tokens.json: the text -> id of each token a fine-tune added (older transformers' format)."""
    data = read_json_object(file)
    if not all(type(i) is int and i >= 0 for i in data.values()):
        raise ValueError(f"{file}: every added token must map to a non-negative integer id")
    return data


def read_tokenizer_config(file: Path) -> tuple[dict[str, int] | None, str | None]:
    """tokenizer_config.json: the added tokens of its `added_tokens_decoder` (id -> entry) as text -> id,
    None without one; and the BOS token's text when `add_bos_token` is set (`bos_token`: GPT-2's
    <|endoftext|> when absent, none when null)."""
    data = read_json_object(file)
    decoder = data.get("added_tokens_decoder")
    bad_decoder = ValueError(f"{file}: added_tokens_decoder must map each id to an entry with a 'content' string")
    if decoder is not None and not isinstance(decoder, dict):
        raise bad_decoder
    added = None if decoder is None else {}
    for i, entry in (decoder or {}).items():
        if not (i.isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str)):
            raise bad_decoder
        added[entry["content"]] = int(i)
        flags = [flag for flag in MATCHING_FLAGS if entry.get(flag) is True]
        if flags:
            logger.warning("%s: added token %r sets %s, which minigpt ignores: it matches the token literally, "
                           "so text around it may encode differently from transformers", file, entry["content"],
                           " and ".join(flags))
    bos = data.get("bos_token", END_OF_TEXT)
    bos = bos.get("content") if isinstance(bos, dict) else bos
    if data.get("add_bos_token") is not True or bos is None:
        return added, None
    if not isinstance(bos, str):
        raise ValueError(f"{file}: add_bos_token is set but bos_token is not a token's text")
    return added, bos


def read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e


def check_vocab(vocab: object, file: Path) -> dict[str, int]:
    if not isinstance(vocab, dict) or not all(type(i) is int and i >= 0 for i in vocab.values()):
        raise ValueError(f"{file}: the vocabulary must map token text to a non-negative integer id")
    return vocab


def read_merges(file: Path) -> list[tuple[str, str]]:
    """merges.txt: an optional "#version" line, then one "left right" pair per line."""
    try:
        lines = file.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e})") from e
    if lines[0].startswith("#version"):
        lines[0] = ""
    pairs = [line.rstrip("\r").split(" ") for line in lines]
    bad = next((n for n, pair in enumerate(pairs) if len(pair) != 2 and pair != [""]), None)
    if bad is not None:
        raise ValueError(f"{file}, line {bad + 1}: expected two tokens separated by a space: {lines[bad]!r}")
    return [(pair[0], pair[1]) for pair in pairs if len(pair) == 2]


def read_tokenizer_json(file: Path) -> tuple[dict[str, int], list[tuple[str, str]], dict[str, int]]:
    """HF tokenizers format: model.vocab, model.merges ("a b" strings or [a, b] pairs), added_tokens."""
    data = read_json(file)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("merges"), list):
        raise ValueError(f"{file}: expected a BPE model with model.vocab and model.merges")
    vocab = check_vocab(model.get("vocab"), file)
    merges = []
    for k, merge in enumerate(model["merges"]):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise ValueError(f"{file}: model.merges[{k}] is not a pair of tokens: {merge!r}")
        merges.append((pair[0], pair[1]))
    added = data.get("added_tokens", [])
    if not isinstance(added, list) or not all(is_added_token(t) for t in added):
        raise ValueError(f"{file}: every added_tokens entry needs a 'content' string and an integer 'id'")
    return vocab, merges, {t["content"]: t["id"] for t in added}


def is_added_token(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("content"), str) and type(entry.get("id")) is int
