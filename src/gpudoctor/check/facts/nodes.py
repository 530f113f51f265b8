"""Small questions about libcst nodes, shared by the collector and the rules."""

from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """``node`` and every node below it, depth first."""
    yield node
    for child in node.children:
        yield from walk(child)


def call_arg(call: cst.Call, position: Optional[int] = None, keyword: Optional[str] = None):
    if keyword is not None:
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == keyword:
                return arg.value
    if position is not None:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if position < len(positional):
            return positional[position].value
    return None


def string_value(node: Optional[cst.CSTNode]) -> Optional[str]:
    if type(node) is cst.SimpleString:
        try:
            value = node.evaluated_value
        except Exception:  # noqa: BLE001 - odd prefixes
            return None
        return value if isinstance(value, str) else None
    if type(node) is cst.ConcatenatedString:
        try:
            value = node.evaluated_value
        except Exception:  # noqa: BLE001
            return None
        return value if isinstance(value, str) else None
    return None


def int_value(node: Optional[cst.CSTNode]) -> Optional[int]:
    if type(node) is cst.Integer:
        try:
            return int(node.value.replace("_", ""), 0)
        except ValueError:
            return None
    return None


def is_true(node: Optional[cst.CSTNode]) -> bool:
    return type(node) is cst.Name and node.value == "True"


def name_key(node: Optional[cst.CSTNode]) -> Optional[str]:
    """``model`` -> "model"; ``self.model`` -> "self.model"; anything else -> None."""
    if type(node) is cst.Name:
        return node.value
    if type(node) is cst.Attribute and type(node.value) is cst.Name and node.value.value == "self":
        return "self." + node.attr.value
    return None


def receiver_key(node: Optional[cst.CSTNode]) -> Optional[str]:
    """The key of the object a method is called on, for indexing calls by receiver: ``model``, ``self.model``,
    and one attribute deep (``pipe.unet``)."""
    key = name_key(node)
    if key is None and type(node) is cst.Attribute and name_key(node.value) is not None:
        key = f"{name_key(node.value)}.{node.attr.value}"
    return key


def dotted(node: cst.CSTNode) -> Optional[str]:
    if type(node) is cst.Name:
        return node.value
    if type(node) is cst.Attribute:
        head = dotted(node.value)
        return f"{head}.{node.attr.value}" if head else None
    return None


def unwrap_iterable(node: cst.BaseExpression) -> cst.BaseExpression:
    """``tqdm(enumerate(loader), ...)`` -> ``loader``: what a loop really iterates."""
    while type(node) is cst.Call and node.args:
        name = dotted(node.func) or ""
        if name.split(".")[-1] in {"tqdm", "enumerate", "iter", "zip", "track", "list"}:
            node = node.args[0].value
            continue
        break
    return node


