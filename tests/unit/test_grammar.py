"""Structured outputs (workers/speculation/grammar.py, workers/drafters/grammar.py): the grammar's mask at every
tree row from that row's own path, pruning, the forced-token drafter, and greedy constrained output
token-identical to plain constrained decoding whatever the drafts, on a tiny random Llama that
speaks the default model's tokenizer."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from scheduler.generation import Engine, GenerationRequest
from tests.helpers import OracleDrafter, tiny_model_dir
from workers.batch_worker import BatchWorker
from workers.contract import DraftContext, SamplingParams, TreeBudget, WorkItem
from workers.drafters.base import Drafter, NoneDrafter
from workers.drafters.merge import MergeDrafter
from workers.drafters.registry import create_drafter
from workers.speculation.grammar import ConstraintError, GrammarRule, Grammars, parse_constraint
from workers.speculation.tree import TokenTree

MAX_NEW = 80
# Bounded schemas: a random model writes any string or number the grammar allows, so lengths are
# capped for its output to end within MAX_NEW tokens.
SCHEMAS = {
    "record": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 3}},
        "required": ["name", "ok", "color", "n", "tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "role": {"enum": ["admin", "viewer"]}}, "required": ["id", "role"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
}
PROMPTS = ["Give me JSON", "Describe the user as JSON:", "{\"name\": \"x\"} again, please"]


def constraint(name: str) -> str:
    return json.dumps({"type": "json_schema", "schema": SCHEMAS[name]})


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    from workers.runtime import load_runtime

    return load_runtime(str(tiny_model_dir(tmp_path_factory.mktemp("tiny"))), keep_hf=True, progress=False)


@pytest.fixture(scope="module")
def grammars(rt) -> Grammars:
    return rt.grammars


def ids(rt, text: str) -> list[int]:
    return rt.tokenizer(text, add_special_tokens=False)["input_ids"]


def allowed_after(grammars: Grammars, c: str, tokens) -> set[int]:
    """The token ids a fresh matcher allows after `tokens`: what each row must allow."""
    m = grammars.matcher(c, tokens)
    mask = grammars.bitmask(1)
    m.fill_next_token_bitmask(mask, 0)
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: grammars.vocab]
    return set(np.flatnonzero(bits).tolist())


def constrained_reference(rt, prompt: list[int], c: str, max_new: int) -> list[int]:
    """Plain constrained greedy decoding written out: transformers' logits at each position, the
    grammar's mask from a matcher fed the output so far, argmax; no speculation anywhere."""
    model = rt.hf_model
    grammars = rt.grammars
    m = grammars.matcher(c)
    mask = grammars.bitmask(1)
    out: list[int] = []
    for _ in range(max_new):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, -1:].float().clone()    # [1, V]
        m.fill_next_token_bitmask(mask, 0)
        xgr.apply_token_bitmask_inplace(logits, mask)
        nxt = int(logits[0].argmax())
        out.append(nxt)
        if nxt in rt.stop_token_ids:
            break
        assert m.accept_token(nxt)
    return out


# ---- pure-ish parts: parse, compile, cache -----------------------------------------------------
def test_constraints_parse_and_bad_ones_are_refused(grammars):
    assert parse_constraint('{"type": "json_object"}') == ("json_object", {"type": "object"})
    assert parse_constraint(constraint("record"))[1] == SCHEMAS["record"]
    for bad in ('{"type": "regex", "pattern": "a+"}', "not json", '{"type": "json_schema"}', "[1]"):
        with pytest.raises(ConstraintError):
            parse_constraint(bad)
    with pytest.raises(ConstraintError):                       # the engine's own refusal
        grammars.compiled(json.dumps({"type": "json_schema", "schema": {"type": "no-such-type"}}))


def test_compiled_grammars_are_cached_and_bounded(rt):
    g = Grammars.from_tokenizer(rt.tokenizer, rt.forward.vocab_size, rt.stop_token_ids, cache_size=2)
    a, b = constraint("record"), constraint("nested")
    first = g.compiled(a)
    assert g.compiled(a) is first                              # a hit: compiled once
    g.compiled(b)
    g.compiled('{"type": "json_object"}')                       # a third: the least recent (a) goes
    assert g.compiled(a) is not first


# ---- the rule at every row -----------------------------------------------------------------------
def test_prune_drops_what_the_grammar_forbids_on_each_path(rt, grammars):
    c = constraint("record")
    out = ids(rt, '{"name":"ab",') + ids(rt, '"')          # the grammar reads bytes: any split will do
    rule = GrammarRule(grammars, c, out)
    (ok,), (quote,), (brace,) = ids(rt, "ok"), ids(rt, '"'), ids(rt, "}")
    # root -> ok -> " (allowed), root -> ok -> } (forbidden), root -> } (forbidden: keys missing)
    tree = TokenTree((ok, quote, brace, brace), (-1, 0, 0, -1))
    kept = rule.prune(tree)
    assert kept == TokenTree((ok, quote), (-1, 0))
    # pruning leaves the rule where it was: the same tree prunes the same way again
    assert rule.prune(tree) == kept


