"""The names the server, the clients' guard mod and the noise node agree on: the config keys
corrflow adds to SecAgg+'s stock stage messages, the recipe's fields, and the byte strings the
noise node signs with its long-term key (Ed25519, from the ``cryptography`` package)."""

from __future__ import annotations

#: Setup (to the noise node): the recipe requested; collect (to the noise node): the round t.
ROUND_KEY, RECIPE_KEY = "corrflow-round", "corrflow-recipe"
#: Setup reply and share-keys relay: the noise node's signature of its SecAgg+ public keys.
SIGNATURE_KEY = "corrflow-noise-signature"
#: Collect reply: the key segment of the row sent, and the noise node's journal head after it.
SEGMENT_KEY, HEAD_KEY = "corrflow-noise-segment", "corrflow-noise-journal-head"
#: The recipe's fields, pinned at start and compared with every setup request.
RECIPE_FIELDS = ("factorization_sha256", "noise_multiplier", "clip_norm", "delta", "rounds")
#: The clients' node config keys that pin the noise node.
PIN_ID, PIN_KEY, PIN_SIGNATURE = "noise-node-id", "noise-node-key", "noise-node-signature"
#: The node config key of the noise node's own SuperNode: the socket its ClientApp relays to.
SOCKET_KEY = "noise-node-socket"


def signed_keys_message(pk1: bytes, pk2: bytes) -> bytes:
    """What the noise node signs each round: its two SecAgg+ public keys, labelled."""
    return b"corrflow-noise-node-keys-v1\x00" + pk1 + b"\x00" + pk2


def id_message(node_id: int) -> bytes:
    """What the noise node signs once: its node id (the clients' pin)."""
    return b"corrflow-noise-node-id-v1\x00" + str(int(node_id)).encode()
