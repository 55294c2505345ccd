"""Suffix drafter on hand-written corpora: longest match, frequency order, pruning, depth rule, budget,
per-tenant caches (isolation, FIFO eviction by outputs and by tokens), per-request state."""

import itertools

import numpy as np
import pytest

from workers.drafters.base import Drafter

from workers.contract import NO_SPECULATION, DraftContext, TreeBudget
from workers.drafters.registry import create_drafter, drafter_names
from workers.drafters.suffix import SuffixDrafter
from workers.drafters.suffix_index import Stream as _Stream
from workers.speculation.tree import TokenTree, depths

BIG = TreeBudget(32, 32)
_IDS = itertools.count()


def ctx(tokens, request_id="q", tenant="A", prompt_len=None):
    return DraftContext(request_id, tenant, list(tokens), len(tokens) if prompt_len is None else prompt_len)


def finish(drafter, output, tenant="A", prompt=(), request_id=None):
    """A request that generated ``output`` after ``prompt`` ends: its text goes to the tenant's cache."""
    request_id = request_id or f"done-{next(_IDS)}"
    drafter.propose(ctx(list(prompt) + list(output), request_id, tenant, len(prompt)), NO_SPECULATION)
    drafter.release(request_id)


def paths(tree):
    out = []
    for tok, par in zip(tree.tokens, tree.parents):
        out.append((out[par] if par >= 0 else ()) + (tok,))
    return out


# --- matching and scoring -----------------------------------------------------------------------


def test_docstring_example():
    a, b, c, d, e, f, x = range(10, 17)
    s = SuffixDrafter()
    finish(s, [a, b, c, d])
    finish(s, [a, b, c, e])
    finish(s, [x, a, b, c, f], tenant="B")
    assert s.propose(ctx([x, a, b, c]), BIG) == TokenTree((e, d), (-1, -1))
    assert s.propose(ctx([a, b, c, a, b, c], "q2"), BIG) == TokenTree((a, e, d, b, c), (-1, -1, -1, 0, 3))


def test_longest_match_wins_over_more_frequent_shorter_ones():
    s = SuffixDrafter(depth_factor=8)
    for _ in range(3):
        finish(s, [7, 2, 3, 8])  # "2 3" → 8, three times
    finish(s, [1, 2, 3, 9])      # "1 2 3" → 9, once
    assert s.propose(ctx([5, 1, 2, 3]), BIG) == TokenTree.chain([9])
    assert s.propose(ctx([5, 4, 2, 3], "q2"), BIG) == TokenTree((8, 9), (-1, -1))  # "2 3" only: 3 : 1


def test_long_matches_up_to_max_match():
    rng = np.random.default_rng(0)
    text = rng.integers(100, 10_000, size=60).tolist()
    s = SuffixDrafter(max_match=32, depth_factor=1)
    finish(s, text)
    # Decoys share ever longer suffixes of text[:40] but continue differently, and are more recent.
    for n in (2, 5, 9, 20, 31):
        finish(s, text[40 - n : 40] + [1, 2, 3, 4])
    tree = s.propose(ctx([7] + text[:40]), BIG)
    assert tree == TokenTree.chain(text[40:60])  # m = 32 (capped at max_match) → depth 32 allowed, 20 exist
    tree = s.propose(ctx([7] + text[40 - 31 : 40], "q2"), BIG)  # m = 31 ties text and the 31-decoy
    assert tree.tokens[:2] == (1, text[40]) and tree.parents[:2] == (-1, -1)


def test_own_text_is_matched_and_excludes_itself():
    s = SuffixDrafter()
    assert s.propose(ctx([1, 2, 3, 4, 5, 1, 2]), BIG) == TokenTree.chain([3, 4])  # m = 2 → depth 2
    assert s.propose(ctx([1, 2, 3, 4], "q2"), BIG) == TokenTree.empty()
    assert s.propose(ctx([], "q3"), BIG) == TokenTree.empty()
    # Periodic text: the nearest earlier occurrence (m = 10, 2 tokens back) continues into the root
    # and on as a copy with period 2.
    assert s.propose(ctx([5, 6] * 6, "q4"), BIG) == TokenTree.chain([5, 6] * 5)
    # m = 7 ("1 2 3 4 5 1 2", 5 back), α = 1 → depth 7.
    assert s.propose(ctx([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], "q5"), BIG) == TokenTree.chain([3, 4, 5, 1, 2, 3, 4])


