"""Talking to the nodes: the node → user directory (with reconnects), the round's training messages,
the inner strategy's train config, and an interruptible exchange of messages and replies."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from corrflow.accounting.report import hash_user_id
from corrflow.config import RunConfig
from corrflow.run.round import RoundPlan

log = logging.getLogger("corrflow")


def exchange(
    grid: Grid, messages: list[Message], timeout: float, stop: threading.Event
) -> list[Message] | None:
    """Push ``messages`` and pull their replies until all arrived, ``timeout`` passed or ``stop``
    was set (then None: the round is abandoned). Flower's ``send_and_receive`` cannot be
    interrupted."""
    if not messages:
        return []
    pending = set(grid.push_messages(messages))
    if getattr(grid, "synchronous", False):
        return list(grid.pull_messages(pending))
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        if stop.is_set():
            return None
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if pending:
            stop.wait(0.05)
    return None if stop.is_set() else replies


class NodeDirectory:
    """node id ↔ stable user id. A node that was not in the map (a reconnected SuperNode with a new
    node id) is mapped by the declared identity before it can be scheduled; until then it is never
    selected."""

    def __init__(
        self,
        node_to_user: dict[int, str],
        resolve: Callable[[list[int]], dict[int, str]] | None,
        salt: bytes,
    ):
        self.node_to_user = {int(k): str(v) for k, v in node_to_user.items()}
        self.user_to_node = {u: n for n, u in self.node_to_user.items()}
        self._resolve, self._salt, self._unmapped = resolve, salt, set()

    def refresh(self, grid: Grid) -> set[int]:
        """Map the nodes that appeared since the last round; returns the nodes online now."""
        online = {int(n) for n in grid.get_node_ids()}
        new = sorted(online - set(self.node_to_user) - self._unmapped)
        if new and self._resolve is not None:
            for node, user in self._resolve(new).items():
                old = self.user_to_node.get(user)
                if old is None or (old in online and old != node):
                    # not in this run's population, or its identity is in use by a live node
                    continue
                del self.node_to_user[old]
                self.node_to_user[node], self.user_to_node[user] = user, node
                log.info(
                    "node %d is %s again (was node %d)", node, hash_user_id(user, self._salt), old
                )
            self._unmapped.update(n for n in new if n not in self.node_to_user)
        return online


def train_messages(
    cfg: RunConfig,
    plan: RoundPlan,
    arrays: ArrayRecord,
    user_config: dict,
    online: set[int],
    directory: NodeDirectory,
    item_home: dict[str, str] | None,
) -> list[Message]:
    """One TRAIN message per node that trains an item of ``plan`` (cross-silo: all its items); an
    item whose node is offline is recorded as rejected in the plan. Fills ``plan.expected`` (node →
    item or items)."""
    cfg_record = ConfigRecord(
        {
            "server-round": plan.round + 1,
            "local-lr": cfg.local_lr,
            "local-steps": cfg.local_steps,
            "clip-norm": cfg.clip_norm,
            "seed": cfg.seed,
            "client": cfg.client,  # corrflow's dispatching ClientApp trains this task
            **user_config,
        }
    )
    if cfg.data_path:  # clients read their user's examples from the same dataset file
        cfg_record.update(
            {"data-path": cfg.data_path, "vocab-path": cfg.vocab_path, "seq-len": cfg.seq_len}
        )
    targets: dict[int, list[str]] = {}
    for item in plan.items:
        node = directory.user_to_node.get(item if item_home is None else item_home[item])
        if node is None or node not in online:
            plan.rejections.append((item, "offline when selected"))
            continue
        targets.setdefault(node, []).append(item)
    messages = []
    for node, items in targets.items():
        content = {"arrays": arrays, "config": cfg_record}
        if item_home is None:
            plan.expected[node] = items[0]
        else:  # cross-silo: the silo trains on exactly these examples, clipping each
            plan.expected[node] = items
            content["config"] = ConfigRecord({**dict(cfg_record), "item-ids": list(items)})
        messages.append(
            Message(content=RecordDict(content), message_type=MessageType.TRAIN, dst_node_id=node)
        )
    return messages


def inner_train_config(
    inner: Strategy | None,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord | None,
    grid: Grid,
) -> tuple[dict, bool]:
    """The user's train config; with an inner strategy, what its ``configure_train`` would send
    (e.g. FedProx's ``proximal-mu``) — its choice of nodes is discarded, corrflow's schedule decides
    who trains. Returns (config, whether the inner strategy sent a message at all)."""
    user = dict(config or {})
    if inner is None:
        return user, True
    for msg in inner.configure_train(
        server_round, arrays, ConfigRecord(user), _ConfigProbeGrid(grid, inner)
    ):
        user.update(dict(msg.content.config_records.get("config", ConfigRecord())))
        return user, True
    return user, False


class _ConfigProbeGrid:
    """The grid an inner strategy sees when corrflow asks it only for its train config. It lists at
    least the nodes the inner strategy's ``min_available_nodes`` / ``min_train_nodes`` ask for:
    Flower's ``sample_nodes`` would otherwise wait for nodes corrflow's population does not have,
    and the run would hang without a word. The node choice is discarded; everything else is the real
    grid."""

    def __init__(self, grid: Grid, inner: Strategy):
        self._grid = grid
        self._needed = max(
            int(getattr(inner, "min_available_nodes", 0) or 0),
            int(getattr(inner, "min_train_nodes", 0) or 0),
        )

    def get_node_ids(self) -> list[int]:
        nodes = list(self._grid.get_node_ids())
        top = max(nodes, default=0)
        return nodes + [top + 1 + i for i in range(self._needed - len(nodes))]

    def __getattr__(self, name: str):
        return getattr(self._grid, name)
