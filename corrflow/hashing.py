"""The one canonical form corrflow hashes and authenticates JSON in: ``json.dumps(obj,
sort_keys=True)`` (default separators, non-JSON values as ``str``), UTF-8. Settings fingerprints,
cache keys, release-journal entries and checkpoint manifests all go through it, so two writers can
never disagree on the bytes behind one digest."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """The canonical bytes of ``obj`` (see the module docstring)."""
    import json

    return json.dumps(obj, sort_keys=True, default=str).encode()


def canonical_sha256(obj: Any) -> str:
    """Hex SHA-256 of `canonical_json`."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def canonical_hmac(key: bytes, obj: Any) -> str:
    """Hex HMAC-SHA-256 of `canonical_json` under ``key``."""
    return hmac.new(key, canonical_json(obj), hashlib.sha256).hexdigest()
