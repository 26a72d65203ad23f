"""The server's side of a deployed noise node (``corrflow.noise-node=true`` with
``corrflow.noise-node-pin``): its link, read from the pin and checked, and the grid the run sees —
the SuperLink's, without the noise node's SuperNode, which is no user (never listed, sampled or
asked for its identity, but reached by its id in every secure round)."""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from corrflow.config import RunConfig
from corrflow.errors import InvalidArgumentError
from corrflow.noisenode.protocol import id_message
from corrflow.run.noise_node_link import NoiseNodeLink

PIN_FIELD = "corrflow.noise-node-pin"
_EXPECTED = (
    "<node id>:<public key, 64 hex digits>:<signature, 128 hex digits> as corrflow noise-node "
    "prints it (pin.json's run_config), with corrflow.noise-node=true"
)


def link_from_pin(pin: str) -> NoiseNodeLink:
    """The noise node's link from its pin, the signature of its id checked.

    Args:
        pin: ``<node id>:<public key hex>:<signature hex>``.

    Returns:
        The `NoiseNodeLink` (no pin callback: the noise node pinned its recipe itself).

    Raises:
        InvalidArgumentError (``corrflow.noise-node-pin``): malformed, or a signature that does not
            verify.
    """
    parts = str(pin).split(":")
    try:
        nid, key, sig = int(parts[0]), bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
        if len(parts) != 3 or nid <= 0:
            raise ValueError
        Ed25519PublicKey.from_public_bytes(key).verify(sig, id_message(nid))
    except (ValueError, IndexError, InvalidSignature):
        raise InvalidArgumentError(PIN_FIELD, _EXPECTED, pin) from None
    return NoiseNodeLink(nid, key, sig)


class WithoutNoiseNode:
    """A grid that does not list the noise node's SuperNode among the run's nodes (every other
    attribute is the wrapped grid's)."""

    def __init__(self, grid, node_id: int):
        self._grid, self.noise_node_id = grid, int(node_id)

    def get_node_ids(self):
        return [n for n in self._grid.get_node_ids() if int(n) != self.noise_node_id]

    def get_nodes(self):
        nodes = self._grid.get_nodes() or []
        return [n for n in nodes if int(n.node_id) != self.noise_node_id]

    def __getattr__(self, name):
        return getattr(self._grid, name)


def deployed_noise_node(cfg: RunConfig, grid):
    """The grid and the noise node link of a deployed run.

    Args:
        cfg: the run's settings.
        grid: the SuperLink's grid.

    Returns:
        (``grid``, None) without a noise node; else (`WithoutNoiseNode` over it, the link).

    Raises:
        InvalidArgumentError: ``corrflow.noise-node-pin`` without ``corrflow.noise-node``, or the
            reverse, or a pin that does not verify.
    """
    pin = (cfg.noise_node_pin or "").strip()
    if not cfg.noise_node:
        if pin:
            raise InvalidArgumentError("corrflow.noise-node", "true with a noise node pin", False)
        return grid, None
    if not pin:
        raise InvalidArgumentError(PIN_FIELD, _EXPECTED, "")
    link = link_from_pin(pin)
    return WithoutNoiseNode(grid, link.node_id), link
