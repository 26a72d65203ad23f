"""Talking to the nodes, and the conversion between Flower's messages and corrflow's value types:
the node → user directory (with reconnects), the model as an ``ArrayRecord``, a reply ``Message`` as
a `Reply`, the round's training messages, the inner strategy's train
config, and an interruptible exchange of messages and replies."""

from __future__ import annotations

import io
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from corrflow.accounting.report import hash_user_id
from corrflow.config import RunConfig
from corrflow.run.model import ModelLayout, arrays_sha256
from corrflow.run.round import Reply, RoundPlan

log = logging.getLogger("corrflow")


#: The reply bytes one pull may bring at once (`ReplyStream`): replies are summed as they arrive,
#: so at most this much of the cohort's replies is held, whatever the cohort.
PULL_BYTES = 128 << 20

#: How often a round still waiting for replies says which nodes it waits for (seconds).
WAIT_REPORT_S = 60.0


class RoundAbandonedError(Exception):
    """The operator's stop arrived while the round's replies were being pulled: nothing of the round
    is committed or released."""


class ReplyStream:
    """The round's training messages, pushed at once; iterating pulls their replies at most
    ``batch`` ids per call and yields each reply as it arrives, until every request was answered
    or ``timeout`` passed (the rest time out). Flower's Grid pushes and pulls separately, but one
    pull returns every ready reply it is asked for, inflated: asking for a few ids at a time bounds
    what is held to ``batch`` replies. Raises `RoundAbandonedError` when ``stop`` is set.

    A synchronous grid (the in-process one) answers each id on its first pull: each id is pulled
    once, and replies that answer no id (injected faults) are yielded as they come. While replies
    are missing, every `WAIT_REPORT_S` seconds a warning names the nodes still waited for: a node
    that will never answer (a SuperNode stuck on an earlier message) is visible before node-timeout.
    """

    def __init__(
        self,
        grid: Grid,
        messages: Sequence[Message],
        timeout: float,
        stop: threading.Event | None,
        batch: int,
    ):
        self.grid, self.timeout, self.stop, self.batch = grid, timeout, stop, max(1, int(batch))
        messages = list(messages)
        ids = list(grid.push_messages(messages)) if messages else []
        # message id → its node, for the wait report (a grid sets each pushed message's id, and
        # may leave out one it could not store: only the returned ids are waited for)
        node_of = {
            getattr(m.metadata, "message_id", None): m.metadata.dst_node_id for m in messages
        }
        self.pending = {i: node_of.get(i) for i in ids}
        self.total, self.started = len(self.pending), time.monotonic()
        self.deadline = self.started + timeout
        self._reported = self.started

    def __iter__(self) -> Iterator[Message]:
        synchronous = getattr(self.grid, "synchronous", False)
        while self.pending and time.monotonic() < self.deadline:
            arrived, waiting = False, list(self.pending)
            for lo in range(0, len(waiting), self.batch):
                ids = waiting[lo : lo + self.batch]
                if self.stop is not None and self.stop.is_set():
                    raise RoundAbandonedError
                if not synchronous and time.monotonic() >= self.deadline:
                    return
                if synchronous:
                    for i in ids:
                        self.pending.pop(i, None)
                got = list(self.grid.pull_messages(ids))
                got.reverse()  # popped from the end: each reply is held only until it is summed
                while got:
                    msg = got.pop()
                    self.pending.pop(msg.metadata.reply_to_message_id, None)
                    arrived = True
                    yield msg
                    msg = None  # noqa: F841 - release it before the next pull
            if self.pending and not arrived and not synchronous:
                self._report_wait()
                if self.stop is not None and self.stop.wait(0.05):
                    raise RoundAbandonedError
                if self.stop is None:
                    time.sleep(0.05)

    def _report_wait(self) -> None:
        now = time.monotonic()
        if now - self._reported < WAIT_REPORT_S:
            return
        self._reported = now
        nodes = sorted({n for n in self.pending.values() if n is not None})
        nodes += ["an unknown node"] * any(n is None for n in self.pending.values())
        shown = ", ".join(map(str, nodes[:10])) + (
            f" and {len(nodes) - 10} more" if len(nodes) > 10 else ""
        )
        log.warning(
            "%d of %d replies still missing after %.0f s, from node(s) %s; they time out in "
            "%.0f s (node-timeout %g s). A SuperNode that stays silent may hold a message of an "
            "ended run: restart it.",
            len(self.pending),
            self.total,
            now - self.started,
            shown,
            max(0.0, self.deadline - now),
            self.timeout,
        )