def test_each_row_is_masked_from_its_own_path(rt, grammars):
    c = constraint("record")
    out = ids(rt, '{"name":"ab","ok":')
    rule = GrammarRule(grammars, c, out)
    true, false = ids(rt, "true"), ids(rt, "false")
    assert len(true) == 1 and len(false) == 1
    comma = ids(rt, ",")[0]
    tree = rule.prune(TokenTree((true[0], comma, false[0]), (-1, 0, -1)))
    assert len(tree) == 3
    rows = torch.zeros(4, grammars.vocab)
    rule.adjust(rows, tree)
    paths = [(), (true[0],), (true[0], comma), (false[0],)]
    for r, path in enumerate(paths):
        finite = set(torch.isfinite(rows[r]).nonzero().flatten().tolist())
        assert finite == allowed_after(grammars, c, out + list(path)), r
    assert set(torch.isfinite(rows[0]).nonzero().flatten().tolist()) != \
        set(torch.isfinite(rows[2]).nonzero().flatten().tolist())


def test_a_complete_output_allows_only_the_stop_token(rt, grammars):
    rule = GrammarRule(grammars, '{"type": "json_object"}', ids(rt, '{"a":[1,2]}'))
    rows = torch.zeros(1, grammars.vocab)
    rule.adjust(rows, TokenTree.empty())
    assert torch.isfinite(rows[0]).nonzero().flatten().tolist() == sorted(rt.stop_token_ids)


def test_logits_past_the_tokenizer_are_masked(rt):
    # a model whose vocabulary is padded past its tokenizer's (49,152 ids, 64 padding rows)
    padded = rt.forward.vocab_size + 64
    g = Grammars.from_tokenizer(rt.tokenizer, padded, rt.stop_token_ids)
    rule = GrammarRule(g, '{"type": "json_object"}', ids(rt, '{"a":'))
    rows = torch.zeros(2, padded)
    rule.adjust(rows, rule.prune(TokenTree.chain(ids(rt, "1"))))
    assert torch.isfinite(rows).any(dim=1).all()
    assert not torch.isfinite(rows[:, rt.forward.vocab_size:]).any()


# ---- the grammar drafter ----------------------------------------------------------------------
def test_the_drafter_proposes_the_forced_run_and_nothing_without_a_constraint(rt, grammars):
    drafter = create_drafter("grammar", grammars=grammars)
    c = constraint("record")
    prompt = ids(rt, "JSON please")
    out = ids(rt, '{"name":"ab"')
    ctx = DraftContext("r", "t", prompt + out, len(prompt), c)
    tree = drafter.propose(ctx, TreeBudget(16, 16))
    # after the name's closing quote, the schema forces ,"ok": and then a boolean is free
    assert rt.tokenizer.decode(tree.tokens) == ',"ok":'
    assert tree == TokenTree.chain(tree.tokens)
    assert len(drafter.propose(ctx, TreeBudget(2, 16))) == 2               # held to the budget
    assert len(drafter.propose(ctx, TreeBudget(16, 1))) == 1
    # incremental: the context grows by what was committed, the proposal moves on
    ctx.tokens = ctx.tokens + list(tree.tokens) + ids(rt, "true")
    assert rt.tokenizer.decode(drafter.propose(ctx, TreeBudget(16, 16)).tokens) == ',"color":"'
    drafter.release("r")
    assert drafter.propose(DraftContext("p", "t", prompt, len(prompt)), TreeBudget(8, 8)) == TokenTree.empty()


def test_the_drafter_proposes_the_stop_token_once_the_object_is_closed(rt, grammars):
    drafter = create_drafter("grammar", grammars=grammars)
    out = ids(rt, '{"user":{"id":"AB-123","role":"admin"},"active":true')
    tree = drafter.propose(DraftContext("r", "t", [1] + out, 1, constraint("nested")), TreeBudget(8, 8))
    assert list(tree.tokens) == ids(rt, "}") + sorted(rt.stop_token_ids)


# ---- end to end: greedy equals plain constrained decoding, drafts or not --------------------------
class AllowedButWrong(Drafter):
    """Drafts the true continuation with siblings the grammar allows but the target does not pick,
    so the mask is exercised at rows that survive pruning, not only pruning."""
    name = "allowed-but-wrong"

    def __init__(self, grammars: Grammars, truth: dict[str, list[int]]):
        self.grammars, self.truth = grammars, truth

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        done = list(ctx.tokens[ctx.prompt_len:])
        truth = self.truth[ctx.request_id][len(done): len(done) + budget.max_depth]
        tokens, parents, parent = [], [], -1
        for level, t in enumerate(truth):
            others = sorted(allowed_after(self.grammars, ctx.constraint, done + truth[:level]) - {t})[:2]
            for tok in [*others, t]:
                if len(tokens) < budget.max_nodes:
                    tokens.append(tok)
                    parents.append(parent)
            if len(tokens) >= budget.max_nodes or tokens[-1] != t:
                break
            parent = len(tokens) - 1
        return TokenTree(tuple(tokens), tuple(parents))


