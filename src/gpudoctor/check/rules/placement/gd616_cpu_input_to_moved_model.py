from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import (
    TRAIT_DISPATCHED,
    TRAIT_MOVED,
    TRAIT_PREPARED,
    TRAIT_QUANTIZED,
    FileFacts,
    Scope,
    WithFrame,
    call_arg,
    name_key,
    string_value,
)
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import exclusive_branches, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import (
    CREATION,
    INPUT_MOVING_WRAPPERS,
    PLACING_METHODS,
    SAME_DEVICE_METHODS,
    accelerator_device,
    cpu_computed,
    cpu_tensor_mapping,
    file_sets_default_device,
    holds_no_tensors,
    loop_item_source,
    method_scopes,
    module_classes,
    on_accelerator,
    parents,
    wrapper_moves_inputs,
)

# torch functions that run ``model(*example_inputs)`` on the inputs as given (tracing exporters).
_TRACING = {"torch.onnx.export": 1, "torch.jit.trace": 1}
# ``torch.nn`` containers: what they run depends on the modules they hold.
_CONTAINERS = {"Sequential", "ModuleList", "ModuleDict"}
# ``torch.autograd.Variable``: a no-op wrapper that returns the tensor it is given.
_VARIABLE = {"torch.autograd.Variable", "torch.autograd.variable.Variable"}


