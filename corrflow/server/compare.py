"""``corrflow compare``: the same federated task trained in several arms at one (ε, δ), cohort, number of rounds
and participation schedule — ``nonprivate`` (no noise), ``dpsgd`` (independent noise, identity encoder) and one arm
per correlated-noise kind — over several seeds. A seed fixes the data, the model initialisation and the
participation order, shared by every arm; the noise key is never seeded (each arm draws a fresh secret key).

Reports the final held-out accuracy and loss per arm (means over seeds), the fraction of the DP-SGD → non-private
gap each kind closes (000 Fig. 3 measures the same on StackOverflow next-word prediction), per-round curves and PNG
plots.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from corrflow.errors import require
from corrflow.fileio import write_json, write_text
from corrflow.planning.learnability import THRESHOLD

log = logging.getLogger("corrflow")


@dataclass(frozen=True)
class Preset:
    """One comparison's task and schedule: ``users`` split into rounds/epochs fixed-epoch groups (the cohort)."""

    name: str
    users: int
    rounds: int
    epochs: int
    seeds: int
    epsilon: float = 8.0
    delta: float = 1e-5
    client: str = "nextword"
    clip_norm: float = 1.0
    server_lr: float = 3.0
    momentum: float = 0.9
    local_lr: float = 2.0
    local_steps: int = 2
    data_path: str = ""          # a real-format dataset file (--data) and its vocabulary (--vocab); "": synthetic
    vocab_path: str = ""

    @property
    def cohort(self) -> int:
        return self.users // (self.rounds // self.epochs)


# quick: 1000 users, cohort 100, 40 rounds, each user in 4 rounds 10 apart — all arms × 3 seeds in a few minutes on
# 2 cores. tiny: the same recipe scaled down for the test suite (well under a minute).
PRESETS = {
    "quick": Preset("quick", users=1000, rounds=40, epochs=4, seeds=3),
    "tiny": Preset("tiny", users=160, rounds=16, epochs=4, seeds=1, local_steps=1),
}


LABELS = {"nonprivate": "non-private", "dpsgd": "DP-SGD (independent noise)", "toeplitz": "banded Toeplitz MF",
          "dense": "dense (optimal multi-epoch) MF", "banded": "BandMF", "bifr": "γ-BIFR", "bisr": "BISR"}


