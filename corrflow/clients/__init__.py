"""Flower ClientApps for corrflow's tasks (numpy regression, numpy and Keras next-word prediction)
behind one dispatching app, and what a user's own ClientApp needs to join a corrflow run: the
identity probe's answer (`register_identity`) and SecAgg+ with corrflow's clipping
(`secure_aggregation_mods`). `get_task` pairs a client with its server-side evaluation.
"""

# Loaded on first use, not with the package: the task helpers must not import Flower.

__all__ = ["get_task", "register_identity", "secure_aggregation_mods", "secure_client_app"]

_HOMES = {
    "get_task": "corrflow.clients.tasks",
    "register_identity": "corrflow.clients.identity",
    "secure_aggregation_mods": "corrflow.clients.secagg",
    "secure_client_app": "corrflow.clients.secagg",
}


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'corrflow.clients' has no attribute {name!r}")
