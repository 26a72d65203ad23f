"""A deployed noise node: its recipe and pin (`recipe_from_run_config`, `open_deployed_node`:
what ``corrflow noise-node`` does before it serves), and the server's side of it
(``corrflow.noise-node=true`` with ``corrflow.noise-node-pin``): its link, read from the pin and
checked, and the grid the run sees — the SuperLink's, without the noise node's SuperNode, which is
no user (never listed, sampled or asked for its identity, but reached by its id in every secure
round)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from corrflow.config import RunConfig
from corrflow.errors import InvalidArgumentError, require
from corrflow.noisenode.protocol import id_message
from corrflow.noisenode.service import write_pin
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


def recipe_from_run_config(run_config: dict) -> tuple[dict, bytes]:
    """The recipe a noise node pins for a run, planned from the run config as the server plans it
    (factorization, σ by the accountant, the model's trainable shapes).

    Args:
        run_config: the run's Flower run config (``corrflow.``-prefixed keys, the app's defaults
            fused with the operator's overrides).

    Returns:
        (`corrflow.run.noise_node_link.noise_recipe`'s recipe, the factorization file's bytes).

    Raises:
        InvalidArgumentError: a run config without secure aggregation and a noise node, or without
            ``corrflow.num-users``.
    """
    from corrflow.clients.tasks import task_for
    from corrflow.config import from_run_config
    from corrflow.run.core import prepare
    from corrflow.run.noise_node_link import noise_recipe
    from corrflow.strategies.messaging import model_arrays

    cfg = from_run_config(run_config)
    require(
        cfg.secure_aggregation and cfg.noise_node,
        "--run-config",
        "a run with corrflow.secure-aggregation=true and corrflow.noise-node=true",
        f"secure-aggregation={cfg.secure_aggregation}, noise-node={cfg.noise_node}",
    )
    require(
        cfg.num_users is not None,
        "--run-config",
        "corrflow.num-users (the population the server plans the run for)",
    )
    arrays, names = model_arrays(task_for(cfg).initial_weights())
    users = [f"user-{i}" for i in range(cfg.num_users)]  # only their number enters the plan
    with tempfile.TemporaryDirectory(prefix="corrflow-noise-node-plan-") as tmp:
        plan = prepare(cfg.replace(state_dir=tmp), users, arrays, names)
        return noise_recipe(plan), (Path(tmp) / "factorization.npz").read_bytes()


def run_config_of(app: Path | None, overrides: str) -> dict:
    """The run config the server runs: the Flower app's ``[tool.flwr.app.config]`` (``app``'s
    pyproject.toml) with ``overrides`` (``flwr run --run-config``'s syntax) on top.

    Raises:
        InvalidArgumentError: ``--app`` without a pyproject.toml, or ``--run-config`` that does
            not parse or names a key the app does not declare.
    """
    from flwr.common.config import flatten_dict, fuse_dicts, get_project_config, parse_config_args

    base: dict = {}
    if app is not None:
        require((Path(app) / "pyproject.toml").is_file(), "--app", "a Flower app directory", app)
        base = flatten_dict(get_project_config(app)["tool"]["flwr"]["app"].get("config", {}))
    try:
        extra = parse_config_args([overrides]) if overrides.strip() else {}
        return fuse_dicts(base, extra) if app is not None else extra
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidArgumentError(
            "--run-config", "key=value pairs the app declares, as flwr run takes them", str(exc)
        ) from None


def open_deployed_node(directory: Path, node_id: int, run_config: dict):
    """The noise node of a deployment, its recipe pinned, its pin written (``pin.json``).

    Args:
        directory: its directory (created 0700 on first use).
        node_id: the node id the SuperLink assigned to its SuperNode key at registration.
        run_config: the run's config (`run_config_of`).

    Returns:
        (the `corrflow.noisenode.node.NoiseNode`, `pin_lines`'s pins).

    Raises:
        InvalidArgumentError: ``--node-id`` other than the directory's, or a ``--run-config``
            that is not a noise-node run or plans another recipe than the one pinned.
    """
    from corrflow.errors import IntegrityError
    from corrflow.noisenode.node import NoiseNode
    from corrflow.noisenode.store import NoiseNodeStore

    try:
        recipe, factorization = recipe_from_run_config(run_config)
    except InvalidArgumentError as exc:
        if exc.field.startswith("--"):
            raise
        raise InvalidArgumentError(
            "--run-config", f"{exc.field}: {exc.expected}", exc.got
        ) from None
    try:
        store = NoiseNodeStore(directory, node_id=node_id)
    except IntegrityError as exc:
        raise InvalidArgumentError(
            "--node-id", "the id of the directory's noise node", str(exc)
        ) from None
    node = NoiseNode(store)
    try:
        node.pin(recipe, factorization)
    except IntegrityError as exc:
        raise InvalidArgumentError(
            "--run-config", "the run the noise node is pinned to", str(exc)
        ) from None
    return node, write_pin(store.dir, node.identity())
