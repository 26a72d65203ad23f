"""Helper for test_rollback: the in-process server with the numpy clients (deterministic), 8 rounds;
keeps each released model in OUT/released/ROUND.npy (lineage_support). NOISE_KEY as in
lineage_support (first start: the fixed test key; "os": a key from the OS, what a server draws).
With BACKUP_AT=R, right after round R is released, copies the run directory to BACKUP_DIR and the
release registry (SQLite's online backup) to BACKUP_REGISTRY. Exits 1 with the error on a refusal,
as the CLI does."""

import os
import shutil
import sqlite3
import sys

from lineage_support import noise_key_from_env, save_released
from strategy_support import HANDLERS, small_config

from corrflow.errors import CorrflowError
from corrflow.run.registry import default_registry
from corrflow.server.app import run_server
from corrflow.server.inprocess import InProcessGrid

out = sys.argv[1]
backup_at = int(os.environ.get("BACKUP_AT", "-1"))


def on_round_end(strategy, metrics):
    save_released(out, strategy, metrics)
    if metrics["round"] + 1 == backup_at:
        shutil.copytree(
            out, os.environ["BACKUP_DIR"], ignore=shutil.ignore_patterns(".corrflow.lock*")
        )
        with (
            sqlite3.connect(default_registry()) as src,
            sqlite3.connect(os.environ["BACKUP_REGISTRY"]) as dst,
        ):
            src.backup(dst)


try:
    run_server(
        InProcessGrid(HANDLERS, 12),
        small_config(out, num_rounds=8, epochs=2),
        noise_key=noise_key_from_env(),
        quiet=True,
        on_round_end=on_round_end,
    )
except CorrflowError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(1)
