"""Questions the data rules (GD3xx) share: which tokenizer call produced a token-id expression,
whether a tokenizer call pads, how labels are shifted."""

from __future__ import annotations

import re
from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, Scope, call_arg, dotted, int_value, is_true, name_key, string_value

_TOKENIZE_METHODS = {None, "__call__", "encode_plus", "batch_encode_plus", "encode", "apply_chat_template"}
# Methods/functions that keep the token ids (and the tokenization) of what they are applied to.
_KEEP_IDS_METHODS = {
    "flatten", "squeeze", "clone", "copy", "detach", "tolist", "to", "long", "contiguous", "cpu", "cuda",
    "view", "reshape", "numpy", "int",
}
# ``BatchEncoding`` methods that return the encoding itself.
_ENCODING_MOVES = {"to"}
_KEEP_IDS_FUNCS = {"torch.tensor", "torch.LongTensor", "torch.as_tensor", "numpy.array", "numpy.asarray"}
_KEEP_IDS_BUILTINS = {"list", "tuple"}


def is_tokenizer_expr(facts: FileFacts, node: Optional[cst.CSTNode]) -> bool:
    if node is None:
        return False
    if facts.value(node).kind == "tokenizer":
        return True
    text = dotted(node)
    if not text:
        return False
    last = text.split(".")[-1].lower()
    return (
        last in ("tok", "tokenizer", "tokeniser", "processor")
        or last.startswith(("tokenizer", "tokeniser"))
        or last.endswith(("_tokenizer", "_tok", "_processor"))
    )


def tokenizer_call(facts: FileFacts, node: Optional[cst.CSTNode]) -> Optional[cst.Call]:
    """``tokenizer(text, ...)`` / ``self.tok.encode_plus(...)``: the call when ``node`` is one."""
    if not isinstance(node, cst.Call):
        return None
    func = node.func
    if isinstance(func, cst.Attribute) and func.attr.value in _TOKENIZE_METHODS and is_tokenizer_expr(facts, func.value):
        return node
    if is_tokenizer_expr(facts, func):
        return node
    return None


def peel(facts: FileFacts, node: cst.BaseExpression) -> cst.BaseExpression:
    """Strip operations that keep the token ids: ``.flatten()``, ``.clone()``, ``[0]``, ``torch.tensor(x)``."""
    for _ in range(12):
        if isinstance(node, cst.Call):
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value in _KEEP_IDS_METHODS:
                node = func.value
                continue
            q = facts.qualname(func)
            if (q in _KEEP_IDS_FUNCS or (isinstance(func, cst.Name) and func.value in _KEEP_IDS_BUILTINS and q is None)) and node.args:
                node = node.args[0].value
                continue
            return node
        if isinstance(node, cst.Subscript) and len(node.slice) == 1:
            index = node.slice[0].slice
            if isinstance(index, cst.Index) and int_value(index.value) is not None:
                node = node.value
                continue
            if isinstance(index, cst.Slice) and index.lower is None and index.upper is None and index.step is None:
                node = node.value
                continue
        return node
    return node


def ids_source(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope: Scope, depth: int = 0) -> Optional[cst.Call]:
    """The tokenizer call whose ``input_ids`` ``node`` is: ``enc["input_ids"].flatten()`` with
    ``enc = tokenizer(text, ...)``, ``tokenizer.encode(text)``, a name bound to either."""
    if node is None or depth > 6:
        return None
    node = peel(facts, node)
    if _row_of(node) is not None:
        node = peel(facts, _row_of(node))  # enc["input_ids"][idx]: one example's ids of that tokenization
    direct = tokenizer_call(facts, node)
    if direct is not None and isinstance(direct.func, cst.Attribute) and direct.func.attr.value == "encode":
        return direct
    base = None
    if isinstance(node, cst.Subscript) and len(node.slice) == 1:
        index = node.slice[0].slice
        if isinstance(index, cst.Index) and string_value(index.value) == "input_ids":
            base = node.value
    elif isinstance(node, cst.Attribute) and node.attr.value == "input_ids":
        base = node.value
    if base is not None:
        return encoding_source(facts, base, order, scope, depth + 1)
    binding = facts.assignment_of(node, order, scope)
    if binding is not None:
        return ids_source(facts, binding.value, binding.order, binding.scope, depth + 1)
    return None


