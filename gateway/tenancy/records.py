"""Tenant records and key digests: plain data and pure functions, shared by the tenants file's
parser (`gateway.tenancy.config`) and the registry that stores them (`gateway.tenancy.tenants`)."""
from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

KEY_PREFIX = "sk-"            # generated keys look like OpenAI's; never like a digest
# The shortest key an operator may configure (tenants file, admin API, `admin_key`, `metrics_key`):
# a guard against placeholder and typed-in keys ("a", "test"), not a strength meter. Generated
# keys (`new_api_key`) are 46 characters. Code that builds a registry itself (tests, benchmarks)
# may use shorter keys through `TenantRegistry.put`.
MIN_KEY_CHARS = 16
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
_DIGEST_RE = re.compile(r"sha256:[0-9a-fA-F]{64}\Z")
# What a store holds for a key when the server has a pepper (`rest_digest`); "sha256:" otherwise.
REST_PREFIX = "hmac-sha256:"


# ---- the records ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculationPolicy:
    enabled: bool = True
    drafters: tuple[str, ...] = ("ngram",)
    max_tree_tokens: int = 32


@dataclass(frozen=True)
class Tenant:
    """`name` is what operators and clients see (metrics, quotas, fairness, the admin API); `id`
    is what the engine's caches are keyed by (prefix cache, suffix drafter): made by the registry
    when the tenant is created, kept while it is replaced or its keys rotate, never reused, so a
    tenant deleted and created again under the same name starts with empty caches (a cache hit
    would tell the new owner, through timing or drafts, what the old one sent). A `Tenant` built
    by hand gets a fresh random id; the registry ignores it and keeps its own (see
    `TenantRegistry.put`). Left out of equality: two records of one tenant compare by content."""
    name: str
    weight: float = 1.0                 # share of verifier work within its priority class
    priority: int = 0                   # 0 = most urgent class
    rpm: int | None = None              # None = unlimited
    tpm: int | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None
    max_prompt_tokens: int | None = None    # longer prompts are refused (413); None = the context
    # stored responses (Responses API) it may keep at once, their bytes, and how long each is
    # kept; None = the gateway's setting (`max_stored_responses`, `max_stored_response_bytes`,
    # `responses_ttl_s`); a count or bytes of 0: it may store none
    max_stored_responses: int | None = None
    max_stored_response_bytes: int | None = None
    responses_ttl_s: int | None = None
    models: tuple[str, ...] = ("*",)
    speculation: SpeculationPolicy = field(default_factory=SpeculationPolicy)
    # the service tiers its requests may ask for (scheduler/tiers.py), and the one `auto` (or no
    # `service_tier`) gets; by default every request is `default`, as before tiers
    service_tiers: tuple[str, ...] = ("default",)
    default_service_tier: str = "default"
    id: str = field(default_factory=lambda: new_tenant_id(), compare=False)

    def allows_model(self, model: str) -> bool:
        """fnmatch patterns, case-sensitive: "*" allows every model, "llama-*" a family."""
        # "*" short-cut: fnmatch on every request was a measurable share of the event loop in
        # `bench gateway` (README.md, "Serving path and start-up times").
        return "*" in self.models or any(fnmatch.fnmatchcase(model, p) for p in self.models)

    def tier_for(self, asked: str | None) -> str:
        """The tier a request that asks for `asked` runs in: its tenant's default for `auto` or
        nothing, else what it asked (which `allows_tier` may refuse)."""
        return self.default_service_tier if asked in (None, "auto") else asked

    def allows_tier(self, tier: str) -> bool:
        return tier in self.service_tiers


