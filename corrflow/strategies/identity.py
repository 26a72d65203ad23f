"""Stable user identities for SuperNodes, from the source the operator declares (``identity``).

* ``node-key``: the fingerprint of the SuperNode's registered public key (stable only under
  SuperNode authentication, where the SuperLink admits registered keys alone);
* ``user-id``: a node-config value the operator sets per device, reported by corrflow's client mod;
* ``partition-id``: ``partition-<i>`` from the node config in simulation, reported likewise;
* ``per-launch``: the node id of this launch — an explicit opt-in: such a run can never resume.

A node that cannot report the declared identity stops the run before any round, naming the node and
the fix.
"""

from __future__ import annotations

import hashlib
import logging
import time

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from corrflow.errors import CorrflowError, IntegrityError
from corrflow.protocol import PROBE_ACTION, PROBE_KEY, REPLY_KEY
from corrflow.strategies.messaging import exchange

log = logging.getLogger("corrflow")

PROBE_FIX = (
    "register corrflow's identity handler in the ClientApp (`from corrflow import "
    "register_identity`; `app = register_identity(ClientApp())`), or choose identity = per-launch "
    "(a run that can never resume)"
)


NO_ANSWER = "no answer to the identity probe"
PROBE_CHUNK = 10_000  # nodes probed at once


class IdentityError(CorrflowError):
    """A node cannot report the declared identity, or two nodes claim one identity."""


def default_identity(grid: Grid) -> str:
    """``partition-id`` on a simulation engine's grid (Flower's in-memory grid or corrflow's
    in-process one), ``node-key`` on a deployment's."""
    name = type(getattr(grid, "recorded_grid", grid)).__name__  # through a `RecordingGrid`
    return "partition-id" if name in ("InMemoryGrid", "InProcessGrid") else "node-key"


def key_fingerprint(public_key: bytes) -> str:
    """The ``node-key`` user id of a SuperNode public key, as Flower stores it in
    ``NodeInfo.public_key``."""
    return "key-" + hashlib.sha256(bytes(public_key)).hexdigest()[:24]


def wait_for_nodes(grid: Grid, expected: int, timeout: float, stop=None) -> list[int]:
    """Nodes register asynchronously, also in simulation: wait for ``expected`` of them, saying
    so.

    Args:
        grid: the grid the nodes register with.
        expected: how many.
        timeout: seconds before giving up.
        stop: a ``threading.Event`` that ends the wait at once (a signal, or an engine that
            failed: its ``reason`` attribute says which).

    Returns:
        The node ids, sorted.

    Raises:
        CorrflowError: fewer nodes within ``timeout``, or ``stop`` set; nothing was trained.
    """
    start, last = time.monotonic(), -1
    while len(nodes := sorted(int(n) for n in grid.get_node_ids())) < expected:
        if stop is not None and stop.is_set():
            raise _stopped(stop, f"waiting for SuperNodes ({len(nodes)} of {expected} connected)")
        if len(nodes) != last:
            log.info(
                "waiting for %d SuperNodes (%d connected; giving up after %.0f s)",
                expected,
                len(nodes),
                timeout,
            )
            last = len(nodes)
        if time.monotonic() - start > timeout:
            raise CorrflowError(
                f"only {len(nodes)} of {expected} SuperNodes connected within {timeout:.0f} s "
                "(num-users sets how many the run waits for; node-timeout how long)"
            )
        time.sleep(0.2)
    return nodes


def _stopped(stop, what: str) -> CorrflowError:
    """The error of a start that ``stop`` ended before round 1, while doing ``what``."""
    why = getattr(stop, "reason", None) or "interrupted by the operator (SIGINT/SIGTERM)"
    return CorrflowError(f"{why}: stopped while {what}; nothing was trained")


