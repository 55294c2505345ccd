"""The tenants file: YAML (or any mapping) → `Tenant` records and key digests, validated.

Pure parsing: every problem is a `TenantsConfigError` naming the field (`tenants[1].rpm`) and,
for a file, its line; messages never repeat a key. `gateway.tenancy.tenants.TenantRegistry` stores what
this returns.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from gateway.tenancy.records import (NAME_RE, SpeculationPolicy, Tenant, configured_digest,
                                     hash_key)
from scheduler.tiers import TIERS

_MAX_FLOAT = sys.float_info.max     # a weight must be a finite float (10**400 is an int, not one)
_MAX_INT = 2**53                    # counts and limits: exact as floats (the limiter's arithmetic)
MAX_TTL_S = 2**31                   # seconds (68 years): in milliseconds, an expiry Redis takes


class TenantsConfigError(ValueError):
    """A bad tenants file or tenant object. `path` locates the field (("tenants", 1, "rpm")),
    `field` spells it ("tenants[1].rpm")."""

    def __init__(self, path: tuple = (), problem: str = "invalid", *, location: str = "") -> None:
        self.path, self.problem = tuple(path), problem
        self.field = _spell(self.path)
        text = f"{self.field}: {problem}" if self.field else problem
        super().__init__(f"{location}: {text}" if location else text)


def _spell(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


_TOP_FIELDS = frozenset({"tenants", "admin_keys"})
_TENANT_FIELDS = frozenset({"name", "api_keys", "weight", "priority", "rpm", "tpm",
                            "max_concurrent", "max_queued", "max_prompt_tokens",
                            "max_stored_responses", "max_stored_response_bytes",
                            "responses_ttl_s", "models", "speculation", "service_tiers",
                            "default_service_tier"})
_SPEC_FIELDS = frozenset({"enabled", "drafters", "max_tree_tokens"})


def _mapping(obj: Any, allowed: frozenset, path: tuple) -> Mapping:
    if not isinstance(obj, Mapping):
        raise TenantsConfigError(path, f"must be a mapping, got {type(obj).__name__}")
    for k in obj:
        if k not in allowed:
            raise TenantsConfigError(path + (str(k),), "unknown field; expected one of "
                                     + ", ".join(sorted(allowed)))
    return obj


def _int(obj: Mapping, key: str, path: tuple, default: int | None, *, minimum: int,
         nullable: bool = False, maximum: int = _MAX_INT) -> int | None:
    v = obj.get(key, default)
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        most = "2**53" if maximum == _MAX_INT else str(maximum)
        raise TenantsConfigError(path + (key,), f"must be an integer >= {minimum} (at most {most})"
                                 + (" or null" if nullable else "") + f", got {v!r}")
    return v


def _strings(obj: Mapping, key: str, path: tuple, default: Sequence[str]) -> list[str]:
    v = obj.get(key, default)
    if not isinstance(v, (list, tuple)):
        raise TenantsConfigError(path + (key,), f"must be a list of strings, got {type(v).__name__}")
    for i, s in enumerate(v):
        if not isinstance(s, str) or not s or not _is_unicode(s):
            raise TenantsConfigError(path + (key, i),
                                     "must be a non-empty string (of valid Unicode)")
    return list(v)


def _is_unicode(s: str) -> bool:
    """False for a string holding a lone surrogate (JSON "\\ud800"): it has no UTF-8 form, so it
    could be neither stored nor sent back."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _speculation(obj: Any, path: tuple) -> SpeculationPolicy:
    if obj is None:
        return SpeculationPolicy()
    _mapping(obj, _SPEC_FIELDS, path)
    enabled = obj.get("enabled", True)
    if not isinstance(enabled, bool):
        raise TenantsConfigError(path + ("enabled",), f"must be true or false, got {enabled!r}")
    drafters = _strings(obj, "drafters", path, SpeculationPolicy.drafters)
    if enabled and not drafters:
        raise TenantsConfigError(path + ("drafters",), "must name a drafter when enabled")
    max_tree = _int(obj, "max_tree_tokens", path, SpeculationPolicy.max_tree_tokens, minimum=1)
    return SpeculationPolicy(enabled, tuple(dict.fromkeys(drafters)), max_tree)


def _tiers(obj: Mapping, path: tuple) -> tuple[tuple[str, ...], str]:
    """(the tiers a tenant may use, its default): known tiers, the default among them."""
    tiers = _strings(obj, "service_tiers", path, Tenant.service_tiers)
    for i, tier in enumerate(tiers):
        if tier not in TIERS:
            raise TenantsConfigError(path + ("service_tiers", i), f"must be one of "
                                     f"{', '.join(TIERS)}, got {tier!r}")
    if not tiers:
        raise TenantsConfigError(path + ("service_tiers",), "must name at least one tier")
    default = obj.get("default_service_tier", "default" if "default" in tiers else tiers[0])
    if default not in tiers:
        raise TenantsConfigError(path + ("default_service_tier",), f"must be one of the tenant's "
                                 f"service_tiers ({', '.join(tiers)}), got {default!r}")
    return tuple(dict.fromkeys(tiers)), default


