"""Helper for test_secagg: run the in-process server with secure aggregation; with
KILL_ROUND_STAGE=t set, SIGKILL this process when round t's masked vectors have reached the server
(mid-protocol: before the unmask stage, nothing of round t checkpointed)."""

import os
import signal
import sys

from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from lineage_support import noise_key_from_env

from corrflow.clients.numpy_client import train
from corrflow.clients.secagg import with_secure_aggregation
from corrflow.config import RunConfig
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

out = sys.argv[1]
kill_round = int(os.environ.get("KILL_ROUND_STAGE", "0"))


class KillGrid(InProcessGrid):
    collects = 0

    def push_messages(self, messages):
        messages = list(messages)
        collect = any(  # read before delivery: Flower's mod pops the stage from the record
            RECORD_KEY_CONFIGS in m.content.config_records
            and m.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
            == Stage.COLLECT_MASKED_VECTORS
            for m in messages
        )
        ids = super().push_messages(messages)
        if collect:
            self.collects += 1
            if self.collects == kill_round:
                os.kill(os.getpid(), signal.SIGKILL)
        return ids


cfg = RunConfig(
    num_users=12,
    num_rounds=4,
    epochs=2,
    noise_multiplier=0.7,
    model_dim=6,
    identity="partition-id",
    state_dir=out,
    secure_aggregation=True,
)
run_server(
    KillGrid({"train": with_secure_aggregation(train)}, 12),
    cfg,
    noise_key=noise_key_from_env(),
    quiet=True,
)
