"""Incremental detokenization and stop strings (gateway/text.py): pure, hand-written cases and
properties over random token streams cut into random steps."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.text import IncrementalDetokenizer, StopMatcher, ToyTokenizer


class ByteTokenizer:
    """One token per UTF-8 byte: a character may span tokens, as with byte-level BPE."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream(tokenizer, ids: list[int], cuts: list[int], stops=(), prompt=()) -> tuple[list[str], bool]:
    """Push `ids` in steps ending at `cuts`; returns (released pieces, stopped)."""
    detok, matcher = IncrementalDetokenizer(tokenizer, prompt), StopMatcher(stops)
    pieces, start = [], 0
    for end in [*sorted(set(cuts)), len(ids)]:
        if end <= start:
            continue
        text, stopped = matcher.push(detok.push(ids[start:end]))
        pieces.append(text)
        start = end
        if stopped:
            return pieces, True
    text, stopped = matcher.push(detok.flush())
    pieces.append(text)
    if not stopped:
        pieces.append(matcher.flush())
    return pieces, matcher.stopped


# ---- the detokenizer ---------------------------------------------------------------------------------
def test_a_character_split_over_tokens_is_held_until_complete():
    tok = ByteTokenizer()
    ids = tok.encode("añ🙂")                         # 1 + 2 + 4 bytes
    d = IncrementalDetokenizer(tok)
    got = [d.push([i]) for i in ids]
    assert got == ["a", "", "ñ", "", "", "", "🙂"]
    assert d.flush() == "" and d.text == "añ🙂"


def test_a_truncated_character_is_flushed_as_a_replacement():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok)
    assert d.push(tok.encode("ok") + [0xF0, 0x9F]) == "ok"
    assert d.flush() == "\ufffd"


def test_prompt_context_and_special_tokens():
    tok = ToyTokenizer()
    d = IncrementalDetokenizer(tok, tok.encode("a prompt"))
    assert d.push(tok.encode(" and")) == " and"            # the prompt is never re-emitted
    assert d.push([tok.eos_token_id]) == ""                 # skipped, no text
    assert d.flush() == "" and d.text == " and"


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)),
                    max_size=40),
       cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_text_is_the_full_decode_however_steps_cut_it(text, cuts):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    pieces, stopped = stream(tok, ids, cuts)
    assert not stopped
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)          # never half a character


# ---- stop strings --------------------------------------------------------------------------------------
def test_stop_string_split_across_pushes_is_never_released():
    m = StopMatcher(["STOP"])
    assert m.push("abc S") == ("abc ", False)              # "S" could start "STOP": held
    assert m.push("T") == ("", False)
    assert m.push("OP and more") == ("", True)
    assert m.text == "abc " and m.flush() == ""


def test_a_false_start_is_released_when_disproved():
    m = StopMatcher(["STOP"])
    assert m.push("ST") == ("", False)
    assert m.push("ART") == ("START", False)
    assert m.flush() == "" and m.text == "START"


def test_held_text_is_released_at_the_end():
    m = StopMatcher(["\n\n"])
    assert m.push("line\n") == ("line", False)
    assert m.flush() == "\n" and m.text == "line\n"


def test_the_stop_completed_first_wins_and_empty_stops_are_ignored():
    m = StopMatcher(["", "world", "lo w"])
    assert m.push("hello world") == ("hel", True)
    assert StopMatcher(["b", "aba"]).push("aba") == ("a", True)    # as if streamed "a", "b", "a"


def test_nothing_after_a_stop():
    m = StopMatcher(["x"])
    assert m.push("axb") == ("a", True)
    assert m.push("more") == ("", True) and m.flush() == "" and m.text == "a"


def test_stop_strings_across_token_boundaries_toy_tokenizer():
    tok = ToyTokenizer()
    ids = tok.encode("the cat sat. The end")
    for cut in range(len(ids)):
        pieces, stopped = stream(tok, ids, [cut], stops=[". T"])
        assert stopped and "".join(pieces) == "the cat sat"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab\nñ🙂", max_size=30),
       stops=st.lists(st.text(alphabet="ab\nñ🙂", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 150), max_size=10))
def test_output_is_the_text_before_the_first_stop_whatever_the_steps(text, stops, cuts):
    tok = ByteTokenizer()
    pieces, stopped = stream(tok, tok.encode(text), cuts, stops)
    out = "".join(pieces)
    # the stop string that completes first (ties: the longer one) cuts the text at its start
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    first = min(found)[1] if found else -1
    assert stopped == (first >= 0)
    assert out == (text[:first] if first >= 0 else text)
    assert not any(s in out for s in stops)
