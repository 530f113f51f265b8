"""The ``gpudoctor demo`` section of ``trace --simulate``: field report 003 on six simulated 8 GB cards."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SEED = "seed003_llama_dataparallel.py"


def seed003_workdir(folder: Path, script: str = SEED) -> Path:
    """A folder with the seed script and the data file it opens (the reference trainer's bundled sample)."""
    from gpudoctor.check.docs import bundled_dir
    from gpudoctor.reference.data import BUNDLED_DATA

    shutil.copy(bundled_dir("fixtures") / "seeds" / script, folder / script)
    shutil.copy(BUNDLED_DATA, folder / "small_en_medical_dialog.json")
    return folder / script


def demo_simulate(console) -> list[str]:
    from rich.rule import Rule

    console.print(Rule("[bold]4. gpudoctor trace --simulate[/] — field report 003 on six 8 GB cards, without them"))
    with tempfile.TemporaryDirectory() as folder:
        script = seed003_workdir(Path(folder))
        report = Path(folder) / "simulated.json"
        console.print(f"[dim]$ gpudoctor trace --simulate 6x3070Ti {script.name}[/]")
        completed = subprocess.run([sys.executable, "-m", "gpudoctor", "trace", "--simulate", "6x3070Ti", "--no-check",
                                    "--json", str(report), script.name], cwd=folder, capture_output=True, text=True, timeout=600)
        sys.stdout.write(completed.stderr[-6000:])
        sys.stdout.flush()
        if not report.is_file():
            return ["trace --simulate wrote no report"]
        verdict = json.loads(report.read_text())["simulated"]["verdict"]
        if verdict.get("kind") != "oom" or verdict.get("device") != "cuda:0":
            return [f"seed 003 was expected to run out of memory on cuda:0, the simulation says {verdict}"]
    return []
