"""Text out of token ids, as they stream: incremental detokenization and stop strings. Pure.

A step commits τ ≥ 1 tokens at once, and neither a token nor a step boundary is a text boundary:
a byte-level BPE token may hold half of a UTF-8 character, and a stop string may span tokens and
steps. Two small state machines turn the token stream into text a client may see:

    token ids ──IncrementalDetokenizer──▶ new text ──StopMatcher──▶ text safe to send (+ stopped?)

`ToyTokenizer` is a stand-in tokenizer for the fake worker (tests, gateway benchmarks): the same
calls as a Hugging Face tokenizer, no files, no model.
"""
from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"      # what decode() gives for an incomplete UTF-8 sequence
# The most tokens held back waiting for a character to complete. A UTF-8 character is at most
# four bytes, so one split over byte tokens completes by its fourth; twice that leaves room for
# tokens that straddle characters back to back. Past it the window moves on and the U+FFFD goes
# out, as the full decode shows it: a run of byte tokens that never forms a character (a
# `logit_bias` can force one) costs a bounded window per token, not the whole run again.
HOLD_TOKENS = 8


class _Joined:
    """Text appended piece by piece, its length always known and the string built only when
    read: `text += piece` on an attribute copies the whole text at every piece."""

    def __init__(self) -> None:
        self._text = ""
        self._pieces: list[str] = []
        self.chars = 0

    def add(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
            self.chars += len(piece)
        return piece

    @property
    def text(self) -> str:
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text


class _LetOut:
    """A text stage's output so far, kept in `_out`: what the detokenizer has emitted, what the
    stop matcher has released."""
    _out: _Joined

    @property
    def text(self) -> str:
        """Everything let out so far."""
        return self._out.text

    @property
    def chars(self) -> int:
        """len(text), without building it."""
        return self._out.chars


class IncrementalDetokenizer(_LetOut):
    """Turns token ids into text chunk by chunk, never splitting a character.

    The text of a span of tokens depends on its neighbours (a leading space, a multi-byte
    character split over two tokens), so each token decodes a short window: from `prefix_offset`
    (the start of the last text already emitted) to the end, and emits what it adds to the text of
    `prefix_offset:read_offset`. An incomplete character at the end (U+FFFD) is held until a
    later token completes it, for at most `hold` tokens; the text before it goes out at once.
    Tokens are taken one at a time, so the text after k tokens does not depend on how they were
    grouped, and the window never spans more than the context and two holds: each token costs
    two decodes of a bounded window, whatever the output's length.
    A few prompt tokens seed the window, so the first output token decodes in context.

    >>> tok = ToyTokenizer()
    >>> d = IncrementalDetokenizer(tok)
    >>> d.push(tok.encode("Hi")), d.push(tok.encode(" there")), d.flush()
    ('Hi', ' there', '')
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), *, context: int = 5,
                 skip_special_tokens: bool = True, hold: int = HOLD_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.hold = hold
        self._ids: list[int] = list(prompt_ids[-context:]) if context > 0 else []   # the window
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self._sent = 0                    # characters after the prefix's text already emitted
        self._out = _Joined()             # everything emitted so far

    def push(self, token_ids: Sequence[int]) -> str:
        """Add committed tokens; returns the new text that is complete (maybe "")."""
        return "".join([self._push_one(int(t)) for t in token_ids])

    def _push_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new = self._decode(self._ids[self.prefix_offset:])[len(prefix):]
        if new.endswith(REPLACEMENT) and len(self._ids) - self.read_offset <= self.hold:
            # An incomplete character at the end: release what comes before it, keep the window.
            return self._emit(new.rstrip(REPLACEMENT))
        out = self._emit(new)
        self._advance()
        return out

    def flush(self) -> str:
        """The text still held at the end (an incomplete character decodes as U+FFFD)."""
        if self.read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self.prefix_offset:self.read_offset])
        out = self._emit(self._decode(self._ids[self.prefix_offset:])[len(prefix):])
        self._advance()
        return out

    def _advance(self) -> None:
        """Everything up to the end is emitted: it becomes the next window's prefix, and the
        tokens before that prefix are no longer needed."""
        del self._ids[:self.read_offset]
        self.prefix_offset, self.read_offset, self._sent = 0, len(self._ids), 0

    def _emit(self, window_text: str) -> str:
        """`window_text` = all text after the prefix so far; returns the part not yet sent."""
        out = window_text[self._sent:] if len(window_text) > self._sent else ""
        self._sent = max(self._sent, len(window_text))
        return self._out.add(out)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


class StopMatcher(_LetOut):
    """Cuts generated text before the first stop string and never lets any of it out.

    While streaming, text that could be the start of a stop string is held back until the next
    text proves it is not (or completes the stop string).

    >>> m = StopMatcher(["\\n\\n", "END"])
    >>> m.push("one\\n"), m.push("two E"), m.push("ND three")
    (('one', False), ('\\ntwo ', False), ('', True))
    >>> m.text
    'one\\ntwo '
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.held = ""
        self._out = _Joined()             # everything released so far
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        """Add new text; returns (text safe to release now, whether a stop string was seen)."""
        if self.stopped:
            return "", True
        buf = self.held + text
        cut = self._first_stop(buf)
        if cut >= 0:
            self.held, self.stopped = "", True
            return self._release(buf[:cut]), True
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return self._release(buf[:len(buf) - keep]), False

    def flush(self) -> str:
        """At the end of generation (no stop string came): release what was held."""
        out, self.held = ("" if self.stopped else self.held), ""
        return self._release(out)

    def _first_stop(self, buf: str) -> int:
        """Where the stop string that completes first starts (-1: none). Completes first, not
        starts first: a generation stops as soon as one is complete, so the answer must not
        depend on how the text was split ("aba" with stops "b" and "aba" gives "a")."""
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        return -1 if best is None else best[1]

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, text: str) -> str:
        return self._out.add(text)


