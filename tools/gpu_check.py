"""One prepared check of the engine on a GPU (issue 33): `scripts/gpu_check.sh` runs it.

A GPU machine is lent for minutes, with no network and no model files, so everything it needs is
built here: random-weight Llama-family models of real shapes (SmolLM2-135M's, a 1B-class and an
8B-class one), their weights spread so greedy ties are rare. Sections, each recorded even when
another fails (one JSON, one printed table):

    exact     greedy output of the engine with n-gram drafts forced on against transformers' own
              greedy on the same device: float32 with TF32 off must be identical; bfloat16 may
              differ only at near-ties (tools/near_tie.py), each divergence classified
    steps     step time against tree tokens (nodes per request) and batch size, synchronised
    speed     tokens/s: the engine plain and with batched trees against transformers' generate,
              single stream and batched, in one run; the batched trees once per attention
              option (workers/model/batched_attention.py), each output checked against the loop's
    serve     `specgate serve --device <device>` for a while, concurrent streaming requests
              through its OpenAI API, every one answered
    attention the candidates for batched tree attention on the device (issue 33, item 2), each
              checked against the forward's own per-request SDPA and timed: that loop, one
              padded SDPA call for the batch, and flex_attention over the packed rows with a
              block mask built from each tree's ancestors (compiled; not in --quick); then the
              engine's own options end to end: a verify step's time at a few (batch, nodes)
              points with SPECGATE_ATTENTION loop, padded and flex, which decides the default
    draft     a model drafter on the device (a draft pruned from the target, as `specgate draft
              build` does): its weights and KV on the device, greedy output identical to plain
              decoding, its acceptance and tokens/s

`--quick` shrinks every section to the tiny shapes so the whole script runs on a CPU in
seconds: the test suite runs it that way (tests/unit/tools/test_gpu_check.py), so the script a
GPU session gets is known to run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from loadtest.results import write_result

# name -> LlamaConfig fields (the public configs' shapes; vocabulary as the models ship)
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     tie_word_embeddings=True, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     tie_word_embeddings=False, rope_theta=500000.0),
    # --quick: a CPU runs every section on these in seconds
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True,
                 rope_theta=10000.0),
}


def build_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random-weight LlamaForCausalLM of `shape`, built on `device` (no host copy of 8B weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, **SHAPES[shape])
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    # spread the logits so exact ties are rare (tests/conftest.py spread_weights),
                    # scaled by width so deep, wide models stay finite
                    p.normal_(0, min(0.08, 2.0 / p.shape[1] ** 0.5))
    return model


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Half repeat a motif (n-gram drafts hit), half are random (drafts mostly miss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i % 2:
            motif = torch.randint(3, vocab, (7,), generator=g).tolist()
            out.append((motif * (length // 7 + 1))[:length])
        else:
            out.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    return out


EOS = 2
# the engine's attention options (workers/model/batched_attention.py), loop (the default) first
ATTENTION_OPTIONS = ("loop", "padded", "flex")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def hf_generate(model, batch: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy `generate` for prompts of one length (no padding: exact per row),
    each row cut after its first EOS as the engine stops there."""
    inp = torch.tensor(batch, device=model.device)
    with torch.inference_mode():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new,
                             min_new_tokens=0, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    rows = out[:, inp.shape[1]:].tolist()
    return [r[: r.index(EOS) + 1] if EOS in r else r for r in rows]


def engine(forward, drafter: str, budget: tuple[int, int], max_tree: int = 64):
    from scheduler.generation import Engine
    from workers.contract import TreeBudget
    from workers.drafters.base import NoneDrafter
    from workers.drafters.registry import create_drafter
    from workers.speculation.verifier import Verifier

    d = NoneDrafter() if drafter == "none" else create_drafter(drafter)
    return Engine(Verifier(forward, max_tree_tokens=max_tree), d, TreeBudget(*budget), adaptive=False)


