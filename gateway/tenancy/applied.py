"""What the store remembers of the tenants file it last applied: pure records and fingerprints.

`TenantRegistry.load_config` applies an entry of the tenants file only when it differs from the
one last applied (otherwise a restart would undo what the admin API did since), and applies an
entry's keys as a change against the keys the file gave last time (otherwise an edit of any other
field would undo a key rotation made through the API). So the store keeps, per tenant name (and
under "@admins" for the admin keys), a fingerprint of the entry and the keys the file gave, in
the form the store holds them (`gateway.tenancy.records.rest_digest`).

Fingerprints are keyed by the server's pepper when there is one: an unkeyed hash over an entry
and its key digests would let a copy of the store test guesses of a typed-in key. Records older
releases wrote are a bare SHA-256 fingerprint, with no keys: `read` returns them with
`keys=None`, and `unchanged` still recognises them, so an upgrade re-applies nothing.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any, Sequence

ADMINS = "@admins"      # the record of the configured admin keys


@dataclass(frozen=True)
class Applied:
    """One record. `keys`: the file's keys as stored, when applied; None when not known (a
    record written before keys were recorded)."""
    fingerprint: str
    keys: tuple[str, ...] | None = None


def fingerprint(obj: Any, pepper: bytes | None) -> str:
    """HMAC-SHA256 of `obj`'s canonical JSON under `pepper`; plain SHA-256 without one (what
    older releases stored, so a store without a pepper keeps its records as they were)."""
    text = json.dumps(obj, sort_keys=True).encode()
    if pepper is None:
        return hashlib.sha256(text).hexdigest()
    return "hmac:" + hmac.new(pepper, text, hashlib.sha256).hexdigest()


def read(text: str | None) -> Applied | None:
    if not text:
        return None
    if not text.startswith("{"):                     # an older release's bare fingerprint
        return Applied(text)
    doc = json.loads(text)
    keys = doc.get("keys")
    return Applied(str(doc.get("fp", "")), None if keys is None else tuple(keys))


def write(record: Applied) -> str:
    doc: dict[str, Any] = {"fp": record.fingerprint}
    if record.keys is not None:
        doc["keys"] = list(record.keys)
    return json.dumps(doc, separators=(",", ":"))


def unchanged(record: Applied | None, obj: Any, pepper: bytes | None) -> bool:
    """Was `obj` (an entry, or the admin keys, with key digests as `hash_key` makes them) the
    last one applied? A bare record of an older release matches its plain fingerprint."""
    if record is None:
        return False
    if hmac.compare_digest(record.fingerprint, fingerprint(obj, pepper)):
        return True
    return record.keys is None and hmac.compare_digest(record.fingerprint, fingerprint(obj, None))


def previous_keys(record: Applied | None, rest: Any) -> list[str] | None:
    """The keys the file gave last time, in the store's current form (`rest` turns a "sha256:"
    digest into it: a store that gained a pepper since holds them migrated), or None if not
    known."""
    if record is None or record.keys is None:
        return None
    return [rest(k) if k.startswith("sha256:") else k for k in record.keys]


def entry(tenant: dict[str, Any], digests: Sequence[str]) -> list[Any]:
    """What an entry's fingerprint is taken over: as older releases took it."""
    return [tenant, sorted(digests)]