def test_frequencies_order_children_and_min_prob_prunes():
    s = SuffixDrafter(min_prob=0.1)
    for out in ([1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 3, 10], [1, 2, 3, 10], [1, 2, 3, 12]):
        finish(s, out)
    # "1 2 3" five times: 10 ×3, 11 ×1, 12 ×1 (12 most recent): the count decides, then recency.
    assert s.propose(ctx([9, 1, 2, 3]), BIG) == TokenTree((10, 12, 11), (-1, -1, -1))
    s.min_prob = 0.3
    assert s.propose(ctx([9, 1, 2, 3], "q2"), BIG) == TokenTree.chain([10])
    s.min_prob = 0.7
    assert s.propose(ctx([9, 1, 2, 3], "q3"), BIG) == TokenTree.empty()


def test_probability_is_the_product_along_the_path():
    s = SuffixDrafter(min_prob=0.3, depth_factor=4)
    # "1 2" → 5 6 (twice), 5 7 (twice), 8 (once): P(5) = .8, P(5 6) = P(5 7) = .4, P(8) = .2 < .3
    for out in ([1, 2, 5, 6], [1, 2, 5, 7], [1, 2, 5, 6], [1, 2, 5, 7], [1, 2, 8]):
        finish(s, out)
    assert s.propose(ctx([9, 1, 2]), BIG) == TokenTree((5, 7, 6), (-1, 0, 0))
    s.min_prob = 0.5
    assert s.propose(ctx([9, 1, 2], "q2"), BIG) == TokenTree.chain([5])


def test_depth_is_bounded_by_match_length_and_budget():
    out = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    for factor, text, want in (
        (1.0, [0, 1, 2], 2),        # m = 2 → depth 2
        (1.0, [1, 2, 3, 4], 4),     # m = 4
        (2.0, [0, 1, 2], 4),        # α = 2
        (0.3, [0, 1, 2], 1),        # at least one token
        (100, [0, 1, 2], 10),       # the continuation ends
    ):
        s = SuffixDrafter(depth_factor=factor)
        finish(s, out)
        tree = s.propose(ctx(text), BIG)
        assert max(depths(tree)) == want, (factor, text)
    s = SuffixDrafter(depth_factor=100)
    finish(s, out)
    assert s.propose(ctx([0, 1, 2]), TreeBudget(32, 3)) == TokenTree.chain([3, 4, 5])
    assert s.propose(ctx([0, 1, 2], "q2"), TreeBudget(2, 32)) == TokenTree.chain([3, 4])


def test_min_match_and_zero_budget():
    s = SuffixDrafter(min_match=3)
    finish(s, [1, 2, 3, 4])
    assert s.propose(ctx([0, 2, 3]), BIG) == TokenTree.empty()  # only 2 tokens match
    assert s.propose(ctx([1, 2, 3], "q2"), BIG) == TokenTree.chain([4])
    assert s.propose(ctx([1, 2, 3], "q3"), NO_SPECULATION) == TokenTree.empty()
    assert s.propose(ctx([1, 2, 3], "q4"), TreeBudget(4, 0)) == TokenTree.empty()


def test_prompt_tail_keys_the_start_of_an_output():
    s = SuffixDrafter(max_match=4)
    prompt = [50, 51, 52, 53, 54, 55]
    finish(s, [60, 61, 62], prompt=prompt)
    # A new request with the same prompt: its first output tokens come from the cache.
    assert s.propose(ctx(prompt, "q2"), BIG) == TokenTree.chain([60, 61, 62])
    # Only the last max_match prompt tokens were kept: 50 51 is not in the cache.
    assert s.propose(ctx([9, 50, 51], "q3"), BIG) == TokenTree.empty()


# --- brute-force reference ----------------------------------------------------------------------


def reference(own, docs, budget, min_match, max_match, min_prob, factor):
    """(m, occurrences' continuations) by brute force, as the drafter defines them."""
    for m in range(min(max_match, len(own)), min_match - 1, -1):
        suffix = own[-m:]
        conts = []
        for e in range(m - 1, len(own) - 1):  # own text: the copy goes on past the root, period p
            if own[e - m + 1 : e + 1] == suffix:
                copy = own[e + 1 :]
                conts.append(tuple(copy[k % len(copy)] for k in range(40)))
        for doc in docs:
            for e in range(m - 1, len(doc) - 1):
                if doc[e - m + 1 : e + 1] == suffix:
                    conts.append(tuple(doc[e + 1 :]))
        if conts:
            return m, conts
    return 0, []


