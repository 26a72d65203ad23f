"""What crossed the wire to the server under secure aggregation: every reply the server pulled,
counted by message type and by what it carried. The privacy report's ``server_saw`` is derived from
this record (`corrflow.run.secure_sum.server_saw`), never assumed: a reply that carried arrays or
metrics in the clear is named there even when the driver refused it.

`RecordingGrid` wraps the run's grid and classifies each reply as it is pulled; the record is kept
in the run directory (``server_received.json``), so it covers every process start of the run and
moves aside with it (``--fresh``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from flwr.app import Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.serverapp import Grid

from corrflow.errors import IntegrityError
from corrflow.fileio import write_json
from corrflow.run.resume import SERVER_RECEIVED
from corrflow.run.secure_sum import UNDECRYPTABLE_KEY

#: What each protocol key of a SecAgg+ reply carries (in Flower's stage order).
_PROTOCOL = (
    (Key.PUBLIC_KEY_1, "public keys"),
    (Key.CIPHERTEXT_LIST, "encrypted shares"),
    (Key.MASKED_PARAMETERS, "masked vectors"),
    (Key.SHARE_LIST, "secret shares"),
    (UNDECRYPTABLE_KEY, "undecryptable-sender reports"),
)
#: Config records of Flower's legacy reply layout that carry nothing of the client's data when empty
# (metrics) or OK (status).
_LEGACY_EMPTY = {"fitres.metrics": {}, "fitres.status": {"code": 0, "message": ""}}


def reply_kinds(msg: Message) -> list[str]:
    """What one reply carried, as the report names it: ``"public keys"``, ``"masked vectors"``, …,
    ``"identity replies"``, ``"error replies"``, or ``"arrays in the clear"`` / ``"metrics in the
    clear (loss, accuracy)"`` / ``"config values in the clear (…)"`` for anything else.

    Args:
        msg: a reply the server received.

    Returns:
        The kinds, in a fixed order (empty for an empty reply).
    """
    if msg.has_error():
        return ["error replies"]
    content, kinds = msg.content, []
    protocol = content.config_records.get(RECORD_KEY_CONFIGS)
    if protocol is not None:
        kinds += [kind for key, kind in _PROTOCOL if key in protocol]
    if any(len(r) for r in content.array_records.values()):
        kinds.append("arrays in the clear")
    # Flower's secaggplus_mod sends the weight it masked with in the clear: corrflow's clients send
    # the constant 1 (checked again inside the masked vector)
    metrics = sorted(
        {
            k
            for r in content.metric_records.values()
            for k, v in r.items()
            if not (k == "num_examples" and v == 1)
        }
    )
    if metrics:
        kinds.append(f"metrics in the clear ({', '.join(metrics)})")
    config = sorted(
        {
            k
            for name, r in content.config_records.items()
            if name != RECORD_KEY_CONFIGS and dict(r) != _LEGACY_EMPTY.get(name)
            for k in r
        }
    )
    if config and msg.metadata.message_type.startswith("query"):
        kinds.append("identity replies")
    elif config:
        kinds.append(f"config values in the clear ({', '.join(config)})")
    return kinds


class WireRecord:
    """Message type → kind → count of the replies the server received (see `reply_kinds`), over
    every process start of the run once `attach` ed to its directory."""

    def __init__(self):
        self.counts: dict[str, Counter] = {}
        self._path: Path | None = None
        self._saved = 0

    def attach(self, run_dir: str | Path) -> None:
        """Add the record of the run's earlier process starts (``server_received.json``, which
        moves aside with an earlier run) and keep the file current from now on.

        Args:
            run_dir: the run directory, after any earlier run in it was moved aside.
        """
        self._path = Path(run_dir) / SERVER_RECEIVED
        try:
            earlier = json.loads(self._path.read_text())
            for mtype, kinds in earlier.items():
                self.counts.setdefault(str(mtype), Counter()).update(
                    {str(k): int(n) for k, n in kinds.items()}
                )
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise IntegrityError(
                f"{self._path}: not the record of what the server received ({exc}); restore "
                "it, or start a new run with --fresh"
            ) from None
        self.save()

    def add(self, replies: list[Message]) -> None:
        """Count received replies (and save the record once attached).

        Args:
            replies: replies the server just pulled.
        """
        for msg in replies:
            mtype = str(msg.metadata.message_type).split(".")[0]
            self.counts.setdefault(mtype, Counter()).update(reply_kinds(msg))
        if replies:
            self.save()

    def save(self) -> None:
        """Write the record, atomically, when attached to a run directory."""
        if self._path is not None:
            write_json(self._path, self.to_dict())

    def to_dict(self) -> dict[str, dict[str, int]]:
        """The record as the report stores it (sorted, plain ints).

        Returns:
            Message type → kind → count.
        """
        return {t: dict(sorted(c.items())) for t, c in sorted(self.counts.items()) if c}


class RecordingGrid:
    """The run's grid, counting every reply the server pulls into a `WireRecord` (every other
    attribute is the wrapped grid's)."""

    def __init__(self, grid: Grid, record: WireRecord | None = None):
        self._grid, self.record = grid, record or WireRecord()

    @property
    def recorded_grid(self) -> Grid:
        """The grid whose replies are recorded (its type says whether this is a simulation)."""
        return self._grid

    def pull_messages(self, message_ids):
        replies = list(self._grid.pull_messages(message_ids))
        self.record.add(replies)
        return replies

    def send_and_receive(self, messages, *args, **kwargs):
        replies = list(self._grid.send_and_receive(messages, *args, **kwargs))
        self.record.add(replies)
        return replies

    def __getattr__(self, name):
        return getattr(self._grid, name)
