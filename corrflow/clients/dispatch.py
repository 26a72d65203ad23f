"""One ClientApp for every corrflow task, the one ``flwr run .`` and ``deploy/app`` bind: each TRAIN
message is handled by the client the server's run config selects (``corrflow.client``, sent as the
message's ``client`` key: ``numpy``, ``nextword`` or ``keras``; ``numpy`` when absent). The
next-word clients read their user's data from the SuperNode's own node config when it names a file
(``data-path``, ``vocab-path``, as ``corrflow data partition`` prints them), else from the paths the
server sends. Answers the identity probe like every corrflow ClientApp, and SecAgg+'s stages when
the server runs with ``corrflow.secure-aggregation`` (`corrflow.clients.secagg`) — behind the noise
node guard when the node config pins a noise node (`corrflow.clients.noise_guard`). On a noise
node's own SuperNode (``noise-node-socket`` in its node config, ``corrflow noise-node``) it only
relays SecAgg+ stages to the noise node's process (`corrflow.noisenode.service.relay`)."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from corrflow.clients import keras_client, nextword_client, numpy_client
from corrflow.clients.identity import register_identity
from corrflow.clients.secagg import with_noise_node_guard, with_secure_aggregation
from corrflow.noisenode.protocol import PIN_ID, SOCKET_KEY

app = register_identity(ClientApp())  # answers the server's identity probe
_CLIENTS = {"numpy": numpy_client, "nextword": nextword_client, "keras": keras_client}


@app.train()
def train(msg: Message, context: Context) -> Message:
    if SOCKET_KEY in context.node_config:  # this SuperNode is a noise node's: it only relays
        return _noise_node(msg, context)
    if RECORD_KEY_CONFIGS in msg.content.config_records:  # a SecAgg+ stage (secure-aggregation)
        if PIN_ID in context.node_config:  # a noise node is pinned: its guard is outermost
            return _guarded_secure_train(msg, context)
        return _secure_train(msg, context)
    return _train(msg, context)


def _noise_node(msg: Message, context: Context) -> Message:
    from corrflow.noisenode.service import relay

    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        raise ValueError("a noise node's SuperNode answers SecAgg+ stages only (no training)")
    config = dict(msg.content.config_records[RECORD_KEY_CONFIGS])
    stage = config.pop(Key.STAGE)
    out = relay(stage, config, context.node_config)
    return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(out)}), reply_to=msg)


def _train(msg: Message, context: Context) -> Message:
    name = str(msg.content["config"].get("client", "numpy"))
    if name not in _CLIENTS:
        raise ValueError(
            f"client: expected one of {', '.join(_CLIENTS)} (corrflow.client), got {name!r}"
        )
    return _CLIENTS[name].train(msg, context)


# Flower's secaggplus_mod around corrflow's clipping mod around the task (corrflow.clients.secagg)
_secure_train = with_secure_aggregation(_train)
_guarded_secure_train = with_noise_node_guard(_secure_train)