def encoding_source(facts: FileFacts, node: cst.BaseExpression, order: int, scope: Scope, depth: int = 0) -> Optional[cst.Call]:
    """The tokenizer call an encoding (``BatchEncoding``) expression comes from."""
    if depth > 6:
        return None
    call = tokenizer_call(facts, node)
    if call is not None:
        return call
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in _ENCODING_MOVES:
        # ``tokenizer(prompt, return_tensors="pt").to(device)``: ``BatchEncoding.to`` moves the tensors and returns
        # the same encoding.
        return encoding_source(facts, node.func.value, order, scope, depth + 1)
    if isinstance(node, cst.DictComp):
        # ``{k: v.to(device) for k, v in batch.items()}``: the same encoding, every tensor moved.
        mapped = _mapped_encoding(facts, node)
        return encoding_source(facts, mapped, order, scope, depth + 1) if mapped is not None else None
    binding = facts.assignment_of(node, order, scope)
    if binding is not None and not _pulls_item(binding.value):
        return encoding_source(facts, binding.value, binding.order, binding.scope, depth + 1)
    # A whole batch of ``DataLoader(..., collate_fn=lambda b: tokenizer(...))`` (``for batch in loader``, ``for i,
    # batch in enumerate(tqdm(loader))``, ``batch = next(it)``): what the collate function returns.
    collate = _collate_of_loader_item(facts, node, order, scope)
    if collate is not None:
        return encoding_source(facts, collate[0], collate[1], collate[2], depth + 1)
    stored = _stored_encoding(facts, node, order, scope, depth)
    if stored is not None:
        return stored
    key = name_key(node)
    binding = facts.binding_at(key, order, scope) if key is not None and "." not in key else None
    if binding is not None and binding.kind == "param":
        # a Dataset's ``__init__(self, encodings)`` ... ``QADataset(tokenizer(questions))``: every call passes one
        found = {id(c): c for c in (
            encoding_source(facts, *argument, depth + 1) for argument in facts.param_arguments(binding)
        )}
        if len(found) == 1 and None not in found:
            return next(iter(found.values()))
    return None


def _stored_encoding(facts: FileFacts, node: cst.BaseExpression, order: int, scope: Scope, depth: int) -> Optional[cst.Call]:
    """``self.examples[idx]`` where every element the file puts in the list is one tokenizer call's encoding
    (``enc = tokenizer(text, ...); self.examples.append(enc)`` in a Dataset's ``__init__``): that call."""
    row = _row_of(node)
    if row is None:
        return None
    items = facts.items_of(row, order, scope)
    if not items:
        return None
    found = {id(c): c for c in (encoding_source(facts, item, at, within, depth + 1) for item, at, within in items)}
    if len(found) == 1 and None not in found:
        return next(iter(found.values()))
    return None


def _mapped_encoding(facts: FileFacts, comp: cst.DictComp) -> Optional[cst.BaseExpression]:
    """``X`` for ``{k: v<id-keeping methods> for k, v in X.items()}``, else None."""
    loop = comp.for_in
    target, iterable = loop.target, loop.iter
    if loop.inner_for_in is not None or loop.ifs or not isinstance(target, cst.Tuple) or len(target.elements) != 2:
        return None
    key_name, value_name = (e.value for e in target.elements)
    if not (isinstance(key_name, cst.Name) and isinstance(value_name, cst.Name)):
        return None
    if not (isinstance(comp.key, cst.Name) and comp.key.value == key_name.value):
        return None
    value = peel(facts, comp.value)
    if not (isinstance(value, cst.Name) and value.value == value_name.value):
        return None
    if isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Attribute) and iterable.func.attr.value == "items" and not iterable.args:
        return iterable.func.value
    return None


def _pulls_item(node: Optional[cst.BaseExpression]) -> bool:
    """``next(it)``: an item of an iterable, not an encoding expression to follow."""
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "next"


def _collate_of_loader_item(facts: FileFacts, node: cst.BaseExpression, order: int, scope: Scope) -> Optional[tuple[cst.BaseExpression, int, Scope]]:
    """What the collate function of the DataLoader a whole loop item comes from returns (the lambda's body, or the
    single returned expression of the file's own function): (expression, order, scope), else None. The item is
    read from the facts' lattice: a whole batch, through ``enumerate``/``tqdm``/``iter()``+``next()``/generators."""
    item = facts.value(node, order, scope)
    source = item.trait("loader") if item.kind == "batch" else None
    loader = source.origin().node if source is not None else None
    collate = call_arg(loader, keyword="collate_fn") if isinstance(loader, cst.Call) else None
    if isinstance(collate, cst.Lambda):
        order, scope = facts._position_of(loader)
        return collate.body, order, scope
    if isinstance(collate, cst.Name):
        functions = [f for f in facts.functions if f.name == collate.value and f.class_name is None]
        if len(functions) == 1:
            returns = [r for r in facts.returns.get(id(functions[0]), ()) if r.kind == "return" and r.value is not None]
            if len(returns) == 1:
                return returns[0].value, returns[0].order, returns[0].scope
    return None


