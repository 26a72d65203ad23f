"""Deprecated spellings: flags and values an earlier release published, kept working for one more.

Every concept has one flag across the commands (``--users``, ``--model-dim``, ``--cohort``,
``--epsilons`` for compare's list of ε, ``--target-epsilon`` where a command takes one ε, and
``--verbose/--quiet`` for verbosity). An old spelling is rewritten to the new one before click
parses the command line, with a warning on stderr naming the new flag: none is refused, and
``--help`` shows only the new names (the old ones are not options at all). Giving one setting under
two spellings is refused (exit 2), since click would silently keep the last.

``--participation min-sep`` was published by the first ``corrflow factorize`` (the factorization
library's b-min-separation participation: at most k participations, any two at least b rounds
apart). That is today's ``bminsep``: its factorization is built, and its sensitivity bounded, over
every b-separated pattern (`corrflow.planning.run.participation_of`). The other readings are
weaker for a non-banded factorization: ``fixed-epoch`` bounds the sensitivity over the fixed
(k, n/k) patterns only, a subset of the b-separated ones; ``cyclic-poisson``, which 002 App. D
also calls b-min-sep, is accounted with amplification (MMCC) where ``bminsep``'s Monte Carlo (004)
does not apply and ``bminsep`` falls back to the unamplified bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import click
import typer
from typer.core import TyperCommand

#: Old flag → new flag, per command (the command's name as ``corrflow COMMAND`` spells it).
RENAMED_FLAGS: dict[str, dict[str, str]] = {
    "plan": {
        "--population": "--users",
        "--num-users": "--users",
        "--model-params": "--model-dim",
        "--cohort-size": "--cohort",
    },
    "compare": {
        "--epsilon": "--epsilons",
        "--target-epsilon": "--epsilons",
        "--num-users": "--users",
    },
    "simulate": {"--num-users": "--users"},
    "audit": {"--num-users": "--users"},
}

#: (flag, old value) → new value, for the commands taking the flag.
RENAMED_VALUES: dict[tuple[str, str], tuple[str, str]] = {
    ("--participation", "min-sep"): (
        "bminsep",
        "it named b-min-separation (at most k participations, any two at least b rounds apart), "
        "as the first `corrflow factorize` published it; bminsep builds and bounds the "
        "factorization over every b-separated pattern, as min-sep did, never over the fixed-epoch "
        "patterns only",
    ),
}


def rewrite(
    args: Sequence[str], renamed: dict[str, str], values: dict[tuple[str, str], tuple[str, str]]
) -> tuple[list[str], list[str]]:
    """The command line with every deprecated spelling replaced, and one warning per replacement.

    Args:
        args: the command's arguments, as click receives them.
        renamed: old flag → new flag.
        values: (flag, old value) → (new value, why), compared case-insensitively.

    Returns:
        The rewritten arguments, and the warnings to print.

    Raises:
        click.UsageError: one setting given under two spellings, at least one of them old.
    """
    out: list[str] = []
    warnings: list[str] = []
    spellings: dict[str, list[str]] = {}
    pending: str | None = None  # a flag whose value is the next argument
    for i, arg in enumerate(args):
        if arg == "--":
            out += args[i:]
            break
        if pending is not None:
            out.append(_new_value(pending, arg, values, warnings))
            pending = None
            continue
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--"):
            out.append(arg)
            continue
        new = renamed.get(flag, flag)
        if new != flag:
            warnings.append(f"warning: {flag} is deprecated: use {new}")
        spellings.setdefault(new, []).append(flag)
        if any(f == new for (f, _) in values):
            if eq:
                value = _new_value(new, value, values, warnings)
            else:
                pending = new
        out.append(f"{new}={value}" if eq else new)
    for new, used in spellings.items():
        if len(used) > 1 and any(u != new for u in used):
            raise click.UsageError(
                f"{' and '.join(dict.fromkeys(used))} both set {new}: give {new} once"
            )
    return out, warnings


def _new_value(
    flag: str, value: str, values: dict[tuple[str, str], tuple[str, str]], warnings: list[str]
) -> str:
    """``value`` of ``flag``, or its replacement (with a warning saying why)."""
    hit = values.get((flag, value.lower()))
    if hit is None:
        return value
    warnings.append(f"warning: {flag} {value} is deprecated: use {flag} {hit[0]} ({hit[1]})")
    return hit[0]


class AliasedCommand(TyperCommand):
    """A command that accepts the deprecated spellings of `RENAMED_FLAGS` and `RENAMED_VALUES`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        renamed = RENAMED_FLAGS.get(ctx.info_name or "", {})
        args, warnings = rewrite(args, renamed, RENAMED_VALUES)
        for line in warnings:
            typer.echo(line, err=True)
        return super().parse_args(ctx, args)
