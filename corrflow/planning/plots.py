"""PNG plots of a plan: RMSE against bands per accountant, with the rule of thumb bands ≈ ε√n/k (as
001 Fig. 2: McKenna, "Scaling up the Banded Matrix Factorization Mechanism for Differentially
Private ML", arXiv 2405.15913), per-iterate error of the top candidates (as 000 Fig. 4:
Choquette-Choo et al., "Multi-Epoch Matrix Factorization Mechanisms for Private Machine Learning",
arXiv 2211.06530), and ε against σ for the recommended recipe and DP-SGD."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from corrflow.accounting.accountant import AccountingOptions, accountant_for
from corrflow.fileio import copy_file, save_figure
from corrflow.planning.cache import cache_key
from corrflow.planning.candidates import sampling_of
from corrflow.progress import Progress

#: The line style of each accountant in a plot whose colours are the factorization kinds.
_ACCOUNTANT_STYLES = {"unamplified": "-", "cyclic-poisson": "--", "monte-carlo": "-.", "mmcc": ":"}

#: Plot name → the PNG file it is written to.
NAMES = {
    "rmse_vs_bands": "rmse_vs_bands.png",
    "per_iterate_error": "per_iterate_error.png",
    "epsilon_vs_sigma": "epsilon_vs_sigma.png",
}


def write_plots(result, out: Path, *, cache=None, quiet: bool = False) -> dict:
    """Write the three plots of a plan into ``out``.

    With a cache, plots of identical plan data are copied from it instead of drawn again
    (atomically, both ways).

    Args:
        result: the plan (`corrflow.planning.candidates.PlanResult`: request, ranked candidates,
            their factorizations and the recommended one).
        out: an existing directory.
        cache: a `corrflow.planning.cache.PlanCache`, or None.
        quiet: no progress bar.

    Returns:
        ``{plot name: file name in out}`` for the names of `NAMES`.
    """
    from dataclasses import asdict

    if cache is None:
        return _draw(result, out, None, quiet)
    req = asdict(result.request)
    req.pop("time_budget")
    volatile = {
        "cached": None,
        "build_seconds": None,
        "calibration_seconds": None,
        "noise_seconds_per_round": None,
        "fits": None,
        "rank": None,
        "over_budget": None,
    }  # what the plots do not show
    key = cache_key(
        {
            "version": 3,  # 3: one colour per kind, merged identical curves
            "plots": [c.to_dict() | volatile for c in result.candidates],
            "request": req,
            "recommended": None if result.recommended is None else result.recommended.label(),
        }
    )
    stored = cache.root / f"plots-{key}"
    if all((stored / f).is_file() for f in NAMES.values()):
        for f in NAMES.values():
            copy_file(stored / f, out / f)
        return dict(NAMES)
    files = _draw(result, out, cache, quiet)
    stored.mkdir(exist_ok=True)
    for f in NAMES.values():
        copy_file(out / f, stored / f)  # atomic: a torn PNG must never be served from the cache
    return files


def _draw(result, out: Path, cache, quiet: bool) -> dict:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    files = {}
    if not quiet:
        import sys

        print(f"plan: drawing {len(NAMES)} plots into {out}", file=sys.stderr, flush=True)
    with Progress("plan: plots", total=3, quiet=quiet, unit="plots") as tick:
        files["rmse_vs_bands"] = _rmse_vs_bands(plt, result, out / NAMES["rmse_vs_bands"])
        tick(1)
        files["per_iterate_error"] = _per_iterate(plt, result, out / NAMES["per_iterate_error"])
        tick(2)
        files["epsilon_vs_sigma"] = _epsilon_vs_sigma(
            plt, result, out / NAMES["epsilon_vs_sigma"], cache
        )
        tick(3)
    return files


def kind_colour(kind: str) -> str:
    """The one colour of a factorization kind in every plot of a plan (DP-SGD black, the others
    matplotlib's ten-colour cycle in the registry's order), so an arm keeps its colour across panels
    and files.

    Args:
        kind: a factorization kind (`corrflow.factorization.registry.KINDS`).

    Returns:
        A matplotlib colour.
    """
    from corrflow.factorization.registry import KINDS

    others = [k for k in KINDS if k != "dpsgd"]
    if kind == "dpsgd":
        return "black"
    return f"C{others.index(kind) % 10}" if kind in others else "grey"


def _legend_below(ax, entries: int) -> None:
    """The legend under the axes, never over a line."""
    ax.legend(
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=min(3, max(entries, 1)),
        frameon=False,
    )


def _rmse_vs_bands(plt, result, path: Path) -> str:
    req = result.request
    accs = sorted({c.accountant for c in result.candidates})
    fig, axes = plt.subplots(1, len(accs), figsize=(5 * len(accs), 5), squeeze=False, sharey=True)
    for ax, acc in zip(axes[0], accs, strict=True):
        mine = [c for c in result.candidates if c.accountant == acc]
        for kind in sorted({c.kind for c in mine}):
            best: dict = {}  # the best sampler for each band count
            for c in mine:
                if c.kind == kind:
                    best[c.bands] = min(best.get(c.bands, np.inf), c.rmse)
            pts = sorted(best.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
            if pts and pts[0][0] is not None and len(pts) > 1:
                ax.plot(
                    [p for p, _ in pts],
                    [r for _, r in pts],
                    marker="o",
                    label=kind,
                    color=kind_colour(kind),
                )
            else:
                ax.axhline(
                    min(r for _, r in pts), linestyle="--", label=kind, color=kind_colour(kind)
                )
        ax.axvline(req.rule_of_thumb(), color="grey", linestyle=":", label="ε√n/k")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bands")
        ax.set_title(f"accountant: {acc}")
        _legend_below(ax, len(ax.get_lines()))
    axes[0][0].set_ylabel(f"RMSE at ε = {req.target_epsilon:g}")
    fig.suptitle(f"n = {req.rounds}, b = {req.min_sep}, k = {req.epochs}, δ = {req.delta:g}")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path.name


def _top(result, count: int = 4):
    seen, out = set(), []
    for c in result.candidates:
        if c.key() in result.factorizations and (c.kind, c.accountant) not in seen:
            seen.add((c.kind, c.accountant))
            out.append(c)
        if len(out) == count:
            break
    dpsgd = next((c for c in result.candidates if c.kind == "dpsgd"), None)
    if dpsgd is not None and dpsgd not in out:
        out.append(dpsgd)
    return out


def _per_iterate(plt, result, path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 5))
    drawn: list[
        tuple[np.ndarray, list]
    ] = []  # one curve per distinct error profile, its candidates
    for c in _top(result):
        fac = result.factorizations[c.key()]
        err = c.noise_multiplier * np.sqrt(fac.per_query_error())
        same = next((d for d in drawn if np.allclose(d[0], err, rtol=1e-6, atol=0.0)), None)
        if same is None:
            drawn.append((err, [c]))
        else:
            same[1].append(c)  # identical curves: one line whose label names them all
    for i, (err, cands) in enumerate(drawn):
        lead = cands[0]
        ax.plot(
            np.arange(1, len(err) + 1),
            err,
            label=" = ".join(c.label() for c in cands),
            color=kind_colour(lead.kind),
            linestyle=_ACCOUNTANT_STYLES.get(lead.accountant, "-"),
            marker="os^Dv"[i % 5],
            markevery=(i, max(1, len(err) // 8)),  # offset markers: near curves stay apart
            markersize=4,
        )
    ax.set_xlabel("round")
    ax.set_ylabel("per-iterate error (std per coordinate)")
    ax.set_title(f"top candidates at ε = {result.request.target_epsilon:g}")
    _legend_below(ax, len(drawn))
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path.name


def _epsilon_vs_sigma(plt, result, path: Path, cache) -> str:
    from dataclasses import asdict

    req = result.request
    fig, ax = plt.subplots(figsize=(6, 5))
    picks = [
        c
        for c in (
            result.recommended,
            next((c for c in result.candidates if c.kind == "dpsgd"), None),
        )
        if c
    ]
    for i, c in enumerate(picks):
        if any(c is other for other in picks[:i]):
            continue
        fac = result.factorizations[c.key()]
        sigmas = [c.noise_multiplier]
        if c.accountant in (
            "unamplified",
            "cyclic-poisson",
        ):  # cheap: a curve; others: the calibrated point
            sigmas = list(c.noise_multiplier * np.geomspace(0.5, 2.0, 5))
        spec = sampling_of(req, c.accountant, c.min_sep)
        acc = accountant_for(spec, AccountingOptions(mc_samples=req.mc_samples))

        def eps(s, fac=fac, acc=acc, c=c, spec=spec):
            if s == c.noise_multiplier:  # the calibrated point: the ε the plan table reports
                return c.epsilon
            # the curve's other points: the accountant's coarse bound (still an upper bound, a few
            # times cheaper)
            if cache is None:
                return acc.epsilon(fac, s, req.delta, coarse=True).epsilon
            params = {
                "epsilon_of": fac.sha256(),
                "accountant": c.accountant,
                "sigma": float(s),
                "delta": req.delta,
                "participation": fac.participation.to_dict(),
                "sampling": asdict(spec),
                "coarse": True,
            }
            return cache.calibration(
                params, lambda: {"epsilon": acc.epsilon(fac, s, req.delta, coarse=True).epsilon}
            )[0]["epsilon"]

        ax.plot(
            sigmas,
            [eps(s) for s in sigmas],
            marker="o",
            label=c.label(),
            color=kind_colour(c.kind),
            linestyle=_ACCOUNTANT_STYLES.get(c.accountant, "-"),
        )
    ax.axhline(req.target_epsilon, color="grey", linestyle=":", label="target ε")
    ax.set_xlabel("noise multiplier σ")
    ax.set_ylabel(f"ε at δ = {req.delta:g}")
    ax.set_yscale("log")
    _legend_below(ax, len(ax.get_lines()))
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)
    return path.name


def write_run_plot(metrics: list[dict], report: dict, path: Path) -> Path:
    """A finished run's ``run.png``: held-out loss per round and ε spent after each round against
    the run's target, from its ``metrics.json`` and ``privacy_report.json``. Rounds are counted from
    1 as on the console (metrics.json's 0-based round + 1; 0 is the initial model).

    Args:
        metrics: the run's metrics.json (one entry per round; round −1 the initial evaluation).
        report: the run's privacy report.
        path: the PNG written.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, eps_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    evaluated = [m for m in metrics if m.get("test_loss") is not None]
    loss_ax.plot(
        [m["round"] + 1 for m in evaluated], [m["test_loss"] for m in evaluated], marker="."
    )
    loss_ax.set_xlabel("round (0: the initial model)")
    loss_ax.set_ylabel("held-out loss")
    spent = [m for m in metrics if m.get("epsilon") is not None]
    total, realized = report.get("total") or {}, report.get("realized") or {}
    # a DP vocabulary's (ε, δ) is composed into the total: shown on top of each round's training ε
    vocab = 0.0
    if total.get("includes_vocabulary") and None not in (
        total.get("epsilon"),
        realized.get("epsilon"),
    ):
        vocab = total["epsilon"] - realized["epsilon"]
    if spent:
        eps_ax.plot(
            [m["round"] + 1 for m in spent],
            [m["epsilon"] + vocab for m in spent],
            marker=".",
            label="ε spent" + (f" (with the vocabulary's {vocab:g})" if vocab else ""),
        )
    target = (total if vocab else report).get("epsilon" if vocab else "target_epsilon")
    if target is not None:
        eps_ax.axhline(
            target,
            color="black",
            linestyle="--",
            linewidth=1,
            label="total ε" if vocab else "target ε",
        )
    eps_ax.set_xlabel("round")
    eps_ax.set_ylabel(f"ε at δ = {(total if vocab else report).get('delta', 0):g}")
    eps_ax.legend(fontsize=8)
    mech = report.get("mechanism", {})
    fig.suptitle(
        f"{mech.get('kind', '?')}, {report.get('rounds_completed', '?')} of "
        f"{mech.get('rounds', '?')} rounds, σ = {report.get('noise_multiplier', 0):.4g}"
        + (
            f", held-out loss every {every} rounds and the last"
            if (every := (report.get("evaluation") or {}).get("every", 1)) > 1
            else ""
        ),
        fontsize=9,
    )
    for ax in (loss_ax, eps_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def try_write_run_plot(metrics: list[dict], report: dict, path: Path) -> tuple[Path | None, str]:
    """`write_run_plot`, or — where the run's directory cannot be written (a read-only mount, an
    archive, another user's run) — nothing and a note that says so: the summary was still read.

    Args:
        metrics: the run's metrics.json.
        report: the run's privacy report.
        path: the PNG to write.

    Returns:
        ``(path, "")`` when written, else ``(None, the note)``.
    """
    try:
        return write_run_plot(metrics, report, path), ""
    except OSError as exc:
        return None, (
            f"note: {path.name} not written ({path.parent}: {exc.strerror or exc}); the summary "
            "above is complete (--no-plot skips the plot)"
        )