def _row_of(node: cst.BaseExpression) -> Optional[cst.BaseExpression]:
    """``ids[idx]`` (an index that is a name, not a key string): ``ids``; else None."""
    if isinstance(node, cst.Subscript) and len(node.slice) == 1:
        index = node.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.Name):
            return node.value
    return None


def tokenized_text(facts: FileFacts, call: cst.Call) -> tuple[str, bool]:
    """(source text of what is tokenized, True when it is passed as ``text_target=``)."""
    target = call_arg(call, keyword="text_target")
    if target is not None:
        return facts.module.code_for_node(target), True
    text = call_arg(call, 0, "text")
    return (facts.module.code_for_node(text) if text is not None else ""), False


def padding_of(facts: FileFacts, call: cst.Call) -> Optional[str]:
    """"max_length", "longest" (``True``/"longest") or None (no padding asked)."""
    padding = call_arg(call, keyword="padding")
    text = string_value(padding)
    if text in ("max_length", "longest"):
        return text
    if is_true(padding):
        return "longest"
    return None


def max_length_of(facts: FileFacts, call: cst.Call) -> Optional[str]:
    value = call_arg(call, keyword="max_length")
    return facts.module.code_for_node(value) if value is not None else None


def shifted_base(node: cst.CSTNode, upper: bool = False) -> Optional[cst.BaseExpression]:
    """``x[:, 1:]`` / ``x[..., 1:]`` / ``x[1:]`` -> ``x`` (with ``upper``: ``x[:, :-1]`` -> ``x``)."""
    if not isinstance(node, cst.Subscript) or not node.slice:
        return None
    *leading, last = node.slice
    for element in leading:
        s = element.slice
        if isinstance(s, cst.Slice) and s.lower is None and s.upper is None and s.step is None:
            continue
        if isinstance(s, cst.Index) and isinstance(s.value, cst.Ellipsis):
            continue
        return None
    s = last.slice
    if not isinstance(s, cst.Slice) or s.step is not None:
        return None
    if not upper:
        if s.upper is None and int_value(s.lower) == 1:
            return node.value
        return None
    if s.lower is None and isinstance(s.upper, cst.UnaryOperation) and isinstance(s.upper.operator, cst.Minus):
        if int_value(s.upper.expression) == 1:
            return node.value
    return None


def subscript_key(target: cst.Subscript) -> Optional[str]:
    """``"labels"`` for ``enc["labels"]``; None for other subscripts."""
    if len(target.slice) != 1 or not isinstance(target.slice[0].slice, cst.Index):
        return None
    return string_value(target.slice[0].slice.value)


def code(facts: FileFacts, node: cst.CSTNode) -> str:
    return " ".join(facts.module.code_for_node(node).split())


def dict_groups(facts: FileFacts) -> Iterator[dict[str, object]]:
    """String-keyed dict displays as {key: DictEntrySite}."""
    groups: dict[int, dict[str, object]] = {}
    for entry in facts.dict_entries:
        if entry.dict_node is None:
            continue
        groups.setdefault(id(entry.dict_node), {})[entry.key] = entry
    return iter(groups.values())


_MINUS_100 = re.compile(r"-\s*100\b|IGNORE_INDEX|ignore_index|label_pad_token_id")
_CUSTOM_LOSS = re.compile(r"cross_entropy|CrossEntropyLoss|nll_loss|NLLLoss|def compute_loss\b|ignore_index")


def computes_own_loss(facts: FileFacts) -> Optional[str]:
    """Evidence that the file computes a token loss itself (from logits) instead of passing labels."""
    match = _CUSTOM_LOSS.search(facts.source)
    return match.group(0) if match else None


def masks_labels_somewhere(facts: FileFacts) -> Optional[str]:
    """Evidence that the file masks labels (``-100``, ``ignore_index``) or computes its own loss."""
    match = _MINUS_100.search(facts.source) or _CUSTOM_LOSS.search(facts.source)
    return match.group(0) if match else None
