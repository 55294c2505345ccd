"""Where a generation ends inside one step's committed tokens: pure, shared by every loop."""
from __future__ import annotations

from typing import Collection, Sequence


def cut(tokens: Sequence[int], *, produced: int, limit: int,
        stop_token_ids: Collection[int]) -> tuple[list[int], str | None]:
    """The tokens to keep from a step (up to and including a stop token, up to `limit` output
    tokens in all, `produced` of them already committed) and why it ended: "stop_token",
    "length" or None (it goes on).

    >>> cut([5, 2, 7], produced=0, limit=10, stop_token_ids={2})
    ([5, 2], 'stop_token')
    >>> cut([5, 6, 7], produced=8, limit=10, stop_token_ids={2})
    ([5, 6], 'length')
    >>> cut([5, 6], produced=0, limit=10, stop_token_ids=())
    ([5, 6], None)
    """
    if produced + len(tokens) < limit:     # most steps: short of the limit and no stop token
        for stop in stop_token_ids:
            if stop in tokens:
                break
        else:
            return list(tokens), None
    out: list[int] = []
    for tok in tokens:
        out.append(tok)
        if tok in stop_token_ids:
            return out, "stop_token"
        if produced + len(out) >= limit:
            return out, "length"
    return out, None
