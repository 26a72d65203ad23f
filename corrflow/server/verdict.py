"""Whether a comparison at one ε decides anything: `verdict` reads the arms' per-seed results and
says *decided*, *inconclusive* or *unpaired*, with the reasons and the settings that would decide
it.

A ranking of private arms means something only where training learned past the noise: non-private
training must beat every private arm (in each measured metric: held-out accuracy, held-out loss),
otherwise the differences between private arms are differences of under-trained models. Two arms
are told apart when the two-sided 95% Student-t interval of their paired per-seed differences (the
seeds share data, initialisation and participation order, so pairing removes their variance)
excludes 0; the private arms are ranked by the primary metric (accuracy when measured, else loss)
and every neighbouring pair in that ranking is tested. With one seed there is no interval: the
ranking is *unpaired* — one draw of data and noise.
"""

from __future__ import annotations

import math

import numpy as np

DECIDED, INCONCLUSIVE, UNPAIRED = "decided", "inconclusive", "unpaired"
#: The paired seed interval's confidence (two-sided).
CONFIDENCE = 0.95
#: Metrics in the order the ranking uses them, and whether a larger value is better.
METRICS = (("accuracy", True), ("loss", False))


def paired_interval(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """The two-sided 95% Student-t interval of the mean per-seed difference a − b (seeds − 1
    degrees of freedom).

    Args:
        a: one arm's final metric per seed.
        b: the other arm's, in the same seed order.

    Returns:
        (low, high), or None with fewer than two seeds (no interval).
    """
    from scipy.stats import t as student_t  # lazy: scipy's import slows every CLI start

    d = np.asarray(a, float) - np.asarray(b, float)
    if len(d) < 2:
        return None
    half = student_t.ppf(0.5 + CONFIDENCE / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return float(d.mean() - half), float(d.mean() + half)


def seeds_to_separate(a: list[float], b: list[float]) -> int | None:
    """The seeds at which the paired interval of a − b would exclude 0 if the per-seed spread and
    mean difference stayed as measured: n·(half-width / |mean|)², rounded up (the t quantile
    shrinks too, so this errs high). None when the mean difference is 0 (no seed count helps)."""
    interval = paired_interval(a, b)
    if interval is None:
        return None
    mean, half = (interval[0] + interval[1]) / 2, (interval[1] - interval[0]) / 2
    if abs(mean) < 1e-15:
        return None
    return max(len(a) + 1, math.ceil(len(a) * (half / abs(mean)) ** 2))


def verdict(entry: dict, *, rounds: int, users: int, epsilon: float) -> dict:
    """The verdict of one ε of a comparison.

    Args:
        entry: the ε's entry of ``comparison.json`` (``arms``: name → mean ``accuracy`` and
            ``loss`` and ``per_seed`` results with ``seed``, ``accuracy`` and ``loss``).
        rounds: the rounds each arm trained.
        users: the users of the task.
        epsilon: the ε of the entry.

    Returns:
        ``{"status", "metric", "ranking", "nonprivate_beaten_by", "ties", "seeds", "reasons",
        "suggestions"}``: ``status`` is ``decided``, ``inconclusive`` or ``unpaired`` (one seed,
        non-private training ahead); ``ranking`` the private arms by mean ``metric``, best first;
        ``ties`` the neighbouring pairs whose paired interval contains 0.
    """
    arms = entry["arms"]
    private = [n for n in arms if n != "nonprivate"]
    metrics = [(m, up) for m, up in METRICS if all(arms[n][m] is not None for n in arms)]
    if not metrics:
        return _no_metric(private)
    metric, up = metrics[0]
    values = {n: _per_seed(arms[n], metric) for n in arms}
    seeds = sorted(set.intersection(*(set(v) for v in values.values())))
    beaten = {
        m: [n for n in private if not _better(arms["nonprivate"][m], arms[n][m], up)]
        for m, up in metrics
    }
    beaten = {m: names for m, names in beaten.items() if names}
    ranking = sorted(private, key=lambda n: arms[n][metric], reverse=up)
    ties = []
    for a, b in zip(ranking, ranking[1:], strict=False):
        x, y = [values[a][s] for s in seeds], [values[b][s] for s in seeds]
        interval = paired_interval(x, y)
        if interval is not None and interval[0] <= 0 <= interval[1]:
            ties.append(
                {
                    "arms": [a, b],
                    "difference": float(np.mean(x) - np.mean(y)),
                    "interval": list(interval),
                    "seeds_to_separate": seeds_to_separate(x, y),
                }
            )
    reasons = [_nonprivate_reason(arms, beaten, rounds, users)] if beaten else []
    reasons += [_tie_reason(t, metric) for t in ties]
    if len(seeds) < 2:
        reasons.append(
            "one seed: there is no paired seed interval, so the ranking is unpaired (one draw of "
            "data and noise; it may not repeat)"
        )
    status = INCONCLUSIVE if beaten or ties else UNPAIRED if len(seeds) < 2 else DECIDED
    return {
        "status": status,
        "metric": metric,
        "ranking": ranking,
        "nonprivate_beaten_by": beaten,
        "ties": ties,
        "seeds": len(seeds),
        "reasons": reasons,
        "suggestions": _suggestions(bool(beaten), ties, len(seeds), rounds, users, epsilon),
    }


def _no_metric(private: list[str]) -> dict:
    return {
        "status": INCONCLUSIVE,
        "metric": None,
        "ranking": private,
        "nonprivate_beaten_by": {},
        "ties": [],
        "seeds": 0,
        "reasons": ["no arm has a held-out metric to compare (no evaluation set)"],
        "suggestions": ["evaluate on held-out data (a task with an evaluation set)"],
    }


def _per_seed(arm: dict, metric: str) -> dict[int, float]:
    return {r["seed"]: r[metric] for r in arm["per_seed"] if r[metric] is not None}


def _better(a: float, b: float, up: bool) -> bool:
    """a strictly better than b."""
    return a > b if up else a < b


def _nonprivate_reason(arms: dict, beaten: dict[str, list[str]], rounds, users) -> str:
    parts = [
        f"in {m} ({arms['nonprivate'][m]:.4f}) "
        + ", ".join(f"{n} ({arms[n][m]:.4f})" for n in names)
        for m, names in beaten.items()
    ]
    return (
        f"non-private training does not beat every private arm: {'; '.join(parts)}. After "
        f"{rounds} rounds with {users} users the models have not learned past the noise, so the "
        "private arms' order says nothing about their mechanisms (too few rounds or users for "
        "this data)"
    )


def _tie_reason(tie: dict, metric: str) -> str:
    a, b = tie["arms"]
    lo, hi = tie["interval"]
    return (
        f"{a} and {b} differ by {tie['difference']:+.4f} in mean {metric}, inside their paired 95% "
        f"seed interval [{lo:+.4f}, {hi:+.4f}]"
    )


def _suggestions(beaten: bool, ties: list[dict], seeds: int, rounds, users, epsilon) -> list[str]:
    out = []
    if beaten:
        out.append(
            f"train longer (--rounds {2 * rounds}) or on more users where the data has them "
            f"(--users {2 * users}), until non-private training beats every private arm"
        )
    if seeds < 2:
        out.append("run 3 or more seeds (--seeds 3) for a paired 95% interval")
    if ties:
        needed = [t["seeds_to_separate"] for t in ties if t["seeds_to_separate"] is not None]
        if needed:
            out.append(
                f"more seeds (--seeds {max(needed)}: where the measured spread would separate the "
                "tied arms)"
            )
        out.append(
            f"a smaller ε (--epsilons {epsilon / 4:g}): the noise, and with it the difference "
            "between mechanisms, grows as ε shrinks"
        )
    return out


def verdict_lines(entry: dict) -> list[str]:
    """The verdict of one ε as table lines (indented two spaces)."""
    v = entry["verdict"]
    order = " > ".join(v["ranking"])
    if v["status"] == DECIDED:
        return [f"  verdict: decided — by mean {v['metric']}, paired 95% seed intervals: {order}"]
    head = "INCONCLUSIVE" if v["status"] == INCONCLUSIVE else "UNPAIRED"
    lines = [f"  verdict: {head} — ranking by mean {v['metric']} {order}, not a finding:"]
    lines += [f"    - {r}" for r in v["reasons"]]
    lines += [f"    to decide: {s}" for s in v["suggestions"]]
    return lines


def undecided(result: dict) -> list[str]:
    """``ε = <key>: <status>`` for every ε of ``result`` that is not decided."""
    return [
        f"ε = {key}: {e['verdict']['status']}"
        for key, e in result["epsilons"].items()
        if e["verdict"]["status"] != DECIDED
    ]
