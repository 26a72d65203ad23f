"""The server's side of a noise node (``--secagg --noise-node``): a noise stream that holds no
noise secret.

A noise node is a separate party that holds the run's noise key and joins every secure round as
one more SecAgg+ participant, its input round t's noise σ·c·(C⁻¹Z)_t on the round's quantization
grid (`corrflow.noisenode`). The sum the server unmasks is therefore already noised: `add` adds
nothing, it checks that the noise node's receipt for the round arrived (the key segment that drew
the row and the head of the noise node's journal, both public), and the checkpoint saves only
those receipts. The noise node's own journal is the authority on what was released; the server's
report carries its journal head so that an auditor can compare the two.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from corrflow.accounting.noise_scale import noise_std_per_round
from corrflow.errors import IntegrityError, InvalidArgumentError
from corrflow.noise.segments import PublicSegment, PublicSegments
from corrflow.run.secure_sum import secure_sum_params, wrap_probability

if TYPE_CHECKING:
    from corrflow.run.checkpoint import Checkpoint, SecretFiles

#: The file of a checkpoint's ``noise/`` directory that records the noise node's receipts.
NODE_FILE = "noise_node.json"
#: The factorization file a run directory caches (what the noise node is pinned with).
FACTORIZATION_FILE = "factorization.npz"

#: The trust model the privacy report states for a run with a noise node.
TRUST_MODEL = {
    "server": "honest-but-curious: it runs the protocol as written and tries to learn from what "
    "it receives; privacy against it holds unless it colludes with the noise node",
    "noise_node": "sees no update and no sum (its inputs are keys, share ciphertexts and the "
    "round's parameters): privacy against it holds trivially",
    "clients": "as with SecAgg+: a client learns nothing of another's update",
    "defended": [
        "a substituted noise node: its id and long-term public key are pinned in every client's "
        "node config, and its per-round SecAgg+ keys are signed with that long-term key",
        "a noise node declared dropped: the clients' guard mod refuses an unmask whose dead list "
        "names it, and a setup without it",
        "σ = 0 or another factorization C: the noise node pins the recipe (factorization sha256, "
        "σ, clip, δ, rounds) and refuses any other",
        "a repeated row: the noise node never sends a row twice; a redo draws it afresh under a "
        "new key segment",
    ],
    "out_of_scope": [
        "a server that breaks the participation schedule (redoes rounds it could unmask, or "
        "sends other cohorts): each redo is a second noised sum of a cohort",
        "a server that ships other client code: deployments pin the client code with Flower's "
        "--trusted-entities",
    ],
}


@dataclass(frozen=True)
class NoiseNodeLink:
    """What the server knows of its noise node: its node id, its long-term public key (Ed25519,
    raw bytes) and the signature of its node id under that key (what the clients pin), and σ_max =
    σ·max_t ‖row t of C⁻¹‖ per unit clip, which sizes the grid's headroom. ``pin`` sends the
    run's recipe and factorization file to the noise node (the operator's hand-over; None when
    the noise node was pinned elsewhere)."""

    node_id: int
    public_key: bytes
    signature: bytes
    pin: Callable[[dict, Path], None] | None = field(default=None, compare=False)

    def public(self) -> dict:
        """The public form (hex for bytes)."""
        return {
            "node_id": self.node_id,
            "public_key": self.public_key.hex(),
            "signature": self.signature.hex(),
        }


class NoiseNodeStream:
    """The run's noise as the noise node adds it inside the secure sum: the
    `corrflow.run.noise.NoiseStream` protocol without a noise key (module docstring)."""

    #: A lost noise node fails its round's secure sum instead (the round is redone).
    lost: str | None = None

    def __init__(self, link: NoiseNodeLink, next_round: int = 0, receipts: list | None = None):
        self.link = link
        self._next = next_round
        self._receipts: list[dict] = list(receipts or [])  # released rounds' receipts
        self._pending: dict | None = None
        self.recipe: dict | None = None
        self.sigma_max: float | None = None

    def prepare(self, plan) -> dict:
        """The run's recipe and σ_max = σ·max_t ‖row t of C⁻¹‖ (per unit clip, the grid's
        headroom), computed once; the first call pins the recipe on the noise node when the link
        can (the operator's hand-over in simulation).

        Args:
            plan: the run's `corrflow.run.plan.RunPlan`.

        Returns:
            The recipe every setup request carries.
        """
        if self.recipe is None:
            recipe = noise_recipe(plan)
            sigma = float(
                noise_std_per_round(plan.factorization, recipe["noise_multiplier"])["max"]
            )
            if self.link.pin is not None:
                self.link.pin(recipe, Path(plan.cfg.state_dir) / FACTORIZATION_FILE)
            self.recipe, self.sigma_max = recipe, sigma
        return self.recipe

    def watch(self, on_lost) -> None:
        """A lost noise node fails its round's secure sum instead (the round is redone)."""

    @property
    def node_id(self) -> int:
        """The noise node's id."""
        return self.link.node_id

    @property
    def next_round(self) -> int:
        """The next round whose receipt is due."""
        return self._next

    def receive(self, round_index: int, segment: dict, journal_head: str) -> None:
        """Record the noise node's receipt for the sum about to be released.

        Args:
            round_index: t.
            segment: the key segment that drew row Z_t ({"first_round", "key_fingerprint"} and,
                from version 2, "derivation").
            journal_head: the head hash of the noise node's journal after it sent row t.
        """
        self._pending = {
            "round": int(round_index),
            "segment": PublicSegment.from_public(segment),
            "journal_head": str(journal_head),
        }

    def add(self, total: Sequence[np.ndarray], t: int, scale: np.float32) -> None:
        """The noise is in ``total`` already: take the noise node's receipt for round ``t``.

        Raises:
            IntegrityError: no receipt of the noise node for round ``t`` (nothing is released).
        """
        self._take_receipt(t)

    def skip(self, t: int) -> None:
        """The server adds no noise of its own in any round: as `add` (whatever the noise node
        put in the sum is in it; its receipt is taken all the same). A run with a noise node is
        private (``--secagg`` refuses a non-private baseline), so the round never calls this.

        Raises:
            IntegrityError: no receipt of the noise node for round ``t``.
        """
        self._take_receipt(t)

    def _take_receipt(self, t: int) -> None:
        if self._pending is None or self._pending["round"] != t or t != self._next:
            raise IntegrityError(
                f"round {t + 1}: the sum carries no receipt of the noise node for this round"
            )
        self._receipts.append(self._pending)
        self._pending = None
        self._next += 1

    @property
    def segments(self) -> PublicSegments:
        """The key segments of the released rows, as the noise node reported them."""
        seen: dict[int, PublicSegment] = {}
        for r in self._receipts:
            seen[r["segment"].first_round] = r["segment"]  # a later receipt supersedes
        firsts = sorted(seen)
        return PublicSegments(tuple(seen[f] for f in firsts), "noise node receipt")

    @property
    def journal_head(self) -> str | None:
        """The noise node's journal head as of the last released round."""
        return self._receipts[-1]["journal_head"] if self._receipts else None

    def save(self, state_dir: Path, secrets: SecretFiles) -> dict[str, bytes]:
        """The receipts, for the checkpoint being written (no secret: there is none).

        Args:
            state_dir: the run's ``state/`` directory (unused: nothing beside the checkpoint).
            secrets: the run's secret files (unused).

        Returns:
            The public files, name → bytes.
        """
        saved = {
            "noise_node": self.link.public(),
            "next_round": self._next,
            "receipts": [{**r, "segment": r["segment"].public()} for r in self._receipts],
        }
        return {NODE_FILE: json.dumps(saved).encode()}

    @classmethod
    def restore(cls, checkpoint: Checkpoint, link: NoiseNodeLink) -> NoiseNodeStream:
        """The receipts a checkpoint saved; refuses another noise node than the run's.

        Raises:
            IntegrityError: the checkpoint's run has no noise node, or another one.
        """
        if NODE_FILE not in checkpoint.noise:
            raise IntegrityError(
                f"{checkpoint.path}: this run drew its noise on the server; resume it without "
                "--noise-node (its noise cannot move to a noise node mid-run)"
            )
        saved = json.loads(checkpoint.noise[NODE_FILE])
        if saved["noise_node"]["public_key"] != link.public_key.hex():
            raise IntegrityError(
                f"{checkpoint.path}: the run's noise node had public key "
                f"{saved['noise_node']['public_key'][:16]}…, this one "
                f"{link.public_key.hex()[:16]}…: resume with the run's noise node directory"
            )
        receipts = [
            {**r, "segment": PublicSegment.from_public(r["segment"])} for r in saved["receipts"]
        ]
        return cls(link, int(saved["next_round"]), receipts)

    def node_report(self) -> dict:
        """The privacy report's ``noise_node`` section (`noise_node_section`)."""
        return {
            **self.link.public(),
            "rounds_contributed": len(self._receipts),
            "key_segments": [s.public() for s in self.segments.segments],
            "journal_head": self.journal_head,
        }


def _dim(recipe: dict) -> int:
    return sum(int(np.prod(s)) for s in recipe["shapes"])


def noise_recipe(plan) -> dict:
    """What the noise node pins: the factorization's sha256, σ, clip c, δ, the rounds n, and the
    trainable arrays' shapes (its input's layout).

    Args:
        plan: the run's `corrflow.run.plan.RunPlan`.

    Returns:
        The recipe (JSON-ready).
    """
    acc = plan.accounting.plan
    return {
        "factorization_sha256": plan.factorization.sha256(),
        "noise_multiplier": float(acc.noise_multiplier),
        "clip_norm": float(plan.cfg.clip_norm),
        "delta": float(acc.delta if acc.delta is not None else plan.cfg.delta),
        "rounds": int(plan.factorization.rounds),
        "shapes": [list(s) for s in plan.layout.trainable_shapes],
    }


def noise_node_section(noise, secure: dict | None = None) -> dict:
    """The privacy report's additions for a run whose noise a noise node adds, else {}: the noise
    node (id, long-term public key, rounds contributed, key segments, the head of its journal as
    of the last released round) and the trust model; the ``secure_aggregation`` section
    (``secure``) is corrected in place: the server no longer holds a noiseless sum.

    Args:
        noise: the run's noise stream.
        secure: the report's ``secure_aggregation`` section, or None.

    Returns:
        ``{"noise_node": …, "trust_model": …}`` or {}.
    """
    if not isinstance(noise, NoiseNodeStream):
        return {}
    if secure is not None:
        secure["noiseless_sum"] = (
            "the server never holds a noiseless sum: the noise node's input (round t's noise on "
            "the quantization grid) is inside every sum it unmasks"
        )
        secure["server_saw"] = secure["server_saw"].replace(
            "unmasked sum of the cohort's clipped updates",
            "unmasked sum of the cohort's clipped updates and the noise node's noise",
        )
        if (sigma := noise.sigma_max) is not None and noise.recipe is not None:
            q = secure["quantization"]
            m, dim = q["cohort"], _dim(noise.recipe)
            p = secure_sum_params(m, q["clipping_range"], dim, sigma)
            secure.update(reconstruction_threshold=p.threshold, neighbours=p.num_shares)
            q.update(p.to_dict())
            q["wrap_probability_per_round"] = wrap_probability(dim)
            secure["dropout_tolerance"] = (
                f"each member's neighbourhood of {p.num_shares} (the noise node included) may "
                f"lose {p.num_shares - p.threshold} clients; a round whose noise node did not "
                "answer, or with more dropouts, is not released and is redone with a fresh noise "
                "row (the noise node never sends a row twice)"
            )
            q["rule"] = (
                "T = the largest integer with m·T + 2·K·σ_max·T < M, K = 20 (room for the noise "
                "on both sides); a round wraps in some coordinate with probability below "
                "d·2·Φ(−K) (wrap_probability_per_round; post-processing: it costs accuracy, "
                "not privacy)"
            )
    return {
        "noise_node": {
            **noise.node_report(),
            "holds": "the run's noise key and its key segments; the server holds none",
            "release_authority": "the noise node's journal: a row counts as released once the "
            "noise node has sent a masked vector containing it, and is never sent again",
        },
        "trust_model": TRUST_MODEL,
    }


def open_noise_node(cfg, link, checkpoint: Checkpoint | None) -> NoiseNodeStream:
    """The server's noise stream of a run with a noise node (`NoiseNodeStream`).

    Args:
        cfg: the run's settings (``noise_node`` set).
        link: the noise node's `NoiseNodeLink`.
        checkpoint: the verified checkpoint a resumed run continues, or None.

    Raises:
        InvalidArgumentError: no noise node link, or noise workers as well.
        IntegrityError: a checkpoint of a run without a noise node, or of another noise node.
    """
    if not isinstance(link, NoiseNodeLink) or not cfg.noise_node:
        raise InvalidArgumentError(
            "noise-node",
            "a running noise node (corrflow simulate --secagg --noise-node starts one)",
            "none" if not isinstance(link, NoiseNodeLink) else "noise_node off",
        )
    if cfg.noise_workers:
        raise InvalidArgumentError(
            "noise-workers",
            "0 with --noise-node (the noise node draws the noise)",
            cfg.noise_workers,
        )
    if checkpoint is None:
        return NoiseNodeStream(link)
    return NoiseNodeStream.restore(checkpoint, link)
