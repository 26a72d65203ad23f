"""The noise workers as trust parties, in the privacy report's ``trust`` section and the run's
summary (McKenna, "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private
ML", arXiv 2405.15913, §3.3).

A run with ``--noise-workers N`` generates its noise (C⁻¹Z)_t in N Ray actors, one contiguous
shard of coordinates each (`corrflow.run.noise_shards`). Each worker holds its shard's block keys
and noise state, never the run's noise key: a compromised worker learns every round's noise of its
own coordinates (past and future), which lets whoever also sees the released models remove that
noise from those coordinates, and nothing of the key or of the other shards.
"""

from __future__ import annotations

from corrflow.run.noise import NoiseStream

#: What one compromised worker gives away, as the report and the summary state it.
COMPROMISED_WORKER_LEARNS = (
    "its shard's noise: every round's (C⁻¹Z)_t on its coordinates, past and future, from its "
    "chunks' block keys and its saved state; with the released models, those coordinates lose "
    "their noise. Nothing of the run's noise key (it holds block keys derived from it, one-way) "
    "or of the other shards"
)


def noise_workers_trust(noise: NoiseStream) -> dict:
    """The report's ``trust`` section for a run whose noise is sharded over workers, else {}.

    Args:
        noise: the run's noise stream.

    Returns:
        ``{"trust": {"noise_workers": …}}``: count, shard plan (coordinates, chunks), each
        worker's pid and the SHA-256 of its state at the last checkpoint, and what a compromised
        worker learns; {} for noise drawn in the server's process.
    """
    trust = getattr(noise, "trust", None)
    if trust is None:
        return {}
    return {
        "trust": {
            "noise_workers": {
                **trust(),
                "holds": "its shards' block keys (per key segment) and noise state, never the "
                "run's noise key",
                "compromised_worker_learns": COMPROMISED_WORKER_LEARNS,
            }
        }
    }


def noise_worker_lines(report: dict) -> list[str]:
    """The summary's trust lines for the noise workers (none for a run without them).

    Args:
        report: a privacy report.

    Returns:
        One line for the count and shard plan, one per worker (coordinates, state hash), and one
        for what a compromised worker learns.
    """
    workers = report.get("trust", {}).get("noise_workers")
    if not workers:
        return []
    at = workers["checkpoint_round"]
    lines = [
        f"trust       {workers['count']} noise workers (Ray), one shard of the model's "
        f"coordinates each; state hashes at the checkpoint of round {at}:"
    ]
    for s in workers["shards"]:
        lo, hi = s["coordinates"]
        digest = s["state_sha256"] or "none saved yet"
        lines.append(
            f"              worker {s['worker']}: coordinates {lo}–{hi - 1} "
            f"({s['chunks']} chunk{'s' * (s['chunks'] != 1)}), state {digest[:16]}"
        )
    lines.append(
        "              a compromised worker learns its shard's noise (all rounds), nothing of the "
        "run key or the other shards (privacy_report.json: trust.noise_workers)"
    )
    return lines