class CpuInputToMovedModel(Rule):
    """A model the file moved to an accelerator (``model.to(device)`` with a CUDA ``device``, ``.cuda()``) is called
    with an input that is still on the CPU: a ``torch.*`` creation without ``device=`` (``torch.randn(...)``,
    ``torch.from_numpy(obs)``), views and arithmetic of one, through names, parameters and the file's helpers, or a
    part of a ``DataLoader`` batch whose dataset is known to yield CPU tensors and that the loop never moves.
    Silent for models that move their inputs (device-map dispatch, ``accelerator.prepare``, ``DataParallel``/DDP),
    for classes whose ``forward`` the file does not show (a warning when the file uses one as a module:
    ``net.load_state_dict(sd); net.to(device)``), for a call in the other branch of the ``if`` that moves the
    model, and when the
    file calls ``torch.set_default_device``."""

    code = "GD616"
    name = "cpu-input-to-moved-model"
    summary = "A model moved to an accelerator is called with an input that is still on the CPU"
    severity = Severity.ERROR
    triggers = (".to(", ".cuda(")

    def check(self, facts: FileFacts):
        if file_sets_default_device(facts) or _device_context(facts):
            return
        for site in facts.calls:
            model_expr, inputs = self._model_call(facts, site)
            if model_expr is None:
                continue
            model = facts.value(model_expr, site.order, site.scope)
            if model.kind != "model":
                continue
            move = self._accelerator_move(facts, model, site)
            if move is None or not self._forward_keeps_inputs(facts, model, site):
                continue
            hf_model = self._transformers_model(facts, model)
            for index, (arg, keyword) in enumerate(inputs):
                if hf_model and keyword == "labels":
                    continue  # transformers' loss moves the labels to the logits' device
                evidence = (
                    self._cpu_mapping(facts, arg, site) or self._unmoved_collated_batch(facts, arg, site)
                    if keyword == "**" else self._cpu_input(facts, arg, site)
                )
                evidence = evidence or _unmoved_tokenizer_output(facts, arg, site, whole=keyword == "**")
                if evidence is None:
                    continue
                origin, why = evidence
                if self._another_input_placed(facts, site, arg, [a for a, _ in inputs]) and (
                    index > 0 or facts._position_of(origin)[1] is not site.scope
                ):
                    # a helper's CPU tensor beside a placed input: GD614's finding; a later input left on the CPU
                    # while the first is moved: deliberate (``pack_padded_sequence`` lengths must be on the CPU)
                    break
                model_text = snippet(facts, model_expr, 30)
                input_text = snippet(facts, arg, 40)
                unseen = (
                    f"unless `{model.trait('class')}.forward` (not in this file) moves its inputs itself, "
                    if model.has("by_use") else ""
                )
                yield self.report(
                    site.node,
                    f"`{model_text}` is on an accelerator (`{snippet(facts, move, 50)}`), but its input "
                    f"`{input_text}` is on the CPU ({why}): {unseen}a module does not move its inputs, so torch raises (on CUDA) "
                    "\"RuntimeError: Expected all tensors to be on the same device, but found at least two devices, "
                    "cuda:0 and cpu!\" (a convolution: \"Input type (torch.FloatTensor) and weight type "
                    "(torch.cuda.FloatTensor) should be the same ...\")",
                    fix_hint=f"Move the input to the model's device first: `{input_text}.to(device)` (or create it with "
                    "`device=`).",
                    related=((move, f"`{model_text}` is moved to an accelerator here"), (origin, "the input is made on the CPU here")),
                    severity=Severity.WARNING if unseen else None,
                )
                break

    # ---------------------------------------------------------------------------------------- the call

    @staticmethod
    def _model_call(facts: FileFacts, site) -> tuple[Optional[cst.CSTNode], list[tuple[cst.BaseExpression, Optional[str]]]]:
        """(the model, its inputs as passed with their keywords): ``model(x, y)`` (positional and keyword arguments),
        or the model and example inputs of a tracing exporter (``torch.onnx.export(model, img, path)``)."""
        if site.qualname in _TRACING:
            model = call_arg(site.node, 0)
            example = call_arg(site.node, _TRACING[site.qualname])
            if model is None or example is None:
                return None, []
            parts = [e.value for e in example.elements] if isinstance(example, cst.Tuple) else [example]
            return model, [(part, None) for part in parts]
        func = site.node.func
        if isinstance(func, cst.Attribute) and func.attr.value == "generate" and _encoder_decoder(facts, func.value, site):
            # generate() moves decoder inputs itself, but runs the encoder on the inputs as given
            return func.value, [
                (a.value, "**" if a.star else a.keyword.value if a.keyword is not None else None)
                for a in site.node.args if a.star != "*"
            ]
        if site.qualname is not None or name_key(site.node.func) is None:
            return None, []
        if any(a.star == "*" for a in site.node.args):
            return None, []  # ``model(*batch)``: what lands where is not shown
        # ``model(**inputs)``: the mapping's entries are the inputs (only a mapping shown to hold CPU tensors counts)
        return site.node.func, [
            (a.value, "**" if a.star else a.keyword.value if a.keyword is not None else None) for a in site.node.args
        ]

    @staticmethod
    def _another_input_placed(facts: FileFacts, site, arg, inputs) -> bool:
        """Another input of the call is shown on an accelerator."""
        for other in inputs:
            if other is arg:
                continue
            order, scope = facts._position_of(other)
            if order == 1 << 30:
                order, scope = site.order, site.scope
            if on_accelerator(facts, other, order, scope) is not None:
                return True
        return False

    # ---------------------------------------------------------------------------------------- the model

    @staticmethod
    def _accelerator_move(facts: FileFacts, model, site) -> Optional[cst.Call]:
        """The last move of the model when it targets an accelerator (``.cuda()``, ``.to("cuda:0")``, ``.to(device)``
        with a CUDA ``device``), unless the call sits in another branch of an ``if`` that holds the move."""
        move = model.trait(TRAIT_MOVED)
        move_site = facts.call_site(move) if isinstance(move, cst.Call) else None
        if move_site is None:
            return None
        if move_site.method == "to":
            target = move_site.arg(0, "device")
            if target is None or not accelerator_device(facts, target, move_site.order, move_site.scope):
                return None
        elif move_site.method not in ("cuda", "xpu", "npu", "mps"):
            return None
        key = name_key(site.node.func) if site.qualname is None else name_key(call_arg(site.node, 0))
        if key is not None and any(other.method == "cpu" and name_key(other.receiver) == key for other in facts.calls):
            return None  # ``model.cpu()`` somewhere: where the model is at the call is not shown by the order of lines
        if exclusive_branches(site.context, move_site.context):
            return None  # the call is in the other branch of the ``if`` that moves the model: it never sees the move
        # ``if args.cuda: policy.cuda()`` then ``policy(cpu_state)`` after the ``if``: the input is on the CPU on every
        # path, so the call fails whenever the move runs (the run the flag exists for)
        return move

    def _forward_keeps_inputs(self, facts: FileFacts, model, site) -> bool:
        """The model's forward is known and leaves its inputs where they are: a ``torch.nn`` layer, a torchvision or
        transformers model (not dispatched, prepared or quantized), or the file's own ``nn.Module`` class whose
        ``forward`` (and the methods it calls) places nothing. Unknown (imported) classes may move their inputs."""
        if model.has(TRAIT_DISPATCHED) or model.has(TRAIT_PREPARED) or model.has(TRAIT_QUANTIZED):
            return False
        if wrapper_moves_inputs(model):
            return False
        class_name = str(model.trait("class") or "")
        if not class_name or class_name.endswith("Loss"):
            return False
        if holds_no_tensors(facts, site.node.func, site.order, site.scope) or "forward_pre_hook" in facts.source:
            return False  # a forward pre-hook may move the inputs
        if model.has("by_use"):
            # a class of the project's own modules (``from models import Darknet``), known a module by its use: its
            # forward is not shown, but model code rarely moves its inputs; reported as a warning that says so
            return True
        origin = model.origin().node
        q = facts.qualname(origin.func) if isinstance(origin, cst.Call) else None
        if class_name in module_classes(facts) and q is None:
            return self._own_forward_keeps_inputs(facts, class_name)
        if q is None:
            return False
        parts = q.split(".")
        if parts[:2] == ["torch", "nn"]:
            if class_name in INPUT_MOVING_WRAPPERS:
                return False
            if class_name in _CONTAINERS:
                return self._container_of_known_layers(facts, origin)
            return True
        if parts[0] == "torchvision":
            return True
        return self._transformers_model(facts, model)

    @staticmethod
    def _transformers_model(facts: FileFacts, model) -> bool:
        """Loaded by a transformers model class's ``from_pretrained`` / ``from_config``."""
        origin = model.origin().node
        q = facts.qualname(origin.func) if isinstance(origin, cst.Call) else None
        owner_method = apis.hf_class_method(q) if q else None
        return bool(owner_method and owner_method[1] in ("from_pretrained", "from_config") and apis.is_model_class(owner_method[0]))

    @staticmethod
    def _container_of_known_layers(facts: FileFacts, call: cst.Call) -> bool:
        """``nn.Sequential(nn.Linear(...), nn.ReLU(), ...)``: every module it holds is a ``torch.nn`` layer."""
        for arg in call.args:
            if arg.star or not isinstance(arg.value, cst.Call):
                return False
            parts = (facts.qualname(arg.value.func) or "").split(".")
            if parts[:2] != ["torch", "nn"] or parts[-1] in _CONTAINERS | INPUT_MOVING_WRAPPERS:
                return False
        return bool(call.args)

    @staticmethod
    def _own_forward_keeps_inputs(facts: FileFacts, class_name: str) -> bool:
        """``forward`` of the file's class (or of a base class of the file), and every method of those classes it
        calls, neither moves a tensor (``.to``, ``.cuda``, ``.type_as``) nor builds one with ``device=``
        (``torch.as_tensor(obs, device=self.device)`` moves its input)."""
        classes = [class_name]
        for name in classes:  # the file's own base classes
            for base in facts.classes[name].node.bases:
                key = name_key(base.value)
                if key in facts.classes and key not in classes:
                    classes.append(key)
        methods = {scope.name: scope for name in reversed(classes) for scope in method_scopes(facts, name)}
        if "forward" not in methods and "__call__" not in methods:
            return False  # forward inherited from a class the file does not show
        pending = [methods.get("forward") or methods["__call__"]]
        seen: set[int] = set()
        while pending:
            scope = pending.pop()
            if id(scope) in seen:
                continue
            seen.add(id(scope))
            for call in facts.calls:
                if call.scope is not scope:
                    continue
                if call.method in PLACING_METHODS and facts.qualname(call.node.func) is None:
                    return False
                if call.qualname in CREATION and call_arg(call.node, keyword="device") is not None:
                    return False
                func = call.node.func
                if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
                    callee = methods.get(func.attr.value)
                    if callee is not None:
                        pending.append(callee)
        return True

    # ---------------------------------------------------------------------------------------- the input

    def _cpu_input(self, facts: FileFacts, arg: cst.BaseExpression, site) -> Optional[tuple[cst.CSTNode, str]]:
        """(where the input is made, why it is on the CPU), or None when it may be anywhere else."""
        order, scope = facts._position_of(arg)
        if order == 1 << 30:  # not a name or call itself (``x.squeeze(1)`` is a call; ``-x`` is not): the call's place
            order, scope = site.order, site.scope
        computed = cpu_computed(facts, arg, order, scope)
        if computed is not None and self._bound_in_try(facts, arg, order, scope):
            return None  # ``try: x = x.cuda() except ...: x = ...``: the last binding is one path among others
        if computed is not None:
            origin = computed[0]
            if _literal_scalar(facts, origin):
                return None  # ``torch.tensor(0.5)``: a 0-dim scalar, which some forwards only multiply with
            return origin, f"`{snippet(facts, origin, 50)}` has no `device=`"
        image = _image_to_tensor(facts, arg, order, scope)
        if image is not None:
            return image, f"`{snippet(facts, image, 50)}` turns an image into a CPU tensor"
        return self._unmoved_loader_part(facts, arg, site) or self._cpu_mapping(facts, arg, site)

    @staticmethod
    def _cpu_mapping(facts: FileFacts, arg: cst.BaseExpression, site) -> Optional[tuple[cst.CSTNode, str]]:
        """A mapping whose every entry the file makes a CPU tensor (``for k, v in inputs.items(): inputs[k] =
        torch.tensor(v)``), handed to the model whole (a forward that unpacks it) or as ``**inputs``."""
        order, scope = facts._position_of(arg)
        if order == 1 << 30:
            order, scope = site.order, site.scope
        filled = cpu_tensor_mapping(facts, arg, order, scope)
        if filled is None:
            return None
        return filled, f"a mapping whose every entry is `{snippet(facts, filled, 50)}`, no `device=`"

    @staticmethod
    def _bound_in_try(facts: FileFacts, arg, order: int, scope: Scope) -> bool:
        """The name's binding at the call is made inside a ``try`` statement (its body, a handler, ``else``)."""
        key = name_key(arg)
        binding = facts.binding_at(key, order, scope) if key is not None else None
        if binding is None:
            return False
        up = parents(facts, facts.module)
        node = up.get(id(binding.target))
        while node is not None and not isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            if isinstance(node, (cst.Try, cst.TryStar)):
                return True
            node = up.get(id(node))
        return False

    def _unmoved_loader_part(self, facts: FileFacts, arg: cst.BaseExpression, site) -> Optional[tuple[cst.CSTNode, str]]:
        """``for x, y in loader: model(x)`` (through ``enumerate``/``zip``/``tqdm``/``iter``/``next``) where ``x`` is
        a part of the batch, the loop binding is the one the call reads (no ``x = x.to(...)`` on the way), and the
        loader is a ``DataLoader`` over a dataset shown to yield CPU tensors, with the default collate function."""
        if not isinstance(arg, cst.Name):
            return None
        binding = facts.binding_at(arg.value, site.order, site.scope)
        wrapped = _variable_of_name(facts, binding)
        while wrapped is not None:
            # ``inputs, labels = Variable(inputs), Variable(labels)`` (pre-0.4 tutorials): the same tensor, same device
            binding = facts.binding_at(wrapped.value, binding.order, binding.scope)
            wrapped = _variable_of_name(facts, binding)
        if binding is None or binding.value is None:
            return None
        iterable, path = binding.value, binding.path
        made = binding.target  # where the input gets its value: the loop target, or the unpacking of the loop item
        if binding.kind == "unpack" and isinstance(iterable, cst.Name):
            # ``for i, data in enumerate(loader): inputs, labels = data`` (the CIFAR-10 tutorial): the loop item
            # unpacked in the body, when the name still holds the item the loop bound
            # (also ``data = next(it)`` / ``i, data = next(it)`` in a ``while`` loop)
            item = facts.binding_at(iterable.value, binding.order, binding.scope)
            if item is None or item.value is None or item.scope is not binding.scope:
                return None
            if item.kind == "for":
                binding, iterable, path = item, item.value, (*item.path, *path)
            elif item.kind in ("assign", "unpack") and _pulled_by_next(item.value):
                binding, iterable, path = item, item.value.args[0].value, (*item.path, *path)
            else:
                return None
        elif binding.kind == "unpack":
            if not _pulled_by_next(iterable):
                return None
            iterable = iterable.args[0].value
        elif binding.kind != "for":
            return None
        found = loop_item_source(facts, iterable, path, binding.order, binding.scope)
        if found is None:
            return None
        loader_expr, path, order, scope = found
        if len(path) != 1:
            return None  # the whole batch (a list or dict), or deeper than the dataset's tuple
        loader = facts.value(loader_expr, order, scope)
        if loader.kind != "dataloader" or loader.has(TRAIT_PREPARED) or not isinstance(loader.node, cst.Call):
            return None
        loader_call = loader.node
        if facts.qualname(loader_call.func) != "torch.utils.data.DataLoader":
            return None
        if call_arg(loader_call, keyword="collate_fn") is not None or any(a.star for a in loader_call.args):
            return None
        dataset = call_arg(loader_call, 0, "dataset")
        at = facts._position_of(loader_call)
        described = self._cpu_dataset(facts, dataset, path[0], *at)
        if described is None:
            return None
        return made, (
            f"a part of a batch from `{snippet(facts, loader_expr, 30)}`, a DataLoader over {described}, "
            "never moved on the way"
        )

    def _unmoved_collated_batch(self, facts: FileFacts, arg: cst.BaseExpression, site) -> Optional[tuple[cst.CSTNode, str]]:
        """``for batch in loader: model(**batch)`` where the whole batch comes from a ``DataLoader`` whose
        ``collate_fn`` builds CPU tensors (a transformers data collator, or the file's own function returning a
        ``tokenizer(..., return_tensors="pt")`` output it never moves) and the loop reads the batch nowhere before
        the call (no ``batch = {k: v.to(device) ...}``, no ``batch.to(device)``)."""
        if not isinstance(arg, cst.Name):
            return None
        binding = facts.binding_at(arg.value, site.order, site.scope)
        if binding is None or binding.kind != "for" or binding.value is None:
            return None
        found = loop_item_source(facts, binding.value, binding.path, binding.order, binding.scope)
        if found is None or found[1]:
            return None  # not the whole batch
        loader_expr, _path, order, scope = found
        loader = facts.value(loader_expr, order, scope)
        if loader.kind != "dataloader" or loader.has(TRAIT_PREPARED) or not isinstance(loader.node, cst.Call):
            return None
        if facts.qualname(loader.node.func) != "torch.utils.data.DataLoader" or any(a.star for a in loader.node.args):
            return None
        collate = call_arg(loader.node, keyword="collate_fn")
        described = _cpu_collate(facts, collate, *facts._position_of(loader.node)) if collate is not None else None
        if described is None:
            return None
        arg_position = facts._position_of(arg)[0]
        if any(order_ < arg_position and node is not arg
               for order_, node, _scope in facts.loads_of(arg.value, after=binding.order, scope=binding.scope)):
            return None  # read on the way (moved in place, passed to a helper, ...): where it is is not shown
        return binding.target, (
            f"a batch from `{snippet(facts, loader_expr, 30)}`, whose collate function {described}, never moved on the way"
        )

    def _cpu_dataset(self, facts: FileFacts, dataset, index: int, order: int, scope: Scope, depth: int = 0) -> Optional[str]:
        """How the dataset is known to yield CPU tensors at position ``index`` of its items: a torchvision dataset (no
        ``lambda`` in the file moves a tensor), a ``TensorDataset`` of CPU tensors, or the file's own ``Dataset``
        whose ``__getitem__`` builds that part without ``device=`` and whose class places nothing."""
        if dataset is None or depth > 4:
            return None
        if isinstance(dataset, cst.Name):
            binding = facts.binding_at(dataset.value, order, scope)
            if binding is None or binding.kind != "assign" or binding.value is None:
                return None
            return self._cpu_dataset(facts, binding.value, index, binding.order, binding.scope, depth + 1)
        if not isinstance(dataset, cst.Call):
            return None
        q = facts.qualname(dataset.func) or ""
        if q.startswith("torchvision.datasets.") and all(
            _torchvision_steps(facts, arg.value, order, scope) for arg in dataset.args if arg.keyword is not None
            and arg.keyword.value in ("transform", "target_transform", "transforms")
        ) and not any(arg.star for arg in dataset.args):
            return f"`{q.split('.')[-1]}` (torchvision builds its samples on the CPU)"
        if q == "torch.utils.data.TensorDataset":
            tensors = [a.value for a in dataset.args if a.keyword is None]
            if any(a.star for a in dataset.args) or index >= len(tensors):
                return None
            if cpu_computed(facts, tensors[index], order, scope) is None:
                return None
            return f"a `TensorDataset` whose tensor `{snippet(facts, tensors[index], 30)}` is on the CPU"
        if isinstance(dataset.func, cst.Name) and dataset.func.value in facts.classes and q == "":
            return self._own_dataset(facts, dataset.func.value, index)
        return None

    @staticmethod
    def _own_dataset(facts: FileFacts, class_name: str, index: int) -> Optional[str]:
        methods = method_scopes(facts, class_name)
        getitem = next((m for m in methods if m.name == "__getitem__"), None)
        if getitem is None:
            return None
        for call in facts.calls:
            if any(call.scope is m for m in methods) and (
                call.method in PLACING_METHODS or call_arg(call.node, keyword="device") is not None
            ):
                return None
        returns = facts.returns.get(id(getitem), ())
        if not returns:
            return None
        for ret in returns:
            value = ret.value
            if ret.kind != "return" or not isinstance(value, cst.Tuple) or index >= len(value.elements):
                return None
            if cpu_computed(facts, value.elements[index].value, ret.order, ret.scope) is None:
                return None
        return f"`{class_name}`, whose `__getitem__` builds its tensors on the CPU"