@pytest.fixture(scope="module")
def references(rt):
    return {(s, p): constrained_reference(rt, ids(rt, p), constraint(s), MAX_NEW)
            for s in SCHEMAS for p in PROMPTS}


@pytest.mark.parametrize("drafter", ["plain", "ngram", "grammar", "merge", "oracle-wide", "oracle-mixed",
                                     "allowed-but-wrong"])
def test_greedy_constrained_output_is_plain_constrained_decoding(rt, references, drafter):
    reqs = [GenerationRequest(f"{s}|{p}", tuple(ids(rt, p)), MAX_NEW, SamplingParams(constraint=constraint(s)),
                              rt.stop_token_ids) for s in SCHEMAS for p in PROMPTS]
    refs = [references[(s, p)] for s in SCHEMAS for p in PROMPTS]
    truth = {r.request_id: ref for r, ref in zip(reqs, refs)}
    budget = TreeBudget(12, 8)
    d: Drafter = {
        "plain": lambda: NoneDrafter(),
        "ngram": lambda: create_drafter("ngram"),
        "grammar": lambda: rt.grammar_drafter(),
        "merge": lambda: MergeDrafter([rt.grammar_drafter(), create_drafter("ngram")]),
        "oracle-wide": lambda: OracleDrafter(truth, rt.forward.vocab_size, "wide"),
        "oracle-mixed": lambda: OracleDrafter(truth, rt.forward.vocab_size, "mixed"),
        "allowed-but-wrong": lambda: AllowedButWrong(rt.grammars, truth),
    }[drafter]()
    engine = Engine(rt.verifier(max_tree_tokens=16), d, budget if drafter != "plain" else TreeBudget(0, 0),
                    adaptive=False)
    results = engine.generate(reqs)
    for req, res, ref in zip(reqs, results, refs):
        assert res.token_ids == ref, req.request_id
        assert res.finish_reason == "stop", "a bounded schema ends within MAX_NEW"
        text = rt.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMAS[req.request_id.split("|")[0]])
    if drafter in ("grammar", "merge"):
        assert sum(r.accepted for r in results) > 0.2 * sum(len(r.token_ids) for r in results)


def test_sampled_constrained_output_stays_in_the_grammar(rt):
    c = constraint("record")
    prompt = tuple(ids(rt, PROMPTS[0]))
    reqs = [GenerationRequest(f"s{seed}", prompt, MAX_NEW, SamplingParams(temperature=1.0, seed=seed, constraint=c),
                              rt.stop_token_ids) for seed in range(6)]
    engine = Engine(rt.verifier(max_tree_tokens=16), MergeDrafter([rt.grammar_drafter(), create_drafter("ngram")]),
                    TreeBudget(12, 8), adaptive=False)
    texts = set()
    for res in engine.generate(reqs):
        assert res.finish_reason == "stop"
        text = rt.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMAS["record"])
        texts.add(text)
    assert len(texts) > 1, "sampling with different seeds gave one output: the test could not fail"


def test_a_readmitted_request_continues_its_grammar(rt, references):
    # as after an eviction: the worker forgets the request, then re-prefills prompt + output so far
    s, p = "record", PROMPTS[1]
    c, prompt, ref = constraint(s), ids(rt, p), references[(s, p)]
    worker = BatchWorker(rt.verifier(max_tree_tokens=16), default_drafter="ngram", grammar=rt.grammar_drafter())
    sampling = SamplingParams(constraint=c)
    worker.prefill("r", prompt, prompt_len=len(prompt), sampling=sampling, max_new_tokens=MAX_NEW)
    out: list[int] = []
    budget = TreeBudget(12, 8)
    while len(out) < len(ref) // 2:
        (step,) = worker.step([WorkItem("r", budget)])
        out += step.tokens
    worker.evict("r")
    worker.prefill("r", prompt + out, prompt_len=len(prompt), sampling=sampling, max_new_tokens=MAX_NEW)
    while len(out) < len(ref):
        (step,) = worker.step([WorkItem("r", budget)])
        out += step.tokens
    worker.release("r")
    assert out[: len(ref)] == ref


def test_the_worker_drafts_forced_tokens_for_constrained_requests_only(rt):
    worker = BatchWorker(rt.verifier(max_tree_tokens=16), default_drafter="none", grammar=rt.grammar_drafter())
    prompt = ids(rt, PROMPTS[0])
    worker.prefill("c", prompt, prompt_len=len(prompt), sampling=SamplingParams(constraint=constraint("nested")),
                   max_new_tokens=MAX_NEW)
    worker.prefill("u", prompt, prompt_len=len(prompt), sampling=SamplingParams(), max_new_tokens=MAX_NEW)
    drafted = {"c": 0, "u": 0}
    for _ in range(4):
        for step in worker.step([WorkItem("c", TreeBudget(12, 8)), WorkItem("u", TreeBudget(12, 8))]):
            drafted[step.request_id] += step.drafted
    assert drafted["c"] > 0 and drafted["u"] == 0
