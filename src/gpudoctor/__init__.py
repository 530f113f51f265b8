"""gpudoctor: find the real cause of device, offload and memory failures in PyTorch training.

Importing this package is cheap: it never imports torch. The runtime probe is reached lazily
through ``gpudoctor.watch`` / ``gpudoctor.Probe``.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "watch": "gpudoctor.trace.api",
    "Probe": "gpudoctor.trace.api",
}


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'gpudoctor' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)


def load_ipython_extension(ipython) -> None:  # pragma: no cover - exercised through IPython
    """``%load_ext gpudoctor`` registers the ``%%gpudoctor`` cell magic."""
    from gpudoctor.trace.magic import load_ipython_extension as _load

    _load(ipython)
