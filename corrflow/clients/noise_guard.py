"""The clients' guard of the noise node: corrflow's mod outside ``secaggplus_mod`` in a run with a
noise node (``--secagg --noise-node``).

SecAgg+ lets the server unmask the sum of the survivors: if it declared the noise node dropped,
honest clients would hand it the noise node's secret-key shares, it would remove the noise node's
masks, and the sum would come out without noise. And SecAgg+ relays public keys unauthenticated,
so a server could run its own "noise node". The guard therefore

- reads the noise node's pin from the node config (`PIN_ID`, `PIN_KEY`: its Ed25519 long-term
  public key, `PIN_SIGNATURE`: its node id signed with that key), and refuses to run without one;
- refuses a share-keys stage (the first that names the round's members) without the pinned node,
  or whose keys for it are not signed with the pinned key;
- refuses an unmask whose dead list names the noise node — before ``secaggplus_mod`` runs, so
  no share leaves.
"""

from __future__ import annotations

import functools

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from flwr.app import Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from corrflow.noisenode.protocol import (
    PIN_ID,
    PIN_KEY,
    PIN_SIGNATURE,
    SIGNATURE_KEY,
    id_message,
    signed_keys_message,
)


class NoiseNodeGuardError(RuntimeError):
    """A stage that would let the server open a sum without the noise node's noise."""


def pinned_noise_node(node_config) -> tuple[int, Ed25519PublicKey]:
    """The noise node this client trusts: its id and long-term key, the pin's signature checked.

    Args:
        node_config: the client's node config.

    Returns:
        (node id, public key).

    Raises:
        NoiseNodeGuardError: no pin, or a pin whose signature does not verify.
    """
    try:
        pin = (str(node_config[PIN_ID]), str(node_config[PIN_KEY]), str(node_config[PIN_SIGNATURE]))
    except KeyError:
        raise NoiseNodeGuardError(
            f"no noise node pinned in the node config ({PIN_ID}, {PIN_KEY}, {PIN_SIGNATURE})"
        ) from None
    try:
        return _verified_pin(*pin)
    except (ValueError, InvalidSignature):
        raise NoiseNodeGuardError("the noise node's pin does not verify") from None


@functools.lru_cache(maxsize=16)
def _verified_pin(node_id: str, public_key: str, signature: str) -> tuple[int, Ed25519PublicKey]:
    """The pin's id and key once its signature verifies (a pure function of the pin's text, so
    a client checks it once, not at every stage; a pin that fails raises and is not cached)."""
    nid = int(node_id)
    key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key))
    key.verify(bytes.fromhex(signature), id_message(nid))
    return nid, key


def guard_noise_node(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """corrflow's mod outside ``secaggplus_mod`` (module docstring).

    Args:
        msg: the message from the server.
        ctxt: the node's context (its node config holds the pin).
        call_next: ``secaggplus_mod`` and what it wraps.

    Returns:
        ``call_next``'s reply.

    Raises:
        NoiseNodeGuardError: a round without the pinned noise node, keys it did not sign, or an
            unmask that names it dead (the server sees an error reply; no share is sent).
    """
    config = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    if msg.metadata.message_type != MessageType.TRAIN or config is None:
        return call_next(msg, ctxt)
    nid, key = pinned_noise_node(ctxt.node_config)
    stage = config.get(Key.STAGE)
    if stage == Stage.SHARE_KEYS:
        signature = config.pop(SIGNATURE_KEY, None)  # stock secaggplus_mod expects keys only
        keys = config.get(str(nid))
        if not isinstance(keys, list) or len(keys) != 2:
            raise NoiseNodeGuardError("a secure round without the pinned noise node: refused")
        try:
            key.verify(bytes(signature or b""), signed_keys_message(keys[0], keys[1]))
        except (InvalidSignature, TypeError):
            raise NoiseNodeGuardError(
                "the noise node's SecAgg+ keys are not signed by its pinned key: refused"
            ) from None
    elif stage == Stage.UNMASK and nid in list(config.get(Key.DEAD_NODE_ID_LIST, [])):
        raise NoiseNodeGuardError("an unmask that declares the noise node dropped: refused")
    return call_next(msg, ctxt)
