"""Step-cost model: the duration of one verification step as a function of batch size and total
tree tokens, by piecewise-linear interpolation over measured points (a profile JSON).

A profile holds one curve per measured batch size: tokens (ascending) → step seconds:

    {"source": "...", "curves": [{"batch": 1, "tokens": [1, 8, 16, 64],
                                  "step_s": [0.040, 0.076, 0.080, 0.140]}, ...]}

`StepCostModel(batch, tokens)` interpolates along tokens within the two curves whose batch sizes
bracket `batch`, then linearly between them; outside the measured range it extends the nearest
segment (the cost of tokens past the last point grows at the last segment's slope).

Context length (tokens of KV each request attends to) is a third, optional dimension: a profile
may hold further sets of curves measured at other contexts,

    {"prompt_len": 200, "curves": [...], "contexts": [{"context": 1000, "curves": [...]}, ...]}

(the top-level curves belong to context `prompt_len`). `StepCostModel(batch, tokens, context)`
then interpolates linearly between the two measured contexts that bracket `context` (extending
the nearest segment outside them); without a context, or in a profile without `contexts` (one
context: every profile written before they existed), the top-level curves answer.

A profile may also hold a `"prefill"` curve, prompt tokens → seconds of one request's prefill pass
(`Verifier.prefill`, batch 1); `StepCostModel.prefill(tokens)` reads it, or, in a profile without
one, extends the batch-1 curve. Other keys (`device`, `date`, `note`, a curve's `nodes`, …) are
descriptive and ignored here.

A profile may hold a `"chunk"` entry too (chunked prefill: `workers.speculation.profiling.measure_chunks`):
what a prefill chunk of k context tokens, after o tokens of its prompt already computed, adds to
a step, measured as (o, k, seconds) points and fitted (`fit_chunk_cost`; a `row_s` and `key_s`
in the entry are taken as the fit) as `row_s · k + key_s · k · (o + (k − 1) / 2)` (its rows' linears, then attention
over every earlier key). `StepCostModel.chunk(k, o)` reads it, or, without one, charges the
prefill curve's difference prefill(o + k) − prefill(o) (its slope: a pass's fixed cost is the
step's own); `keys_per_row` (row_s ÷ key_s) is how
many earlier keys cost what a row does, which the planner weighs chunks by.

>>> m = StepCostModel([(1, [1, 9], [0.04, 0.08]), (8, [8, 64], [0.09, 0.17])])
>>> round(m(1, 5), 3), round(m(8, 36), 3)
(0.06, 0.13)
>>> c = StepCostModel([(1, [1, 9], [0.04, 0.08])], context=200,
...                   contexts=[(1000, [(1, [1, 9], [0.06, 0.10])])])
>>> round(c(1, 1), 3), round(c(1, 1, 600), 3), round(c(1, 9, 1000), 3), c.contexts
(0.04, 0.05, 0.1, [200, 1000])
"""
from __future__ import annotations

import bisect
import json
from importlib import resources
from pathlib import Path
from typing import Sequence

from scheduler.step_cost import MIN_STEP_S, StepCost

Curve = tuple[int, Sequence[float], Sequence[float]]   # (batch, tokens, step_s)


def prefill_steps(cost: StepCost, prompt_len: int, batch: int) -> float:
    """A prompt's prefill in plain steps of `batch` requests: how the
    scheduler weighs the prefill a request has still to come against decode steps.

    >>> m = StepCostModel([(1, [1, 9], [0.04, 0.08])], prefill=([100, 200], [0.2, 0.3]))
    >>> round(prefill_steps(m, 150, 1), 2)
    6.25
    """
    return cost.prefill(prompt_len) / cost(batch, batch)


