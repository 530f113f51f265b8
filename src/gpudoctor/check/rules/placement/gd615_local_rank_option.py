from __future__ import annotations

import re
from typing import Optional

from gpudoctor.check.facts import CallSite, FileFacts, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_LOCAL_RANK_FLAGS = {"--local_rank", "--local-rank"}
# torchrun / torch.distributed.run, and the legacy launcher run with --use-env, only set the LOCAL_RANK variable.
_ENV_LAUNCH = re.compile(r"\btorchrun\b|torch\.distributed\.run\b")
_LEGACY_LAUNCH = re.compile(r"torch\.distributed\.launch\b[^\n]*")
_USE_ENV = re.compile(r"--use[-_]env\b")
# Launchers that do pass ``--local_rank=<rank>`` (underscored): DeepSpeed's.
_PASSES_UNDERSCORED = re.compile(r"\bdeepspeed\s+(--\S+\s+)*\S+\.py|\bdeepspeed\.launcher")


class LocalRankOption(Rule):
    """An argparse ``--local_rank`` option that the launcher the file names does not fill: torchrun sets only the
    ``LOCAL_RANK`` environment variable (the option keeps its default on every process), and the legacy
    ``torch.distributed.launch`` passes the dashed ``--local-rank=<rank>``, which a parser that only knows
    ``--local_rank`` rejects."""

    code = "GD615"
    name = "local-rank-option"
    summary = "argparse --local_rank that torchrun never sets (default on every rank) or that rejects the launcher's --local-rank"
    severity = Severity.ERROR
    triggers = ("local_rank", "local-rank")

    def check(self, facts: FileFacts):
        if _PASSES_UNDERSCORED.search(facts.source):
            return
        env_launch = _env_launch(facts.source)
        legacy_launch = _legacy_launch(facts.source)
        if env_launch is None and legacy_launch is None:
            yield from self._no_launcher_named(facts)
            return
        for site in facts.method_calls("add_argument"):
            flags = {string_value(a.value) for a in site.node.args if a.keyword is None} - {None}
            if not flags & _LOCAL_RANK_FLAGS:
                continue
            if env_launch is not None and self._default_ignores_environment(facts, site):
                yield self.report(
                    site.node,
                    f"`{env_launch}` does not pass `--local-rank` to the script (torch 2.13 `torch/distributed/run.py` "
                    "sets only the `LOCAL_RANK` environment variable), so `local_rank` keeps its default "
                    f"`{snippet(facts, site.arg(keyword='default'), 30) if site.arg(keyword='default') is not None else 'None'}` "
                    "on every process: all ranks pick the same GPU (or take the single-process branch and each train "
                    "the whole dataset alone, without gradient sync).",
                    fix_hint="Read the variable: `parser.add_argument(\"--local-rank\", \"--local_rank\", type=int, "
                    "default=int(os.environ.get(\"LOCAL_RANK\", -1)))`.",
                )
            elif legacy_launch is not None and "--local-rank" not in flags and "parse_known_args" not in facts.source:
                yield self.report(
                    site.node,
                    f"`{legacy_launch}` passes the dashed `--local-rank=<rank>` to every process (torch >= 2.0), but the "
                    "parser only declares `--local_rank`: `parse_args()` exits each process with \"error: "
                    "unrecognized arguments: --local-rank=0\".",
                    fix_hint="Declare both spellings: `parser.add_argument(\"--local-rank\", \"--local_rank\", type=int, "
                    "default=-1)`, or launch with torchrun and read `os.environ[\"LOCAL_RANK\"]`.",
                )

    def _no_launcher_named(self, facts: FileFacts):
        """No launch command in the file, but it joins a process group from the environment
        (``init_process_group`` without ``rank=``/a non-``env://`` ``init_method``): RANK and WORLD_SIZE come from a
        launcher, and neither launcher torch ships fills an underscored-only ``--local_rank``."""
        if _SPAWNS_OR_DEEPSPEED.search(facts.source) or "parse_known_args" in facts.source:
            return
        joins = [site for site in facts.calls_to(*_INIT_PROCESS_GROUP) if _initialised_from_environment(site)]
        if not joins:
            return
        for site in facts.method_calls("add_argument"):
            flags = {string_value(a.value) for a in site.node.args if a.keyword is None} - {None}
            if "--local_rank" not in flags or "--local-rank" in flags or not self._default_ignores_environment(facts, site):
                continue
            yield self.report(
                site.node,
                "The script joins its process group from the environment a launcher sets, but declares only "
                "`--local_rank`, which neither torch launcher fills (torch 2.13): torchrun sets only the `LOCAL_RANK` "
                "environment variable, so the option keeps its default "
                f"`{snippet(facts, site.arg(keyword='default'), 30) if site.arg(keyword='default') is not None else 'None'}` "
                "on every process (all ranks pick the same GPU), and `python -m torch.distributed.launch` passes the "
                "dashed `--local-rank=<rank>`, which `parse_args()` rejects (\"error: unrecognized arguments: "
                "--local-rank=0\").",
                fix_hint="Read the variable: `parser.add_argument(\"--local-rank\", \"--local_rank\", type=int, "
                "default=int(os.environ.get(\"LOCAL_RANK\", -1)))`.",
                related=((joins[0].node, "the process group is initialised from the launcher's environment here"),),
            )

    @staticmethod
    def _default_ignores_environment(facts: FileFacts, site: CallSite) -> bool:
        """The option's default is not read from the environment and nothing in the file reads ``LOCAL_RANK``
        (``args.local_rank = int(os.environ["LOCAL_RANK"])`` after parsing also fixes it)."""
        if "LOCAL_RANK" in facts.source:
            return False
        return ".local_rank" in facts.source  # the script uses the option


_INIT_PROCESS_GROUP = ("torch.distributed.init_process_group",)
# Launch paths that give the script its local rank another way: mp.spawn's first argument, DeepSpeed's launcher.
_SPAWNS_OR_DEEPSPEED = re.compile(r"\bspawn\(|\bstart_processes\(|deepspeed", re.IGNORECASE)


def _initialised_from_environment(site: CallSite) -> bool:
    """``init_process_group(backend="nccl")`` / ``init_method="env://"``: rank and world size are read from the
    variables a launcher sets (not passed by the script)."""
    if site.arg(keyword="rank") is not None or site.arg(keyword="store") is not None:
        return False
    method = site.arg(1, "init_method")
    return method is None or string_value(method) == "env://"


def _env_launch(source: str) -> Optional[str]:
    found = _ENV_LAUNCH.search(source)
    if found is not None:
        return found.group(0)
    legacy = _LEGACY_LAUNCH.search(source)
    if legacy is not None and _USE_ENV.search(legacy.group(0)):
        return "torch.distributed.launch --use-env"
    return None


def _legacy_launch(source: str) -> Optional[str]:
    legacy = _LEGACY_LAUNCH.search(source)
    if legacy is None or _USE_ENV.search(legacy.group(0)):
        return None
    return "torch.distributed.launch"
