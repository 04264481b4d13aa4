"""Edge text handling: stop strings across chunk boundaries and UTF-8-safe incremental detokenization."""
import pytest

from coordinator.text import IncrementalDetokenizer, StopMatcher, Tokenizer


def test_stop_string_split_across_chunks_is_held_back_then_cut():
    m = StopMatcher(["###"], include_stop=False)
    assert m.feed("hello #") == ("hello ", None)
    assert m.feed("#") == ("", None)
    assert m.feed("# tail") == ("", "###")


def test_false_alarm_prefix_is_released():
    m = StopMatcher(["STOP"], include_stop=False)
    assert m.feed("ST") == ("", None)
    assert m.feed("ART") == ("START", None)
    assert m.flush() == ""


def test_include_stop_and_earliest_match_wins():
    m = StopMatcher(["b", "abc"], include_stop=True)
    assert m.feed("xxabc") == ("xxabc", "abc")  # "abc" starts at 2, before "b" at 3


@pytest.fixture(scope="module")
def tok(real_model_dir):
    return Tokenizer(real_model_dir)


def test_detokenizer_never_emits_broken_utf8_and_reassembles(tok):
    text = "Grüße aus Köln 🌍🚀 — 日本語テキスト"
    ids = tok.hf(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok, [1])
    pieces = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
