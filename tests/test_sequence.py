"""A Sequence's text and statistics beside its tokens: a stop string finishes it at the token that completes it,
and a fork goes on with its own text, stream and statistics."""

from __future__ import annotations

import pytest

from minigpt import SamplingParams
from minigpt.engine.sequence import Sequence
from minigpt.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


def sequence(tok: Tokenizer, **params) -> Sequence:
    return Sequence(0, tok.encode("Once"), SamplingParams(max_tokens=32, **params), 0, tok, (tok.eos_token_id,), 1024)


def test_a_stop_string_finishes_the_sequence_at_its_token(tok):
    seq = sequence(tok, stop=["lazy"])
    tokens = tok.encode(" the quick brown fox jumps over the lazy dog")
    streamed = ""
    for token in tokens:
        seq.append(token)
        streamed += seq.take_text_delta()
        if seq.finished:
            break
    assert seq.finish_reason == "stop" and tok.decode(seq.output_token_ids).endswith("lazy")
    assert seq.text == streamed == " the quick brown fox jumps over the "
    assert seq.stats.first_token is not None and seq.stats.finished >= seq.stats.first_token


def test_a_fork_goes_on_with_its_own_text_and_statistics(tok):
    parent = sequence(tok, stop=["!"])
    for token in tok.encode(" hello"):
        parent.append(token)
    assert parent.take_text_delta() == " hello"
    child = parent.fork([])
    child.stats.num_spec_steps += 1
    for token in tok.encode(" world"):
        parent.append(token)
    for token in tok.encode(" there!"):
        child.append(token)
    assert (parent.text, parent.take_text_delta(), parent.finished) == (" hello world", " world", False)
    assert (child.text, child.take_text_delta(), child.finish_reason) == (" hello there", " there", "stop")
    assert parent.stats.num_spec_steps == 0 and parent.stats.finished is None


def test_a_last_token_ends_the_output_as_text(tok):
    seq = sequence(tok)
    seq.append(tok.encode(" yes")[0], last=True)
    assert seq.finish_reason == "stop" and seq.text == " yes"


def test_an_eos_a_feature_ends_on_is_no_text_even_with_ignore_eos(tok):
    seq = sequence(tok, ignore_eos=True)
    seq.append(tok.encode(" yes")[0])
    seq.append(tok.eos_token_id)
    assert not seq.finished  # ignore_eos: an EOS alone goes on
    seq.append(tok.eos_token_id, last=True)
    assert seq.finish_reason == "stop" and seq.text == " yes" + tok.decode([tok.eos_token_id])


def test_a_refused_token_fails_the_sequence_and_is_no_text(tok):
    seq = sequence(tok)
    seq.append(tok.encode(" yes")[0])
    seq.refuse(tok.encode(" no")[0], None, "not allowed")
    assert (seq.finish_reason, seq.error, seq.text) == ("error", "not allowed", " yes")
    assert len(seq.output_token_ids) == 2
