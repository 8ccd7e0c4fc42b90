"""`python -m tests.fuzz --examples N --seed S`: a fuzz campaign (docs/FUZZING.md)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .campaign import Campaign, parse_features, read_record, run_dist, shrink_groups, summary
from .check import run_example
from .grammar import FEATURES, parse
from .shrink import program_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    p.add_argument("--examples", type=int, default=100, help="in-process examples (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first example index")
    p.add_argument(
        "--features", help=f"comma-separated features to enable (default all): {', '.join(FEATURES)}"
    )
    p.add_argument("--without", help="comma-separated features to disable")
    p.add_argument("--dist", type=int, default=0, help="multi-rank examples, all in one torchrun launch")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the multi-rank launch (2 or 4)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes for in-process examples")
    p.add_argument("--no-shrink", action="store_true")
    p.add_argument("--shrink-budget", type=int, default=60, help="runs per failure group")
    p.add_argument("--shrink-groups", type=int, help="shrink only this many of the largest groups")
    p.add_argument("--replay", help="an Example(...) as printed: run it and print its outcome")
    p.add_argument("--record", type=Path, help="append a JSON line per example to this file")
    p.add_argument("--summarize", type=Path, help="summarize (and shrink) a --record file instead of running")
    p.add_argument("--deadline-s", type=float, help="start no in-process example after this many seconds")
    args = p.parse_args(argv)
    if args.replay:
        ex = parse(args.replay)
        print(program_text(ex))
        if ex.dp * ex.pp > 1:
            (o,) = run_dist([ex], Path(tempfile.mkdtemp(prefix="fpipe-fuzz-replay-")), ex.dp * ex.pp)
        else:
            o = run_example(ex)
        print(o)
        return 1 if o.status == "fail" else 0
    if args.summarize:
        results = read_record(args.summarize)
        print(summary(results))
        if not args.no_shrink:
            shrink_groups(results, args.ranks, args.shrink_budget, most=args.shrink_groups)
        return 1 if any(r.outcome.status == "fail" for r in results) else 0
    feats = parse_features(args.features, args.without)
    print(f"fuzz: seed {args.seed}, examples {args.start}..{args.start + args.examples - 1}"
          f"{f' + {args.dist} on {args.ranks} ranks' if args.dist else ''}, features: {', '.join(sorted(feats))}")  # fmt: skip
    c = Campaign(args.seed, feats, args.examples, args.start, args.dist, args.ranks, args.jobs, record=args.record,
                 deadline_s=args.deadline_s)  # fmt: skip
    results = c.run()
    print(summary(results))
    if not args.no_shrink:
        shrink_groups(results, args.ranks, args.shrink_budget, most=args.shrink_groups)
    return 1 if any(r.outcome.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
