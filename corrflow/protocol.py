"""The identity probe's wire format, shared by the server (which sends it) and corrflow's client mod
(which answers it): config keys, and how a node reports its stable id from its node config.
Flower-free.

The server cannot tell from a node id who is behind it (simulated nodes and insecure SuperNodes get
a new id and a new key on every launch), so an operator who declares ``identity = user-id`` or
``partition-id`` needs every ClientApp to report that value from its node config.
"""

from __future__ import annotations

from collections.abc import Mapping

# The probe is a QUERY message of this action (query.corrflow_identity).
PROBE_ACTION = "corrflow_identity"
# The config key of a probe; its value is the identity source asked for.
PROBE_KEY = "corrflow.identity-probe"
REPLY_KEY = "corrflow.identity"  # reply record: {"value": id} or {"error": why}


def node_identity(source: str, node_config: Mapping) -> tuple[str | None, str | None]:
    """(stable id, None) for ``source`` from a node config, or (None, why it cannot be reported)."""
    if source == "partition-id":
        value = node_config.get("partition-id")
        if value is None or isinstance(value, bool) or not float(value).is_integer():
            return None, "the node config has no integer 'partition-id' (simulation sets it)"
        return f"partition-{int(value)}", None
    if source == "user-id":
        value = node_config.get("user-id")
        if not isinstance(value, str) or not value.strip():
            return (
                None,
                "the node config has no non-empty string 'user-id' (start the SuperNode with "
                "--node-config \"user-id='…'\")",
            )
        return f"user-{value.strip()}", None
    return None, f"identity source {source!r} is not reported by clients"
