"""Start-up cost of the CLI: wall time of `corrflow --help`, an argument error, `factorize` and
`account` on a small problem (median of --repeat runs, fresh interpreters). Targets (2
cores): --help and argument errors < 1 s, factorize < 1.5 s, account < 2.5 s (dp-accounting alone
imports in about 1.1 s).

Usage: python benchmarks/cli.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def timed(args: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "corrflow.cli", *args], capture_output=True, check=False
        )
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    repeat = ap.parse_args().repeat
    fac = os.path.join(tempfile.mkdtemp(prefix="corrflow-cli-"), "t.npz")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "corrflow.cli",
            "factorize",
            "--kind",
            "toeplitz",
            "--rounds",
            "20",
            "--epochs",
            "2",
            "--quiet",
            "--out",
            fac,
        ],
        check=True,
        capture_output=True,
    )
    results = {
        "help_seconds": timed(["--help"], repeat),
        "argument_error_seconds": timed(
            ["factorize", "--kind", "nonsense", "--rounds", "20"], repeat
        ),
        "factorize_seconds": timed(
            ["factorize", "--kind", "toeplitz", "--rounds", "20", "--epochs", "2", "--quiet"],
            repeat,
        ),
        "account_seconds": timed(
            ["account", "--factorization", fac, "--delta", "1e-5", "--noise-multiplier", "1"],
            repeat,
        ),
    }
    targets = {
        "help_seconds": 1.0,
        "argument_error_seconds": 1.0,
        "factorize_seconds": 1.5,
        "account_seconds": 2.5,
    }
    print(
        json.dumps(
            {
                "benchmark": "cli",
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg()[0],
                **results,
                "targets": targets,
                "within_target": {k: results[k] < v for k, v in targets.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