def generate(forward, batch: list[list[int]], max_new: int, drafter: str,
             budget: tuple[int, int]) -> tuple[list[list[int]], float]:
    from scheduler.generation import GenerationRequest
    from workers.model.device import synchronize

    reqs = [GenerationRequest(f"r{i}", tuple(p), max_new, stop_token_ids=frozenset({EOS}))
            for i, p in enumerate(batch)]
    e = engine(forward, drafter, budget)
    synchronize(forward.device)
    t0 = time.perf_counter()
    out = e.generate(reqs)
    synchronize(forward.device)
    return [o.token_ids for o in out], time.perf_counter() - t0


def section_exact(shapes: list[str], device: torch.device, n_prompts: int, length: int,
                  max_new: int) -> list[dict]:
    from tools.near_tie import NEAR_TIE_LOGITS, first_divergence, logit_gap
    from workers.model.llama_forward import LlamaForward

    rows = []
    for shape, dtype in [(s, d) for s in shapes for d in (torch.float32, torch.bfloat16)]:
        model = build_model(shape, dtype, device)
        forward = LlamaForward(model)
        ps = prompts(model.config.vocab_size, n_prompts, length)
        ref = [hf_generate(model, [p], max_new)[0] for p in ps]
        spec, _ = generate(forward, ps, max_new, "ngram", (16, 8))
        plain, _ = generate(forward, ps, max_new, "none", (0, 0))
        row: dict[str, Any] = {"shape": shape, "dtype": str(dtype).replace("torch.", ""),
                               "prompts": len(ps), "new_tokens": max_new,
                               "spec_vs_hf_identical": sum(a == b for a, b in zip(spec, ref)),
                               "plain_vs_hf_identical": sum(a == b for a, b in zip(plain, ref)),
                               "spec_vs_plain_identical": sum(a == b for a, b in zip(spec, plain))}
        divergences = []
        for p, a, b in zip(ps, spec, ref):
            at = first_divergence(a, b)
            if at is not None and at < min(len(a), len(b)):
                gap = logit_gap(forward, p + b[:at], a[at], b[at])
                divergences.append({"at": at, "gap": round(gap, 4), "near_tie": gap < NEAR_TIE_LOGITS})
        row["divergences"] = divergences
        row["ok"] = (row["spec_vs_hf_identical"] == len(ps) if dtype == torch.float32
                     else all(d["near_tie"] for d in divergences))
        rows.append(row)
        del model, forward
        _free(device)
    return rows


def section_steps(shapes: list[tuple[str, torch.dtype]], device: torch.device, nodes: list[int],
                  batches: list[int], context: int, repeats: int, profiles: Path | None = None) -> list[dict]:
    """Also writes each shape's measurements as a step-cost profile (`profile_<shape>.json` in
    `profiles`), which the planner (`--step-profile`) and the simulator (`specgate sim
    --profile`) read: item 3's GPU profile."""
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.profiling import describe_device, measure_profile, profile_document
    from workers.speculation.verifier import Verifier

    rows = []
    for shape, dtype in shapes:
        model = build_model(shape, dtype, device)
        forward = LlamaForward(model)
        del model
        _free(device)
        verifier = Verifier(forward, max_tree_tokens=max(nodes))
        prof = measure_profile(verifier, batches=batches, nodes=nodes, prompt_len=context,
                               repeats=repeats, prefill_tokens=(context,), interleaved=True)
        if profiles is not None:
            doc = profile_document(prof, model=f"random {shape}", dtype=str(dtype).replace("torch.", ""),
                                   device=describe_device(forward), prompt_len=context, repeats=repeats)
            (profiles / f"profile_{shape}.json").write_text(json.dumps(doc, indent=1))
        for c in prof["curves"]:
            rows.append({"shape": shape, "dtype": str(dtype).replace("torch.", ""), "batch": c["batch"],
                         "nodes": c["nodes"], "step_ms": [round(s * 1e3, 3) for s in c["step_s_raw"]]})
        del forward, verifier
        _free(device)
    return rows


