"""Test helpers shared by the engine tests: reference generation and an oracle drafter."""
from __future__ import annotations

import contextlib
import sys
import weakref
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from workers.contract import DraftContext, TreeBudget
from workers.drafters.base import Drafter
from workers.speculation.tree import TokenTree, truncate


def hf_greedy(model, prompt_ids, max_new_tokens: int, eos: int | list[int] | None = None) -> list[int]:
    """Plain greedy decoding with transformers `generate`: the reference output."""
    inp = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens,
                             min_new_tokens=0, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


class OracleDrafter(Drafter):
    """Proposes trees around a known continuation: some branches right, some wrong, in a chosen shape.

    `shape` = "chain" (the true continuation, cut at a random point, then wrong tokens), "wide"
    (several siblings per level, one right), or "mixed" (random branching). Exercises every
    acceptance length from 0 to the full budget.
    """
    name = "oracle"

    def __init__(self, continuation: dict[str, list[int]], vocab: int, shape: str, seed: int = 0):
        self.continuation = continuation
        self.vocab = vocab
        self.shape = shape
        self.rng = np.random.default_rng(seed)

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        if budget.max_nodes == 0:
            return TokenTree.empty()
        done = len(ctx.tokens) - ctx.prompt_len
        truth = self.continuation[ctx.request_id][done: done + budget.max_depth]
        tokens, parents = [], []
        parent, level = -1, 0
        right = int(self.rng.integers(0, len(truth) + 1))  # how many true tokens before a wrong one
        while level < budget.max_depth and len(tokens) < budget.max_nodes:
            width = {"chain": 1, "wide": 3, "mixed": int(self.rng.integers(1, 4))}[self.shape]
            true_tok = truth[level] if level < len(truth) else None
            chosen = true_tok if level < right and true_tok is not None else None
            siblings = []
            while len(siblings) < width:
                t = int(self.rng.integers(0, self.vocab))
                if t != true_tok and t not in siblings:
                    siblings.append(t)
            if chosen is not None:
                siblings[int(self.rng.integers(0, width))] = chosen
            next_parent = None
            for t in siblings:
                if len(tokens) >= budget.max_nodes:
                    break
                tokens.append(t)
                parents.append(parent)
                if t == chosen or (chosen is None and next_parent is None):
                    next_parent = len(tokens) - 1
            if next_parent is None:
                break
            parent, level = next_parent, level + 1
        return truncate(TokenTree(tuple(tokens), tuple(parents)), budget.max_nodes, budget.max_depth)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_model_dir(path, seed: int = 0):
    """A Hugging Face model directory holding a tiny random Llama that speaks the default model's
    tokenizer (copied from its cached directory): real text in and out, steps of a millisecond or
    two. For tests that load a model by path in other processes (Ray replicas, a served gateway)."""
    import shutil

    from tests.conftest import tiny_llama
    from workers.model.loader import resolve_model

    source = resolve_model(progress=False)
    path = Path(path)
    model = tiny_llama(seed, vocab=49152, max_positions=2048)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


@contextlib.contextmanager
def serving(settings, tenants: dict[str, list[str]], *, tenant_options: dict | None = None,
            log_level: str = "warning"):
    """An embedded gateway built from `settings`, with `tenants` (name -> API keys; options per
    name in `tenant_options`, e.g. {"limited": {"rpm": 1}}), its step loop running, served on a
    free loopback port: yields (embedded, base URL); stops it all on exit."""
    from gateway.http.server import background_server
    from gateway.builders.embedded import build_embedded
    from gateway.tenancy.records import Tenant

    emb = build_embedded(settings, progress=False)
    for name, keys in tenants.items():
        emb.tenants.put(Tenant(name=name, **(tenant_options or {}).get(name, {})), keys)
    emb.start()
    try:
        with background_server(emb.app, log_level=log_level) as url:
            yield emb, url
    finally:
        emb.stop()


@contextlib.contextmanager
def openai_client_on(runtime, settings, *, timeout: float = 300):
    """An embedded gateway on an already loaded `runtime` (one model load for a whole module),
    its step loop running, served on a free loopback port, and the official `openai` client for
    its dev tenant: yields (embedded, client); stops it all on exit."""
    import openai

    from gateway.builders.embedded import build_embedded
    from gateway.http.server import background_server

    emb = build_embedded(settings, runtime=runtime)
    emb.start()
    try:
        with background_server(emb.app) as url:
            yield emb, openai.OpenAI(base_url=url + "/v1", api_key=emb.dev_key, max_retries=0, timeout=timeout)
    finally:
        emb.stop()


class DeviceAudit(TorchFunctionMode):
    """Watches the torch calls made from the source files `files` (paths ending so): every tensor
    factory call and whether it names a device (`made`: (function, device or None, file:line)),
    and every read of a tensor's values back to Python or the host (`reads`, same form).

    Why: this suite runs on a CPU, where a tensor made without a device and one made on the
    configured device look alike. On a GPU the first is a host tensor (a copy each use, or an
    error), so a test asserts that every factory call names the device, and that values cross to
    the host only where the design says (counted per forward pass). A hard-coded device="cpu"
    would still pass here: the audit catches omissions, which are the usual slip.
    """
    FACTORIES = frozenset({"tensor", "as_tensor", "arange", "full", "zeros", "ones", "empty", "rand", "randn",
                           "randint", "linspace", "eye", "empty_like", "zeros_like", "full_like", "ones_like"})
    LIKE = frozenset({"empty_like", "zeros_like", "full_like", "ones_like"})   # take their input's device
    READS = frozenset({"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"})

    def __init__(self, *files: str):
        super().__init__()
        self.files = tuple(str(f) for f in files)
        self.made: list[tuple[str, object, str]] = []
        self.reads: list[tuple[str, str]] = []
        # what `.cpu()` returned, by id: reading those is no second read
        self._host: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.FACTORIES or name in self.READS:
            frame = sys._getframe(1)
            if frame.f_code.co_filename.endswith(self.files):
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                if name in self.READS:
                    if not (args and isinstance(args[0], torch.Tensor) and self._host.get(id(args[0])) is args[0]):
                        self.reads.append((name, where))
                    if name == "cpu":
                        out = func(*args, **kwargs)
                        self._host[id(out)] = out
                        return out
                elif name in self.LIKE:
                    self.made.append((name, kwargs.get("device", args[0].device), where))
                else:
                    self.made.append((name, kwargs.get("device"), where))
        return func(*args, **kwargs)

    def off_device(self, device) -> list[tuple[str, object, str]]:
        """The factory calls that named no device, or another than `device`."""
        want = torch.device(device)
        return [m for m in self.made if m[1] is None or torch.device(m[1]) != want]


def device_generic(model, **options):
    """The lean forward as a GPU runs it, here on the CPU: plain linears, and torch's norms, rope
    and attention (no CPU kernels: `small_gemm.available` is false off the CPU)."""
    from workers.model.llama_forward import LlamaForward

    lf = LlamaForward(model, gemm="plain", **options)
    lf.fused = lf.fused_attention = False
    lf._stack = None
    return lf
