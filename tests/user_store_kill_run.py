"""Helper for test_user_store: run the in-process server (12 users, 4 rounds); with KILL_ROUND and
KILL_WHERE set, SIGKILL this process when the per-user store commits that round (0-based):
``before`` — after the round's checkpoint, before the store's transaction begins; ``inside`` — with
the round's rows written inside the open transaction, before its COMMIT (a torn commit)."""

import os
import signal
import sys

from corrflow.clients.numpy_client import train
from corrflow.config import RunConfig
from corrflow.run import user_store
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

out = sys.argv[1]
kill_round = int(os.environ.get("KILL_ROUND", "-1"))
where = os.environ.get("KILL_WHERE", "before")
real_commit = user_store.UserStore.commit


def commit(self, rows, meta, replace=False):
    # a round's commit brings the store to ledger line round + 1
    if not replace and int(meta["ledger_lines"]) == kill_round + 1:
        if where == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        self._db.execute("BEGIN IMMEDIATE")
        self._db.executemany(
            f"INSERT OR REPLACE INTO {user_store.TABLE} VALUES (?, ?, ?, ?, ?)",
            map(user_store._row, rows),
        )
        os.kill(os.getpid(), signal.SIGKILL)
    return real_commit(self, rows, meta, replace)


user_store.UserStore.commit = commit
cfg = RunConfig(
    num_users=12, num_rounds=4, epochs=2, noise_multiplier=0.7, model_dim=6, state_dir=out
)
run_server(InProcessGrid({"train": train}, 12), cfg, noise_key=bytes(range(16)), quiet=True)
