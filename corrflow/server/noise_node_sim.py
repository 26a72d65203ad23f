"""A simulation with a noise node (``corrflow simulate --secagg --noise-node --backend
inprocess``): the noise node runs as a child process with its state in its own directory
(`noise_node_dir`), the in-process grid reaches it by its node id, and every simulated client
pins it in its node config and runs the guard mod (`corrflow.clients.noise_guard`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from corrflow.config import RunConfig
from corrflow.errors import require
from corrflow.noisenode.protocol import PIN_ID, PIN_KEY, PIN_SIGNATURE
from corrflow.paths import corrflow_home


def _inside(path: Path, root: Path) -> bool:
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def noise_node_dir(cfg: RunConfig) -> Path:
    """The noise node's directory: ``cfg.noise_node_dir``, default ``<out>.noise-node``.

    Raises:
        InvalidArgumentError (``noise-node-dir``): a directory under the run's directory or under
            $CORRFLOW_HOME (the server's files must hold no noise key).
    """
    out = Path(cfg.state_dir).resolve()
    d = Path(cfg.noise_node_dir or f"{out}.noise-node").expanduser().resolve()
    home = corrflow_home()
    require(
        not _inside(d, out) and not _inside(out, d) and not _inside(d, home),
        "noise-node-dir",
        f"a directory outside --out ({out}) and $CORRFLOW_HOME ({home}): the server's files "
        "hold no noise key",
        str(d),
    )
    return d


def check_noise_node(cfg: RunConfig, backend: str) -> None:
    """Refuse a noise node on an engine that cannot reach it yet.

    Raises:
        InvalidArgumentError (``noise-node``): a backend other than "inprocess".
    """
    require(
        not cfg.noise_node or backend == "inprocess",
        "noise-node",
        "--backend inprocess (the noise node joins the in-process grid as a child process; "
        "Flower's engine and the cohort engine do not reach it)",
        backend,
    )
    if cfg.noise_node:
        noise_node_dir(cfg)


def pin(identity: dict) -> dict:
    """The node config entries that pin the noise node in every client.

    Args:
        identity: the noise node's (``node_id``, ``public_key``, ``signature``).

    Returns:
        `PIN_ID`, `PIN_KEY` and `PIN_SIGNATURE`, hex-encoded.
    """
    return {
        PIN_ID: str(identity["node_id"]),
        PIN_KEY: identity["public_key"].hex(),
        PIN_SIGNATURE: identity["signature"].hex(),
    }


@contextmanager
def running_noise_node(cfg: RunConfig) -> Iterator:
    """The noise node's child process over `noise_node_dir`, stopped on exit.

    Args:
        cfg: the run's settings.

    Returns:
        A context manager yielding the started `corrflow.noisenode.process.NoiseNodeProcess`.
    """
    from corrflow.noisenode.process import NoiseNodeProcess

    d = noise_node_dir(cfg)
    node = NoiseNodeProcess(d)
    node.start()
    try:
        yield node
    finally:
        node.close()


def noise_node_grid(cfg: RunConfig, train, node):
    """The in-process grid of a run with the noise node ``node`` (a started
    `corrflow.noisenode.process.NoiseNodeProcess`): clients behind the guard mod with the pin in
    their node config, the noise node reachable by its id.

    Args:
        cfg: the run's settings (``num_users``).
        train: the task's train handler.
        node: the started noise node process.

    Returns:
        The `corrflow.server.inprocess.InProcessGrid`.
    """
    from corrflow.clients.secagg import with_noise_node_guard, with_secure_aggregation
    from corrflow.server.inprocess import InProcessGrid

    pins = pin(node.identity)
    handlers = {"train": with_noise_node_guard(with_secure_aggregation(train))}
    return InProcessGrid(
        handlers,
        cfg.num_users,
        node_config=lambda partition: pins,
        extra_nodes={int(node.identity["node_id"]): node.handler},
    )


__all__ = ["check_noise_node", "noise_node_dir", "noise_node_grid", "running_noise_node"]
