"""Gateway settings: defaults, then `SPECGATE_*` environment variables, then command-line flags.

    SPECGATE_PORT=9000 SPECGATE_POLICY=fcfs specgate serve --redis-url redis://localhost:6379/0

Built once at start-up and passed in (`build_app(settings, …)`); nothing reads the environment
later, and there is no module-level instance.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.keepalive import KEEPALIVE_S
from gateway.tenancy.records import configured_digest
from gateway.tiers import DEFAULT_TIERS, TierObjectives, merged_tiers
from scheduler.tiers import TIERS

# a pepper is a random secret nobody types: this refuses placeholders, not weak randomness
MIN_PEPPER_CHARS = 32
DEFAULT_MODEL = "smollm2-135m"      # = workers.model.loader.DEFAULT_MODEL (not imported: no torch here)


class Settings(BaseSettings):
    # hide_input_in_errors: a setting may be a key, and an error must not print it
    model_config = SettingsConfigDict(env_prefix="SPECGATE_", extra="ignore", frozen=True,
                                      hide_input_in_errors=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: str = DEFAULT_MODEL                 # built-in name, HF directory or .gguf file
    served_model_name: str | None = None       # the id clients send; default: `model`
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # where the engine runs (workers/model/device.py): auto = CUDA when torch sees a GPU, else the CPU
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    # how the requests torch attends for (no CPU kernel: a GPU) share a call
    # (workers/model/batched_attention.py); auto: one call per request until a GPU run decides
    attention: Literal["auto", "loop", "padded", "flex"] = "auto"
    tenants_file: Path | None = None
    redis_url: str | None = None               # scheduler state, tenants and rate limits
    store_prefix: str = "specgate:"
    # Tenants and rate limits are shared by every replica under `store_prefix`; each replica's
    # scheduler keeps its requests under its own `<store_prefix>sched:<replica_id>:`, so a restarted
    # replica recovers its own requests and never another live replica's (e.g. the pod name).
    # how long an ended request's record stays fetchable (a client's late GET or reconnect);
    # in Redis every ended request holds a few keys this long, so it sets the store's plateau
    ended_ttl_s: float = Field(3600.0, gt=0)
    # Stored responses (POST /v1/responses with store: true, the default), per tenant unless its
    # record says otherwise: how long each can be retrieved, resumed or continued from its
    # creation (OpenAI keeps them 30 days; a week here: long enough to continue a conversation
    # after a weekend, and a tenant at its quota gets room back within days, not a month), and
    # how many, and how many bytes of input and output, a tenant may keep at once (a new one past
    # either is a 429 stored_responses_exceeded). The bytes default lets no tenant hold more than
    # a tenth of the chart's Redis (deploy/helm: 384 MB); the count bounds the keys it holds.
    responses_ttl_s: float = Field(7 * 86400.0, gt=0, le=2**31)     # Redis takes it in ms
    max_stored_responses: int = Field(10_000, ge=0)
    max_stored_response_bytes: int = Field(32 * 2**20, ge=0)
    replica_id: str = Field("0", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    # one process per replica id over one Redis: its lease, renewed every third of this; a dead
    # replica's id is free (and its requests adopted by a live replica) once it runs out
    replica_lease_s: float = Field(10.0, gt=0)
    # what one Redis call may take before it fails (a 503 with Retry-After to a client; the step
    # loop waits and retries); socket and connect timeout of every Redis client
    redis_timeout_s: float = Field(1.0, gt=0)
    # new requests get 503 store_full while Redis uses this share of its maxmemory or more: the
    # rest is the room the requests running write into until they end (scheduler/store/room.py)
    redis_memory_watermark: float = Field(0.9, gt=0, le=1)
    # a concurrency slot's lease: renewed every third of it while its request runs; a crashed
    # gateway's slots free themselves within it
    concurrency_lease_s: float = Field(30.0, gt=0)
    # with the tenants file's admin keys, THE admin keys: a change replaces the stored set at start
    admin_key: SecretStr | None = None
    metrics_key: SecretStr | None = None       # reads GET /metrics only (for Prometheus)
    # the server secret API keys rest under in the store (an HMAC, gateway/tenancy/records.py):
    # set it once and keep it; a different one makes every stored key unknown
    key_pepper: SecretStr | None = None
    # srpt is for measurement only: it needs `length_oracle` (scheduler/length_oracle.py);
    # priority: strict service tiers, first come first served in each (the tiers' baseline)
    policy: Literal["laps", "fcfs", "sjf", "las", "srpt", "priority"] = "laps"
    # service tiers (gateway/tiers.py): each tier's TTFT and time-between-tokens targets, the
    # percentile of its requests that must meet them, its maximum queue wait and what the planner
    # does about a request about to pass it; JSON, a tier's fields over its defaults
    service_tiers: dict[Literal[TIERS], TierObjectives] = Field(
        default_factory=lambda: dict(DEFAULT_TIERS))
    # predict each request's TTFT from the queue ahead (scheduler/miss.py) and refuse, or move
    # to flex, one that would miss its tier's target (`on_predicted_miss`); docs/operations.md
    slo_admission: bool = False
    drafters: str = "ngram"                    # comma-separated; the first is the default
    grpc_port: int | None = Field(None, ge=0, le=65535)
    # the scheduler
    max_batch: int = Field(8, ge=1)
    token_budget: int = Field(64, ge=1)        # per step: Σ (1 root + tree nodes)
    max_tree_tokens: int = Field(16, ge=0)      # per request per step (a tenant may cap lower)
    max_resident: int = Field(32, ge=1)        # requests holding KV at once
    # prompt tokens a step prefills, per request waiting for its context, beside the trees
    # (chunked prefill, `scheduler.policies.step_budget.chunk_budget`); 0: whole, alone
    prefill_chunk_tokens: int = Field(24, ge=0)
    # in a step shared by tenants, the least share of its spare rows each tenant's chunks and
    # draft nodes may take (`scheduler.policies.row_shares`): one tenant's speculation or prompt
    # flood stretches another's gaps by at most this share's rows; 1: no limit
    tenant_row_share: float = Field(0.5, gt=0, le=1)
    prefix_cache_mb: float = Field(256.0, ge=0)   # per verifier: earlier prompts' prefix KV; 0: off
    # of the prefix cache, the most one tenant may hold (so one tenant cannot flush the others')
    prefix_cache_tenant_share: float = Field(0.5, gt=0, le=1)
    # with Redis: how often a replica checks for tenants removed through another replica, to
    # drop their caches and series here too (GenerationService.sweep_tenants); 0: never
    tenant_sweep_s: float = Field(30.0, ge=0)
    # per verifier: the KV memory of all resident requests and the prefix cache together (the
    # prefix cache yields first); None: half the memory available once the model is loaded
    kv_cache_mb: float | None = Field(None, gt=0)
    length_predictor: bool = True      # predict output lengths from the target's hidden states
    # measurement only: a table of prompts' true lengths (`loadtest compare` writes it for srpt)
    length_oracle: Path | None = None
    # the planner's step costs: a profile JSON (`specgate bench profile --json`); default: measured
    # on this machine at start-up, a few seconds (tools/bench_profile.py startup_profile)
    step_profile: Path | None = None
    max_live: int = Field(4096, ge=1)          # queued + running: more is 503
    max_live_per_tenant: int = Field(1024, ge=1)   # default tenant queue (tenant.max_queued wins)
    # streams one tenant may follow at once (resumes, GET /v1/responses/{id}?stream=true, gRPC
    # Resume), on every replica together: each holds a connection and an ingress slot while the
    # request it follows runs (gateway/followers.py says why this is not max_concurrent)
    max_followers_per_tenant: int = Field(16, ge=1)
    # structured outputs: caps on a schema's size and shape, checked before any compile (400
    # schema_too_complex naming the cap; workers/speculation/schema_caps.py says why each)
    schema_max_bytes: int = Field(131_072, ge=1)
    schema_max_depth: int = Field(20, ge=1, le=64)           # levels of subschemas
    schema_max_properties: int = Field(1_000, ge=1)         # in the whole schema
    schema_max_enum_values: int = Field(1_000, ge=1)        # enum members and consts, in all
    schema_max_enum_chars: int = Field(15_000, ge=1)        # their characters, in all
    schema_max_pattern_chars: int = Field(1_000, ge=1)      # one pattern
    schema_max_repeat: int = Field(100, ge=1)               # n in a pattern's {m,n}
    schema_max_items: int = Field(1_000, ge=0)              # minItems, maxItems
    # compiles run in these many processes per gateway (Ray: per scheduler), each ended past the
    # time limit (400 schema_too_complex); a tenant may have this many compiling at once (429)
    grammar_compile_workers: int = Field(2, ge=1, le=64)
    grammar_compile_timeout_s: float = Field(5.0, gt=0)
    grammar_compiles_per_tenant: int = Field(1, ge=1)
    # Ray: the largest compiled grammar the scheduler ships to a verifier replica with a prefill
    grammar_max_shipped_mb: float = Field(16.0, gt=0)
    # HTTP
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    # answer a generation request whose key was refused for its rpm or concurrency a moment ago
    # with the same 429 before any work on it (gateway/http/refusal_book.py); off: every
    # refusal takes the full path (`specgate bench refusals` compares the two)
    early_refusals: bool = True
    # how long the gate holds an early refusal before answering it (at most the refusal's own
    # Retry-After): a client that retries at once, as a flood does, then gets one answer per
    # connection per hold instead of as many as the gateway can write; the hold is a sleep,
    # which costs the event loop nothing. 0: answer at once
    early_refusal_hold_s: float = Field(1.0, ge=0, le=10)
    # a stream that has sent nothing for this long sends a keep-alive (SSE: a comment line; gRPC:
    # an empty delta and HTTP/2 pings), so proxies that close idle connections do not cut one that
    # waits in the queue; keep it below their idle timeout (often 60 s). 0: none
    stream_keepalive_s: float = Field(KEEPALIVE_S, ge=0)
    # backpressure (gateway/service/stream.py): a live stream whose reader has left this many
    # generated tokens unread is paused in the scheduler (no steps, its KV freed) until it has
    # drained to stream_resume_tokens; 0: never paused. Enough to ride out a reader's hiccup
    # without a pause, little beside what a client that stopped reading would waste.
    stream_backlog_tokens: int = Field(256, ge=0)
    stream_resume_tokens: int = Field(64, ge=0)
    # bytes one HTTP connection may hold written and unsent, in the transport and in the
    # socket's send buffer each (gateway/http/server.py SEND_BUFFER_BYTES): a stream's backlog
    # builds only once they are full; 0: the event loop's and the kernel's defaults
    send_buffer_bytes: int = Field(16384, ge=0)
    # `n`: choices one request may ask for, each its own request through the scheduler
    max_choices: int = Field(8, ge=1)
    openapi_docs: bool = False                 # serve /docs, /redoc and /openapi.json (public)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # testing and gateway benchmarks: no model, the scheduler's fake worker
    fake_worker: bool = False
    fake_step_ms: float = Field(0.0, ge=0)     # sleep per fake step (a stand-in step cost)
    fake_context: int = Field(4096, ge=2)

    @field_validator("drafters")
    @classmethod
    def _drafters(cls, v: str) -> str:
        names = [d.strip() for d in v.split(",") if d.strip()]
        if not names:
            raise ValueError("name at least one drafter (e.g. 'ngram', or 'none')")
        return ",".join(names)

    @field_validator("service_tiers", mode="before")
    @classmethod
    def _tiers_over_defaults(cls, v: object) -> object:
        return merged_tiers(v)

    @field_validator("admin_key", "metrics_key")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            configured_digest(v.get_secret_value())     # ValueError: too short (never says the key)
        return v

    @field_validator("key_pepper")
    @classmethod
    def _pepper_long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < MIN_PEPPER_CHARS:
            raise ValueError(f"key_pepper must have at least {MIN_PEPPER_CHARS} characters "
                             "(e.g. `openssl rand -hex 32`)")
        return v

    @model_validator(mode="after")
    def _srpt_needs_oracle(self) -> "Settings":
        if self.policy == "srpt" and self.length_oracle is None:
            raise ValueError("policy 'srpt' knows true lengths only from a length_oracle table "
                             "(measurement only: `specgate loadtest compare` makes one)")
        return self

    @property
    def drafter_names(self) -> tuple[str, ...]:
        return tuple(self.drafters.split(","))

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model
