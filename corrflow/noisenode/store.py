"""The noise node's directory: its long-term identity, the pinned recipe, the noise key segments
and the release journal — the authority on which noise rows were sent — and its report.

Files (the directory is 0700, secrets 0600):

- ``identity.key``: the Ed25519 long-term private key (clients pin its public key);
- ``node.json``: the node id and the public key;
- ``recipe.json`` and ``factorization.npz``: the pinned recipe and the factorization it names;
- ``keys.json``: the key segments (first round, key), segment 0's key written once;
- ``journal.jsonl``: one hash-chained entry per row sent, appended *before* the masked vector
  containing it leaves (a row counts as released when it is sent);
- ``noise_node_report.json``: rounds contributed, key segments, journal head.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections import Counter
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from corrflow.errors import IntegrityError
from corrflow.fileio import fsync_dir, read_jsonl, write_bytes, write_json
from corrflow.hashing import canonical_json
from corrflow.noise import new_secret
from corrflow.noise.segments import KeySegment, SegmentTable

GENESIS = "0" * 64
JOURNAL, KEYS, RECIPE, REPORT = (
    "journal.jsonl",
    "keys.json",
    "recipe.json",
    "noise_node_report.json",
)
FACTORIZATION = "factorization.npz"


def entry_hash(entry: dict) -> str:
    """SHA-256 of a journal entry's canonical JSON without its own ``hash``."""
    return hashlib.sha256(
        canonical_json({k: v for k, v in entry.items() if k != "hash"})
    ).hexdigest()