class OutputText:
    """A request's output as a client is shown it: tokens → `IncrementalDetokenizer` →
    `StopMatcher`, one token at a time, so the text shown after k tokens is a function of the
    first k tokens alone, never of how steps grouped them. That is what makes a stream resumable
    exactly (gateway/replay.py): a live stream and one rebuilt from the state store's tokens show
    the same text at every token, and a stop string cuts at the same token.

    `push` takes committed tokens and returns (new text, tokens taken): fewer than given when a
    stop string completes, as the tokens after it are never part of the output.

    >>> tok = ToyTokenizer()
    >>> out = OutputText(tok, stops=["END"])
    >>> out.push(tok.encode("one EN")), out.push(tok.encode("D two")), out.text, out.tokens
    (('one ', 6), ('', 1), 'one ', 7)
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (),
                 stops: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopMatcher(stops)
        self.tokens = 0                   # tokens taken (the stop string's last one included)

    @property
    def text(self) -> str:
        """Everything shown so far."""
        return self._stops.text

    @property
    def chars(self) -> int:
        """len(text), without building it: what a caller asks after every token."""
        return self._stops.chars

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_ids: Sequence[int]) -> tuple[str, int]:
        out, taken = [], 0
        for t in token_ids:
            if self._stops.stopped:
                break
            taken += 1
            out.append(self._stops.push(self._detok.push([int(t)]))[0])
        self.tokens += taken
        return "".join(out), taken

    def finish(self) -> str:
        """The text held at the end of a generation that no stop string ended."""
        if self._stops.stopped:
            return ""
        text, _ = self._stops.push(self._detok.flush())
        return text + self._stops.flush()


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for, so that a prompt of n characters is
    known to have at least n / this many tokens before it is tokenized (a prompt far too long is
    refused without that work). A vocabulary entry's string is never shorter than the text it
    decodes to: byte-level BPE spells each byte as one character, SentencePiece spells the text
    itself ("▁" for a space), byte fallback spells one byte as "<0x41>". (A tokenizer whose
    normalizer drops characters would break this; no causal LM's we load has one.)"""
    own = getattr(tokenizer, "max_token_chars", None)
    if own is not None:
        return int(own)
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


class ToyTokenizer:
    """A stand-in tokenizer for the fake worker: no files, deterministic, ids 0 … 999.

    Ids 0, 1, 2 are pad, bos and eos (special: skipped when decoding); 3 … 98 are the printable
    ASCII characters and the newline (so any ASCII text round-trips); 99 … 999 are short words
    with a leading space, which is what the fake worker's output mostly decodes to. Characters
    outside ASCII encode as "?".
    """

    vocab_size = 1000
    max_token_chars = 1                       # it encodes one character per token
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    all_special_ids = [0, 1, 2]
    _CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
    _CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"

    def __init__(self) -> None:
        words = [" " + c + v + c2 for c in self._CONSONANTS for v in self._VOWELS
                 for c2 in ("", "n", "s", "t", "r")]
        self._pieces = ["", "", ""] + list(self._CHARS)
        self._pieces += words[:self.vocab_size - len(self._pieces)]
        self._pieces += [f" w{i}" for i in range(self.vocab_size - len(self._pieces))]
        self._char_id = {ch: 3 + i for i, ch in enumerate(self._CHARS)}

    def __len__(self) -> int:
        return self.vocab_size

    def pieces(self) -> list[str]:
        """Every id's text ("" for the special ids): a grammar engine's raw vocabulary."""
        return list(self._pieces)

    def encode(self, text: str) -> list[int]:
        unknown = self._char_id["?"]
        return [self._char_id.get(ch, unknown) for ch in text]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        special = {"0": "<pad>", "1": "<s>", "2": "</s>"}
        out = []
        for i in ids:
            i = int(i)
            if i < 3:
                if not skip_special_tokens:
                    out.append(special[str(i)])
            else:
                out.append(self._pieces[i])
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> the byte it spells: printable Latin-1 bytes
    spell themselves, the other 68 bytes are shifted to U+0100 and up, in byte order. Written out
    because transformers 5 no longer exports its copy (`bytes_to_unicode`)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            table[chr(256 + shift)] = b
            shift += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def token_piece(tokenizer: Any, token_id: int) -> tuple[str, tuple[int, ...]]:
    """One token's text and its bytes, as OpenAI's logprobs show a token (`token`, `bytes`).

    The text is the token decoded alone (special tokens as their names). A byte-level BPE token
    may hold part of a UTF-8 character: its text then shows U+FFFD, and its bytes are read from
    the vocabulary entry's spelling instead (each character one byte), so a client can join the
    bytes of consecutive tokens back into the character.

    >>> token_piece(ToyTokenizer(), 99)
    (' ba', (32, 98, 97))
    """
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if REPLACEMENT in text:
        # a Hugging Face tokenizer's spelling (the toy tokenizer never decodes to U+FFFD)
        spelled = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(spelled, str) and spelled and all(ch in _BYTE_LEVEL for ch in spelled):
            return text, tuple(_BYTE_LEVEL[ch] for ch in spelled)
    return text, tuple(text.encode("utf-8"))