def section_speed(shapes: list[tuple[str, torch.dtype]], device: torch.device, batch: int, length: int,
                  max_new: int, options: tuple[str, ...] = ("padded", "flex")) -> list[dict]:
    """`options`: attention options (besides loop, the default) whose batched-tree tokens/s are
    measured too, each output compared with the loop's (float32: must be identical)."""
    from workers.model.device import synchronize
    from workers.model.llama_forward import LlamaForward

    rows = []
    for shape, dtype in shapes:
        model = build_model(shape, dtype, device)
        forward = LlamaForward(model)
        ps = prompts(model.config.vocab_size, batch, length, seed=1)
        row: dict[str, Any] = {"shape": shape, "dtype": str(dtype).replace("torch.", ""), "batch": batch,
                               "new_tokens": max_new}
        hf_generate(model, [ps[0]], 4)                                     # warm-up
        forward.attention = "loop"
        loop_out, _ = generate(forward, ps, max_new, "ngram", (16, 8))     # what each option must equal
        for label, group in (("single", ps[:1]), ("batched", ps)):
            synchronize(device)
            t0 = time.perf_counter()
            made = hf_generate(model, group, max_new)
            synchronize(device)
            row[f"hf_{label}_tok_s"] = round(sum(map(len, made)) / (time.perf_counter() - t0), 1)
            for drafter, budget in (("none", (0, 0)), ("ngram", (16, 8))):
                generate(forward, group[:1], 4, drafter, budget)           # warm-up
                out, s = generate(forward, group, max_new, drafter, budget)
                row[f"engine_{drafter}_{label}_tok_s"] = round(sum(map(len, out)) / s, 1)
        same = []
        for option in options:                  # the batched trees under each attention option
            forward.attention = option
            try:
                generate(forward, ps, 4, "ngram", (16, 8))                  # warm-up (compiles flex)
                out, s = generate(forward, ps, max_new, "ngram", (16, 8))
                row[f"engine_ngram_batched_{option}_tok_s"] = round(sum(map(len, out)) / s, 1)
                row[f"{option}_same_as_loop"] = sum(a == b for a, b in zip(out, loop_out))
                same.append(row[f"{option}_same_as_loop"] == len(ps))
            except Exception as e:  # noqa: BLE001 — an option that fails here is a finding
                row[f"{option}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                same.append(False)
            finally:
                forward.attention = "loop"
        row["ok"] = all(same) or dtype != torch.float32     # bf16 may differ at near-ties
        rows.append(row)
        del model, forward
        _free(device)
    return rows


def section_serve(device: torch.device, seconds: float, tokenizer_dir: Path | None, streams: int) -> dict:
    """`specgate serve` on a random SmolLM2-shaped model (the default tokenizer's files from
    `tokenizer_dir`) for `seconds`, `streams` concurrent streaming requests at a time."""
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").exists():
        return {"skipped": "no tokenizer files (scripts/gpu_check.sh --prepare copies them)"}
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    shape = "tiny" if device.type == "cpu" else "smollm2-135m"
    model = build_model(shape, torch.float32, torch.device("cpu"))
    model.config.vocab_size = model.get_input_embeddings().weight.shape[0]
    if model.config.vocab_size < 49152:     # the tokenizer's ids must exist in the model
        model.resize_token_embeddings(49152)
    model.save_pretrained(work)
    for name in TOKENIZER_FILES:            # only these: the directory may hold a whole model
        if (tokenizer_dir / name).exists():
            (work / name).write_bytes((tokenizer_dir / name).read_bytes())
    from gateway.http.server import free_port

    port = free_port()
    env = {**os.environ, "SPECGATE_ADMIN_KEY": "gpu-check-admin-key-0000", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-c", "import sys; from specgate.cli import main; sys.exit(main())", "serve",
           "--model", str(work), "--served-model-name", "check", "--device", str(device), "--port", str(port),
           "--kv-cache-mb", "2048"]
    if device.type == "cpu":
        # a shipped profile: measuring one at start-up takes minutes on a loaded 2-core CPU, and
        # the quick run checks the serving path, not this machine's step costs
        cmd += ["--step-profile", str(Path(__file__).resolve().parents[1] / "scheduler/profiles/default.json")]
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    result: dict[str, Any] = {"device": str(device), "seconds": seconds, "streams": streams}
    try:
        base = f"http://127.0.0.1:{port}"
        key = _wait_ready(base, proc, work / "serve.log", timeout=300)
        result.update(_stream_load(base, key, seconds, streams))
    except Exception as e:  # noqa: BLE001 — recorded in the report, the script goes on
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        result["log_tail"] = (work / "serve.log").read_text(errors="replace")[-3000:]
    result["ok"] = "error" not in result and result.get("failed", 1) == 0 and result.get("completed", 0) > 0
    return result


def tree_batch(batch: int, context: int, nodes: int, nq: int, nkv: int, d: int, device, dtype, seed: int = 0):
    """Random queries, caches and trees for `batch` requests: per request `context` cached keys
    then 1 + nodes new rows (the root, then nodes with random parents in topological order).
    Returns q [B, Hq, R, D], k/v [B, Hkv, C + R, D] and visible [B, R, C + R] bool."""
    g = torch.Generator().manual_seed(seed)
    rows = 1 + nodes
    q = torch.randn(batch, nq, rows, d, generator=g).to(device, dtype)
    k = torch.randn(batch, nkv, context + rows, d, generator=g).to(device, dtype)
    v = torch.randn(batch, nkv, context + rows, d, generator=g).to(device, dtype)
    visible = torch.zeros(batch, rows, context + rows, dtype=torch.bool)
    visible[:, :, :context] = True
    for b in range(batch):
        anc = torch.zeros(rows, rows, dtype=torch.bool)
        anc[0, 0] = True
        for i in range(1, rows):
            parent = int(torch.randint(0, i, (1,), generator=g))     # row index (0 = the root)
            anc[i] = anc[parent]
            anc[i, i] = True
        visible[b, :, context:] = anc
    return q, k, v, visible.to(device)


def section_attention(device: torch.device, configs: list[tuple], flex: bool, repeats: int,
                      steps: dict[str, Any] | None = None) -> list[dict]:
    """configs: (label, Hq, Hkv, D, batch, context, nodes, dtype): the candidates alone on random
    tensors; `steps`: the keyword arguments of `attention_steps` (the engine's options end to end)."""
    import torch.nn.functional as F

    from workers.model.device import elapsed

    rows_out = []
    for label, nq, nkv, d, batch, context, nodes, dtype in configs:
        q, k, v, visible = tree_batch(batch, context, nodes, nq, nkv, d, device, dtype)
        additive = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))

        def loop():   # what the lean forward does today: one call per request
            return torch.cat([F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                             attn_mask=additive[b], enable_gqa=True)
                              for b in range(batch)])

        def padded():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=additive[:, None], enable_gqa=True)

        methods: dict[str, Callable[[], torch.Tensor]] = {"sdpa_loop": loop, "sdpa_padded": padded}
        if flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            vis = visible

            def mask_mod(b, h, qi, ki):
                return vis[b, qi, ki]

            block = create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2],
                                      device=device)
            compiled = torch.compile(flex_attention)
            methods["flex"] = lambda: compiled(q, k, v, block_mask=block, enable_gqa=True)
        ref = loop()
        row: dict[str, Any] = {"config": label, "batch": batch, "context": context, "nodes": nodes,
                               "heads": f"{nq}/{nkv}x{d}", "dtype": str(dtype).replace("torch.", "")}
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name, fn in methods.items():
            try:
                out = fn()                                                       # warm-up, compile
                row[f"{name}_max_diff"] = float((out.float() - ref.float()).abs().max())
                row[f"{name}_ms"] = round(min(elapsed(fn, device) for _ in range(repeats)) * 1e3, 3)
            except Exception as e:  # noqa: BLE001 — a candidate that fails to build is a finding
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["ok"] = all(row.get(f"{n}_max_diff", float("inf")) <= tol for n in methods)
        if flex:
            torch._dynamo.reset()       # each shape compiles afresh (no recompile limits hit)
        rows_out.append(row)
    return rows_out + (attention_steps(device, **steps) if steps else [])


