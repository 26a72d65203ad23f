"""An in-process Flower Grid that delivers messages to ClientApp handler functions directly (no Ray,
no network).

For tests, comparisons and debugging of the strategy: deterministic, fast, and able to inject faults
(drop, corrupt, duplicate, foreign senders) through ``tamper`` and node restarts through
`restart_node`. A pushed message is delivered — its handler run — when its id is pulled, so a
round that pulls a few ids at a time holds only those replies; with ``tamper`` set, the first pull
of a push's training messages delivers all of them and hands the whole list to ``tamper`` (a fault
may duplicate, reorder or drop across the cohort), as a test expects. Messages are routed as a
ClientApp routes them (``category`` or ``category.action``); corrflow's identity handler is
registered as in corrflow's ClientApps (``identity=False`` emulates an app without it).
Production uses Flower's own engines: ``corrflow simulate`` without ``--backend inprocess`` runs
Flower's simulation engine (docs/tutorials/first-simulation.md), and deployments run SuperLink and
SuperNodes (docs/how-to/deploy.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from corrflow.clients.identity import answer_probe
from corrflow.protocol import PROBE_ACTION


def enable_offline_messages() -> None:
    """Messages can only be built inside a running app; set the task identity like run_simulation
    does."""
    try:
        TaskIdentity.run_id  # noqa: B018 - raises when unset
    except RuntimeError:
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


class InProcessGrid(Grid):
    # every reply exists once push_messages returns (replies may answer no request id)
    synchronous = True

    def __init__(
        self,
        handlers: dict[str, Callable[[Message, Context], Message]],
        num_nodes: int,
        tamper: Callable[[list[Message]], list[Message]] | None = None,
        first_node_id: int = 1 << 62,
        identity: bool = True,
        node_config: Callable[[int], dict] | None = None,
        extra_nodes: dict[int, Callable[[Message, Context], Message]] | None = None,
    ):
        enable_offline_messages()
        self.handlers = {
            **handlers,
            **({f"query.{PROBE_ACTION}": answer_probe} if identity else {}),
        }
        # large ids, like Flower's uint64s
        self.nodes = {first_node_id + 7919 * i: i for i in range(num_nodes)}
        self.tamper = tamper
        self.node_config = node_config or (lambda partition: {})
        self.online = set(self.nodes)
        self._listed: tuple[int, ...] | None = None  # sorted(online), until a node restarts
        # nodes that are no user's (a noise node): reached by id, never listed or sampled
        self.extra_nodes = dict(extra_nodes or {})
        self._run = None
        self._pending: dict[str, Message] = {}  # pushed, not delivered yet (push order)
        self._ready: list[Message] = []  # delivered, not pulled yet (tampered replies)
        self._contexts: dict[int, Context] = {}
        self._next_id = first_node_id + 7919 * num_nodes

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def restart_node(self, partition: int) -> int:
        """The node of ``partition`` goes away and comes back with a new node id (an insecure
        SuperNode's restart); returns the new id."""
        old = next(n for n, p in self.nodes.items() if p == partition)
        self.online.discard(old)
        del self.nodes[old]
        new, self._next_id = self._next_id, self._next_id + 7919
        self.nodes[new] = partition
        self.online.add(new)
        self._listed = None
        return new

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(
            content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id
        )

    def get_node_ids(self) -> Iterable[int]:
        if self._listed is None:  # sorting 342,477 ids every round cost 0.1 s
            self._listed = tuple(sorted(self.online))
        return self._listed

    def get_nodes(self):
        return []

    def _deliver(self, msg: Message) -> Message:
        node = int(msg.metadata.dst_node_id)
        if node in self.extra_nodes:
            try:
                return self.extra_nodes[node](msg, None)
            except Exception as exc:  # as Flower does: a ClientApp exception is an error reply
                return Message(
                    Error(code=2, reason=f"ClientApp exception: {type(exc).__name__}: {exc}"),
                    reply_to=msg,
                )
        if node not in self.online:
            return Message(
                Error(code=5, reason="Error: Node Unavailable — no heartbeat (in-process grid)"),
                reply_to=msg,
            )
        kind = msg.metadata.message_type
        handler = self.handlers.get(kind) or (
            self.handlers.get(kind.split(".")[0]) if "." not in kind else None
        )
        if handler is None:  # Flower's ClientApp raises before any user code runs
            category, _, action = kind.partition(".")
            return Message(
                Error(
                    code=2,
                    reason=f"ClientApp exception: ValueError: No {category} function "
                    f"registered with name '{action or 'default'}'",
                ),
                reply_to=msg,
            )
        ctx = self._contexts.get(node)
        if ctx is None:  # one Context per node for the run, as Flower keeps it (mods keep state)
            ctx = self._contexts[node] = Context(
                run_id=1,
                node_id=node,
                node_config={
                    "partition-id": self.nodes[node],
                    "num-partitions": len(self.nodes),
                    **self.node_config(self.nodes[node]),
                },
                state=RecordDict(),
                run_config={},
            )
        try:
            return handler(msg, ctx)
        except Exception as exc:  # as Flower does: a ClientApp exception becomes an error reply
            return Message(
                Error(code=2, reason=f"ClientApp exception: {type(exc).__name__}: {exc}"),
                reply_to=msg,
            )

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            ids.append(msg.metadata.message_id)
            self._pending[msg.metadata.message_id] = msg
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` (every pushed message when empty), each handler run now in
        push order; a tampered push's replies all come with its first pull, those that answer no id
        included.
        """
        asked = set(message_ids)
        wanted = [m for i, m in self._pending.items() if not asked or i in asked]
        for m in wanted:
            del self._pending[m.metadata.message_id]
        if self.tamper and wanted and all(_is_train(m) for m in wanted):
            rest = [i for i, m in self._pending.items() if _is_train(m)]
            wanted += [self._pending.pop(i) for i in rest]
            self._ready.extend(self.tamper([self._deliver(m) for m in wanted]))
            wanted = []
        out, self._ready = self._ready, []
        out.extend(self._deliver(m) for m in wanted)
        return out

    @property
    def _replies(self) -> list[Message]:
        """Every reply not pulled yet, delivering whatever is still pending first (for a test grid
        that inspects or drops the replies of a push before they are pulled)."""
        if self._pending:  # a pull returns the replies already delivered too
            self._ready = list(self.pull_messages(list(self._pending)))
        return self._ready

    @_replies.setter
    def _replies(self, replies: list[Message]) -> None:
        self._ready = list(replies)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        self.push_messages(messages)
        return self.pull_messages([])


def _is_train(msg: Message) -> bool:
    return msg.metadata.message_type.split(".")[0] == "train"
