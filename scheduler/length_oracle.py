"""Clairvoyant output lengths, for measurement only: the real gateway's counterpart of the
simulator's `srpt` oracle.

How far can any order of service cut the mean latency on the real engine, with its real step
costs, prefills and KV limits? The simulator answers with clairvoyant SRPT, but only for the
engine it models. A load test sends greedy requests (temperature 0) drawn from a few dozen
prompts, so each prompt's answer, and its length, is fixed: `loadtest compare` with `srpt` among
its policies first asks a fresh gateway for every prompt's answer once (`truth pass`), builds a
`LengthOracle` from the lengths, and gives it to the srpt gateway (`Settings.length_oracle`),
which then sets every request's `predicted_len` to its true length (gateway/service/prepare.py) and ranks
by the true remaining tokens (`true_remaining`).

Never for serving: it knows only the prompts it was built from (others get no prediction).

Prompts are keyed by what the client sent (the messages or the prompt text, `prompt_key`), not by
token ids: the load generator that builds the table has no tokenizer, and the gateway's chat
template turns the same messages into the same ids every time.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.request import RequestStats


def prompt_key(*, messages: list[dict] | None = None, prompt: Any = None) -> str:
    """A digest of the request's input as the client sent it (messages, else prompt)."""
    what = {"messages": messages} if messages is not None else {"prompt": prompt}
    text = json.dumps(what, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


@dataclass
class LengthOracle:
    """Each known prompt's true output length when asked for at most `cap` tokens (greedy)."""
    cap: int
    lengths: dict[str, int] = field(default_factory=dict)      # prompt_key -> output tokens

    def length(self, key: str, max_new: int) -> int | None:
        """The output length of prompt `key` under a limit of `max_new` tokens; None if unknown
        (a prompt not in the table, or one that ran to `cap` asked for more than `cap`)."""
        n = self.lengths.get(key)
        if n is None:
            return None
        if n < self.cap:                 # it stopped on its own: the same under any larger limit
            return min(n, max_new)
        return max_new if max_new <= self.cap else None

    def to_dict(self) -> dict:
        return {"cap": self.cap, "lengths": dict(self.lengths)}

    @classmethod
    def from_dict(cls, doc: dict) -> LengthOracle:
        return cls(int(doc["cap"]), {str(k): int(v) for k, v in doc["lengths"].items()})

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> LengthOracle:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def true_remaining(s: RequestStats) -> float:
    """The `srpt` policy's key on the gateway: output tokens still to come, from a
    `predicted_len` the oracle set (a request it does not know goes last)."""
    return math.inf if s.predicted_len is None else max(0, s.predicted_len - s.committed)