def tenant_to_dict(t: Tenant) -> dict[str, Any]:
    """The tenant as in the tenants file, less `api_keys` (what the admin API and the store show;
    the id is stored beside it by the registry, `TenantRegistry`)."""
    s = t.speculation
    d = {"name": t.name, "weight": t.weight, "priority": t.priority, "rpm": t.rpm, "tpm": t.tpm,
         "max_concurrent": t.max_concurrent, "max_queued": t.max_queued,
         "max_prompt_tokens": t.max_prompt_tokens,
         "models": list(t.models),
         "speculation": {"enabled": s.enabled, "drafters": list(s.drafters),
                         "max_tree_tokens": s.max_tree_tokens}}
    # Fields added since records were first written (stored-response quotas, tiers) are left out
    # at their defaults, as an entry may leave them out: a record, and the fingerprint of a
    # tenants-file entry (gateway/tenancy/applied.py), made before them stay what they were, so
    # an upgrade re-applies no entry over what the admin API changed since, and a replica of the
    # previous release still reads every record of a tenant that does not use them.
    stored = {"max_stored_responses": t.max_stored_responses,
              "max_stored_response_bytes": t.max_stored_response_bytes,
              "responses_ttl_s": t.responses_ttl_s}
    d.update({k: v for k, v in stored.items() if v is not None})
    if (t.service_tiers, t.default_service_tier) != _DEFAULT_TIERS:
        d["service_tiers"] = list(t.service_tiers)
        d["default_service_tier"] = t.default_service_tier
    return d


_DEFAULT_TIERS = (Tenant.service_tiers, Tenant.default_service_tier)


def new_tenant_id() -> str:
    """A tenant's immutable id: random (uuid4), so no two tenants ever share one, even across
    replicas and restarts, and nothing about the name can be read from it."""
    return "t-" + uuid.uuid4().hex


# ---- keys -------------------------------------------------------------------------------------------
def hash_key(api_key: str) -> str:
    """A key as configured -> "sha256:<hex>". A "sha256:<hex>" digest passes through (lowercased),
    so a tenants file need not hold plaintext keys.

    >>> hash_key("sk-acme-1")[:15]
    'sha256:81968561'
    """
    if not isinstance(api_key, str) or not api_key:
        raise ValueError("an API key must be a non-empty string")
    if api_key.startswith("sha256:"):
        if not _DIGEST_RE.match(api_key):
            raise ValueError("a 'sha256:' key must be followed by 64 hex digits")
        return api_key.lower()
    return presented_digest(api_key)


def configured_digest(api_key: str) -> str:
    """`hash_key` for a key an operator configures: a plaintext key must have at least
    MIN_KEY_CHARS characters (a "sha256:" digest passes: its key cannot be measured). The error
    never repeats the key."""
    if isinstance(api_key, str) and not api_key.startswith("sha256:") and len(api_key) < MIN_KEY_CHARS:
        raise ValueError(f"an API key must have at least {MIN_KEY_CHARS} characters")
    return hash_key(api_key)


def presented_digest(presented: str) -> str:
    # NOTE: a key presented by a client is always hashed, even if it looks like a digest: otherwise
    # anyone who saw a digest (the tenants file, the store) could send it as a key.
    return "sha256:" + hashlib.sha256(presented.encode()).hexdigest()


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


# ---- keys at rest -------------------------------------------------------------------------------------
def rest_digest(digest: str, pepper: bytes | None) -> str:
    """What a store keeps for the key whose digest is `digest` ("sha256:<hex>", as `hash_key`
    makes it): HMAC-SHA256 under the server's pepper, so a copy of the store (a Redis dump, a
    backup) cannot be used to test guesses of a typed-in key without the pepper, which lives
    elsewhere (the gateway's environment). With no pepper: the digest itself.

    Why an HMAC over the SHA-256 digest rather than over the key: a tenants file may hold only a
    key's "sha256:" digest, and a store written by an older release holds those digests; both
    become this form without the key (`TenantRegistry` migrates a store at start). Why a pepper
    rather than a random salt per key: a presented key must be found in one lookup, and keys an
    operator types carry no id to find a per-key salt by. Why not a slow hash: every request
    computes one, and a slow one would be a cost any caller could make the gateway pay.

    >>> rest_digest(hash_key("sk-acme-1"), b"pepper-0123456789")[:20]
    'hmac-sha256:84c99397'
    """
    if pepper is None:
        return digest
    return REST_PREFIX + hmac.new(pepper, bytes.fromhex(digest.removeprefix("sha256:")),
                                  hashlib.sha256).hexdigest()
