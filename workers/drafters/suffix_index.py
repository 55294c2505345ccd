"""The suffix drafter's index (workers/drafters/suffix.py): token streams with hash-chain n-gram
indexes, a tenant's FIFO cache of finished outputs, and the scan for the longest earlier match of a
context's suffix.

NOTE: the index is a hash-chain n-gram index over a FIFO token stream (as in LZ77 compressors),
not a suffix tree or automaton. A suffix trie of the depth we need (match + speculation, ~40 tokens)
costs O(tokens × depth) nodes, ~100 bytes each in Python; a suffix automaton is O(tokens) but cannot
delete, so FIFO eviction would mean rebuilds, and its occurrence counts cost O(n) per token on
periodic text (a degenerate model loop). Here every token costs one 8-byte slot plus, per anchor
length k (``min_match``·4^i ≤ ``max_match``: 2, 8, 32 by default), an 8-byte chain link and at most
one dict entry (~400 bytes a token in all, measured); eviction drops the front of the stream and the
dict entries of k-grams that no longer occur. The longest match is found on the chain of
the longest anchor that occurs (all occurrences of that k-gram, most recent first, ``max_scan`` at
most), extended by binary search on slice comparisons; the one departure from an exact suffix
structure: when a k-gram occurred more than ``max_scan`` times, only its most recent ``max_scan``
occurrences are looked at.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

SEP = -1  # ends each output in a tenant stream: no k-gram, match or continuation crosses it

class Stream:
    """Tokens with hash chains: for each anchor length k, ``heads[a][hash(k-gram)]`` is the last
    position where that k-gram ends and ``prev[a][i]`` the one before the k-gram ending at slot i.

    Positions are absolute (``base`` is the position of slot 0), so dropping the front keeps every
    link valid; a link below ``base`` ends the chain. k-grams never span a ``SEP``.
    """

    __slots__ = ("anchors", "tokens", "base", "heads", "prev", "run")

    def __init__(self, anchors: tuple[int, ...]) -> None:
        self.anchors = anchors
        self.tokens = array("q")
        self.base = 0
        self.heads: list[dict[int, int]] = [{} for _ in anchors]
        self.prev = [array("q") for _ in anchors]
        self.run = 0  # tokens since the last separator

    def extend(self, new: Sequence[int]) -> None:
        tokens, base = self.tokens, self.base
        chains = list(zip(self.anchors, self.heads, self.prev))
        for tok in new:
            tokens.append(tok)
            self.run += 1
            n = len(tokens)
            for k, heads, prev in chains:
                if k <= self.run:
                    h = hash(tokens[n - k : n].tobytes())
                    prev.append(heads.get(h, -1))
                    heads[h] = base + n - 1
                else:
                    prev.append(-1)

    def end_document(self) -> None:
        self.tokens.append(SEP)
        for prev in self.prev:
            prev.append(-1)
        self.run = 0

    def drop_front(self, n: int) -> None:
        """Forget the first ``n`` slots, whole documents (slot n - 1 is a separator).

        A head pointing there is the last occurrence of its k-gram, so every occurrence is gone:
        delete it (the cost of indexing those tokens again), and the dicts hold live k-grams only.
        """
        tokens, base = self.tokens, self.base
        run = 0
        for i in range(n):
            if tokens[i] == SEP:
                run = 0
                continue
            run += 1
            for k, heads in zip(self.anchors, self.heads):
                if k <= run:
                    h = hash(tokens[i - k + 1 : i + 1].tobytes())
                    if heads.get(h) == base + i:
                        del heads[h]
        del tokens[:n]
        for prev in self.prev:
            del prev[:n]
        self.base += n


# An occurrence: (stream tokens, slot of its next continuation token, period). Period 0: the
# continuation stops at the stream's end or a separator. In the request's own text, an occurrence p
# tokens before the root says the text repeats with period p; its continuation reaches the root and
# goes on as that copy would (LZ77's overlapping copy): slot j ≥ len(tokens) reads slot j - p.
Occurrence = tuple[array, int, int]


@dataclass
class Found:
    """The occurrences of the longest match so far."""

    cap: int
    best: int = 0
    occurrences: list[Occurrence] = field(default_factory=list)

    def add(self, length: int, occurrence: Occurrence) -> None:
        if length > self.best:
            self.best = length
            self.occurrences = [occurrence]
        elif length == self.best and len(self.occurrences) < self.cap:
            self.occurrences.append(occurrence)


def match_len(tokens: array, i: int, tail: array, lower: int) -> int:
    """How many tokens ending at slot i equal the end of ``tail``, if at least ``lower``; else 0.

    One slice comparison rejects a shorter match; a longer one is measured by binary search (a match
    of length L implies every shorter one).
    """
    upper = min(len(tail), i + 1)
    t = len(tail)
    if lower > upper or tokens[i - lower + 1 : i + 1] != tail[t - lower :]:
        return 0
    lo, hi = lower, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tokens[i - mid + 1 : i + 1] == tail[t - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def scan(stream: Stream, tail: array, found: Found, max_scan: int, periodic: bool) -> None:
    """Add ``stream``'s occurrences of the longest suffix of ``tail`` (that has a continuation) to
    ``found``, trying the longest anchor first. ``periodic``: the stream is the request's own text,
    whose last token is the root (see ``Occurrence``)."""
    tokens, base, anchors = stream.tokens, stream.base, stream.anchors
    last = len(tokens) - 1
    limit = len(tail)  # the longest match this stream may still hold
    for a in range(len(anchors) - 1, -1, -1):
        k = anchors[a]
        if k > len(tail):
            continue
        if found.best > limit:
            return  # nothing here can reach the match found in another stream
        pos = stream.heads[a].get(hash(tail[len(tail) - k :].tobytes()), -1)
        if pos < base:
            limit = k - 1  # the k-gram does not occur here
            continue
        prev = stream.prev[a]
        scanned = 0
        while pos >= base and scanned < max_scan:
            i = pos - base
            scanned += 1
            if i < last and tokens[i + 1] != SEP:  # a continuation follows
                length = match_len(tokens, i, tail, max(found.best, k))
                if length:
                    found.add(length, (tokens, i + 1, last - i if periodic else 0))
                    if found.best == len(tail) and len(found.occurrences) >= found.cap:
                        return  # nothing longer exists, and no room for more
            pos = prev[i]
        if found.best >= k:
            return  # a shorter anchor finds only shorter matches (or older ones past max_scan)


class TenantCache:
    """One tenant's finished outputs in one FIFO stream, each followed by a separator."""

    def __init__(self, anchors: tuple[int, ...], max_requests: int, max_tokens: int) -> None:
        self.stream = Stream(anchors)
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.lengths: deque[int] = deque()  # tokens of each stored output, oldest first
        self.tokens = 0  # their sum (separators not counted)

    def add(self, tokens: Sequence[int]) -> None:
        tokens = tokens[len(tokens) - self.max_tokens :] if len(tokens) > self.max_tokens else tokens
        while self.lengths and (
            len(self.lengths) >= self.max_requests or self.tokens + len(tokens) > self.max_tokens
        ):
            oldest = self.lengths.popleft()
            self.tokens -= oldest
            self.stream.drop_front(oldest + 1)
        self.stream.extend(tokens)
        self.stream.end_document()
        self.lengths.append(len(tokens))
        self.tokens += len(tokens)