def fingerprint(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def arm_config(preset: Preset, kind: str, seed: int, out: Path, non_private: bool = False):
    from corrflow.config import RunConfig

    privacy = {"non_private": True} if non_private else {"target_epsilon": preset.epsilon}
    return RunConfig(num_users=preset.users, num_rounds=preset.rounds, epochs=preset.epochs, kind=kind,
                     delta=preset.delta, clip_norm=preset.clip_norm, server_lr=preset.server_lr,
                     momentum=preset.momentum, local_lr=preset.local_lr, local_steps=preset.local_steps,
                     client=preset.client, seed=seed, state_dir=str(out), **privacy, **data_settings(preset))


def data_settings(preset: Preset) -> dict:
    """The run settings of a comparison on a dataset file (``--data``): the file and its vocabulary; on arXiv
    JSON lines the author is the privacy unit (multi-attribution participation, k_u = 2, 004 §7.3)."""
    if not preset.data_path:
        return {}
    from corrflow.data.federated import data_format

    out = {"data_path": preset.data_path, "vocab_path": preset.vocab_path}
    if data_format(preset.data_path) == "arxiv-jsonl":
        out.update(participation="multi-attribution", min_sep=preset.rounds // preset.epochs, max_items_per_user=2)
    return out


def run_arm(preset: Preset, name: str, kind: str, seed: int, out: Path, backend: str) -> dict:
    """Train one arm for one seed in ``out`` (a fresh directory); its final metrics and per-round curve."""
    from corrflow.clients.tasks import get_task
    from corrflow.server.simulation import simulate

    require(not (out / "state").exists(), "out", "a directory without a previous comparison run", str(out))
    cfg = arm_config(preset, kind, seed, out, non_private=name == "nonprivate")
    task = get_task(cfg.client, cfg.model_dim, cfg.data_path, cfg.vocab_path, cfg.seq_len, seed, cfg.eval_sequences)
    started = time.perf_counter()
    report = simulate(cfg, backend=backend)
    curve = json.loads((out / "metrics.json").read_text())
    last = curve[-1]
    require(last["round"] == preset.rounds - 1, "rounds", f"all {preset.rounds} rounds completed in arm {name}",
            report.get("rounds_completed"))
    learning = report["learning"]
    return {"seed": seed, "accuracy": last.get("test_accuracy"), "loss": last["test_loss"],
            "learned": learning["learned"], "noise_to_signal": learning["noise_to_signal"],
            "initial_accuracy": curve[0].get("test_accuracy"), "initial_loss": curve[0]["test_loss"],
            "epsilon": report["realized"]["epsilon"], "noise_multiplier": report["noise_multiplier"],
            "cohort": curve[-1]["cohort"], "rejected": sum(int(m.get("rejected", 0)) for m in curve[1:]),
            "init_sha256": fingerprint(task.initial_weights()),
            "data_sha256": fingerprint([a for u in range(3) for a in task.user_data(u)]),
            "seconds": time.perf_counter() - started,
            "curve": [{"round": m["round"], "loss": m["test_loss"], "accuracy": m.get("test_accuracy")}
                      for m in curve]}


def gap_closed(value: float | None, dpsgd: float | None, nonprivate: float | None) -> float | None:
    """(kind − DP-SGD) / (non-private − DP-SGD): 1 when the kind matches non-private training, 0 when it is no
    better than DP-SGD; null when the two reference arms tie (no gap to close) or a value is missing."""
    if value is None or dpsgd is None or nonprivate is None or abs(nonprivate - dpsgd) < 1e-12:
        return None
    return (value - dpsgd) / (nonprivate - dpsgd)


def _mean(values):
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def compare(preset: Preset, kinds: list[str], out_dir: str | Path, backend: str = "inprocess",
            progress=None) -> dict:
    """Run every arm for seeds 0..preset.seeds−1; write ``comparison.json``, ``curves.csv`` and the plots."""
    require(preset.seeds >= 1, "seeds", "a positive integer", preset.seeds)
    require(bool(kinds) and all(k not in ("dpsgd", "nonprivate") for k in kinds), "kinds",
            "one or more correlated-noise kinds (dpsgd and nonprivate always run)", kinds)
    out = Path(out_dir)
    arms = {"nonprivate": "toeplitz", "dpsgd": "dpsgd", **{k: k for k in kinds}}
    for name, kind in arms.items():   # every arm's settings are valid before any arm trains
        arm_config(preset, kind, 0, out / "runs" / name, non_private=name == "nonprivate")
    out.mkdir(parents=True, exist_ok=True)
    per_seed: dict[str, list[dict]] = {name: [] for name in arms}
    for seed in range(preset.seeds):
        for name, kind in arms.items():
            res = run_arm(preset, name, kind, seed, out / "runs" / f"{name}-seed{seed}", backend)
            per_seed[name].append(res)
            if progress is not None:
                acc = "-" if res["accuracy"] is None else f"{res['accuracy']:.4f}"
                progress(f"seed {seed} {name:<10} accuracy {acc}  loss {res['loss']:.4f}  σ "
                         f"{res['noise_multiplier']:.3f}  {'learned' if res['learned'] else 'did not learn'}  "
                         f"({res['seconds']:.1f} s)")
    result = {"preset": preset.name, "epsilon": preset.epsilon, "delta": preset.delta, "rounds": preset.rounds,
              "cohort": preset.cohort, "seeds": preset.seeds, "users": preset.users, "epochs": preset.epochs,
              "client": preset.client, "backend": backend, "config": asdict(preset), "arms": {}, "gap_closed": {}}
    for name, kind in arms.items():
        runs = per_seed[name]
        result["arms"][name] = {"accuracy": _mean(r["accuracy"] for r in runs), "loss": _mean(r["loss"] for r in runs),
                                "kind": "none" if name == "nonprivate" else kind,
                                "noise_multiplier": runs[0]["noise_multiplier"],
                                "noise_to_signal": runs[0]["noise_to_signal"],
                                "learned_seeds": sum(bool(r["learned"]) for r in runs), "per_seed": runs}
    a = result["arms"]
    for kind in kinds:
        result["gap_closed"][kind] = {m: gap_closed(a[kind][m], a["dpsgd"][m], a["nonprivate"][m])
                                      for m in ("accuracy", "loss")}
    result["seconds"] = float(sum(r["seconds"] for runs in per_seed.values() for r in runs))
    result["plots"] = plot(result, out)
    write_curves(result, out / "curves.csv")
    write_json(out / "comparison.json", result, indent=1)
    return result


def write_curves(result: dict, path: Path) -> None:
    lines = ["arm,seed,round,loss,accuracy"]
    for name, arm in result["arms"].items():
        for run in arm["per_seed"]:
            for m in run["curve"]:
                acc = "" if m["accuracy"] is None else f"{m['accuracy']:.6f}"
                lines.append(f"{name},{run['seed']},{m['round']},{m['loss']:.6f},{acc}")
    write_text(path, "\n".join(lines) + "\n")


def plot(result: dict, out: Path) -> list[str]:
    """accuracy.png and loss.png: held-out metric against round (round 0 = the initial model), the mean over
    seeds as a line and the min–max over seeds as a band, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, label in (("accuracy", "held-out next-word accuracy"), ("loss", "held-out loss")):
        if any(m[metric] is None for arm in result["arms"].values() for run in arm["per_seed"] for m in run["curve"]):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
        for name, arm in result["arms"].items():
            curves = np.array([[m[metric] for m in run["curve"]] for run in arm["per_seed"]])
            x = np.arange(curves.shape[1])
            ax.plot(x, curves.mean(axis=0), label=LABELS.get(name, name))
            ax.fill_between(x, curves.min(axis=0), curves.max(axis=0), alpha=0.2)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.set_title(f"{result['preset']} ({result['client']}): ε = {result['epsilon']:g}, δ = {result['delta']:g}, "
                     f"cohort {result['cohort']}, {result['seeds']} seed(s)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(str(path))
    return paths


def table(result: dict) -> str:
    """The final metrics per arm and the gap each kind closes, as aligned text."""
    def fmt(v, spec=".4f"):
        return "-" if v is None else format(v, spec)

    rows = [f"{'arm':<12} {'kind':<10} {'σ':>7} {'ρ':>5} {'accuracy':>9} {'loss':>8} {'learned':>8} "
            f"{'gap closed (acc, loss)':>24}"]
    for name, arm in result["arms"].items():
        gap = result["gap_closed"].get(name)
        gap_text = f"{fmt(gap['accuracy'], '.0%')}, {fmt(gap['loss'], '.0%')}" if gap else ""
        learned = f"{arm['learned_seeds']}/{len(arm['per_seed'])}"
        rows.append(f"{name:<12} {arm['kind']:<10} {arm['noise_multiplier']:>7.3f} {arm['noise_to_signal']:>5.2f} "
                    f"{fmt(arm['accuracy']):>9} {fmt(arm['loss']):>8} {learned:>8} {gap_text:>24}")
    rows.append(f"ρ: the pre-flight noise-to-signal estimate (> {THRESHOLD} warns that an arm is unlikely to learn); "
                "learned: seeds whose final held-out loss is below the initial model's.")
    return "\n".join(rows)


def json_summary(result: dict) -> dict:
    """The ``--json`` object: preset, privacy, schedule, per-arm means and per-seed results, gaps, plots."""
    keep = ("preset", "epsilon", "delta", "rounds", "cohort", "seeds", "gap_closed", "plots", "seconds")
    arms = {name: {"accuracy": a["accuracy"], "loss": a["loss"], "kind": a["kind"],
                   "noise_multiplier": a["noise_multiplier"], "noise_to_signal": a["noise_to_signal"],
                   "learned_seeds": a["learned_seeds"],
                   "per_seed": [{k: v for k, v in r.items() if k != "curve"} for r in a["per_seed"]]}
            for name, a in result["arms"].items()}
    return {**{k: result[k] for k in keep}, "arms": arms}


def with_overrides(preset: Preset, **overrides) -> Preset:
    return replace(preset, **{k: v for k, v in overrides.items() if v is not None})


def stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