@pytest.mark.parametrize("seed", range(60))
def test_agrees_with_brute_force(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 5))
    docs = [rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist() for _ in range(int(rng.integers(0, 6)))]
    own = rng.integers(0, vocab, size=int(rng.integers(1, 25))).tolist()
    budget = TreeBudget(int(rng.integers(0, 12)), int(rng.integers(0, 7)))
    opts = dict(min_match=int(rng.integers(1, 3)), max_match=int(rng.integers(3, 9)),
                min_prob=float(rng.choice([0.0, 0.1, 0.3])), depth_factor=float(rng.choice([0.5, 1.0, 3.0])),
                max_occurrences=10_000, max_scan=10_000)
    s = SuffixDrafter(**opts)
    for d in docs:
        finish(s, d)
    tree = s.propose(ctx(own), budget)
    m, conts = reference(own, docs, budget, opts["min_match"], opts["max_match"], opts["min_prob"], opts["depth_factor"])
    if not budget.speculates or m == 0:
        assert tree == TokenTree.empty()
        return
    limit = min(budget.max_depth, max(1, int(opts["depth_factor"] * m)))
    count = {}
    for c in conts:
        for n in range(1, min(limit, len(c)) + 1):
            count[c[:n]] = count.get(c[:n], 0) + 1
    eligible = {p for p, n in count.items() if n >= opts["min_prob"] * len(conts) - 1e-9}
    # Every node is an eligible continuation; the tree is closed under parents (a TokenTree).
    got = paths(tree)
    assert len(got) <= budget.max_nodes and set(got) <= eligible
    assert all(d <= limit for d in depths(tree))
    # Best-first: nodes in order of non-increasing count; nothing left out beats a kept node
    # unless it hangs below a left-out parent.
    counts = [count[p] for p in got]
    assert counts == sorted(counts, reverse=True)
    frontier = {p for p in eligible - set(got) if len(p) == 1 or p[:-1] in set(got)}
    if len(got) < budget.max_nodes:
        assert not frontier
    elif frontier:
        assert max(count[p] for p in frontier) <= min(counts)


# --- incremental per-request index --------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_incremental_equals_from_scratch(seed):
    rng = np.random.default_rng(100 + seed)
    text = rng.integers(0, 5, size=300).tolist()
    s = SuffixDrafter(min_match=1, max_match=8)
    finish(s, rng.integers(0, 5, size=50).tolist())
    length = int(rng.integers(1, 20))
    while length <= len(text):
        budget = TreeBudget(int(rng.integers(0, 10)), int(rng.integers(0, 5)))
        fresh = SuffixDrafter(min_match=1, max_match=8)
        fresh._tenants = s._tenants
        c = ctx(text[:length], prompt_len=3)
        assert s.propose(c, budget) == fresh.propose(c, budget)
        length += int(rng.integers(1, 6))


def test_rebuilds_when_the_context_changes_and_release_frees_state():
    s = SuffixDrafter(min_match=1)
    s.propose(ctx([1, 2, 3, 1, 2, 4, 1, 2]), BIG)
    for tokens in ([1, 2, 3, 1], [9, 8, 7, 9, 8, 7, 9], [1, 2, 3, 1, 2, 4, 1, 2, 5, 1]):
        assert s.propose(ctx(tokens), BIG) == SuffixDrafter(min_match=1).propose(ctx(tokens), BIG)
    s.propose(ctx([4, 4], "other"), NO_SPECULATION)
    assert set(s._requests) == {"q", "other"}
    s.release("q")
    s.release("other")
    s.release("never-seen")
    assert s._requests == {}


def test_accepts_numpy_context():
    s = SuffixDrafter()
    c = DraftContext("r", "A", np.array([1, 2, 3, 1, 2]), 2)
    assert s.propose(c, BIG) == TokenTree.chain([3, 1])
    s.release("r")
    assert s.propose(ctx([7, 1, 2]), BIG) == TokenTree.chain([3, 1])  # the output went to the cache


def test_release_reads_the_callers_grown_context():
    """BatchWorker extends the context list in place after the last propose: the cache sees it all."""
    s = SuffixDrafter()
    tokens = [1, 2, 3]
    s.propose(DraftContext("r", "A", tokens, 3), BIG)
    tokens.extend([4, 5, 6, 7])
    s.release("r")
    assert s.propose(ctx([0, 5, 6]), BIG) == TokenTree.chain([7])
    # A context that changed under it (not grown) falls back to what was indexed.
    tokens = [1, 2, 3, 8, 9]
    s.propose(DraftContext("r2", "B", tokens, 3), BIG)
    tokens[:] = [6, 6]
    s.release("r2")
    assert s.propose(ctx([0, 3, 8], tenant="B"), BIG) == TokenTree.chain([9])