def parse_tenant(obj: Any, path: tuple = ()) -> tuple[Tenant, list[str]]:
    """One tenant object (a tenants-file entry, or an admin API body) -> (tenant, key digests)."""
    _mapping(obj, _TENANT_FIELDS, path)
    name = obj.get("name")
    if name is None:
        raise TenantsConfigError(path + ("name",), "is required")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise TenantsConfigError(path + ("name",), "must be 1-64 letters, digits, '.', '_' or '-', "
                                 f"starting with a letter or digit; got {name!r}")
    weight = obj.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= _MAX_FLOAT:
        raise TenantsConfigError(path + ("weight",), f"must be a number > 0, got {weight!r}")
    digests: list[str] = []
    for i, key in enumerate(_strings(obj, "api_keys", path, ())):
        try:
            digests.append(configured_digest(key))
        except ValueError as exc:
            raise TenantsConfigError(path + ("api_keys", i), str(exc)) from None
    tiers, default_tier = _tiers(obj, path)
    tenant = Tenant(
        name=name, weight=float(weight),
        priority=_int(obj, "priority", path, 0, minimum=0),
        rpm=_int(obj, "rpm", path, None, minimum=1, nullable=True),
        tpm=_int(obj, "tpm", path, None, minimum=1, nullable=True),
        max_concurrent=_int(obj, "max_concurrent", path, None, minimum=1, nullable=True),
        max_queued=_int(obj, "max_queued", path, None, minimum=1, nullable=True),
        max_prompt_tokens=_int(obj, "max_prompt_tokens", path, None, minimum=1, nullable=True),
        max_stored_responses=_int(obj, "max_stored_responses", path, None, minimum=0,
                                  nullable=True),
        max_stored_response_bytes=_int(obj, "max_stored_response_bytes", path, None, minimum=0,
                                       nullable=True),
        responses_ttl_s=_int(obj, "responses_ttl_s", path, None, minimum=1, nullable=True,
                             maximum=MAX_TTL_S),
        models=tuple(_strings(obj, "models", path, ("*",))),
        speculation=_speculation(obj.get("speculation"), path + ("speculation",)),
        service_tiers=tiers, default_service_tier=default_tier)
    return tenant, list(dict.fromkeys(digests))


def parse_tenants(doc: Mapping) -> tuple[list[tuple[Tenant, list[str]]], list[str]]:
    """A tenants file's document -> ([(tenant, key digests)], admin key digests). Pure. Rejects
    duplicate names and a key given twice (to two tenants, or to a tenant and the admins)."""
    _mapping(doc, _TOP_FIELDS, ())
    entries = doc.get("tenants") or []
    if not isinstance(entries, list):
        raise TenantsConfigError(("tenants",), f"must be a list, got {type(entries).__name__}")
    parsed: list[tuple[Tenant, list[str]]] = []
    names: dict[str, int] = {}
    owners: dict[str, tuple] = {}
    for i, entry in enumerate(entries):
        tenant, digests = parse_tenant(entry, ("tenants", i))
        if tenant.name in names:
            raise TenantsConfigError(("tenants", i, "name"), f"duplicate tenant name {tenant.name!r}"
                                     f" (also tenants[{names[tenant.name]}])")
        names[tenant.name] = i
        keys = entry.get("api_keys") or []
        for digest in digests:
            j = next(j for j, k in enumerate(keys) if hash_key(k) == digest)
            if digest in owners:
                raise TenantsConfigError(("tenants", i, "api_keys", j),
                                         f"key is also an API key of {_spell(owners[digest])}")
            owners[digest] = ("tenants", i)
        parsed.append((tenant, digests))
    admins = []
    for j, key in enumerate(_strings(doc, "admin_keys", (), ())):
        try:
            digest = configured_digest(key)
        except ValueError as exc:
            raise TenantsConfigError(("admin_keys", j), str(exc)) from None
        if digest in owners:
            raise TenantsConfigError(("admin_keys", j),
                                     f"key is also an API key of {_spell(owners[digest])}")
        admins.append(digest)
    return parsed, list(dict.fromkeys(admins))



def load_tenants_file(path) -> tuple[list[tuple[Tenant, list[str]]], list[str]]:
    """Read and parse a tenants file; an error names the file and the line of the bad field."""
    path = Path(path)
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TenantsConfigError((), f"not valid YAML: {exc}", location=str(path)) from None
    try:
        return parse_tenants({} if doc is None else doc)
    except TenantsConfigError as exc:
        line = _line_of(node, exc.path)
        where = f"{path}:{line}" if line else str(path)
        raise TenantsConfigError(exc.path, exc.problem, location=where) from None


def _line_of(node, path: tuple) -> int | None:
    """The 1-based line of the deepest node of the YAML tree that `path` reaches."""
    line = None
    for step in path:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == step]
            node = match[0][1] if match else None
            if match:
                line = match[0][0].start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
            node = node.value[step]
            line = node.start_mark.line + 1
        else:
            node = None
    return line
