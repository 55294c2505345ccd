"""The model side of a gateway: what the step loop drives and what the planner sizes by.

A `Target` is loaded here in process (`local_target`: the model, or the fake worker), or made
by Ray mode's scheduler replica over its verifier replicas (`gateway.ray_serve.deployments`),
each of which builds its own `batch_worker`. Imports of the model code (and torch) happen inside
the functions that load it: a Ray ingress replica imports the assembly and never loads a model.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.settings import Settings
from gateway.text import ToyTokenizer
from scheduler.loop import Worker
from scheduler.profile import StepCostModel
from workers.fake_worker import PacedFakeWorker

if TYPE_CHECKING:
    from workers.runtime import Runtime
    from workers.speculation.verifier import Verifier


@dataclass(frozen=True)
class Target:
    """What a gateway serves: the tokenizer, the step loop's worker, the ids that end a
    generation, the step costs the planner sizes trees by (None: its defaults), the tokenizer's
    compiled constraints when the worker runs in this process (None: the service compiles its
    own), the policy's KV fields with the line reported at start (none: no KV budget), and
    which CPU kernel path the model runs (workers/model/small_gemm.py; "torch": none) with its
    start-up line (None: no model in this process)."""
    tokenizer: Any
    worker: Worker
    stop_token_ids: frozenset[int]
    step_cost: StepCostModel | None = None
    grammars: Any = None
    kv: dict[str, int] = field(default_factory=dict)
    kv_note: str | None = None
    kernel_path: str | None = None
    kernel_note: str | None = None


def local_target(settings: Settings, progress: bool = True, runtime: Runtime | None = None) -> Target:
    """The target for `settings`, in this process: the fake worker, or the model (`runtime`, when
    a caller loaded it already, e.g. a test or a benchmark) behind a batch worker."""
    # the registry imports every drafter, the model drafters' torch with them: here, so that
    # importing the assembly (the `specgate serve --ray` driver does) loads no torch
    from workers.drafters.registry import drafter_names, is_drafter_name

    unknown = [d for d in settings.drafter_names if not is_drafter_name(d)]
    if unknown:
        raise ValueError(f"unknown drafter {unknown[0]!r}; available: {', '.join(drafter_names())}")
    if settings.fake_worker:
        tok = ToyTokenizer()
        worker = PacedFakeWorker(settings.fake_step_ms / 1000, context_limit=settings.fake_context)
        return Target(tok, worker, frozenset({tok.eos_token_id}))
    # the model code and torch: only where a model is loaded
    from workers.runtime import load_runtime

    rt = runtime or load_runtime(settings.model, dtype=settings.dtype, device=settings.device,
                                 attention=settings.attention, progress=progress)
    from workers.model import small_gemm

    worker = batch_worker(settings, rt)
    kv, note = kv_budget(worker.verifier)
    dtype, device = rt.forward.dtype, rt.forward.device
    return Target(rt.tokenizer, worker, rt.stop_token_ids, planner_step_cost(settings, rt),
                  rt.grammars, kv, note, small_gemm.serving_path(dtype, device),
                  small_gemm.serving_note(dtype, device))


def batch_worker(settings: Settings, rt: Runtime, drafters: dict | None = None) -> Any:
    """The model worker for a loaded runtime: in process (embedded) or in a verifier replica (Ray,
    where `drafters` are the draft workers' remote drafters by name)."""
    from workers.batch_worker import BatchWorker     # torch: a model is loaded

    kv_mb = settings.kv_cache_mb if settings.kv_cache_mb is not None else default_kv_cache_mb(rt.forward.device)
    verifier = rt.verifier(max_tree_tokens=max(64, settings.max_tree_tokens),
                           prefix_cache_mb=min(settings.prefix_cache_mb, kv_mb), kv_pool_mb=kv_mb,
                           prefix_cache_tenant_share=settings.prefix_cache_tenant_share)
    verifier.features = settings.length_predictor     # the length predictor reads them
    return BatchWorker(verifier, default_drafter=settings.drafter_names[0], drafters=drafters,
                       grammar=rt.grammar_drafter(), grammars=rt.grammars)


def planner_step_cost(settings: Settings, rt: Runtime | None, measured: dict | None = None) -> StepCostModel:
    """The step costs the planner sizes tree budgets by: `settings.step_profile` when set, else
    `measured` (a verifier replica's start-up profile, Ray mode), else measured now on `rt`."""
    if settings.step_profile is not None:
        return StepCostModel.from_json(settings.step_profile)
    if measured is None:
        measured = rt.step_profile(settings.max_batch, settings.max_tree_tokens)
    return StepCostModel.from_doc(measured)


def kv_budget(verifier: Verifier) -> tuple[dict[str, int], str | None]:
    """The policy's KV budget fields for a verifier with a KV pool, and the line reported at
    start; ({}, None) for one without (in Ray mode each verifier replica computes this for its
    own pool and the scheduler turns it into a budget per replica, `replica_kv_budget`)."""
    pool = verifier.kv_pool_bytes
    if pool is None:
        return {}, None
    per, slots = verifier.slot_bytes, verifier.kv_budget_slots
    note = (f"KV cache {pool / 2**20:,.0f} MiB: {slots:,} tokens at {per / 1024:.1f} KiB each "
            f"(requests and prefix cache; --kv-cache-mb)")
    return {"kv_budget_tokens": slots, "kv_block": verifier.kv_block,
            "kv_tree_tokens": verifier.max_tree_tokens + 1}, note


def replica_kv_budget(fields: dict[str, int], note: str | None) -> tuple[dict[str, int], str | None]:
    """Ray mode's policy KV fields and start note, from one verifier replica's `kv_budget`: every
    replica has a budget of its own, which the planner gets per replica every step
    (`StepLoop(kv_budgets=...)`), so the policy keeps the block and tree sizes only. ({}, None)
    for replicas without a KV pool.

    >>> replica_kv_budget({"kv_budget_tokens": 4096, "kv_block": 256, "kv_tree_tokens": 65}, "KV cache 16 MiB")
    ({'kv_block': 256, 'kv_tree_tokens': 65}, 'KV cache 16 MiB per verifier replica; the planner keeps each replica within its own')
    """
    if not fields:
        return {}, None
    fields = {k: v for k, v in fields.items() if k != "kv_budget_tokens"}
    return fields, f"{note} per verifier replica; the planner keeps each replica within its own"


def default_kv_cache_mb(device: Any = None) -> float:
    """Half the memory available now (the model loaded) where the KV lives: what KV may take by
    default. On a GPU (`device`, a torch device), its free memory; on the CPU, Linux's
    MemAvailable (free memory plus what caches would give back), else free pages."""
    if device is not None and device.type == "cuda":
        from workers.model.device import free_bytes       # torch: a model is loaded

        return free_bytes(device) / 2 / 2**20
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 2 / 2**20
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2 / 2**20


def freeze_heap() -> None:
    """Call once a serving process has loaded its model and built its app: collect, then move
    every object that survives into the collector's permanent generation (`gc.freeze`). A full
    collection walks every tracked object, and a loaded model and web stack are hundreds of
    thousands of them, all alive for good: walked, such a collection holds the GIL long enough
    to stall every stream for a step or more, at moments nobody chooses. Frozen, they are never
    walked again; collections see only what serving creates. Not for a process that builds and
    drops many apps (tests): what is frozen is never freed."""
    gc.collect()
    gc.freeze()
