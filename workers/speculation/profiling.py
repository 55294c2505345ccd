"""Measure what a verification step costs on this machine: the step-cost profile (a plain dict,
the format `scheduler.profile.StepCostModel.from_doc` reads) by batch size and tree tokens.

Device work, so it lives with the verifier; the model that reads the numbers (interpolation) is
the scheduler's (scheduler/profile.py), and `specgate bench profile` (tools/bench_profile.py)
writes a full profile to a file.

For each batch size B, B requests are prefilled with `prompt_len`-token random prompts; then, for
each tree size n, every request gets a chain of n draft tokens (`TokenTree.chain`; the cost of a
pass depends on the rows it computes, not on the tree's shape) and `Verifier.verify` is timed: one
warm-up, then the median of `repeats` steps. The point recorded is

    tokens = B · (1 + n)   (each request's root row plus its n nodes)  →  step_s

Median, not minimum: the planner and the simulator need a typical step, noise included. Each curve
is made non-decreasing in tokens (`step_s_raw` keeps the medians as measured), because a negative
marginal cost would make the goodput-aware tree sizing (scheduler/sizing.py) hand out nodes for
free.

`startup_profile` measures a smaller grid every time a model is served (the gateway, each Ray
verifier replica, the generation loop of `specgate generate` and the benches): tree sizing is
only as good as its costs, and a shipped profile's machine is rarely the one serving. It is the
one start-up measurement: the planner sizes every request's tree from it.

`measure_chunks` measures what a prefill chunk adds to a step (chunked prefill): a step of
`batch` decoding requests is timed with and without a chunk of k context tokens of another
request, whose KV already holds o tokens, alternately (adjacent pairs see the same machine
state). The chunk's rows cost about the same each (the linears, no logits), and its attention
reads every earlier key, so the pairs' differences are fitted to

    extra_s(k, o) = row_s · k + key_s · k · (o + (k − 1) / 2)

(`scheduler.profile.fit_chunk_cost`, when a profile is loaded): the profile's `"chunk"` entry, which the planner weighs
chunks by and the simulator charges mixed steps from. `specgate bench profile` measures it;
`startup_profile` does not: the attention term only stands out of the noise thousands of keys
deep, and getting a request there is a prefill of seconds at every start (without a measured
fit the planner keeps its default weight, `scheduler.policies.step_budget.DEFAULT_KEYS_PER_ROW`).
"""
from __future__ import annotations

import datetime
import platform
import random
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from workers.model.device import elapsed

if TYPE_CHECKING:
    import torch

DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_NODES = (0, 1, 3, 7, 15)
DEFAULT_PREFILL = (64, 256, 1024)
# Start-up grid. Interleaved (`measure_profile`): requests are prefilled once (their context grows
# by a few dozen tokens over the grid, which moves a step by less than the noise) and 5 rounds
# time every point once each.
STARTUP_NODES = (0, 1, 3, 7)
STARTUP_BATCH1_NODES = (0, 1, 3, 7, 11, 15, 23, 31)
STARTUP_PROMPT_LEN = 128
STARTUP_REPEATS = 5
DEFAULT_CHUNK_TOKENS = (8, 24, 64)
DEFAULT_CHUNK_OFFSETS = (0, 1024, 3072)


def _monotone(ys: Sequence[float]) -> list[float]:
    out, top = [], 0.0
    for y in ys:
        top = max(top, y)
        out.append(top)
    return out


def _median_s(fn, repeats: int, device: Any = "cpu") -> float:
    """The median of `repeats` timings of `fn` on `device` (synchronised: workers/model/device.py)."""
    fn()                                                # warm-up
    return statistics.median(elapsed(fn, device) for _ in range(repeats))


def _headroom(nodes: Sequence[int], repeats: int, interleaved: bool) -> int:
    """Tokens a request may commit while the grid is timed (every step could accept its whole
    chain): one cell's steps, or, interleaved, every cell's, the requests never re-prefilled."""
    per_step = sum(n + 1 for n in set(nodes)) if interleaved else max(nodes) + 1
    return (repeats + 1) * per_step + 1       # + 1 warm-up step a cell


