"""Base class of every rule. Subclassing registers the rule: there is no other list to edit."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterable, Optional

from gpudoctor.check.finding import Fix, Severity

if TYPE_CHECKING:
    import libcst as cst

    from gpudoctor.check.facts import FileFacts

_CODE = re.compile(r"^GD\d{3}$")
_REGISTRY: dict[str, type["Rule"]] = {}


@dataclass
class Report:
    """What a rule yields; the engine turns it into a positioned :class:`Finding`."""

    node: cst.CSTNode
    message: str
    fix_hint: str = ""
    severity: Optional[Severity] = None
    fix: Optional[Fix] = None
    # Other lines of the evidence chain, (node, what it does there), in the order a reader follows them.
    related: tuple[tuple[cst.CSTNode, str], ...] = ()


class Rule:
    """One diagnosis. Subclasses set the class attributes and implement :meth:`check`.

    ``check`` receives the file's facts (imports, bindings, values, calls in source order) and
    yields :class:`Report` objects. Rules never walk the tree themselves: the facts collector
    did it once for all of them.
    """

    code: ClassVar[str]
    name: ClassVar[str]  # kebab-case, also the doc's slug: rules/<code>-<name>.md
    summary: ClassVar[str]  # one line for `gpudoctor rule --all`
    severity: ClassVar[Severity] = Severity.ERROR
    preview: ClassVar[bool] = False
    fixable: ClassVar[Optional[str]] = None  # None, "safe" or "unsafe"
    # The prefilter: the file is only analysed by this rule when one of these strings occurs.
    triggers: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        code = getattr(cls, "code", None)
        if code is None:  # an abstract helper base
            return
        if not _CODE.match(code):
            raise ValueError(f"{cls.__name__}: rule code {code!r} is not GD + 3 digits")
        if code in _REGISTRY and _REGISTRY[code] is not cls:
            raise ValueError(f"rule code {code} is used by {_REGISTRY[code].__name__} and {cls.__name__}")
        _REGISTRY[code] = cls

    def check(self, facts: "FileFacts") -> Iterable[Report]:
        raise NotImplementedError

    # Convenience for rules.
    def report(self, node: cst.CSTNode, message: str, fix_hint: str = "", **kw) -> Report:
        return Report(node=node, message=message, fix_hint=fix_hint, **kw)


def registered() -> dict[str, type[Rule]]:
    return _REGISTRY
