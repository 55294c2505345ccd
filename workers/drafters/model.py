"""Model drafter: a small causal LM proposes the tree, keeping its own KV per request.

Any model directory whose tokenizer is the target's works (`workers.drafters.neural.draft_model`); one built by
`specgate draft build` attends sink + window, so its KV stays constant-size.

Per request the drafter keeps the draft's KV of every committed token except the root, as the
verifier does for the target. A call first feeds what was committed since the last call (the
accepted tokens and the bonus; on the first call the whole prompt, in chunks), then grows the tree
one depth per forward pass; the tree's own rows are dropped from the KV before returning, so the
KV always matches the committed text whatever the verifier accepted.

Tree shapes (``mode``):
* "dynamic" (EAGLE-2 style, default): at each depth, the ``width`` candidates with the highest
  cumulative draft log-probability (over all children of the last depth's nodes, ``top_k`` each)
  join the tree, until ``max_nodes`` or ``max_depth``. A confident draft goes deep and narrow, an
  unsure one wide and shallow.
* "widths" (SpecInfer's width vector ⟨k1,…,kd⟩): every node at depth i − 1 gets its top k_i
  children, cut to ``max_nodes`` in breadth-first order.
* ``sample=True``: one chain whose tokens are drawn from the draft's distribution q (seeded per
  request and position), with q attached to every node (`TokenTree.draft_probs`), so multi-step
  speculative sampling accepts with min(1, p/q) and stays exact; deterministic trees carry no q
  (one-hot), which is exact too.

All requests of a call share each forward pass (`propose_batch`), as the verifier's do.

Device: the draft's weights, its KV, the positions and masks it builds and its logits all live
on the forward's device (`ModelDrafter.load(device=...)`; a `BatchWorker` creates model drafters
on its verifier's device). What the tree needs crosses to the host once per forward pass, for
all rows of the pass together: the top-k log-probabilities and ids (or, sampling, the rows' q,
which the tree carries); parent pointers go the other way, as one small visibility matrix per
request and pass.
"""
from __future__ import annotations

import heapq
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from workers.drafters.neural.cheap_head import CheapHead, read_head
from workers.contract import DraftContext, TreeBudget
from workers.model.device import resolve_device
from workers.drafters.neural.draft_model import DraftSpec, SparseKV, read_spec, sparse_mask
from workers.drafters.base import Drafter
from workers.model.llama_forward import LlamaForward, Segment
from workers.speculation.tree import TokenTree

__all__ = ["ModelDrafter", "is_model_dir", "one_off_catch_up"]

PREFILL_CHUNK = 128        # prompt rows per pass: bounds the KV a windowed draft needs
MAX_TREE_ROWS = 128        # draft KV rows a tree may hold while it grows (its expanded nodes)


def one_off_catch_up(seconds: float, fed: Sequence[int], depths: Sequence[int]) -> float:
    """The one-off part of a catch-up that took `seconds` to feed `fed` tokens per request: a step
    of steady drafting feeds at most a tree's depth + 1 tokens (its accepted path and the bonus),
    so rows beyond that (a prompt, an idle stretch) are one-off, pro rata.

    >>> round(one_off_catch_up(0.2, [200, 3], [4, 4]), 3)    # a prompt of 200 beside a steady one
    0.192
    >>> one_off_catch_up(0.01, [2, 5], [4, 4])
    0.0
    """
    total = sum(max(0, n) for n in fed)
    if total == 0:
        return 0.0
    extra = sum(max(0, n - (d + 1)) for n, d in zip(fed, depths))
    return seconds * extra / total


def is_model_dir(name: str) -> bool:
    """Whether a drafter name is a model directory (it holds config.json)."""
    try:
        return (Path(name) / "config.json").is_file()
    except (OSError, ValueError):
        return False