def resolve(
    grid: Grid,
    nodes: list[int],
    source: str,
    *,
    timeout: float = 120.0,
    strict: bool = True,
    stop=None,
) -> dict[int, str]:
    """node id → stable user id for ``nodes`` under ``source``. ``strict``: a node that cannot
    report raises `IdentityError` naming it; otherwise it is left out (a node that joined
    mid-run stays unscheduled). ``stop`` (a ``threading.Event``) ends a probe at once, raising
    CorrflowError."""
    if source == "per-launch":
        return {n: f"launch-node-{n}" for n in nodes}
    if source == "node-key":
        keys = {
            int(info.node_id): bytes(getattr(info, "public_key", b"") or b"")
            for info in grid.get_nodes() or []
        }
        users = {n: key_fingerprint(keys[n]) for n in nodes if keys.get(n)}
        errors = {n: "the SuperLink reports no public key for it" for n in nodes if n not in users}
        fix = "enable SuperNode authentication (see deploy/), or declare another identity source"
    else:
        started = time.monotonic()
        users, errors = _probe(grid, nodes, source, timeout, stop)
        fix = PROBE_FIX
        if any(why == NO_ANSWER for why in errors.values()):
            fix = (
                f"{len(nodes) - sum(why == NO_ANSWER for why in errors.values())} of {len(nodes)} "
                f"node(s) answered within {time.monotonic() - started:.0f} s (node-timeout "
                f"{timeout:g} s); a slow or loaded engine needs a longer --node-timeout "
                f"(corrflow.node-timeout). Otherwise: {PROBE_FIX}"
            )
    if errors and strict:
        shown = "; ".join(f"node {n}: {why}" for n, why in sorted(errors.items())[:5])
        raise IdentityError(
            f"{len(errors)} of {len(nodes)} node(s) cannot report identity = {source} ({shown}"
            f"{'; …' if len(errors) > 5 else ''}). Fix: {fix}"
        )
    seen: dict[str, int] = {}
    for n, u in sorted(users.items()):
        if u in seen:
            raise IntegrityError(
                f"nodes {seen[u]} and {n} both report identity {u!r} ({source}); every device "
                "must have its own"
            )
        seen[u] = n
    return users


def _probe(
    grid: Grid, nodes: list[int], source: str, timeout: float, stop=None
) -> tuple[dict[int, str], dict[int, str]]:
    # A QUERY of corrflow's own action: an app without corrflow's handler answers with Flower's "no
    # query function registered" error before any of its code runs (a TRAIN probe would reach the
    # user's train function).
    users, errors = {}, {n: NO_ANSWER for n in nodes}
    deadline = time.monotonic() + timeout
    # In chunks: a population's probes and replies at once would hold ~2 messages per user in memory
    # (GBs at StackOverflow's 342,477 users); the chunks share the one deadline.
    for start in range(0, len(nodes), PROBE_CHUNK):
        probes = [
            Message(
                content=RecordDict({"config": ConfigRecord({PROBE_KEY: source})}),
                message_type=f"{MessageType.QUERY}.{PROBE_ACTION}",
                dst_node_id=n,
            )
            for n in nodes[start : start + PROBE_CHUNK]
        ]
        left = max(1.0, deadline - time.monotonic())
        if stop is None:
            replies = grid.send_and_receive(probes, timeout=left)
        elif (replies := exchange(grid, probes, left, stop)) is None:
            raise _stopped(stop, "asking the SuperNodes for their identity")
        _read_probe_replies(replies, users, errors)
    return users, errors


def _read_probe_replies(replies, users: dict[int, str], errors: dict[int, str]) -> None:
    """Move each node that answered with its identity from ``errors`` to ``users``, or say why
    its answer is not one."""
    for reply in replies:
        node = int(reply.metadata.src_node_id)
        if node not in errors:
            continue
        if reply.has_error():
            missing = PROBE_ACTION in str(reply.error.reason) and "registered" in str(
                reply.error.reason
            )
            errors[node] = (
                "the ClientApp has no corrflow identity handler"
                if missing
                else f"the probe failed ({reply.error.reason})"
            )
            continue
        record = reply.content.config_records.get(REPLY_KEY)
        if record is None:
            errors[node] = "the ClientApp answered the probe without corrflow's identity record"
        elif "value" in record:
            users[node] = str(record["value"])
            del errors[node]
        else:
            errors[node] = str(record.get("error", "no identity in the reply"))
