"""Trace quality on tests/trace/cases: each script (reconstructed from a public bug report) runs under
``gpudoctor trace --json`` in its own process and its report must name the declared module, line, cause and fix,
keep the program's exit code and traceback, and stay quiet on correct programs.

Every case costs a Python process importing torch and transformers (~10 s), so the full set is ``slow``; a
representative subset (a second model left on the CPU, a failure in the user's own code, a silent problem in a
``main()`` script, a k-fold control) runs unmarked. benchmarks/trace_quality.py prints the four scores.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cases"))

from scoring import load_cases, run_all  # noqa: E402

CASES = load_cases()
FAST = {"f05_teacher_left_on_cpu", "f07_custom_loss_on_split_outputs", "s01_optimizer_before_get_peft_model",
        "c01_kfold_fresh_model_per_fold"}


def test_the_case_set_is_complete_and_cited():
    kinds = [c.kind for c in CASES]
    assert kinds.count("failure") >= 16 and kinds.count("silent") >= 4 and kinds.count("clean") >= 4
    for case in CASES:
        with open(case.path, encoding="utf-8") as fh:
            doc = fh.read().split('"""')[1]
        assert "Source: https://" in doc, case.name
        if case.kind != "clean":
            assert case.line is not None and "cause" in case.expect and "fix" in case.expect, case.name
    assert FAST <= {c.name for c in CASES}


@pytest.fixture(scope="module")
def outcomes(request):
    """Run every selected case once, several at a time (bounded by the CPU count), before their tests look."""
    selected = {item.callspec.params["case"].name for item in request.session.items
                if getattr(item, "originalname", None) == "test_case" and hasattr(item, "callspec")}
    return {o.case.name: o for o in run_all([c for c in CASES if c.name in selected])}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=() if c.name in FAST else pytest.mark.slow) for c in CASES])
def test_case(case, outcomes):
    outcome = outcomes[case.name]
    assert outcome.ok, "\n".join(outcome.problems)
    assert outcome.kept_program_behaviour and not outcome.crashed
