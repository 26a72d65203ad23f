"""Helper for test_secagg: run the in-process server with secure aggregation; with
KILL_ROUND_STAGE=t set, SIGKILL this process when round t's masked vectors have reached the server
(mid-protocol: before the unmask stage, nothing of round t checkpointed); with WRONG_COUNTS=1, one
client of round 1 adds T to the action counts inside its masked vector (two more "kept" in the
unmasked sum: the plausibility check stops the run). Exits 1 when the run stopped early."""

import os
import signal
import sys

from flwr.common import bytes_to_ndarray, ndarray_to_bytes
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from lineage_support import noise_key_from_env

from corrflow.clients.numpy_client import train
from corrflow.clients.secagg import with_secure_aggregation
from corrflow.config import RunConfig
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

out = sys.argv[1]
kill_round = int(os.environ.get("KILL_ROUND_STAGE", "0"))
wrong_counts = os.environ.get("WRONG_COUNTS") == "1"


class KillGrid(InProcessGrid):
    collects = 0
    ranges = (0, 1)  # the round's T and M, read from its setup messages

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            rec = m.content.config_records.get(RECORD_KEY_CONFIGS)
            if rec is not None and rec.get(Key.STAGE) == Stage.SETUP:
                self.ranges = (int(rec[Key.TARGET_RANGE]), int(rec[Key.MOD_RANGE]))
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
            if wrong_counts:
                self._add_to_counts()
        return ids

    def _add_to_counts(self):
        t, m = self.ranges
        rec = min(self._replies, key=lambda r: int(r.metadata.src_node_id)).content[
            RECORD_KEY_CONFIGS
        ]
        vectors = list(rec[Key.MASKED_PARAMETERS])
        counts = bytes_to_ndarray(vectors[-1]).copy()
        counts[0] = (int(counts[0]) + t) % m
        rec[Key.MASKED_PARAMETERS] = [*vectors[:-1], ndarray_to_bytes(counts)]


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
strategy = run_server(
    KillGrid({"train": with_secure_aggregation(train)}, 12),
    cfg,
    noise_key=noise_key_from_env(),
    quiet=True,
)
sys.exit(1 if strategy.stopped_reason else 0)