# transformers data collators: they pad and stack into CPU tensors (``torch.tensor``/``tokenizer.pad``) and never move.
_CPU_COLLATORS = {
    "transformers.DataCollatorWithPadding", "transformers.DataCollatorForLanguageModeling",
    "transformers.DataCollatorForSeq2Seq", "transformers.DataCollatorForTokenClassification",
    "transformers.DefaultDataCollator", "transformers.default_data_collator",
}


def _cpu_collate(facts: FileFacts, collate: cst.BaseExpression, order: int, scope: Scope) -> Optional[str]:
    """How a ``collate_fn`` is known to build CPU tensors: a transformers data collator, or the file's own function
    (not a method) whose every ``return`` gives a tokenizer output made with ``return_tensors="pt"`` that the
    function never places (``.to``/``.cuda`` on it, or a ``device=`` anywhere in it)."""
    if facts.qualname(collate) in _CPU_COLLATORS:
        return f"`{snippet(facts, collate, 30)}` pads into CPU tensors"
    built = facts.built_by(collate, order, scope)
    if isinstance(built, cst.Call) and facts.qualname(built.func) in _CPU_COLLATORS:
        return f"`{snippet(facts, built, 40)}` pads into CPU tensors"
    if not isinstance(collate, cst.Name) or facts.binding_at(collate.value, order, scope) is None:
        return None
    functions = [f for f in facts.functions if f.name == collate.value and f.class_name is None]
    if len(functions) != 1:
        return None
    function = functions[0]
    if any(call.scope is function and (call.method in PLACING_METHODS or call_arg(call.node, keyword="device") is not None)
           for call in facts.calls):
        return None
    returns = [r for r in facts.returns.get(id(function), ()) if r.value is not None]
    if not returns:
        return None
    for ret in returns:
        value = facts.value(ret.value, ret.order, ret.scope)
        origin = value.node if value.base is None else None
        if value.kind != "tokenizer_output" or not isinstance(origin, cst.Call):
            return None
        at = facts._position_of(origin)
        if string_value(facts.keyword_argument(origin, "return_tensors", *at)) != "pt":
            return None
    return f"`{collate.value}` returns a `return_tensors=\"pt\"` tokenizer output (CPU tensors)"


