"""GPU specifications (``--gpus``, ``[tool.gpudoctor] gpus``, NVML) and how GD112/GD506 use them."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from gpudoctor import hardware
from gpudoctor.check.config import Config, ConfigError
from gpudoctor.check.engine import check_source
from gpudoctor.check.registry import rule_by_code
from gpudoctor.cli import main

ROOT = Path(__file__).resolve().parents[2]
UNKNOWN = ROOT / "fixtures" / "rules" / "memory" / "gd506_unknown_hardware.py"
FITS = ROOT / "fixtures" / "rules" / "memory" / "gd506_unknown_hardware.fixed.py"


@pytest.fixture(autouse=True)
def no_assumed_hardware(monkeypatch):
    # `main` sets the run's hardware globally; every test starts and ends without one.
    monkeypatch.setattr(hardware, "_ASSUMED", None)
    hardware.local_gpus.cache_clear()
    yield
    hardware.local_gpus.cache_clear()


@pytest.mark.parametrize(
    "spec, count, label, gib",
    [
        ("2xT4", 2, "T4", 14.74),
        ("6x3070Ti", 6, "3070 Ti", 7.58),
        ("1xA100-80GB", 1, "A100-80GB", 79.2),
        ("4090", 1, "4090", 23.65),
        ("2 x Tesla T4", 2, "T4", 14.74),
        ("V100 32GB", 1, "V100-32GB", 31.7),
        ("A100 40GB", 1, "A100", 39.4),
    ],
)
def test_cards(spec, count, label, gib):
    gpus = hardware.parse_gpus(spec)
    assert (gpus.count, gpus.label) == (count, label)
    assert gpus.gib_each == pytest.approx(gib, abs=0.05)


def test_memory_sizes():
    assert hardware.parse_gpus("2x16GB").bytes_each == 16 * 10**9
    assert hardware.parse_gpus("6x8GB").count == 6
    assert hardware.parse_gpus("24GiB").bytes_each == 24 * 2**30
    # the canonical spec parses back to the same memory
    gpus = hardware.parse_gpus("2xT4")
    assert hardware.parse_gpus(gpus.spec).bytes_each == pytest.approx(gpus.bytes_each, rel=0.01)


@pytest.mark.parametrize("spec, close", [("2xT5", "T4"), ("rtx 5090", "4090"), ("A100-60GB", "A100-80GB")])
def test_unknown_card_lists_close_matches(spec, close):
    with pytest.raises(hardware.HardwareError, match=f"close matches: [^;]*{close}"):
        hardware.parse_gpus(spec)


@pytest.mark.parametrize("spec", ["", "0xT4", "x", "0GB"])
def test_bad_specs(spec):
    with pytest.raises(hardware.HardwareError):
        hardware.parse_gpus(spec)


def test_nvml_absent_means_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert hardware.local_gpus() is None


def _fake_nvml(memory, fail_init=False):
    module = types.ModuleType("pynvml")

    def init():
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    module.nvmlInit = init
    module.nvmlShutdown = lambda: None
    module.nvmlDeviceGetCount = lambda: len(memory)
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetMemoryInfo = lambda i: types.SimpleNamespace(total=memory[i])
    module.nvmlDeviceGetName = lambda i: b"Tesla T4"
    return module


def test_nvml_without_driver_means_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([], fail_init=True))
    assert hardware.local_gpus() is None


def test_nvml_devices(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([15 * 2**30, 16 * 2**30]))
    gpus = hardware.local_gpus()
    assert gpus is not None and gpus.count == 2 and gpus.bytes_each == 15 * 2**30 and gpus.detected


def test_config_key(tmp_path):
    config = Config.from_table({"gpus": "2xT4"}, tmp_path)
    assert config.gpus == "2xT4"
    assert config.cache_key() != Config.from_table({"gpus": "6x8GB"}, tmp_path).cache_key()
    with pytest.raises(ConfigError, match="close matches: T4"):
        Config.from_table({"gpus": "2xT5"}, tmp_path)
    with pytest.raises(ConfigError, match="must be a string"):
        Config.from_table({"gpus": 2}, tmp_path)


def _gd506(path: Path):
    return check_source(path.read_text(), str(path), rules=[rule_by_code("GD506")])


def test_unknown_hardware_uses_the_largest_training_card():
    (finding,) = _gd506(UNKNOWN)
    assert "~560 GB" in finding.message and "more than 80 GB, the largest GPU training usually runs on" in finding.message
    assert _gd506(FITS) == []


def test_unknown_hardware_passes_what_an_80gb_card_holds(tmp_path):
    # 7B x 4 x 2 B = ~56 GB: out of reach of a 24 GB card, but an A100/H100 80 GB holds it, and the file
    # does not say which it runs on.
    script = tmp_path / "ft.py"
    script.write_text(
        "import torch\nfrom transformers import AutoModelForCausalLM\n"
        'model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-2-7b-hf", dtype=torch.bfloat16)\n'
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)\n"
    )
    assert _gd506(script) == []
    script.write_text(script.read_text().replace("torch.bfloat16", "torch.float32"))  # ~112 GB
    (finding,) = _gd506(script)
    assert "4 x 4 B/param (`float32` weights) = ~112 GB" in finding.message


def test_declared_hardware_wins(monkeypatch):
    hardware.set_assumed(hardware.parse_gpus("2xT4", "--gpus 2xT4"))
    (finding,) = _gd506(UNKNOWN)
    assert "2 x T4 (14.7 GiB usable), from --gpus 2xT4" in finding.message
    # a 1.3B model (~10 GB) does not fit a 8 GB card
    hardware.set_assumed(hardware.parse_gpus("1x8GB", "--gpus 1x8GB"))
    (finding,) = _gd506(FITS)
    assert "1 x 8 GB" in finding.message


def test_cli_option_and_config(tmp_path, capsys):
    assert main(["check", "--no-cache", "--preview", "--select", "GD506", "--gpus", "1x8GB", str(FITS)]) == 1
    assert "1 x 8 GB, from --gpus 1x8GB" in capsys.readouterr().out
    assert main(["check", "--no-cache", "--preview", "--select", "GD506", "--gpus", "2xT5", str(FITS)]) == 2
    assert "close matches: T4" in capsys.readouterr().err
    project = tmp_path / "pyproject.toml"
    project.write_text('[tool.gpudoctor]\ngpus = "1x8GB"\npreview = true\n')
    assert main(["check", "--no-cache", "--select", "GD506", "--config", str(project), str(FITS)]) == 1
    assert "from [tool.gpudoctor] gpus" in capsys.readouterr().out


def test_gd112_judges_against_declared_gpus():
    path = ROOT / "fixtures" / "rules" / "accelerate" / "gd112_dataparallel_model_too_large.py"

    def gd112():
        return check_source(path.read_text(), str(path), rules=[rule_by_code("GD112")])

    as_stated = gd112()  # the file names its GPUs
    assert len(as_stated) == 2
    hardware.set_assumed(hardware.parse_gpus("2xH200", "--gpus 2xH200"))
    (left,) = gd112()  # ~52 GiB fits a 140 GiB card; ~194 GiB does not
    assert "~194 GiB" in left.message and "2 x H200 (139.8 GiB usable), from --gpus 2xH200" in left.message


@pytest.mark.parametrize(
    "text, count, gb",
    [
        ("# Kaggle accelerator: GPU T4 x2", 2, 16.0),  # Kaggle's own label
        ("# 2x RTX 3090", 2, 24.0),
        ("# 2xT4", 2, 16.0),
        ("# two T4s on kaggle", 2, 16.0),
        ("# dual 3090", 2, 24.0),
        ("# 6x3070Ti", 6, 8.0),
        ("# RTX 3070 Laptop GPU", 1, 8.0),
        ("# the T4 x-ray", 1, 16.0),  # "x-ray" is no count
    ],
)
def test_stated_card_counts(text, count, gb):
    from gpudoctor.check.queries import stated_gpus

    stated = stated_gpus(text, model_names=True)
    assert stated is not None and stated[:2] == (count, gb)
