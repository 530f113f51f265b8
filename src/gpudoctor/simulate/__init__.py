"""``gpudoctor trace --simulate``: run a script on GPUs you don't have (fake tensors, modelled allocator).

Python API: :class:`Simulation` (a context manager), :func:`parse_spec` (``"2xT4"`` -> cards) and
:func:`simulate_step` (one model, one batch, N optimizer steps -> per-device peaks by category).
"""

from gpudoctor.simulate.cards import CARDS, Card, UnknownCard, format_table, parse_spec
from gpudoctor.simulate.session import Simulation, SimulationStopped


def simulate_step(*args, **kwargs):
    """See :func:`gpudoctor.simulate.step.simulate_step` (imported lazily: it needs transformers)."""
    from gpudoctor.simulate.step import simulate_step as run

    return run(*args, **kwargs)


__all__ = ["CARDS", "Card", "UnknownCard", "format_table", "parse_spec", "Simulation", "SimulationStopped", "simulate_step"]
