"""Line/column of the few nodes that have findings, without libcst's MetadataWrapper.

``MetadataWrapper(...).resolve(PositionProvider)`` renders the whole module recording a range for
every node, then walks the tree once more; for a file with findings that was most of the check time.
Here the module is rendered once and ranges are recorded only for the wanted nodes (and for
statements and suites, whose ranges libcst derives from their children).
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import libcst as cst
from libcst._position import CodePosition, CodeRange
from libcst.metadata.position_provider import PositionProvider, PositionProvidingCodegenState

_NOTHING = contextlib.nullcontext()
# Nodes whose range libcst hoists from their last child ("end_node"): they must all be recorded.
_ALWAYS = (cst.BaseStatement, cst.BaseSmallStatement, cst.BaseSuite, cst.Else, cst.Finally, cst.ExceptHandler, cst.ExceptStarHandler, cst.MatchCase)


class _TargetedState(PositionProvidingCodegenState):
    __slots__ = ("wanted",)

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        if id(node) not in self.wanted and not isinstance(node, _ALWAYS):
            return _NOTHING
        return self._record(node, start_node, end_node)

    @contextlib.contextmanager
    def _record(self, node, start_node, end_node):
        start = CodePosition(self.line, self.column)
        try:
            yield
        finally:
            end = CodePosition(self.line, self.column)
            computed = self.provider._computed
            if start_node is not None and start_node in computed:
                start = computed[start_node].start
            if end_node is not None and end_node in computed:
                end = computed[end_node].end
            computed[node] = CodeRange(start, end)


def positions(module: cst.Module, nodes: Iterable[cst.CSTNode]) -> dict[cst.CSTNode, CodeRange]:
    """Ranges (1-based lines, 0-based columns, as PositionProvider) for ``nodes`` of ``module``."""
    wanted = {id(node) for node in nodes}
    provider = PositionProvider()
    state = _TargetedState(default_indent=module.default_indent, default_newline=module.default_newline, provider=provider)
    state.wanted = wanted
    module._codegen(state)
    return provider._computed
