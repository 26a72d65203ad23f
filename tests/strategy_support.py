"""Shared by the strategy tests: the numpy ClientApp handlers, a fixed noise key, a small run
config, and the stand-in request used to build tampered replies."""

import sqlite3

from flwr.app import Message, RecordDict

from corrflow.clients.numpy_client import train
from corrflow.config import RunConfig
from corrflow.run.journal import JOURNAL, ReleaseJournal
from corrflow.run.registry import default_registry

HANDLERS = {"train": train}
KEY = bytes(range(16))


def small_config(tmp_path, **kw) -> RunConfig:
    base = dict(
        num_users=12,
        num_rounds=6,
        epochs=2,
        noise_multiplier=0.7,
        model_dim=6,
        state_dir=str(tmp_path),
    )
    base.update(kw)
    return RunConfig(**base)


def request_for(reply: Message) -> Message:
    """A stand-in for the request a reply answers (same node), to build tampered replies."""
    return Message(
        content=RecordDict({}), message_type="train", dst_node_id=int(reply.metadata.src_node_id)
    )


def forget_last_release(run_dir) -> None:
    """What a kill before a round's journal append leaves behind: the release registry (written
    after the journal) has not recorded that round either. Tests that cut the journal's last line
    cut the registry's too."""
    run_id = ReleaseJournal(run_dir / JOURNAL).read()[0].run_id
    with sqlite3.connect(default_registry()) as db:
        db.execute(
            "DELETE FROM releases WHERE run_id = ? AND round = (SELECT MAX(round) FROM releases "
            "WHERE run_id = ?)",
            (run_id, run_id),
        )
