"""The client side of stable identities: a Flower client mod that answers corrflow's identity probe.

The server cannot tell from a node id who is behind it (simulated nodes and insecure SuperNodes get a new id and a
new key on every launch), so an operator who declares ``identity = user-id`` or ``partition-id`` needs every
ClientApp to report that value from its node config. Flower runs mods only around registered handlers, so the probe
travels as a TRAIN message, which every training app handles; the mod answers it without calling the app.
Add it to your own app with one line: ``ClientApp(mods=[corrflow_identity_mod])``.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

PROBE_KEY = "corrflow.identity-probe"   # config key of a probe; its value is the identity source asked for
REPLY_KEY = "corrflow.identity"         # reply record: {"value": id} or {"error": why}


def node_identity(source: str, node_config) -> tuple[str | None, str | None]:
    """(stable id, None) for ``source`` from a node config, or (None, why it cannot be reported)."""
    if source == "partition-id":
        value = node_config.get("partition-id")
        if value is None or isinstance(value, bool) or not float(value).is_integer():
            return None, "the node config has no integer 'partition-id' (simulation sets it)"
        return f"partition-{int(value)}", None
    if source == "user-id":
        value = node_config.get("user-id")
        if not isinstance(value, str) or not value.strip():
            return None, "the node config has no non-empty string 'user-id' (start the SuperNode with " \
                         "--node-config \"user-id='…'\")"
        return f"user-{value.strip()}", None
    return None, f"identity source {source!r} is not reported by clients"


def is_probe(msg: Message) -> bool:
    if msg.metadata.message_type != MessageType.TRAIN:
        return False
    config = msg.content.config_records.get("config")
    return config is not None and PROBE_KEY in config


def corrflow_identity_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Answer corrflow's identity probe from ``context.node_config``; pass every other message to the app."""
    if not is_probe(msg):
        return call_next(msg, context)
    value, error = node_identity(str(msg.content["config"][PROBE_KEY]), context.node_config)
    record = ConfigRecord({"value": value} if value is not None else {"error": error})
    return Message(content=RecordDict({REPLY_KEY: record}), reply_to=msg)
