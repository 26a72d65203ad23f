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

import numpy as np
from flwr.app import Context, Message, MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
)
from flwr.compat.common import recorddict_compat as compat

from corrflow.clients.identity import register_identity
from corrflow.run.secure_sum import SecureSumParams, action_vector, bound_update

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
    bound = min(clip, params.client_bound(sum(u.size for u in update)))
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


def secure_aggregation_mods() -> list[Mod]:
    """The mods of a ClientApp that trains under ``--secagg``: Flower's ``secaggplus_mod``
    outermost (the protocol), corrflow's `clip_for_secure_aggregation` inside it.

    Returns:
        ``[secaggplus_mod, clip_for_secure_aggregation]`` for ``ClientApp(mods=...)``.
    """
    return [secaggplus_mod, clip_for_secure_aggregation]


def with_secure_aggregation(train):
    """``train`` (a ClientApp train function) wrapped in `secure_aggregation_mods`, as a ClientApp
    with those mods would call it (the in-process grid's handlers)."""

    def handler(msg: Message, ctxt: Context) -> Message:
        return secaggplus_mod(msg, ctxt, lambda m, c: clip_for_secure_aggregation(m, c, train))

    return handler


def secure_client_app(train) -> ClientApp:
    """A ClientApp that trains with ``train`` under `secure_aggregation_mods` and answers
    corrflow's identity probe (what ``corrflow simulate --secagg`` runs on Flower's engine)."""
    app = register_identity(ClientApp(mods=secure_aggregation_mods()))
    app.train()(train)
    return app
