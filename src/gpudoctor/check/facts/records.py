"""Plain records of what the walk saw: scopes, bindings, frames (loop/with/if/function), call sites."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import libcst as cst

from gpudoctor.check.facts.nodes import call_arg


@dataclass(eq=False, repr=False)
class Scope:
    kind: str  # "module" | "function" | "class"
    name: str
    node: cst.CSTNode
    parent: Optional["Scope"]
    class_name: Optional[str] = None
    bindings: dict[str, list["Binding"]] = field(default_factory=dict)
    decorators: tuple[str, ...] = ()


@dataclass(eq=False, repr=False)
class Binding:
    key: str  # "model" or "self.model"
    order: int
    scope: Scope
    target: cst.CSTNode
    value: Optional[cst.BaseExpression]
    kind: str = "assign"  # assign | unpack | for | with | param | augassign | import | def
    index: Optional[int] = None  # position in a tuple unpacking
    context: tuple = ()
    path: tuple[int, ...] = ()  # positions in nested unpackings: ``for i, (x, y) in ...`` binds y at (1, 1)


@dataclass(eq=False, repr=False)
class ReturnSite:
    """``return value`` or ``yield value`` in a function of the file."""

    node: cst.CSTNode
    order: int
    scope: Scope
    value: Optional[cst.BaseExpression]
    kind: str = "return"  # "return" | "yield" | "yield from"


@dataclass(eq=False, repr=False)
class LoopFrame:
    node: Union[cst.For, cst.While]
    order: int
    iter: Optional[cst.BaseExpression]
    end_order: int = 0
    scope: Optional[Scope] = None  # the scope the loop runs in


@dataclass(eq=False, repr=False)
class WithFrame:
    node: cst.With
    item: cst.WithItem
    qualname: Optional[str]
    # For ``with accelerator.accumulate(model):`` the receiver and method.
    receiver: Optional[cst.BaseExpression]
    method: Optional[str]


@dataclass(eq=False, repr=False)
class IfFrame:
    node: cst.If
    test: cst.BaseExpression
    branch: str  # "body" | "orelse"


@dataclass(eq=False, repr=False)
class FunctionFrame:
    scope: Scope


Frame = Union[LoopFrame, WithFrame, IfFrame, FunctionFrame]


@dataclass(eq=False, repr=False)
class CallSite:
    node: cst.Call
    order: int
    qualname: Optional[str]  # canonical, when the callee resolves through an import
    method: Optional[str]  # attribute name for ``x.method(...)`` calls
    receiver: Optional[cst.BaseExpression]
    scope: Scope
    context: tuple  # frames, outermost first
    statement: bool = False  # the call is a whole expression statement

    def arg(self, position: Optional[int] = None, keyword: Optional[str] = None) -> Optional[cst.BaseExpression]:
        return call_arg(self.node, position, keyword)


@dataclass(eq=False, repr=False)
class AugAssignSite:
    node: cst.AugAssign
    order: int
    target_key: Optional[str]
    scope: Scope
    context: tuple


@dataclass(eq=False, repr=False)
class KeyDeletion:
    """``del base["key"]``."""
    key: Optional[str]
    base_key: Optional[str]
    order: int
    scope: Scope


@dataclass(eq=False, repr=False)
class SubscriptAssignSite:
    node: cst.Assign
    order: int
    base_key: Optional[str]
    target: cst.Subscript
    value: cst.BaseExpression
    scope: Scope
    context: tuple


@dataclass(eq=False, repr=False)
class AttributeAssignSite:
    """``tokenizer.pad_token = tokenizer.eos_token``: an assignment to an attribute that is not ``self.x``."""

    node: cst.Assign
    order: int
    target: cst.Attribute
    value: cst.BaseExpression
    scope: Scope
    context: tuple


@dataclass(eq=False, repr=False)
class DictEntrySite:
    key: str
    value: cst.BaseExpression
    element: cst.DictElement
    order: int
    scope: Scope
    context: tuple
    dict_node: Optional[cst.Dict] = None  # the display the entry belongs to
