"""Trace diagnosis quality on tests/trace/cases: right module, line, cause and fix, controls clean, crashes.

    PYTHONPATH=src python benchmarks/trace_quality.py [--workers N] [case_name ...]

Each case is a small script reconstructed from a public bug report (tiny HF models built from configs, virtual GPUs)
that declares the expected report in its header; see tests/trace/cases/scoring.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "trace", "cases"))

from scoring import SCORES, load_cases, run_all, totals  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    cases = load_cases(args.names or None)
    start = time.perf_counter()
    outcomes = run_all(cases, args.workers)
    elapsed = time.perf_counter() - start
    for outcome in outcomes:
        marks = " ".join(f"{k}:{'ok' if outcome.scores[k] else 'NO'}" for k in SCORES if k in outcome.scores)
        print(f"{outcome.case.name:45s} {outcome.case.kind:8s} {marks}")
        for problem in outcome.problems:
            print(f"    - {problem}")
    result = totals(outcomes)
    print()
    print(f"cases: {len(outcomes)} ({sum(o.case.kind == 'failure' for o in outcomes)} failures, "
          f"{sum(o.case.kind == 'silent' for o in outcomes)} silent, {sum(o.case.kind == 'clean' for o in outcomes)} controls)"
          f" in {elapsed:.0f} s")
    for key in SCORES:
        good, total = result[key]
        print(f"right {key:7s} {good}/{total}")
    print(f"controls clean {result['controls_clean'][0]}/{result['controls_clean'][1]}, crashes {result['crashes']}, "
          f"exit code and traceback kept {result['behaviour_kept'][0]}/{result['behaviour_kept'][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
