"""Shared by the strategy tests: the numpy ClientApp handlers, a fixed noise key, a small run config, and the
stand-in request used to build tampered replies."""

from flwr.app import Message, RecordDict

from corrflow.clients.numpy_client import train
from corrflow.strategies.config import StrategyConfig

HANDLERS = {"train": train}
KEY = bytes(range(16))


def small_config(tmp_path, **kw) -> StrategyConfig:
    base = dict(num_users=12, num_rounds=6, epochs=2, noise_multiplier=0.7, model_dim=6,
                state_dir=str(tmp_path / "state"))
    base.update(kw)
    return StrategyConfig(**base)


def request_for(reply: Message) -> Message:
    """A stand-in for the request a reply answers (same node), to build tampered replies."""
    return Message(content=RecordDict({}), message_type="train", dst_node_id=int(reply.metadata.src_node_id))