def _variable_of_name(facts: FileFacts, binding) -> Optional[cst.Name]:
    """``x`` when ``binding`` gives its name ``Variable(x)`` (``v = Variable(x)``, or an element of ``a, b =
    Variable(x), Variable(y)``): since torch 0.4 ``Variable`` returns the tensor itself, on its device."""
    if binding is None or binding.value is None:
        return None
    node = binding.value
    if binding.kind == "unpack" and isinstance(node, (cst.Tuple, cst.List)) and len(binding.path) == 1 \
            and binding.path[0] < len(node.elements) and not any(isinstance(e, cst.StarredElement) for e in node.elements):
        node = node.elements[binding.path[0]].value
    elif binding.kind != "assign":
        return None
    if isinstance(node, cst.Call) and facts.qualname(node.func) in _VARIABLE and len(node.args) >= 1 \
            and node.args[0].keyword is None and not node.args[0].star and isinstance(node.args[0].value, cst.Name):
        return node.args[0].value
    return None


def _pulled_by_next(value: Optional[cst.CSTNode]) -> bool:
    """``next(it)``: one item of ``it``."""
    return isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "next" and bool(value.args)


def _literal_scalar(facts: FileFacts, origin: cst.CSTNode) -> bool:
    """``torch.tensor(3)`` / ``torch.tensor(-0.5)``: a 0-dim tensor from a number written in the code."""
    if not isinstance(origin, cst.Call) or facts.qualname(origin.func) not in ("torch.tensor", "torch.as_tensor"):
        return False
    first = call_arg(origin, 0, "data")
    while isinstance(first, cst.UnaryOperation):
        first = first.expression
    return isinstance(first, (cst.Integer, cst.Float))