# --- tenants and eviction -----------------------------------------------------------------------


def test_tenant_isolation():
    secret = [1, 2, 3, 40, 41, 42, 43]
    a = SuffixDrafter()
    finish(a, secret, tenant="A")
    assert a.propose(ctx([9, 1, 2, 3], tenant="A"), BIG).tokens[:1] == (40,)
    assert a.propose(ctx([9, 1, 2, 3], "q2", tenant="B"), BIG) == TokenTree.empty()
    # B's drafts are the same whether A's cache is empty or huge.
    rng = np.random.default_rng(0)
    b_outputs = [rng.integers(0, 30, size=40).tolist() for _ in range(20)]
    b_contexts = [rng.integers(0, 30, size=int(n)).tolist() for n in rng.integers(3, 60, size=30)]
    quiet, busy = SuffixDrafter(max_tokens=5000), SuffixDrafter(max_tokens=5000)
    for i, out in enumerate(b_outputs):
        for _ in range(50 if i % 2 else 0):
            finish(busy, rng.integers(0, 30, size=40).tolist(), tenant="A")
        finish(quiet, out, tenant="B")
        finish(busy, out, tenant="B")
    assert busy._tenants["A"].tokens > 1000
    drafted = 0
    for i, c in enumerate(b_contexts):
        t1 = quiet.propose(ctx(c, f"b{i}", tenant="B"), BIG)
        t2 = busy.propose(ctx(c, f"b{i}", tenant="B"), BIG)
        assert t1 == t2
        drafted += len(t1)
    assert drafted > 0


def test_fifo_eviction_by_requests():
    s = SuffixDrafter(max_requests=2)
    for first in (10, 20, 30):
        finish(s, [first, 1, 2, first + 1])
    cache = s._tenants["A"]
    assert list(cache.lengths) == [4, 4]
    assert s.propose(ctx([10, 1, 2]), BIG) == TokenTree((31, 21), (-1, -1))  # 11 is gone
    assert s.propose(ctx([9, 10, 1], "q2"), BIG) == TokenTree.empty()


def test_fifo_eviction_by_tokens():
    s = SuffixDrafter(max_tokens=10, max_requests=100)
    finish(s, [10, 1, 2, 11])
    finish(s, [20, 1, 2, 21])
    assert s._tenants["A"].tokens == 8
    finish(s, [30, 1, 2, 31])          # 12 > 10: the oldest goes
    assert s._tenants["A"].tokens == 8
    assert s.propose(ctx([5, 1, 2]), BIG) == TokenTree((31, 21), (-1, -1))
    finish(s, list(range(100, 120)))   # longer than the whole cache: its last 10 tokens stay, alone
    cache = s._tenants["A"]
    assert cache.tokens == 10 and list(cache.lengths) == [10]
    assert s.propose(ctx([5, 1, 2], "q2"), BIG) == TokenTree.empty()
    assert s.propose(ctx([110, 111], "q3"), BIG) == TokenTree.chain([112, 113])


def test_eviction_keeps_the_index_bounded_and_exact():
    rng = np.random.default_rng(5)
    s = SuffixDrafter(max_tokens=300, max_requests=1000, min_match=1, max_match=8)
    outputs = [rng.integers(0, 6, size=int(rng.integers(1, 40))).tolist() for _ in range(200)]
    for out in outputs:
        finish(s, out)
    cache = s._tenants["A"]
    stream = cache.stream
    assert cache.tokens <= 300 and len(stream.tokens) == cache.tokens + len(cache.lengths)
    # The heads hold only live k-grams: at most one per live token and anchor.
    assert all(len(h) <= cache.tokens for h in stream.heads)
    assert all(p >= stream.base for h in stream.heads for p in h.values())
    # And the evicted index drafts exactly like one built from the kept outputs alone.
    kept = outputs[len(outputs) - len(cache.lengths) :]
    assert [len(o) for o in kept] == list(cache.lengths)
    fresh = SuffixDrafter(max_tokens=300, min_match=1, max_match=8)
    for out in kept:
        finish(fresh, out)
    for i in range(30):
        c = rng.integers(0, 6, size=int(rng.integers(1, 12))).tolist()
        assert s.propose(ctx(c, f"c{i}"), BIG) == fresh.propose(ctx(c, f"c{i}"), BIG)