def measure_profile(verifier, *, batches: Sequence[int] = DEFAULT_BATCHES,
                    nodes: Sequence[int] = DEFAULT_NODES, prompt_len: int = 200,
                    repeats: int = 5, prefill_tokens: Sequence[int] = DEFAULT_PREFILL,
                    contexts: Sequence[int] = (), seed: int = 0,
                    interleaved: bool = False) -> dict[str, Any]:
    """Time `verifier` (a `workers.speculation.verifier.Verifier`) over the grid; returns the profile's
    `curves` (and `prefill`, and `contexts` when other contexts are asked for) in the format
    `StepCostModel.from_json` reads. `interleaved=True` prefills every batch once and times the
    grid in rounds, one step of each (batch, nodes) point a round: faster (contexts drift up by
    the tokens the steps commit), and a slow spell of a noisy machine costs each point one sample,
    which the median drops, instead of every sample of one point."""
    from workers.contract import SamplingParams
    from workers.speculation.tree import TokenTree
    from workers.speculation.verifier import VerifyItem

    if min(batches) < 1 or min(nodes) < 0 or prompt_len < 2 or repeats < 1:
        raise ValueError("need batches ≥ 1, nodes ≥ 0, prompt_len ≥ 2, repeats ≥ 1")
    if max(nodes) > verifier.max_tree_tokens:
        raise ValueError(f"{max(nodes)} nodes exceed the verifier's max_tree_tokens "
                         f"({verifier.max_tree_tokens})")
    rng = random.Random(seed)
    vocab = verifier.target.vocab_size
    device = verifier.target.device
    greedy = SamplingParams()
    headroom = _headroom(nodes, repeats, interleaved)
    ns = sorted(set(nodes))
    if min((prompt_len, *contexts)) < 2:
        raise ValueError("contexts must be ≥ 2 tokens")
    longest = max((prompt_len, *contexts))
    if longest + headroom > verifier.context_limit:
        raise ValueError(f"prompt_len {longest} + {headroom} tokens of steps exceed the "
                         f"model's context ({verifier.context_limit})")

    def prefill(rid: str, length: int) -> None:
        verifier.release(rid)
        verifier.prefill(rid, [rng.randrange(3, vocab) for _ in range(length)], greedy, headroom)

    def step(ids: list[str], n: int) -> None:
        verifier.verify([VerifyItem(rid, TokenTree.chain(
            [rng.randrange(3, vocab) for _ in range(n)])) for rid in ids])

    def curve(b: int, step_s: list[float]) -> dict[str, Any]:
        return {"batch": b, "nodes": ns, "tokens": [b * (1 + n) for n in ns],
                "step_s": _monotone(step_s), "step_s_raw": step_s}

    def grid(length: int) -> list[dict[str, Any]]:
        curves = []
        for b in sorted(set(batches)):
            ids = [f"b{b}r{i}" for i in range(b)]
            step_s = []
            for n in ns:
                for rid in ids:
                    prefill(rid, length)
                step_s.append(_median_s(lambda n=n: step(ids, n), repeats, device))
            for rid in ids:
                verifier.release(rid)
            curves.append(curve(b, step_s))
        return curves

    def grid_interleaved(length: int) -> list[dict[str, Any]]:
        groups = {b: [f"b{b}r{i}" for i in range(b)] for b in sorted(set(batches))}
        for ids in groups.values():
            for rid in ids:
                prefill(rid, length)
        points = [(b, n) for b in groups for n in ns]
        for b, n in points:                                 # warm-up
            step(groups[b], n)
        times: dict[tuple[int, int], list[float]] = {pt: [] for pt in points}
        for _ in range(repeats):
            for b, n in points:
                times[b, n].append(elapsed(lambda b=b, n=n: step(groups[b], n), device))
        for ids in groups.values():
            for rid in ids:
                verifier.release(rid)
        return [curve(b, [statistics.median(times[b, n]) for n in ns]) for b in groups]

    measure = grid_interleaved if interleaved else grid
    out: dict[str, Any] = {"curves": measure(prompt_len)}
    others = sorted(set(c for c in contexts if c != prompt_len))
    if others:
        out["contexts"] = [{"context": c, "curves": measure(c)} for c in others]
    lengths = sorted(set(t for t in prefill_tokens if 2 <= t < verifier.context_limit))
    if lengths:
        times = [_median_s(lambda t=t: prefill("prefill", t), repeats, device) for t in lengths]
        verifier.release("prefill")
        out["prefill"] = {"tokens": [t - 1 for t in lengths], "step_s": _monotone(times),
                          "step_s_raw": times}
    return out


def startup_profile(runtime, max_batch: int, max_tree_tokens: int = 31) -> dict[str, Any]:
    """This machine's step costs for the planner, measured once when a model is served: batches
    1, 2, 4, … up to `max_batch` (and `max_batch` itself) with STARTUP_NODES draft nodes each,
    and batch 1 further out, up to `max_tree_tokens` nodes (STARTUP_BATCH1_NODES): one stream
    can use deep trees, a full batch cannot afford them. A profile document. Measured on a
    verifier of its own over `runtime` (a `workers.runtime.Runtime`), without a prefix cache for
    the random prompts to fill."""
    deep = [n for n in STARTUP_BATCH1_NODES if n <= max(max_tree_tokens, max(STARTUP_NODES))]
    verifier = runtime.verifier(max_tree_tokens=max(deep), prefix_cache_mb=0)
    batches = sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch})
    room = verifier.context_limit
    while len(deep) > 1 and _headroom(deep, STARTUP_REPEATS, True) + 2 > room:
        deep.pop()                    # short-context models: fewer tree sizes
    nodes = [n for n in STARTUP_NODES if n <= max(deep)]
    prompt_len = max(2, min(STARTUP_PROMPT_LEN, room - _headroom(deep, STARTUP_REPEATS, True)))
    measured = measure_profile(verifier, batches=[1], nodes=deep, prompt_len=prompt_len,
                               repeats=STARTUP_REPEATS, prefill_tokens=(), interleaved=True)
    wider = [b for b in batches if b > 1]
    if wider:
        measured["curves"] += measure_profile(verifier, batches=wider, nodes=nodes,
                                              prompt_len=prompt_len, repeats=STARTUP_REPEATS,
                                              prefill_tokens=(), interleaved=True)["curves"]
    doc = profile_document(measured, model="serving", dtype=str(verifier.target.dtype).replace("torch.", ""),
                           device=describe_device(verifier.target), prompt_len=prompt_len,
                           repeats=STARTUP_REPEATS)
    doc["source"] = "measured at start-up (workers/speculation/profiling.py startup_profile)"
    return doc