@dataclass
class _State:
    kv: SparseKV
    fed: list[int]        # tokens fed so far, the last root included (its KV is cached too)
    root_logits: torch.Tensor | None = None   # [V] the draft's logits at the last root fed
    request_id: str = ""


@dataclass
class _Node:
    token: int
    parent: int           # index among the request's nodes, -1 = child of the root
    depth: int
    logp: float           # cumulative draft log-probability from the root
    q: np.ndarray | None = None   # [V] the distribution the token was drawn from (sample mode)
    slot: int = -1        # its KV row among the tree rows once expanded, -1 = not expanded


class ModelDrafter(Drafter):
    batched = True                 # propose_batch: one forward pass per tree level for all requests

    def __init__(self, forward: LlamaForward, spec: DraftSpec | None = None, *, name: str = "model",
                 mode: str = "dynamic", top_k: int = 4, width: int = 4,
                 widths: Sequence[int] = (4, 2, 1, 1), sample: bool = False, seed: int = 0):
        if mode not in ("dynamic", "widths"):
            raise ValueError(f"mode must be 'dynamic' or 'widths', not {mode!r}")
        if top_k < 1 or width < 1 or not widths or min(widths) < 1:
            raise ValueError("top_k, width and every width must be >= 1")
        self.forward = forward
        self.device = forward.device   # where every tensor the drafter builds lives
        self.spec = spec or DraftSpec()
        self.name = name
        self.mode = mode
        self.top_k = top_k
        self.width = width
        self.widths = tuple(int(w) for w in widths)
        self.sample = sample
        self.seed = seed
        self._states: dict[str, _State] = {}

    @classmethod
    def load(cls, path: str | Path, *, dtype: torch.dtype | None = None,
             device: str | torch.device = "auto", **options) -> "ModelDrafter":
        """A drafter from a model directory (its specgate_draft.json, if any, sets the attention
        and the dtype it drafts in; `dtype` overrides that). `device`: where its weights, KV and
        step tensors live (workers/model/device.py; 'auto' takes CUDA when torch sees a GPU, so a
        draft replica with no GPU runs on its CPUs)."""
        from transformers import AutoModelForCausalLM

        spec = read_spec(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or spec.torch_dtype).eval().to(
            resolve_device(device))
        options.setdefault("name", str(path))
        # the draft attends as its spec says over a cache packed to sink + window (slots are not
        # positions), so the forward applies no window of the model's own
        forward = LlamaForward(model, windowed=False)
        kept = read_head(path)
        if kept is not None:                    # a cheap head (workers/drafters/neural/cheap_head.py)
            forward.lm_head = CheapHead(model.lm_head.weight, kept, forward.gemm)
        return cls(forward, spec, **options)

    # -- the Drafter protocol -------------------------------------------------------------------

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        return self.propose_batch([(ctx, budget)])[0]

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def kv_length(self, request_id: str) -> int:
        """Cached draft KV slots of a request (0 when none): constant-bounded for a windowed draft."""
        state = self._states.get(request_id)
        return state.kv.length if state else 0

    def propose_batch(self, items: Sequence[tuple[DraftContext, TreeBudget]]) -> list[TokenTree]:
        trees = [TokenTree.empty()] * len(items)
        self.catch_up_s = 0.0          # a call that feeds nothing leaves no one-off behind
        live = [(i, ctx, b) for i, (ctx, b) in enumerate(items) if b.speculates and len(ctx.tokens) > 0]
        if not live:
            return trees
        states = [self._sync(ctx) for _, ctx, _ in live]
        fed = [len(ctx.tokens) - len(s.fed) for s, (_, ctx, _) in zip(states, live)]
        t0 = time.perf_counter()
        root_logits = self._catch_up(states, [ctx.tokens for _, ctx, _ in live])       # [R, V]
        self.catch_up_s = one_off_catch_up(time.perf_counter() - t0, fed, [b.max_depth for _, _, b in live])
        built = self._grow([ctx for _, ctx, _ in live], [b for _, _, b in live], states, root_logits)
        for (i, _, _), nodes in zip(live, built):
            trees[i] = _as_tree(nodes, self.sample)
        return trees

    # -- keeping the KV in step with commits ------------------------------------------------------

    def _sync(self, ctx: DraftContext) -> _State:
        """The request's state, reset if the context is not a continuation of what was fed."""
        state = self._states.get(ctx.request_id)
        n = len(state.fed) if state else 0
        if state is None or n > len(ctx.tokens) or (n and ctx.tokens[n - 1] != state.fed[-1]):
            state = _State(SparseKV(self.forward.new_cache, self.spec, PREFILL_CHUNK + MAX_TREE_ROWS), [],
                           request_id=ctx.request_id)
            self._states[ctx.request_id] = state
        return state

    def _catch_up(self, states: list[_State], contexts: list[Sequence[int]]) -> torch.Tensor:
        """Feed each request's committed tokens not yet fed, the root last, in chunks; all requests
        share each pass. The root's KV stays (tree rows see it; `fed` includes it, so the next call
        starts after it). Returns the logits at every root: [R, V]."""
        out: list[torch.Tensor | None] = [s.root_logits for s in states]
        # A request with nothing new (asked twice between commits) reuses its last root's logits.
        todo = {r: list(ctx[len(s.fed):]) for r, (s, ctx) in enumerate(zip(states, contexts))
                if len(ctx) > len(s.fed)}
        while todo:
            ids, pos, segs, last_rows, finishing = [], [], [], [], []
            for r, pending in todo.items():
                chunk = pending[:PREFILL_CHUNK]
                s = states[r]
                start = len(s.fed)
                positions = torch.arange(start, start + len(chunk), device=self.device)
                s.kv.make_room(len(chunk), start)
                own = sparse_mask(positions, positions, self.spec.sink, self.spec.window)
                segs.append(Segment(s.kv.cache, len(ids), len(chunk), own, s.kv.past_mask(positions)))
                ids.extend(chunk)
                pos.append(positions)
                if len(chunk) == len(pending):
                    last_rows.append(len(ids) - 1)
                    finishing.append(r)
            logits = self._feed(torch.tensor(ids, device=self.device), torch.cat(pos), segs,
                                torch.tensor(last_rows, device=self.device) if last_rows else None,
                                [states[r] for r in todo])
            for r, seg, positions in zip(list(todo), segs, pos):
                states[r].kv.append(positions)
                states[r].fed.extend(todo[r][: seg.rows])
                todo[r] = todo[r][seg.rows:]
            for k, r in enumerate(finishing):
                out[r] = states[r].root_logits = logits[k]
                del todo[r]
        return torch.stack(out)

    def _feed(self, ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
              logit_rows: torch.Tensor | None, states: list[_State]) -> torch.Tensor | None:
        """One pass over committed tokens (`states`: each segment's request); a draft that reads
        more than the tokens (workers/drafters/memory.py) adds it here."""
        return self.forward.forward(ids, positions, segments, logit_rows)

    # -- growing the tree ----------------------------------------------------------------------

    def _grow(self, contexts: list[DraftContext], budgets: list[TreeBudget], states: list[_State],
              root_logits: torch.Tensor) -> list[list[_Node]]:
        """Expand every request's tree depth by depth, one forward pass per depth for all of them;
        returns each request's chosen nodes, parents first."""
        seen: list[list[_Node]] = [[] for _ in states]     # every node drafted, parents first
        for r, s in enumerate(states):
            s.kv.make_room(MAX_TREE_ROWS, len(s.fed))       # the only move: tree rows stay put
        # committed KV length, restored at the end: read once `make_room` has packed the cache
        # (read before, a packed cache would be "restored" past what it holds)
        base = [s.kv.length for s in states]
        frontier = self._children([(contexts[r], -1, 0, 0.0) for r in range(len(states))], root_logits)
        width = None if self.sample or self.mode == "widths" else self.width   # `pick`
        try:
            for depth in range(1, max(b.max_depth for b in budgets) + 1):
                expand: list[tuple[int, list[int]]] = []     # (request, its nodes to expand now)
                for r, cands in enumerate(frontier):
                    first = len(seen[r])
                    seen[r].extend(cands)
                    if depth < budgets[r].max_depth and cands:
                        kv = states[r].kv
                        room = min(kv.cache.capacity - kv.length, MAX_TREE_ROWS - (kv.length - base[r]))
                        picked = pick(seen[r], first, budgets[r], width)[:max(room, 0)]
                        if picked:
                            expand.append((r, picked))
                frontier = [[] for _ in states]
                if not expand:
                    break
                logits = self._tree_pass(states, seen, expand, base)               # [rows, V]
                rows = [(r, i) for r, picked in expand for i in picked]
                kids = self._children([(contexts[r], i, depth, seen[r][i].logp) for r, i in rows], logits)
                for (r, _), children in zip(rows, kids):
                    frontier[r].extend(children)
        finally:
            for s, n in zip(states, base):
                s.kv.cache.length = n                        # forget the tree rows: only commits stay
        ranked = self.mode == "dynamic" and not self.sample
        return [choose(nodes, b, ranked) for nodes, b in zip(seen, budgets)]

    def _children(self, rows: list[tuple[DraftContext, int, int, float]],
                  logits: torch.Tensor) -> list[list[_Node]]:
        """Candidate children of each row (its context, node index, depth and cumulative log-prob;
        every row of a pass is at one depth) from the rows' logits [rows, V]: its top-k (dynamic),
        top k_{depth+1} (widths), or one token drawn from q (sample). One copy to the host for
        all rows: the top-k log-probabilities and ids, or each row's q."""
        logq = torch.log_softmax(logits.float(), dim=-1)          # [rows, V] on the device
        if self.sample:
            qs = logq.double().exp().cpu().numpy()                 # [rows, V] on the host: trees carry q
            return [[self._draw(ctx, parent, depth, logp, q)] for (ctx, parent, depth, logp), q in zip(rows, qs)]
        depth = rows[0][2]
        k = self.top_k if self.mode == "dynamic" else self.widths[min(depth, len(self.widths) - 1)]
        vals, toks = torch.topk(logq, k)                           # [rows, k] each
        # one copy for both: float64 holds every float32 value and token id exactly
        host = torch.cat([vals.double(), toks.double()], dim=1).tolist()   # [rows, 2k]
        return [[_Node(int(t), parent, depth + 1, logp + v) for v, t in zip(h[:k], h[k:])]
                for (_, parent, depth, logp), h in zip(rows, host)]

    def _draw(self, ctx: DraftContext, parent: int, depth: int, logp: float, q: np.ndarray) -> _Node:
        """One child drawn from q ([V], on the host), seeded by request and position: a retried
        step drafts the same chain."""
        q /= q.sum()
        rng = np.random.default_rng([self.seed, zlib.crc32(ctx.request_id.encode()), len(ctx.tokens), depth])
        tok = min(int(np.searchsorted(np.cumsum(q), rng.random(), side="right")), q.size - 1)
        if q[tok] <= 0:
            tok = int(np.argmax(q))
        return _Node(tok, parent, depth + 1, logp + float(np.log(q[tok])), q)

    def _tree_pass(self, states: list[_State], nodes: list[list[_Node]],
                   expand: list[tuple[int, list[int]]], base: list[int]) -> torch.Tensor:
        """One forward pass over the nodes to expand; each sees the committed KV and its ancestors
        (expanded earlier, so held in the KV after the committed slots). Returns [rows, V]."""
        ids, pos, segs = [], [], []
        for r, idx in expand:
            s, tree = states[r], nodes[r]
            root_pos = len(s.fed) - 1
            positions = torch.tensor([root_pos + tree[i].depth for i in idx], device=self.device)
            past = s.kv.past_mask(positions)                      # [rows, committed + tree rows]
            # the tree rows held so far: each new row sees its ancestors among them, nothing else
            held = s.kv.length - base[r]
            ancestors = np.zeros((len(idx), held), dtype=bool)    # [rows, held], from parent pointers
            for row, i in enumerate(idx):
                a = tree[i].parent
                while a >= 0:
                    ancestors[row, tree[a].slot] = True
                    a = tree[a].parent
            if held:
                seen = torch.tensor(ancestors, device=self.device)
                past[:, base[r]:] = torch.zeros_like(past[:, base[r]:]).masked_fill_(~seen, float("-inf"))
            for k, i in enumerate(idx):
                tree[i].slot = held + k
            segs.append(Segment(s.kv.cache, len(ids), len(idx), _diagonal(len(idx), self.device), past))
            ids.extend(tree[i].token for i in idx)
            pos.append(positions)
        logits = self.forward.forward(torch.tensor(ids, device=self.device), torch.cat(pos), segs,
                                      torch.arange(len(ids), device=self.device))
        for (r, _), p in zip(expand, pos):
            states[r].kv.append(p)
        return logits