def test_stream_drops_whole_documents():
    st = _Stream((1, 2))
    st.extend([1, 2, 3])
    st.end_document()
    st.extend([1, 2, 4])
    st.end_document()
    st.drop_front(4)
    assert st.base == 4 and list(st.tokens) == [1, 2, 4, -1]
    assert sorted(p for h in st.heads for p in h.values()) == [4, 5, 5, 6, 6]


# --- options and registry -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(min_match=0), "min_match"),
        (dict(min_match=5, max_match=4), "min_match"),
        (dict(min_prob=1.5), "min_prob"),
        (dict(depth_factor=0), "depth_factor"),
        (dict(max_occurrences=0), "max_occurrences"),
        (dict(max_scan=0), "max_scan"),
        (dict(max_requests=0), "max_requests"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_options_validated(options, message):
    with pytest.raises(ValueError, match=message):
        SuffixDrafter(**options)


def test_registered_and_satisfies_the_protocol():
    assert "suffix" in drafter_names()
    d = create_drafter("suffix", min_prob=0.2)
    assert isinstance(d, Drafter) and d.name == "suffix" and d.min_prob == 0.2
    assert SuffixDrafter().anchors == (2, 8, 32) and SuffixDrafter(min_match=1, max_match=20).anchors == (1, 4, 16)


def test_an_evicted_request_joins_the_cache_once_when_it_finishes():
    """Eviction (KV freed, the request prefilled again later) is not the end of the request: its
    output must not enter the tenant's cache then and again when it finishes. With room for two
    outputs, a double entry would push out the older one."""
    s = SuffixDrafter(max_requests=2)
    finish(s, [31, 32, 33, 34], prompt=[1])
    grown = [2, 41, 42, 43]
    s.propose(DraftContext("r", "A", grown, 1), NO_SPECULATION)
    s.evict("r")
    s.propose(DraftContext("r", "A", grown + [44, 45], 1), NO_SPECULATION)   # prefilled again, goes on
    s.release("r")
    assert s.propose(ctx([9, 31, 32]), BIG) == TokenTree.chain([33, 34])      # the older output stayed
    assert s.propose(ctx([9, 43, 44]), BIG) == TokenTree.chain([45])          # and the finished one is in


def test_merge_forwards_evict_to_the_parts_that_have_it():
    from workers.drafters.merge import MergeDrafter
    from workers.drafters.ngram import NgramDrafter

    suffix = SuffixDrafter(max_requests=1)
    merged = MergeDrafter([NgramDrafter(), suffix])
    finish(suffix, [31, 32, 33], prompt=[1])
    merged.propose(DraftContext("r", "A", [2, 41, 42], 1), NO_SPECULATION)
    merged.evict("r")                                # the suffix part must not store r's output yet
    assert suffix.propose(ctx([9, 31, 32]), BIG) == TokenTree.chain([33])


def test_a_dropped_tenant_leaves_nothing_and_a_new_id_drafts_from_nothing():
    """Tenants reach drafters by immutable id: "t-1" removed and created again under its name is
    "t-2", which gets no draft from "t-1"'s outputs; dropping "t-1" frees its cache, and one of its
    requests that finishes later adds nothing back."""
    secret = [1, 2, 3, 40, 41, 42, 43]
    s = SuffixDrafter()
    finish(s, secret, tenant="t-1")
    finish(s, [7, 8, 9, 10], tenant="t-other")
    late = "late"
    s.propose(ctx([5, 6, 1, 2, 3, 40, 41], late, tenant="t-1", prompt_len=2), NO_SPECULATION)
    assert s.propose(ctx([9, 1, 2, 3], "q1", tenant="t-1"), BIG).tokens[:1] == (40,)
    assert s.propose(ctx([9, 1, 2, 3], "q2", tenant="t-2"), BIG) == TokenTree.empty()
    assert s.cached_tokens("t-1") == len(secret)
    s.drop_tenant("t-1")
    assert s.cached_tokens("t-1") == 0
    s.release(late)                                   # ran on past the removal
    assert s.cached_tokens("t-1") == 0 and s.cached_tokens("t-other") == 4
    assert s.propose(ctx([9, 1, 2, 3], "q3", tenant="t-1"), BIG) == TokenTree.empty()


def test_drop_tenant_is_part_of_every_drafters_protocol():
    for name in ("ngram", "suffix", "none", "merge:ngram+suffix"):
        create_drafter(name).drop_tenant("t-gone")    # never raises; nothing kept: nothing to do
