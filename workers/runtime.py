"""Assemble a runnable target: tokenizer, lean forward, verifier (prompt records to ids: workers/prompts.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.model.device import resolve_device, resolve_dtype
from workers.model.llama_forward import LlamaForward
from workers.model.loader import DEFAULT_MODEL, load_target
from workers.model.prefix_cache import DEFAULT_TENANT_SHARE, PrefixCache
from workers.speculation.processors import ProcessorFactory, sampling_processors
from workers.speculation.profiling import startup_profile
from workers.speculation.verifier import Verifier

# Per verifier: SmolLM2-135M's fp32 KV is 46 KiB a token, so 256 MiB holds ~5,700 prompt tokens.
DEFAULT_PREFIX_CACHE_MB = 256.0


@dataclass
class Runtime:
    tokenizer: Any
    forward: LlamaForward
    hf_model: Any | None          # kept only when a caller needs the transformers reference
    stop_token_ids: frozenset[int]
    _profiles: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    _grammars: Any = None

    @property
    def grammars(self) -> Any:
        """The tokenizer's compiled constraints (workers.speculation.grammar.Grammars), one per process:
        what the verifier's rules, the grammar drafter and the gateway's check share. Imported
        on first use: the grammar engine takes a while to import."""
        if self._grammars is None:
            from workers.speculation.grammar import Grammars

            self._grammars = Grammars.from_tokenizer(self.tokenizer, self.forward.vocab_size,
                                                     self.stop_token_ids)
        return self._grammars

    def processors(self) -> ProcessorFactory:
        """Each request's logit rules: penalties and logit_bias, and its grammar when it has a
        constraint (workers/speculation/grammar.py, loaded at the first constrained request)."""
        vocab = self.forward.vocab_size
        plain = sampling_processors(vocab)

        def build(sampling, output):
            if not sampling.constraint:
                return plain(sampling, output)
            from workers.speculation.grammar import grammar_processors

            return grammar_processors(self.grammars, vocab)(sampling, output)
        return build

    def grammar_drafter(self) -> Any:
        """The grammar drafter (workers/drafters/grammar.py) over this tokenizer's grammars: what
        BatchWorker merges into constrained requests' drafters."""
        from workers.drafters.registry import create_drafter

        return create_drafter("grammar", grammars=self.grammars)

    def verifier(self, max_tree_tokens: int = 64,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 kv_pool_mb: float | None = None,
                 prefix_cache_tenant_share: float = DEFAULT_TENANT_SHARE) -> Verifier:
        """`prefix_cache_mb`: KV of earlier prompts' prefixes kept per verifier (0: none), at
        most; `kv_pool_mb`: the KV memory requests and prefix cache share (None: no pool);
        `prefix_cache_tenant_share`: the most of the prefix cache one tenant may hold."""
        f = self.forward
        cache = PrefixCache.for_bytes(int(prefix_cache_mb * 2**20), f.n_layers, f.n_kv_heads,
                                      f.head_dim, f.kv_dtype, tenant_share=prefix_cache_tenant_share)
        return Verifier(f, max_tree_tokens=max_tree_tokens, prefix_cache=cache,
                        kv_pool_bytes=None if kv_pool_mb is None else int(kv_pool_mb * 2**20),
                        processors=self.processors())

    def step_profile(self, max_batch: int = 1, max_tree_tokens: int = 31) -> dict[str, Any]:
        """This machine's step-cost profile (`workers.speculation.profiling.startup_profile`), measured once
        per shape asked for: what tree sizing reads (`scheduler.profile.StepCostModel.from_doc`)."""
        key = (max_batch, max_tree_tokens)
        if key not in self._profiles:
            self._profiles[key] = startup_profile(self, max_batch, max_tree_tokens)
        return self._profiles[key]


def load_runtime(model: str = DEFAULT_MODEL, *, dtype: str = "float32", device: str = "auto",
                 attention: str | None = None, keep_hf: bool = False, progress: bool = True) -> Runtime:
    """`device`: where the target, its KV and every step's tensors live (workers/model/device.py:
    'auto' takes CUDA when torch sees a GPU); `attention`: how the requests torch attends for
    share a call (workers/model/batched_attention.py; None: SPECGATE_ATTENTION, else auto)."""
    hf_model, tokenizer = load_target(model, dtype=resolve_dtype(dtype), device=resolve_device(device),
                                      progress=progress)
    return Runtime(tokenizer, LlamaForward(hf_model, attention=attention), hf_model if keep_hf else None,
                   stop_token_ids(hf_model, tokenizer))


def stop_token_ids(hf_model, tokenizer) -> frozenset[int]:
    """The ids that end a generation: the generation config's eos ids and the tokenizer's eos."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return frozenset(ids)