# torchvision steps that only take a PIL image or a numpy array (a tensor raises), so what they give is on the CPU.
_IMAGE_TO_TENSOR = {"torchvision.transforms.ToTensor", "torchvision.transforms.PILToTensor",
                    "torchvision.transforms.functional.to_tensor", "torchvision.transforms.functional.pil_to_tensor"}


def _image_to_tensor(facts: FileFacts, node, order: int, scope: Scope, depth: int = 0) -> Optional[cst.Call]:
    """The call that turns an image into a CPU tensor behind ``node``: ``tfms(img)`` where ``tfms`` is a torchvision
    ``ToTensor``/``PILToTensor`` or a ``Compose`` of torchvision steps holding one, ``TF.to_tensor(img)``; followed
    through names (never moved: ``x = x.to(...)`` stops it), views or casts with literal arguments
    (``.unsqueeze(0)``, ``.float()``) and the file's own helpers (every ``return`` of the one called)."""
    if node is None or depth > 6:
        return None
    if isinstance(node, cst.Call):
        func = node.func
        if isinstance(func, cst.Attribute) and facts.qualname(func) is None:
            literal = all(isinstance(a.value, (cst.Integer, cst.UnaryOperation)) for a in node.args)
            if func.attr.value in SAME_DEVICE_METHODS and literal:
                return _image_to_tensor(facts, func.value, order, scope, depth + 1)
            return None
        if facts.qualname(func) in _IMAGE_TO_TENSOR:
            return node
        site = facts.call_site(node)
        if site is not None and site.qualname is None and facts.callee_scopes(site):
            # the file's own helper (``image_loader(path)``): what every one of its returns is
            return facts.every_return(site, lambda value, at, within, _callee: _image_to_tensor(facts, value, at, within, depth + 1))
        built = func if isinstance(func, cst.Call) else facts.built_by(func, order, scope)
        q = facts.qualname(built.func) if isinstance(built, cst.Call) else None
        if q in _IMAGE_TO_TENSOR:
            return node
        if q and q.endswith(".Compose") and _torchvision_steps(facts, built, *facts._position_of(built)):
            steps = call_arg(built, 0, "transforms")
            if any(isinstance(step.value, cst.Call) and facts.qualname(step.value.func) in _IMAGE_TO_TENSOR
                   for step in steps.elements):
                return node
        return None
    binding = facts.assignment_of(node, order, scope)
    if binding is None or binding.key.startswith("self."):
        return None
    return _image_to_tensor(facts, binding.value, binding.order, binding.scope, depth + 1)