def pick(nodes: list[_Node], first: int, budget: TreeBudget, width: int | None) -> list[int]:
    """Which of the nodes drafted at this depth (indices first..) to expand; `width` None: every
    one within the node budget, breadth-first ("widths" mode, or a sampled chain)."""
    new = range(first, len(nodes))
    if width is None:
        return [i for i in new if i < budget.max_nodes]   # breadth-first within the node budget
    # Dynamic: the `width` best by cumulative log-probability, and only those that can still be
    # chosen: a node's children are less likely than itself, so once max_nodes drafted nodes
    # beat it, nothing below it can enter the tree.
    order = sorted(new, key=lambda i: -nodes[i].logp)[:width]
    if len(nodes) > budget.max_nodes:
        cut = heapq.nlargest(budget.max_nodes, (n.logp for n in nodes))[-1]
        order = [i for i in order if nodes[i].logp > cut]
    return order


def choose(nodes: list[_Node], budget: TreeBudget, ranked: bool) -> list[_Node]:
    """The tree: with `ranked` (dynamic mode) the max_nodes most likely nodes (EAGLE-2's
    re-ranking; a parent is at least as likely as its child, so the set keeps every chosen node's
    path), else every node within the budget; either way at depth <= max_depth, parents first,
    re-indexed."""
    ok = [i for i, n in enumerate(nodes) if n.depth <= budget.max_depth]
    if ranked:
        order = sorted(ok, key=lambda i: (-nodes[i].logp, nodes[i].depth))
        chosen: set[int] = set()
        for i in order:
            if len(chosen) >= budget.max_nodes:
                break
            if nodes[i].parent < 0 or nodes[i].parent in chosen:
                chosen.add(i)
        ok = sorted(chosen)
    else:
        ok = ok[: budget.max_nodes]
    index = {old: new for new, old in enumerate(ok)}
    return [_Node(nodes[i].token, index.get(nodes[i].parent, -1), nodes[i].depth, nodes[i].logp, nodes[i].q)
            for i in ok]


def _as_tree(nodes: list[_Node], sample: bool) -> TokenTree:
    """Chosen nodes (parents first) as a TokenTree; siblings are distinct (top-k of one row)."""
    probs = tuple(n.q for n in nodes) if sample else None
    return TokenTree(tuple(n.token for n in nodes), tuple(n.parent for n in nodes), probs)


def _diagonal(n: int, device: torch.device) -> torch.Tensor:
    """[n, n] additive mask: each row sees itself only (the other rows of a pass are its
    siblings or cousins, never its ancestors: those were expanded in earlier passes)."""
    m = torch.full((n, n), float("-inf"), device=device)
    m.fill_diagonal_(0.0)
    return m
