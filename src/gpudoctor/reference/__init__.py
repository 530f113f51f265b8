"""Reference LoRA fine-tuning trainer: the fixed counterpart of the field-report scripts.

``train(TrainConfig(...))`` runs the whole pipeline (place, LoRA, train, evaluate, save, reload,
generate) and returns a ``TrainResult``. Attributes are imported lazily so that importing this
package, or its CLI module, does not import torch.
"""

from __future__ import annotations

_LAZY = {
    "TrainConfig": "gpudoctor.reference.trainer",
    "TrainResult": "gpudoctor.reference.trainer",
    "train": "gpudoctor.reference.trainer",
    "load_trained": "gpudoctor.reference.trainer",
    "plan_placement": "gpudoctor.reference.placement",
    "Block": "gpudoctor.reference.placement",
    "PlacementError": "gpudoctor.reference.placement",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'gpudoctor.reference' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
