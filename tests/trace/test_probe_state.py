"""The probe's own state: per-thread correctness (11.19), nothing held per call, bookkeeping only at a module's first
call (10.9: the cost is paid at failure), ids of freed models forgotten (a fresh model per fold is a new root)."""

import gc
import threading
import weakref

import torch
import torch.nn as nn

from gpudoctor.trace.api import Probe


def test_threads_keep_their_own_module_paths_and_hold_no_inputs():
    """11.19: no shared call stack: three threads x 600 calls leave nothing behind, and a failure in one thread
    is attributed to that thread's module."""
    good = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    bad = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(3, 3)))
    inputs, errors = [], []

    def loop(model, fails):
        for _ in range(600):
            x = torch.randn(4, 8)
            inputs.append(weakref.ref(x))
            try:
                model(x)
            except RuntimeError as exc:
                errors.append(exc)
                if not fails:
                    raise

    with Probe(good, bad, print_on_error=False) as probe:
        threads = [threading.Thread(target=loop, args=(m, m is bad)) for m in (good, good, bad)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 600
        exc = errors.pop()
        errors.clear()
        failure = probe.report(exc)["failure"]
    assert failure["module"]["path"] == "1.1" and [f["path"] for f in failure["module_stack"]] == ["", "1", "1.1"]
    assert probe.forward_calls == 2 * 600 * 4 + 600 * 5
    del exc, failure
    gc.collect()
    assert not [ref for ref in inputs if ref() is not None]  # the probe holds no module inputs


def test_only_a_modules_first_call_does_bookkeeping(monkeypatch):
    """Steady-state calls cost a counter and a set lookup; what the report needs is read at failure."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    probe = Probe(print_on_error=False)
    seen = []
    original = Probe._call_bookkeeping
    monkeypatch.setattr(Probe, "_call_bookkeeping", lambda self, module: (seen.append(module), original(self, module)))
    with probe:
        for _ in range(10):
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen == list(model.modules()) and probe.forward_calls == 40
    assert [type(m).__name__ for m in probe.root_models()] == ["Sequential"]
    assert {probe.names[id(m)] for m in model.modules()} == {"", "0", "1", "2"}


def test_a_fresh_model_per_fold_is_a_new_root():
    """A k-fold loop frees each fold's model: a later model reusing an id is named and checked afresh."""
    with Probe(print_on_error=False) as probe:
        for _ in range(4):
            model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            model(torch.randn(1, 2))
            del model
            gc.collect()
        last = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
        last(torch.randn(1, 2))
    assert probe.root_models() == [last]
    assert {probe.names[id(m)] for m in last.modules()} == {"", "0", "1"}
    assert len(probe.settled) == 3
