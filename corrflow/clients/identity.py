"""The client side of stable identities: a query handler that answers corrflow's identity probe.

The probe travels as a QUERY message with its own action (``query.corrflow_identity``), not as
TRAIN: Flower runs a ClientApp's mods only around the functions it registered, so a TRAIN probe
reached a user's ``train`` function whenever corrflow's mod was missing — private data touched
outside the accounting, and a traceback per node. A ClientApp without this handler answers the QUERY
probe with Flower's own error ("No query function registered with name 'corrflow_identity'") before
any user code runs, and the server refuses the run, naming the fix.

Add it to your own app with one line: ``app = register_identity(ClientApp())`` (or
``register_identity(app)``).
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from corrflow.protocol import PROBE_ACTION, PROBE_KEY, REPLY_KEY, node_identity


def answer_probe(msg: Message, context: Context) -> Message:
    """Reply to corrflow's identity probe from ``context.node_config`` (the id, or why it cannot be
    reported)."""
    value, error = node_identity(str(msg.content["config"][PROBE_KEY]), context.node_config)
    record = ConfigRecord({"value": value} if value is not None else {"error": error})
    return Message(content=RecordDict({REPLY_KEY: record}), reply_to=msg)


def register_identity(app: ClientApp) -> ClientApp:
    """The one line a user's ClientApp needs: ``app = register_identity(ClientApp())``.

    Registers `answer_probe` as ``app``'s ``query.corrflow_identity`` function, so the server
    can resolve each node's stable user id (``partition-id`` or ``user-id`` from the node config)
    before round 0.

    Args:
        app: the user's ClientApp.

    Returns:
        ``app`` itself.
    """
    app.query(PROBE_ACTION)(answer_probe)
    return app
