"""An in-process Flower Grid that delivers messages to ClientApp handler functions directly (no Ray, no network).

For tests and debugging of the strategy: deterministic, fast, and able to inject faults (drop, corrupt, duplicate,
foreign senders) through ``tamper``. Production and the README's simulation use Flower's own engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


def enable_offline_messages() -> None:
    """Messages can only be built inside a running app; set the task identity like run_simulation does."""
    try:
        TaskIdentity.run_id  # noqa: B018 - raises when unset
    except RuntimeError:
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


class InProcessGrid(Grid):
    def __init__(self, handlers: dict[str, Callable[[Message, Context], Message]], num_nodes: int,
                 tamper: Callable[[list[Message]], list[Message]] | None = None, first_node_id: int = 1 << 62):
        enable_offline_messages()
        self.handlers = handlers
        self.nodes = {first_node_id + 7919 * i: i for i in range(num_nodes)}  # large ids, like Flower's uint64s
        self.tamper = tamper
        self.online = set(self.nodes)
        self._run = None

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.online)

    def get_nodes(self):
        return []

    def push_messages(self, messages):
        raise NotImplementedError("use send_and_receive")

    def pull_messages(self, message_ids):
        raise NotImplementedError("use send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies, kinds = [], set()
        for msg in messages:
            node = int(msg.metadata.dst_node_id)
            if node not in self.online:
                continue
            kind = msg.metadata.message_type.split(".")[0]
            kinds.add(kind)
            ctx = Context(run_id=1, node_id=node, node_config={"partition-id": self.nodes[node],
                                                               "num-partitions": len(self.nodes)},
                          state=RecordDict(), run_config={})
            replies.append(self.handlers[kind](msg, ctx))
        return self.tamper(replies) if self.tamper and kinds == {"train"} else replies
