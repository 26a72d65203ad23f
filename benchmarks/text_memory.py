"""Peak memory of a Keras next-word simulation at the papers' scale: a 10,000-word vocabulary (+ 4
special tokens) on a TFF-format StackOverflow SQLite with ≥ 500 train users and ≥ 4,000 held-out
sequences (target: ≤ 4 GB peak RSS for the whole simulation).

    PYTHONPATH=$PWD python benchmarks/text_memory.py [--users 1500] [--rounds 2] [--client keras]
    [--keep DIR]

Writes the file with ``corrflow data generate``'s generator (40% of users train, 50% held out, 10%
test, so the held-out split is large), a public 10,000-word vocabulary (the generator's lexicon
head: public, not counted from the private data), then runs ``corrflow simulate --data … --backend
inprocess`` under ``/usr/bin/time -v`` (one process: server, clients and evaluation together) and
prints one JSON object: the peak RSS, the held-out size, and the ratio against the peer — the logits
the unbatched evaluation held at once (sequences × seq_len × tokens × float32), which is what
OOM-killed earlier runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--users", type=int, default=1500, help="generated users (40%% train, 50%% held out)"
    )
    ap.add_argument("--train-users", type=int, default=500, help="--users of the simulation")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--client", default="keras", choices=("keras", "nextword"))
    ap.add_argument("--vocab-size", type=int, default=10_000)
    ap.add_argument("--keep", type=Path, default=None, help="directory to keep the data and run in")
    args = ap.parse_args()

    from corrflow.data.federated import TextSource
    from corrflow.data.lexicon import synthetic_word
    from corrflow.data.stackoverflow import StackOverflowSpec, generate_stackoverflow
    from corrflow.data.vocab import Vocabulary

    work = args.keep or Path(tempfile.mkdtemp(prefix="corrflow-textmem-"))
    work.mkdir(parents=True, exist_ok=True)
    data, vocab = work / "so.sqlite", work / "vocab.txt"
    started = time.perf_counter()
    if not data.exists():
        generate_stackoverflow(
            data, StackOverflowSpec(users=args.users, seed=0, split_fractions=(0.4, 0.5, 0.1))
        )
    words = list(dict.fromkeys(synthetic_word(i) for i in range(args.vocab_size + 100)))[
        : args.vocab_size
    ]
    Vocabulary(words, 1, {"source": "public"}).save(vocab)
    source = TextSource(str(data), str(vocab))
    held = len(source.held_out())
    train = len(source.train_clients)
    gen_seconds = time.perf_counter() - started

    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "corrflow.cli",
        "simulate",
        "--data",
        str(data),
        "--vocab",
        str(vocab),
        "--client",
        args.client,
        "--users",
        str(min(args.train_users, train)),
        "--rounds",
        str(args.rounds),
        "--backend",
        "inprocess",
        "--fresh",
        "--out",
        str(work / "run"),
        "--json",
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    cpu = sum(
        float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", proc.stderr)
    )
    if rss is None or proc.returncode not in (0, 3):
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"the simulation failed (exit {proc.returncode})")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = int(rss.group(1)) * 1024
    tokens = source.num_tokens
    unbatched = held * source.seq_len * tokens * 4
    print(
        json.dumps(
            {
                "client": args.client,
                "vocabulary_tokens": tokens,
                "train_users": min(args.train_users, train),
                "file_train_clients": train,
                "held_out_sequences": held,
                "rounds": args.rounds,
                "peak_rss_bytes": peak,
                "peak_rss_gib": round(peak / 2**30, 3),
                "target_bytes": 4 * 10**9,
                "meets_target": peak <= 4 * 10**9,
                "peer_unbatched_eval_logits_bytes": unbatched,
                "ratio_peak_to_peer": round(peak / unbatched, 4),
                "held_out": report.get("held_out"),
                "wall_seconds": round(wall, 1),
                "cpu_seconds": round(cpu, 1),
                "data_seconds": round(gen_seconds, 1),
                "exit_code": proc.returncode,
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