def attention_steps(device: torch.device, shapes: list[tuple[str, torch.dtype]], options: tuple[str, ...],
                    batches: list[int], nodes: list[int], context: int, repeats: int) -> list[dict]:
    """A verify step's time under each attention option of the engine (SPECGATE_ATTENTION), at
    each (batch, nodes) point, timed as the start-up profile times steps (synchronised,
    interleaved rounds, the median): what decides `batched_attention.default_attention`."""
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.profiling import measure_profile
    from workers.speculation.verifier import Verifier

    rows = []
    for shape, dtype in shapes:
        model = build_model(shape, dtype, device)
        forward = LlamaForward(model, attention="loop")
        del model
        _free(device)
        for option in options:
            forward.attention = option          # read once a pass: one forward serves every option
            row: dict[str, Any] = {"kind": "step", "shape": shape, "dtype": str(dtype).replace("torch.", ""),
                                   "attention": option, "context": context}
            try:
                prof = measure_profile(Verifier(forward, max_tree_tokens=max(nodes)), batches=batches,
                                       nodes=nodes, prompt_len=context, repeats=repeats, prefill_tokens=(),
                                       interleaved=True)
                row["points"] = [{"batch": c["batch"], "nodes": n, "step_ms": round(s * 1e3, 3)}
                                 for c in prof["curves"] for n, s in zip(c["nodes"], c["step_s_raw"])]
            except Exception as e:  # noqa: BLE001 — an option that fails to run is a finding
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["ok"] = "error" not in row
            rows.append(row)
        del forward
        _free(device)
    return rows