def _device_context(facts: FileFacts) -> bool:
    """``with torch.device("cuda"):``: creations without ``device=`` inside land on that device."""
    return any(isinstance(frame, WithFrame) and frame.qualname == "torch.device" for site in facts.calls for frame in site.context)


def _torchvision_steps(facts: FileFacts, node: cst.BaseExpression, order: int, scope: Scope) -> bool:
    """A dataset transform made only of torchvision's own steps (``transforms.Compose([transforms.ToTensor(), ...])``),
    none a ``Lambda`` or a class of the file's that could move the sample."""
    built = facts.built_by(node, order, scope)
    if not isinstance(built, cst.Call):
        return False
    q = facts.qualname(built.func) or ""
    if not q.startswith("torchvision.transforms.") or q.endswith(".Lambda"):
        return False
    if q.endswith(".Compose"):
        steps = call_arg(built, 0, "transforms")
        if not isinstance(steps, (cst.List, cst.Tuple)):
            return False
        at = facts._position_of(built)
        return all(_torchvision_steps(facts, step.value, *at) for step in steps.elements)
    return True


# transformers encoder-decoder text models: generate() runs their encoder on the input_ids as given (transformers 5.24
# moves only the decoder's inputs, in prepare_inputs_for_generation).
_ENCODER_DECODER = ("AutoModelForSeq2SeqLM", "T5ForConditionalGeneration", "MT5ForConditionalGeneration",
                    "UMT5ForConditionalGeneration", "LongT5ForConditionalGeneration", "BartForConditionalGeneration",
                    "MBartForConditionalGeneration", "MarianMTModel", "PegasusForConditionalGeneration",
                    "BlenderbotForConditionalGeneration", "LEDForConditionalGeneration", "M2M100ForConditionalGeneration")


