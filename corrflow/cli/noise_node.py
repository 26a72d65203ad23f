"""``corrflow noise-node``: run a deployment's noise node as its own Flower SuperNode
(docs/explanation/noise-node.md, docs/how-to/deploy.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from corrflow.cli.common import AsJson, emit, fail
from corrflow.errors import CorrflowError, InvalidArgumentError, require
from corrflow.paths import corrflow_home


def _inside(path: Path, root: Path) -> bool:
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def noise_node(
    directory: Annotated[
        Path,
        typer.Option(
            "--dir",
            help="the noise node's directory: its long-term key, pinned recipe, key segments, "
            "journal and report (created 0700; never under $CORRFLOW_HOME)",
        ),
    ],
    node_id: Annotated[
        int,
        typer.Option(
            help="the node id the SuperLink assigned to the noise node's SuperNode key "
            "(flwr supernode register)"
        ),
    ],
    run_config: Annotated[
        str,
        typer.Option(help="the run's config overrides, as given to flwr run --run-config"),
    ] = "",
    app: Annotated[
        Path | None,
        typer.Option(help="the Flower app directory whose config the overrides apply to"),
    ] = None,
    superlink: Annotated[
        str | None, typer.Option(help="the SuperLink's Fleet API address, host:port")
    ] = None,
    root_certificates: Annotated[
        Path | None, typer.Option(help="the CA certificate that verifies the SuperLink's TLS")
    ] = None,
    auth_supernode_private_key: Annotated[
        Path | None, typer.Option(help="the noise node's SuperNode authentication private key")
    ] = None,
    port: Annotated[int, typer.Option(help="its SuperNode's local Runtime API port")] = 9094,
    flwr_bin: Annotated[
        Path | None, typer.Option(help="the directory holding flower-supernode")
    ] = None,
    supernode_log: Annotated[
        Path | None,
        typer.Option(help="where its SuperNode's output goes (default: <dir>/supernode.log)"),
    ] = None,
    init_only: Annotated[
        bool, typer.Option(help="pin the recipe, write and print the pin, and exit")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Pin the run's recipe and serve the run's noise as its own SuperNode: its id, public key
    and signature go into every client's --node-config and the server's run config (pin.json)."""
    from corrflow.noisenode.service import run_service
    from corrflow.server.noise_node_deploy import open_deployed_node, run_config_of

    try:
        home = corrflow_home()
        require(
            not _inside(directory, home),
            "--dir",
            f"a directory outside $CORRFLOW_HOME ({home}): the server's files hold no noise key",
            str(directory),
        )
        require(node_id > 0, "--node-id", "a positive integer", node_id)
        require(1 <= port <= 65535, "--port", "a port number", port)
        args = None
        if not init_only:
            args = _supernode_args(
                superlink, root_certificates, auth_supernode_private_key, port, flwr_bin
            )
        node, pins = open_deployed_node(directory, node_id, run_config_of(app, run_config))
    except CorrflowError as exc:
        fail(exc)
    emit({**pins, "dir": str(directory.resolve())}, as_json)
    if init_only:
        return
    code = run_service(node, args, supernode_log or directory / "supernode.log")
    raise typer.Exit(code=code)


def _supernode_args(superlink, root_certificates, auth_key, port, flwr_bin):
    from corrflow.noisenode.service import SuperNodeArgs, flower_bin

    for flag, path in (
        ("--root-certificates", root_certificates),
        ("--auth-supernode-private-key", auth_key),
    ):
        if path is None or not Path(path).is_file():
            raise InvalidArgumentError(flag, "an existing file (or --init-only)", path)
    host, _, number = (superlink or "").rpartition(":")
    require(bool(host) and number.isdigit(), "--superlink", "host:port", superlink)
    return SuperNodeArgs(
        superlink, Path(root_certificates), Path(auth_key), port, flower_bin(flwr_bin)
    )