def section_draft(shape: str, device: torch.device, n_prompts: int, length: int, max_new: int,
                  layers: tuple[int, ...]) -> dict:
    """A model drafter on the device: a draft pruned from the target (`tools.draft_build.prune`,
    its `layers`), greedy with the draft's trees against plain decoding on the same target."""
    from scheduler.generation import Engine, GenerationRequest
    from tools.draft_build import prune
    from workers.contract import TreeBudget
    from workers.model.device import synchronize
    from workers.drafters.neural.draft_model import DraftSpec
    from workers.drafters.base import NoneDrafter
    from workers.drafters.model import ModelDrafter
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.verifier import Verifier

    target = build_model(shape, torch.float32, device)
    draft = prune(target, layers)
    forward = LlamaForward(target)
    drafter = ModelDrafter(LlamaForward(draft, windowed=False), DraftSpec(sink=4, window=64))
    ps = prompts(target.config.vocab_size, n_prompts, length, seed=2)
    reqs = [GenerationRequest(f"r{i}", tuple(p), max_new, stop_token_ids=frozenset({EOS})) for i, p in enumerate(ps)]
    runs = {}
    for name, d, budget in (("plain", NoneDrafter(), (0, 0)), ("draft", drafter, (16, 6))):
        e = Engine(Verifier(forward, max_tree_tokens=64), d, TreeBudget(*budget), adaptive=False)
        synchronize(device)
        t0 = time.perf_counter()
        runs[name] = (e.generate(reqs), time.perf_counter() - t0)
        synchronize(device)
    (plain, plain_s), (spec, spec_s) = runs["plain"], runs["draft"]
    places = {str(t.device) for t in (drafter.forward.embed, drafter.forward.layers[0]["ln1"])}
    result = {"shape": shape, "draft_layers": list(layers), "device": str(device), "draft_on": sorted(places),
              "prompts": len(ps), "identical": sum(a.token_ids == b.token_ids for a, b in zip(spec, plain)),
              "accepted": sum(o.accepted for o in spec), "drafted": sum(o.drafted for o in spec),
              "plain_tok_s": round(sum(len(o.token_ids) for o in plain) / plain_s, 1),
              "draft_tok_s": round(sum(len(o.token_ids) for o in spec) / spec_s, 1)}
    result["ok"] = (result["identical"] == len(ps) and result["drafted"] > 0
                    and places == {str(torch.empty(0, device=device).device)})
    del target, draft, forward, drafter
    _free(device)
    return result


