"""The client side of secure aggregation: corrflow's mod inside Flower's stock ``secaggplus_mod``.

Flower's mod runs the SecAgg+ protocol (keys, Shamir shares, masks: unchanged); in its
collect-masked-vectors stage it calls the app through corrflow's mod, which turns the app's reply
into what the accountant's sensitivity assumes: the update against the model sent, zeros when it is
not finite or its ℓ∞ exceeds the zeroing threshold (000 App. F.3), else clipped in ℓ2 to c − Δ√d so
that the quantized update never exceeds c. It repacks the update in the legacy ``fitres.*`` layout
the stock mod reads, with weight exactly 1 (``num_examples`` = ``max_weight``), the round's action
as a one-hot summed inside the masked vector, and no metric in the clear.

One line for users: ``app = register_identity(ClientApp(mods=secure_aggregation_mods()))``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client import Client, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate
from flwr.compat.common import recorddict_compat as compat

from corrflow.clients.identity import register_identity
from corrflow.run.secure_sum import (
    UNDECRYPTABLE_KEY,
    SecureSumParams,
    action_vector,
    bound_update,
)

log = logging.getLogger("corrflow")

#: The TRAIN config keys corrflow's server adds in the collect stage.
REPLIES_KEY, ZEROING_KEY = "replies", "zeroing-factor"


def clip_for_secure_aggregation(
    msg: Message, ctxt: Context, call_next: ClientAppCallable
) -> Message:
    """corrflow's mod inside ``secaggplus_mod`` (see the module docstring): the app's reply as the
    bounded update ``[u₁ … u_k, action one-hot · r]`` (trainable arrays in order, as float64) with
    weight 1 and no metrics."""
    if (
        msg.metadata.message_type != MessageType.TRAIN
        or RECORD_KEY_CONFIGS not in msg.content.config_records
    ):
        return call_next(msg, ctxt)
    state = ctxt.state.config_records[RECORD_KEY_STATE]  # the stock mod's, from the setup stage
    config = msg.content["config"]
    sent = msg.content["arrays"].to_numpy_ndarrays()
    trainable = [i for i, a in enumerate(sent) if np.issubdtype(a.dtype, np.floating)]
    try:
        update = _update(call_next(msg, ctxt), sent, trainable, config)
    except Exception:  # a failed training contributes zeros, counted (never named) as "zeroed"
        log.exception("training failed; this round's contribution is zero")
        update = [np.full(sent[i].shape, np.nan) for i in trainable]
    params = SecureSumParams(
        int(state["sample_num"]),
        int(state["share_num"]),
        int(state["threshold"]),
        float(state["clipping_range"]),
        int(state["target_range"]),
        int(state["mod_range"]),
    )
    clip = float(config["clip-norm"])
    # min(c, r) − Δ√d: a server that sends a range r > c cannot widen the client's bound past c
    bound = params.client_bound(sum(u.size for u in update), clip)
    bounded, action = bound_update(update, bound, float(config.get(ZEROING_KEY, 0.0)) * clip)
    # float64: Flower quantizes in the arrays' dtype, and float32 cannot hold T ≈ 2³¹ to one step
    packed = [
        np.asarray(a, np.float64) for a in (*bounded, action_vector(action, params.clipping_range))
    ]
    weight = int(float(state["max_weight"]))  # the server sends max_weight 1: ratio exactly 1
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(packed), weight, {})
    out = compat.fitres_to_recorddict(fitres, keep_input=False)
    return Message(out, reply_to=msg)


def _update(reply: Message, sent: list[np.ndarray], trainable: list[int], config) -> list:
    """The app's reply as its update against the model sent (float64; ``replies`` = delta: the
    reply itself)."""
    if reply.has_error():
        raise RuntimeError(f"the ClientApp failed: {reply.error.reason}")
    got = reply.content["arrays"].to_numpy_ndarrays()
    if len(got) != len(sent):
        raise ValueError(f"the ClientApp replied {len(got)} arrays for the {len(sent)} sent")
    delta = str(config.get(REPLIES_KEY, "weights")) == "delta"
    return [
        np.asarray(got[i], np.float64) - (0.0 if delta else np.asarray(sent[i], np.float64))
        for i in trainable
    ]


def report_undecryptable(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """corrflow's mod outside ``secaggplus_mod``: in the collect stage, before the app trains, it
    opens every share ciphertext forwarded to this node with the key agreed with its sender; when
    one does not authenticate, decrypt or name this node and its sender, it replies with those
    senders (`UNDECRYPTABLE_KEY`) instead, so the server blames the sender, not this node.

    Args:
        msg: the message from the server.
        ctxt: the node's context (holds the stock mod's protocol state).
        call_next: ``secaggplus_mod`` and the app.

    Returns:
        The report of the undecryptable senders, or ``call_next``'s reply.
    """
    config = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    if (
        msg.metadata.message_type != MessageType.TRAIN
        or config is None
        or config.get(Key.STAGE) != Stage.COLLECT_MASKED_VECTORS
        or RECORD_KEY_STATE not in ctxt.state.config_records
    ):
        return call_next(msg, ctxt)
    state = SecAggPlusState(**ctxt.state.config_records[RECORD_KEY_STATE])
    sources, texts = config.get(Key.SOURCE_LIST, []), config.get(Key.CIPHERTEXT_LIST, [])
    bad = [
        int(src) for src, text in zip(sources, texts, strict=False) if not _opens(state, src, text)
    ]
    if not bad:
        return call_next(msg, ctxt)
    log.warning("share ciphertexts from node(s) %s did not decrypt; reporting them", bad)
    return Message(
        RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({UNDECRYPTABLE_KEY: bad})}), reply_to=msg
    )


def _opens(state: SecAggPlusState, src: int, text) -> bool:
    """Whether ``text`` is a share ciphertext from ``src`` to this node under their agreed key."""
    key = state.ss2_dict.get(src)
    if key is None or not isinstance(text, bytes):
        return False
    try:
        actual, dst, _, _ = share_keys_plaintext_separate(decrypt(key, text))
    except Exception:  # a forged or corrupted token, or a plaintext of another form
        return False
    return actual == src and dst == state.nid


def secure_aggregation_mods() -> list[Mod]:
    """The mods of a ClientApp that trains under ``--secagg``: corrflow's `report_undecryptable`
    outermost (names the sender of a bad share ciphertext), Flower's ``secaggplus_mod`` (the
    protocol), corrflow's `clip_for_secure_aggregation` inside it.

    Returns:
        ``[report_undecryptable, secaggplus_mod, clip_for_secure_aggregation]`` for
        ``ClientApp(mods=...)``.
    """
    return [report_undecryptable, secaggplus_mod, clip_for_secure_aggregation]


def with_secure_aggregation(train):
    """``train`` (a ClientApp train function) wrapped in `secure_aggregation_mods`, as a ClientApp
    with those mods would call it (the in-process grid's handlers)."""

    def protocol(msg: Message, ctxt: Context) -> Message:
        return secaggplus_mod(msg, ctxt, lambda m, c: clip_for_secure_aggregation(m, c, train))

    def handler(msg: Message, ctxt: Context) -> Message:
        return report_undecryptable(msg, ctxt, protocol)

    return handler


def with_noise_node_guard(handler):
    """``handler`` (`with_secure_aggregation`'s) behind the noise node's guard mod
    (`corrflow.clients.noise_guard.guard_noise_node`), as a ClientApp with the guard outermost
    would call it."""
    from corrflow.clients.noise_guard import guard_noise_node

    def guarded(msg: Message, ctxt: Context) -> Message:
        return guard_noise_node(msg, ctxt, handler)

    return guarded


def secure_client_app(train) -> ClientApp:
    """A ClientApp that trains with ``train`` under `secure_aggregation_mods` and answers
    corrflow's identity probe (what ``corrflow simulate --secagg`` runs on Flower's engine)."""
    app = register_identity(ClientApp(mods=secure_aggregation_mods()))
    app.train()(train)
    return app


def train_with_client_fn(client_fn: Callable[[Context], Client | NumPyClient]):
    """A Message-API train function that trains with a classic app's ``client_fn``: the client's
    ``fit`` gets the model and the round's config, and its returned parameters are the reply (its
    ``num_examples`` and metrics stay on the client: the server sums equal-weight updates).

    Args:
        client_fn: the classic app's ``client_fn(context)``, returning a ``Client`` (e.g.
            ``NumPyClient.to_client()``) or a ``NumPyClient``.

    Returns:
        ``train(msg, context) -> Message`` for `secure_client_app`.
    """

    def train(msg: Message, context: Context) -> Message:
        client = client_fn(context)
        if isinstance(client, NumPyClient):
            client = client.to_client()
        sent = msg.content["arrays"].to_numpy_ndarrays()
        config = dict(msg.content["config"]) if "config" in msg.content else {}
        fitres = client.fit(FitIns(ndarrays_to_parameters(sent), config))
        if fitres.status.code != Code.OK:
            raise RuntimeError(f"the client's fit failed: {fitres.status.message}")
        arrays = ArrayRecord(parameters_to_ndarrays(fitres.parameters))
        return Message(RecordDict({"arrays": arrays}), reply_to=msg)

    return train


def secure_client_fn_app(client_fn: Callable[[Context], Client | NumPyClient]) -> ClientApp:
    """The one change a classic Flower app (``ClientApp(client_fn=client_fn,
    mods=[secaggplus_mod])``, a ``NumPyClient``) needs to train under corrflow's secure
    aggregation: ``app = secure_client_fn_app(client_fn)``. Flower refuses a ``client_fn`` app
    with a query function ("Use either `@app.query()` or `client_fn`, but not both"), and corrflow
    answers its identity probe with one: so the app becomes a Message-API ClientApp whose train
    function calls ``client_fn``'s ``fit`` (`train_with_client_fn`).

    Args:
        client_fn: the classic app's ``client_fn(context)``.

    Returns:
        A ClientApp with `secure_aggregation_mods` and corrflow's identity probe. It has no
        evaluate function: federated evaluation is refused under secure aggregation (the server
        evaluates with ``evaluate_fn``).
    """
    return secure_client_app(train_with_client_fn(client_fn))