def measure_chunks(verifier, *, chunk_tokens: Sequence[int] = DEFAULT_CHUNK_TOKENS,
                   offsets: Sequence[int] = DEFAULT_CHUNK_OFFSETS, batch: int = 4, nodes: int = 3,
                   prompt_len: int = 128, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """The profile's `"chunk"` entry: for each offset o and chunk size k, `repeats` pairs of
    steps of `batch` requests with `nodes`-node chains, one pair member also computing k pending
    context tokens of a request whose KV holds o (+ the chunks before it in the series) tokens.
    `points` are (offset at the chunk's start, k, median extra seconds), which the step-cost
    model fits (module docstring). Offsets that leave no room in the model's context are
    skipped."""
    from workers.contract import SamplingParams
    from workers.speculation.tree import TokenTree
    from workers.speculation.verifier import VerifyItem

    if batch < 1 or nodes < 0 or repeats < 1 or not chunk_tokens or min(chunk_tokens) < 1:
        raise ValueError("need batch ≥ 1, nodes ≥ 0, repeats ≥ 1 and chunks ≥ 1 token")
    rng = random.Random(seed)
    vocab = verifier.target.vocab_size
    greedy = SamplingParams()
    # the decoders commit up to nodes + 1 tokens a step, over every series' steps
    series = [(o, k) for o in sorted(set(offsets)) for k in sorted(set(chunk_tokens))]
    headroom = (2 * repeats + 1) * (nodes + 1) * len(series) + 1
    series = [(o, k) for o, k in series if o + k * (repeats + 1) + 2 <= verifier.context_limit]
    if not series or prompt_len + headroom > verifier.context_limit:
        return {}

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    ids = [f"chunk-b{i}" for i in range(batch)]
    for rid in ids:
        verifier.prefill(rid, tokens(prompt_len), greedy, headroom)

    def step(k: int = 0) -> float:
        items = [VerifyItem(rid, TokenTree.chain(tokens(nodes))) for rid in ids]
        if k:
            items.append(VerifyItem("chunk", TokenTree.chain([]), prefill=k, decode=False))
        return elapsed(lambda: verifier.verify(items), verifier.target.device)

    points = []
    for o, k in series:
        verifier.release("chunk")
        # pending context: o to reach the offset, then every timed chunk, never the whole (a
        # chunk that completes the context would add the root's row)
        verifier.prefill("chunk", tokens(o + k * (repeats + 1) + 2), greedy, 1, defer=True)
        if o:
            verifier.verify([VerifyItem("chunk", TokenTree.chain([]), prefill=o, decode=False)])
        step(k)                                             # warm-up, at this size
        extra = []
        for _ in range(repeats):
            with_chunk = step(k)
            extra.append(with_chunk - step())
        points.append((o + k * (1 + repeats // 2), k, statistics.median(extra)))
    for rid in (*ids, "chunk"):
        verifier.release(rid)
    return {"batch": batch, "nodes": nodes, "points": [list(p) for p in points]}


class DescribedForward(Protocol):
    """What `describe_device` reads of a forward (workers.model.llama_forward.LlamaForward has it)."""
    device: torch.device
    dtype: torch.dtype
    n_layers: int
    hidden: int


def describe_device(forward: DescribedForward) -> str:
    """One line: the device, threads, dtype and model size the numbers belong to."""
    import torch

    if forward.device.type == "cuda":
        where = torch.cuda.get_device_name(forward.device)
    else:
        where = _cpu_name() or platform.processor() or platform.machine()
        where = f"CPU {where}, {torch.get_num_threads()} threads"
    return (f"{where}, {str(forward.dtype).replace('torch.', '')}, "
            f"{forward.n_layers} layers, hidden {forward.hidden}")


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def profile_document(measured: dict[str, Any], *, model: str, dtype: str, device: str,
                     prompt_len: int, repeats: int) -> dict[str, Any]:
    return {
        "source": f"specgate bench profile, {model}",
        "device": device,
        "date": datetime.date.today().isoformat(),
        "model": model,
        "dtype": dtype,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "note": ("step_s = median wall time of one Verifier.verify over the batch (chain trees); "
                 "tokens = batch × (1 + nodes); prefill = one request's Verifier.prefill; "
                 "contexts = the same curves with every request holding `context` tokens "
                 "(the top-level curves: `prompt_len`); chunk = what a prefill chunk of k "
                 "tokens at offset o adds to a step, row_s·k + key_s·k·(o + (k − 1)/2)"),
        **measured,
    }