def _encoder_decoder(facts: FileFacts, model_expr: cst.BaseExpression, site) -> bool:
    origin = facts.value(model_expr, site.order, site.scope).origin().node
    q = facts.qualname(origin.func) if isinstance(origin, cst.Call) else None
    owner_method = apis.hf_class_method(q) if q else None
    return bool(owner_method and owner_method[1] == "from_pretrained" and owner_method[0].split(".")[-1] in _ENCODER_DECODER)


def _unmoved_tokenizer_output(facts: FileFacts, arg: cst.BaseExpression, site, whole: bool) -> Optional[tuple[cst.CSTNode, str]]:
    """``inputs = tokenizer(text, return_tensors="pt")`` handed on as ``**inputs`` (``whole``), or its
    ``inputs["input_ids"]`` / ``inputs.input_ids``, when nothing moves it between the tokenizer call and the model
    call: no ``.to(...)``/``.cuda()`` on it (``BatchEncoding.to`` moves in place), no store into it, not handed to
    another call."""
    node = arg
    if not whole:
        if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) \
                and string_value(node.slice[0].slice.value) is not None:
            node = node.value
        elif isinstance(node, cst.Attribute) and node.attr.value in ("input_ids", "attention_mask", "pixel_values"):
            node = node.value
        else:
            return None
    key = name_key(node)
    if key is None or "." in key:
        return None
    binding = facts.binding_at(key, site.order, site.scope)
    if binding is None or binding.kind != "assign" or binding.scope is not site.scope or not isinstance(binding.value, cst.Call):
        return None
    made = binding.value
    if isinstance(made.func, cst.Attribute) and made.func.attr.value in PLACING_METHODS:
        return None  # ``tokenizer(...).to(device)``
    if facts.value(made, binding.order, binding.scope).kind != "tokenizer_output":
        return None
    if string_value(call_arg(made, keyword="return_tensors")) != "pt":
        return None
    for other in facts.calls:
        if not binding.order < other.order < site.order or other is site:
            continue
        if name_key(other.receiver) == key or any(name_key(a.value) == key for a in other.node.args):
            return None  # moved (``inputs.to(device)``) or handed to a helper that may move it
    if any(binding.order < s.order < site.order and s.base_key == key for s in facts.subscript_assigns):
        return None  # ``inputs["input_ids"] = inputs["input_ids"].to(device)``
    return made, f"`{snippet(facts, made, 50)}` returns CPU tensors and nothing moves them"
