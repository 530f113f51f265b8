"""Fixtures for the reference trainer tests: everything is built locally, nothing is downloaded."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def dialogs():
    from gpudoctor.reference.data import BUNDLED_DATA, load_dialogs

    return load_dialogs(BUNDLED_DATA)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, dialogs):
    """The built-in tiny model and its tokenizer, saved once for the session."""
    from gpudoctor.reference.model import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), [d.prompt + d.response for d in dialogs], seed=0)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """One full reference run (30 optimizer steps on the tiny model, fixed seed), shared by the tests."""
    from gpudoctor.reference.trainer import TrainConfig, train

    config = TrainConfig(output_dir=str(tmp_path_factory.mktemp("run")), steps=30, seed=0)
    return config, train(config, quiet=True)