class NoiseNodeStore:
    """The noise node's directory (module docstring)."""

    def __init__(self, directory: str | os.PathLike, node_id: int | None = None):
        """Open (or create) the directory.

        Args:
            directory: the noise node's directory.
            node_id: the node id the SuperLink assigned to the noise node's SuperNode key (a
                deployment); None: a random SuperNode-like id (a simulation's child process).

        Raises:
            IntegrityError: the directory's noise node has another node id.
        """
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self._identity = self._load_identity(node_id)
        if node_id is not None and self.node_id != int(node_id):
            raise IntegrityError(
                f"the noise node in {self.dir} has node id {self.node_id}, not {node_id}: its "
                "clients pin that id; give another node its own directory"
            )
        self.entries = self._read_journal()
        # per-round tallies kept with the journal: a round's bookkeeping is O(1), not O(rounds)
        self._sends = Counter(int(e["round"]) for e in self.entries)
        self._segments = {canonical_json(e["segment"]): e["segment"] for e in self.entries}

    # -- identity ----------------------------------------------------------------------------------
    def _load_identity(self, node_id: int | None) -> Ed25519PrivateKey:
        path = self.dir / "identity.key"
        if not path.exists():
            key = Ed25519PrivateKey.generate()
            raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
            if node_id is None:
                node_id = secrets.randbits(62) | 1  # a SuperNode-like id, never 0
            write_json(self.dir / "node.json", {"node_id": int(node_id)})
            write_bytes(path, raw, private=True)  # last: a directory with a key has its id
        return Ed25519PrivateKey.from_private_bytes(path.read_bytes())

    @property
    def node_id(self) -> int:
        """The noise node's id, chosen once."""
        return int(json.loads((self.dir / "node.json").read_text())["node_id"])

    @property
    def public_key(self) -> bytes:
        """The long-term Ed25519 public key, raw bytes."""
        return self._identity.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def sign(self, data: bytes) -> bytes:
        """``data`` signed with the long-term key."""
        return self._identity.sign(data)

    # -- recipe ------------------------------------------------------------------------------------
    def recipe(self) -> dict | None:
        """The pinned recipe, or None before the pin."""
        path = self.dir / RECIPE
        return json.loads(path.read_text()) if path.exists() else None

    def pin(self, recipe: dict, factorization: bytes) -> None:
        """Pin ``recipe`` with its factorization file's bytes, once.

        Raises:
            IntegrityError: another recipe is pinned already.
        """
        held = self.recipe()
        if held is not None:
            if held != recipe:
                diff = sorted(k for k in {*held, *recipe} if held.get(k) != recipe.get(k))
                raise IntegrityError(
                    f"the noise node in {self.dir} is pinned to another recipe (differs in "
                    f"{diff}); a noise node serves one run: give this run its own "
                    "--noise-node-dir"
                )
            return
        write_bytes(self.dir / FACTORIZATION, factorization)
        write_json(self.dir / RECIPE, recipe, indent=1)

    # -- key segments ------------------------------------------------------------------------------
    def segments(self) -> tuple[SegmentTable, bool]:
        """The key segments, and whether they existed before (this start is then a restart)."""
        path = self.dir / KEYS
        if not path.exists():
            table = SegmentTable.single(new_secret())
            self.save_segments(table)
            return table, False
        try:
            raw = json.loads(path.read_text())["segments"]
            return SegmentTable(tuple(KeySegment.from_row(row) for row in raw)), True
        except (ValueError, TypeError, KeyError) as exc:
            raise IntegrityError(f"{path}: unreadable noise key segments ({exc})") from None

    def save_segments(self, table: SegmentTable) -> None:
        """Write the key segments (0600), before any row is drawn with a new one."""
        path = self.dir / KEYS
        rows = [s.private() for s in table.segments]
        write_json(path, {"segments": rows}, private=True)

    # -- journal -----------------------------------------------------------------------------------
    def _read_journal(self) -> list[dict]:
        path = self.dir / JOURNAL
        if not path.exists():
            return []
        prev, out = GENESIS, []
        for line, entry in read_jsonl(path):
            if entry.get("prev") != prev or entry_hash(entry) != entry.get("hash"):
                raise IntegrityError(f"{path}:{line}: the journal's hash chain is broken")
            out.append(entry)
            prev = entry["hash"]
        return out

    @property
    def head(self) -> str:
        """The journal's head hash (all zeros when empty)."""
        return self.entries[-1]["hash"] if self.entries else GENESIS

    def sent_rounds(self) -> set[int]:
        """The rounds whose rows were sent, at least once."""
        return set(self._sends)

    def last_sent_round(self) -> int | None:
        """The latest round whose row was sent, or None before the first."""
        return max(self._sends) if self._sends else None

    def append(self, round_index: int, segment: dict, input_sha256: str) -> dict:
        """Journal that row ``round_index`` is being sent (fsynced before it leaves).

        Args:
            round_index: t.
            segment: the public form of the key segment that drew row Z_t.
            input_sha256: SHA-256 of the grid input sent (identifies the row, reveals nothing).

        Returns:
            The entry, with its ``hash``: the journal's new head.
        """
        entry = {
            "seq": len(self.entries),
            "round": int(round_index),
            "send": self._sends[int(round_index)] + 1,
            "segment": segment,
            "input_sha256": input_sha256,
            "prev": self.head,
        }
        entry["hash"] = entry_hash(entry)
        path = self.dir / JOURNAL
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.dir)
        self.entries.append(entry)
        self._sends[int(round_index)] += 1
        self._segments.setdefault(canonical_json(segment), segment)
        return entry

    # -- report ------------------------------------------------------------------------------------
    def write_report(self, table: SegmentTable) -> Path:
        """noise_node_report.json: what an auditor compares with the server's report."""
        return write_json(
            self.dir / REPORT,
            {
                "node_id": self.node_id,
                "public_key": self.public_key.hex(),
                "recipe": self.recipe(),
                "rounds_contributed": len(self._sends),
                "sends": len(self.entries),
                "rounds_sent_more_than_once": sorted(r for r, n in self._sends.items() if n > 1),
                "key_segments": [self._segments[k] for k in sorted(self._segments)],
                "current_key_segments": [s.public() for s in table.segments],
                "journal_head": self.head,
                # each segment's own version is in its public form (absent: 1)
                "key_derivation": "corrflow.noise.keys version "
                + ", ".join(str(v) for v in sorted({seg.version for seg in table.segments})),
                "journal_entries": len(self.entries),
                "rule": "a row counts as released once a masked vector containing it was sent; "
                "a row is never sent twice (a redo draws it afresh under a new key segment)",
            },
            indent=1,
        )