def _wait_ready(base: str, proc, log: Path, timeout: float) -> str:
    """The dev key the gateway prints once it serves (its log), after /health answers."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                for line in log.read_text(errors="replace").splitlines():
                    if "dev tenant API key:" in line:
                        return line.split("dev tenant API key:")[1].strip()
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("serve did not become ready")


def _stream_load(base: str, key: str, seconds: float, streams: int) -> dict:
    import concurrent.futures as cf

    import httpx

    deadline = time.time() + seconds

    def one(i: int) -> tuple[int, int, float]:
        done = failed = 0
        tokens = 0
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
            while time.time() < deadline:
                body = {"model": "check", "stream": True, "max_tokens": 64,
                        "messages": [{"role": "user", "content": f"Count from {i} upwards: {i} {i+1} {i+2}"}]}
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            failed += 1
                            continue
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                tokens += 1
                    done += 1
                except httpx.HTTPError:
                    failed += 1
        return done, failed, tokens

    t0 = time.time()
    with cf.ThreadPoolExecutor(streams) as pool:
        parts = list(pool.map(one, range(streams)))
    wall = time.time() - t0
    return {"completed": sum(p[0] for p in parts), "failed": sum(p[1] for p in parts),
            "chunks": sum(p[2] for p in parts), "chunks_per_s": round(sum(p[2] for p in parts) / wall, 1)}


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> dict:
    from workers.model.device import resolve_device

    device = resolve_device(args.device)
    # float32 exactness against transformers needs both to do the same float32 arithmetic
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "quick": args.quick, "sections": {}}
    if device.type == "cuda":
        report["cuda"] = torch.version.cuda
    q = args.quick
    plan: dict[str, Callable[[], Any]] = {
        "exact": lambda: section_exact(["tiny"] if q else ["smollm2-135m", "llama-1b"], device,
                                       n_prompts=2 if q else 6, length=24 if q else 96,
                                       max_new=12 if q else 64),
        "steps": lambda: section_steps([("tiny", torch.float32)] if q else
                                       [("smollm2-135m", torch.float32), ("llama-1b", torch.bfloat16),
                                        ("llama-8b", torch.bfloat16)],
                                       device, nodes=[1, 4] if q else [1, 16, 64, 256],
                                       batches=[1, 2] if q else [1, 8, 32], context=32 if q else 512,
                                       repeats=2 if q else 5,
                                       profiles=Path(args.json).parent if args.json else None),
        "speed": lambda: section_speed([("tiny", torch.float32)] if q else
                                       [("smollm2-135m", torch.float32), ("llama-8b", torch.bfloat16)],
                                       device, batch=2 if q else 8, length=24 if q else 128,
                                       max_new=8 if q else 128, options=ATTENTION_OPTIONS[1:]),
        "draft": lambda: section_draft("tiny" if q else "smollm2-135m", device, n_prompts=2 if q else 8,
                                       length=24 if q else 128, max_new=12 if q else 64,
                                       layers=(0,) if q else (0, 1)),
        "attention": lambda: section_attention(
            device, [("tiny", 4, 2, 32, 2, 40, 8, torch.float32)] if q else
            [(f"{name} b{b} n{n}", hq, hkv, d, b, 1024, n, dt)
             for name, hq, hkv, d, dt in (("smollm2", 9, 3, 64, torch.float32), ("8b", 32, 8, 128, torch.bfloat16))
             for b, n in ((1, 16), (8, 64), (32, 64), (8, 256))],
            flex=not q, repeats=3 if q else 10,
            steps=dict(shapes=[("tiny", torch.float32)] if q else [("llama-1b", torch.bfloat16),
                                                                   ("llama-8b", torch.bfloat16)],
                       options=ATTENTION_OPTIONS, batches=[2] if q else [8, 32], nodes=[4] if q else [16, 64],
                       context=32 if q else 512, repeats=2 if q else 5)),
        "serve": lambda: section_serve(device, 5 if q else args.serve_s, args.tokenizer, 2 if q else 8),
    }
    for name in args.sections.split(","):
        t0 = time.time()
        try:
            report["sections"][name] = {"result": plan[name]()}
        except Exception:  # noqa: BLE001 — one broken section must not lose the others' figures
            report["sections"][name] = {"error": traceback.format_exc()[-4000:]}
        report["sections"][name]["seconds"] = round(time.time() - t0, 1)
        if args.json:
            write_result(args.json, report)
        print(f"[gpu_check] {name}: {report['sections'][name]['seconds']} s", flush=True)
    return report


def table(report: dict) -> str:
    lines = [f"device {report['device']}, torch {report['torch']}"]
    for name, sec in report["sections"].items():
        if "error" in sec:
            lines.append(f"{name}: ERROR {sec['error'].strip().splitlines()[-1]}")
            continue
        res = sec["result"]
        if name == "exact":
            for r in res:
                lines.append(f"exact {r['shape']:>13} {r['dtype']:>8}: spec=hf {r['spec_vs_hf_identical']}/"
                             f"{r['prompts']}, plain=hf {r['plain_vs_hf_identical']}/{r['prompts']}, "
                             f"spec=plain {r['spec_vs_plain_identical']}/{r['prompts']}, "
                             f"divergences {[(d['at'], d['gap']) for d in r['divergences']]} ok={r['ok']}")
        elif name == "steps":
            for r in res:
                lines.append(f"steps {r['shape']:>13} {r['dtype']:>8} batch {r['batch']:>3}: "
                             + ", ".join(f"{n} nodes {ms} ms" for n, ms in zip(r["nodes"], r["step_ms"])))
        elif name == "speed":
            for r in res:
                lines.append(f"speed {r['shape']:>13} {r['dtype']:>8}: "
                             + ", ".join(f"{k[:-6]} {v}" for k, v in r.items() if k.endswith("_tok_s"))
                             + "".join(f", {k} {v}/{r['batch']}" for k, v in r.items() if k.endswith("_same_as_loop")))
        elif name == "draft":
            lines.append("draft: " + json.dumps(res))
        elif name == "attention":
            for r in res:
                if r.get("kind") == "step":
                    lines.append(f"attention step {r['shape']:>13} {r['dtype']:>8} {r['attention']:>6} ctx "
                                 f"{r['context']}: " + (r.get("error") or ", ".join(
                                     f"b{pt['batch']} n{pt['nodes']} {pt['step_ms']} ms" for pt in r["points"])))
                    continue
                lines.append(f"attention {r['config']:>16} {r['heads']} ctx {r['context']}: "
                             + ", ".join(f"{k[:-3]} {v} ms" for k, v in r.items() if k.endswith("_ms"))
                             + f" ok={r['ok']}")
        elif name == "serve":
            lines.append("serve: " + json.dumps({k: v for k, v in res.items() if k != "log_tail"}))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--quick", action="store_true", help="tiny shapes: the whole script in seconds on a CPU")
    p.add_argument("--sections", default="exact,attention,steps,speed,draft,serve")
    p.add_argument("--serve-s", type=float, default=60.0)
    p.add_argument("--tokenizer", type=Path, help="the default model's tokenizer files (serve section)")
    p.add_argument("--json", help="write the report here (after every section)")
    args = p.parse_args(argv)
    report = run(args)
    print(table(report))
    return 0 if all("error" not in s and _ok(s["result"]) for s in report["sections"].values()) else 1


def _ok(result: Any) -> bool:
    if isinstance(result, list):
        return all(r.get("ok", True) for r in result)
    return result.get("ok", True) or "skipped" in result


if __name__ == "__main__":
    sys.exit(main())