def fit_chunk_cost(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(row_s, key_s) ≥ 0, the least-squares fit of extra_s = row_s·k + key_s·k·(o + (k − 1)/2)
    to measured (o, k, extra_s) points. A coefficient the data would make negative (noise) is
    held at 0 and the other refitted alone.

    >>> pts = [(o, k, 1e-3 * k + 1e-6 * k * (o + (k - 1) / 2)) for o in (0, 1000) for k in (8, 32)]
    >>> [round(x, 9) for x in fit_chunk_cost(pts)]
    [0.001, 1e-06]
    >>> fit_chunk_cost([(0, 8, 0.008), (500, 8, 0.006)])[1]
    0.0
    """
    rows = [(float(k), float(k) * (o + (k - 1) / 2), float(y)) for o, k, y in points]
    if not rows:
        raise ValueError("no chunk points to fit")
    aa = sum(a * a for a, _, _ in rows)
    bb = sum(b * b for _, b, _ in rows)
    ab = sum(a * b for a, b, _ in rows)
    ay = sum(a * y for a, _, y in rows)
    by = sum(b * y for _, b, y in rows)
    det = aa * bb - ab * ab
    if det > 1e-12 * aa * bb:
        row_s, key_s = (ay * bb - by * ab) / det, (by * aa - ay * ab) / det
        if row_s >= 0 and key_s >= 0:
            return row_s, key_s
    # one coefficient alone: whichever leaves the smaller error
    alone = [(max(ay / aa, 0.0), 0.0)] + ([(0.0, max(by / bb, 0.0))] if bb else [])
    return min(alone, key=lambda c: sum((y - c[0] * a - c[1] * b) ** 2 for a, b, y in rows))


def _chunk_fit(chunk: dict) -> tuple[float, float] | None:
    """A profile's chunk entry → (row_s, key_s): its fit where it holds one, else fitted now
    from its measured points (what `workers.speculation.profiling.measure_chunks` writes). None
    when the fit is 0 and 0: the chunks measured nothing above the timing noise (a profile
    taken on busy cores), so they are charged as if none were measured, by the prefill curve."""
    if "row_s" in chunk and "key_s" in chunk:
        fit = float(chunk["row_s"]), float(chunk["key_s"])
    else:
        fit = fit_chunk_cost(chunk["points"])
    return None if fit == (0.0, 0.0) else fit


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _check(curves: Sequence[Curve]) -> list[Curve]:
    if not curves:
        raise ValueError("a profile needs at least one curve")
    curves = sorted(curves, key=lambda c: c[0])
    for b, xs, ys in curves:
        if len(xs) != len(ys) or not xs or list(xs) != sorted(xs) or len(set(xs)) != len(xs):
            raise ValueError(f"curve for batch {b}: tokens must be ascending, one step_s each")
    return curves


class _Grid:
    """Step seconds over (batch, tokens) at one context length."""

    def __init__(self, curves: Sequence[Curve]) -> None:
        curves = _check(curves)
        self.batches = [c[0] for c in curves]
        self.curves = [(list(map(float, c[1])), list(map(float, c[2]))) for c in curves]

    def __call__(self, batch: int, tokens: int) -> float:
        at = [_interp(xs, ys, tokens) for xs, ys in self.curves]
        if len(self.batches) == 1:
            return at[0]
        return _interp(self.batches, at, batch)


class StepCostModel(StepCost):
    """The measured profile (module docstring), as `scheduler.step_cost.StepCost` declares it."""

    def __init__(self, curves: Sequence[Curve], source: str = "",
                 prefill: tuple[Sequence[float], Sequence[float]] | None = None, *,
                 context: int | None = None,
                 contexts: Sequence[tuple[int, Sequence[Curve]]] = (),
                 chunk: tuple[float, float] | None = None) -> None:
        """`curves` at context `context` (the profile's prompt_len; may be None when there are
        no other `contexts`), plus (context, curves) sets measured at other contexts; `chunk`:
        the (row_s, key_s) of a prefill chunk's fit."""
        base = _Grid(curves)
        self.batches, self.curves = base.batches, base.curves   # the top-level curves
        self.source = source
        if contexts and context is None:
            raise ValueError("a profile with several contexts needs the top-level curves' context")
        grids = {context: base}
        for c, cs in contexts:
            if c in grids:
                raise ValueError(f"context {c} is measured twice")
            grids[c] = _Grid(cs)
        self.contexts = sorted(grids) if contexts else [context]
        self._grids = [grids[c] for c in self.contexts]
        self._base = base
        if prefill is not None:
            xs, ys = prefill
            if len(xs) != len(ys) or not xs or list(xs) != sorted(xs) or len(set(xs)) != len(xs):
                raise ValueError("prefill curve: tokens must be ascending, one step_s each")
            prefill = (list(map(float, xs)), list(map(float, ys)))
        self._prefill = prefill
        if chunk is not None and (chunk[0] < 0 or chunk[1] < 0 or chunk[0] + chunk[1] <= 0):
            raise ValueError("chunk cost: row_s and key_s must be ≥ 0, not both 0")
        self._chunk = chunk
        self._cache: dict[tuple[int, int, int | None], float] = {}

    @classmethod
    def from_json(cls, path: str | Path | None = None) -> "StepCostModel":
        """Load a profile; None loads the shipped `scheduler/profiles/default.json`."""
        if path is None:
            text = resources.files("scheduler").joinpath("profiles/default.json").read_text()
        else:
            text = Path(path).read_text()
        return cls.from_doc(json.loads(text))

    @classmethod
    def from_doc(cls, doc: dict) -> "StepCostModel":
        """A profile already parsed (e.g. `tools.bench_profile.startup_profile`'s)."""

        def curves(cs: list[dict]) -> list[Curve]:
            return [(c["batch"], c["tokens"], c["step_s"]) for c in cs]

        pre, chunk = doc.get("prefill"), doc.get("chunk")
        return cls(curves(doc["curves"]), doc.get("source", ""),
                   None if pre is None else (pre["tokens"], pre["step_s"]),
                   context=doc.get("prompt_len"),
                   contexts=[(c["context"], curves(c["curves"])) for c in doc.get("contexts", ())
                             if c["context"] != doc.get("prompt_len")],
                   chunk=None if not chunk else _chunk_fit(chunk))

    def __call__(self, batch: int, tokens: int, context: int | None = None) -> float:
        """Seconds of one step of `batch` requests verifying `tokens` tree tokens in all, each
        request holding `context` tokens of KV (None: the top-level curves' context)."""
        if len(self._grids) == 1:
            context = None
        key = (batch, tokens, context)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._compute(batch, tokens, context)
        return hit

    def prefill(self, tokens: int) -> float:
        """Seconds to prefill a `tokens`-token context for one request (its own pass).

        >>> m = StepCostModel([(1, [1, 9], [0.04, 0.08])], prefill=([100, 200], [0.2, 0.3]))
        >>> round(m.prefill(150), 3), round(StepCostModel([(1, [1, 9], [0.04, 0.08])]).prefill(17), 3)
        (0.25, 0.12)
        """
        key = (0, tokens, None)           # batch 0 never occurs in a step: the cache is shared
        hit = self._cache.get(key)
        if hit is None:
            if self._prefill is None:
                hit = self(1, tokens)
            else:
                hit = max(_interp(*self._prefill, tokens), MIN_STEP_S)
            self._cache[key] = hit
        return hit

    def chunk(self, tokens: int, offset: int) -> float:
        """Seconds a prefill chunk of `tokens` context tokens, after `offset` tokens of its
        context already hold KV, adds to a step (module docstring).

        >>> m = StepCostModel([(1, [1, 9], [0.04, 0.08])], chunk=(1e-3, 1e-6))
        >>> round(m.chunk(10, 1000), 5), round(m.keys_per_row)
        (0.02005, 1000)
        >>> p = StepCostModel([(1, [1, 9], [0.04, 0.08])], prefill=([100, 200], [0.2, 0.3]))
        >>> round(p.chunk(50, 100), 3), p.keys_per_row is None
        (0.05, True)
        """
        if tokens <= 0 or self._chunk is None:
            return super().chunk(tokens, offset)      # the prefill curve's slope
        row_s, key_s = self._chunk
        return row_s * tokens + key_s * tokens * (offset + (tokens - 1) / 2)

    @property
    def keys_per_row(self) -> float | None:
        """Earlier keys whose attention costs what one chunk row's linears do (the measured
        chunk fit's row_s ÷ key_s); None without a fit that has both."""
        if self._chunk is None or not self._chunk[0] or not self._chunk[1]:
            return None
        return self._chunk[0] / self._chunk[1]

    def _compute(self, batch: int, tokens: int, context: int | None) -> float:
        if context is None:
            return max(self._base(batch, tokens), MIN_STEP_S)
        at = [g(batch, tokens) for g in self._grids]
        return max(_interp(self.contexts, at, context), MIN_STEP_S)