def pull_batch(layout: ModelLayout) -> int:
    """How many replies one pull asks for: `PULL_BYTES` of float32 replies of ``layout``'s size,
    between 1 and 256.

    Args:
        layout: the model's layout.

    Returns:
        The number of ids per pull.
    """
    size = 4 * max(1, sum(math.prod(s) for s in layout.shapes))
    return max(1, min(256, PULL_BYTES // size))


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
        # the last listing of online nodes and its set (the in-process grid lists one tuple until a
        # node restarts)
        self._ids: object = None
        self._online: frozenset[int] = frozenset()

    def refresh(self, grid: Grid) -> frozenset[int]:
        """Map the nodes that appeared since the last round; returns the nodes online now."""
        ids = grid.get_node_ids()
        if isinstance(ids, tuple) and ids is self._ids:  # the same immutable listing: no new node
            return self._online
        # set operations in C: at 342,477 nodes a Python loop over the ids cost 0.2 s per round
        online = frozenset(map(int, ids))
        new = sorted(online.difference(self.node_to_user, self._unmapped))
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
        self._ids, self._online = ids, online  # after the mapping: a failed one is retried
        return online


def train_messages(
    cfg: RunConfig, plan: RoundPlan, arrays: ArrayRecord, user_config: dict
) -> list[Message]:
    """One TRAIN message per node of the routed ``plan`` (`RoundPlan.route`), carrying the
    model and the round's config (cross-silo: also the item ids the silo trains, clipping each)."""
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
    messages = []
    for node, items in plan.expected.items():
        content = {"arrays": arrays, "config": cfg_record}
        if not isinstance(items, str):
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


# -- models and replies as corrflow's value types ------------------------------------------------


def model_arrays(model: ArrayRecord | Sequence[np.ndarray]) -> tuple[list[np.ndarray], list | None]:
    """A model's arrays in order and their names (None for a plain list: the layout numbers
    them)."""
    if isinstance(model, ArrayRecord):
        return model.to_numpy_ndarrays(), list(model.keys())
    return [np.asarray(a) for a in model], None


def model_record(layout: ModelLayout, params: Sequence[np.ndarray]) -> ArrayRecord:
    """The model as the user's app sees it: every array, in its names, order and dtypes."""
    return ArrayRecord(
        OrderedDict(
            (k, Array(np.require(a, requirements="C")))  # keeps 0-d arrays 0-d
            for k, a in zip(layout.keys, layout.full(params), strict=True)
        )
    )


def model_sha256(model: ArrayRecord | Sequence[np.ndarray]) -> str:
    """`corrflow.run.model.arrays_sha256` of an ``ArrayRecord`` or a list of arrays."""
    return arrays_sha256(model_arrays(model)[0])


#: Flower's error codes (flwr.common.constant.ErrorCode) and what they mean for a round's reply.
_ERROR_CLASSES = {
    5: "offline: the SuperLink had no heartbeat from the node",
    3: "timed out: the message expired before the node fetched it",
    4: "timed out: the reply expired before the server fetched it",
    1: "crashed: the ClientApp could not be loaded",
    8: "crashed: the ClientApp process died",
}


def error_reason(code: int, reason: str) -> str:
    """One line for a Flower error reply: offline, timed out or crashed, with the first line of the
    client's own message (a multi-line traceback stays in the log)."""
    first = (str(reason).strip().splitlines() or [""])[0][:200]
    if int(code) in _ERROR_CLASSES:
        return _ERROR_CLASSES[int(code)]
    return f"client error: {first}"


def to_reply(msg: Message, node: int, node_to_user: Mapping[int, str]) -> Reply:
    """A reply ``Message`` to the request sent to ``node`` as a `Reply`: a Flower error, a
    sender other than ``node`` or records other than ``arrays`` + ``metrics`` become its ``error``;
    its arrays are decoded without copying (`array_view`)."""
    user = node_to_user.get(node)
    if msg.has_error():
        reason = msg.error.reason
        return Reply(node, user, error=error_reason(msg.error.code, reason), details=reason)
    src = int(msg.metadata.src_node_id)
    if src != node:
        return Reply(node, user, error=f"a reply from node {src} to the message sent to {node}")
    content = msg.content
    keys = set(content.keys())
    if keys != {"arrays", "metrics"}:
        return Reply(
            node, user, error=f"reply records {sorted(keys)}, expected ['arrays', 'metrics']"
        )
    record, metrics = content["arrays"], content["metrics"]
    if not isinstance(record, ArrayRecord) or not isinstance(metrics, MetricRecord):
        return Reply(
            node, user, error="'arrays' must be an ArrayRecord and 'metrics' a MetricRecord"
        )
    names = list(record.keys())
    try:
        arrays = [array_view(a) for a in record.values()]
    except Exception as exc:  # undecodable array payloads of any kind
        return Reply(node, user, names, (), dict(metrics), undecodable=str(exc))
    return Reply(node, user, names, arrays, dict(metrics))


def array_view(payload: Array) -> np.ndarray:
    """The NumPy array in a Flower ``Array`` without copying its bytes (a read-only view into the
    serialized ``np.save`` payload); other serializations go through Flower's own decoder."""
    data = payload.data
    if payload.stype != "numpy.ndarray" or not isinstance(data, bytes):
        return payload.numpy()
    head = io.BytesIO(data)
    version = np.lib.format.read_magic(head)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
    else:
        return payload.numpy()
    if dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    count = math.prod(shape)
    offset = head.tell()
    if len(data) - offset < count * dtype.itemsize:
        raise ValueError(
            f"{len(data) - offset} bytes of data for {count} × {dtype.itemsize}-byte values"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
