"""What an expression IS, beyond library calls: the small type lattice every rule asks.

Kinds (``Value.kind``): model (any nn.Module, with its traits), accelerator, optimizer, scheduler,
dataloader, batch (an item a dataloader yields), tensor (a batch item, ``torch.*`` results, arithmetic and
views of tensors), model_output, tokenizer, tokenizer_output, device, tuple (a tuple/list display, or what a
function returns as several values), trainer, training_args, device_map, diffusion_pipeline (a diffusers
pipeline: its ``unet``/``vae``/``text_encoder``/``transformer``... are models, ``apis.DIFFUSION_PIPELINE_MODULES``),
unknown.

Values flow through assignments, unpacking, ``for`` targets (``enumerate``/``zip``/``tqdm``/``iter``,
the file's own generators), ``next()``, comprehensions, attribute stores on ``self``, returns of the file's
own functions and methods, and their parameters at each call site. Flow order is the collector's order.
Kept as a mixin of ``FileFacts`` (``model.py``) so evaluation stays one cached recursion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts.nodes import call_arg, dotted, name_key, string_value
from gpudoctor.check.facts.values import TRAIT_PEFT, TRAIT_PREPARED, UNKNOWN, Value

if TYPE_CHECKING:
    from gpudoctor.check.facts.records import Binding, CallSite, Scope

TENSOR = "tensor"
BATCH = "batch"
DEVICE = "device"
TUPLE = "tuple"
MODEL_OUTPUT = "model_output"
DIFFUSION_PIPELINE = "diffusion_pipeline"
TOKENIZER_OUTPUT = "tokenizer_output"

# Iteration wrappers whose items are the items of their first argument.
# Wrappers that hand on the items of their first argument unchanged (``tqdm(loader)``, ``list(params)``).
PASS_ITEMS = frozenset({"tqdm", "iter", "list", "track", "sorted", "reversed", "tuple", "trange"})
# torch functions that do not return a tensor.
_TORCH_NOT_TENSOR = {
    "device", "no_grad", "enable_grad", "inference_mode", "set_grad_enabled", "load", "save", "manual_seed",
    "compile", "Size", "Generator", "autocast", "is_tensor", "numel", "is_floating_point", "get_default_dtype",
    "set_default_dtype", "set_default_device", "set_default_tensor_type", "use_deterministic_algorithms",
    "set_float32_matmul_precision", "set_num_threads", "get_num_threads", "dtype", "finfo", "iinfo",
}
# Tensor methods whose result is not a tensor.
_TENSOR_TO_PYTHON = {"item", "tolist", "numpy", "size", "dim", "numel", "ndimension", "nelement", "element_size",
                     "is_contiguous", "data_ptr", "get_device", "register_hook", "backward", "__len__"}
# Methods of a module that return the module itself.
_MODULE_SELF = {"train", "eval", "requires_grad_", "apply", "zero_grad"}
_DEVICE_PREFIXES = ("cuda", "cpu", "mps", "xpu", "npu", "meta")
# torchvision transforms whose output is a tensor: a pipeline's last step decides (``Compose([..., ToTensor(),
# Normalize(...)])(img)``), and the functional forms.
_TENSOR_TRANSFORMS = {"ToTensor", "PILToTensor", "Normalize", "ConvertImageDtype", "RandomErasing", "ToImage", "ToDtype",
                      "ToPureTensor"}
_TENSOR_TRANSFORM_FUNCTIONS = {"to_tensor", "pil_to_tensor", "normalize", "convert_image_dtype"}


class FollowedCall(NamedTuple):
    """A call of the file's own function being followed into (``helper(w)`` into ``def helper(x)``): inside
    ``callee``, its parameters stand for what ``site`` passes, not for what every call passes."""

    site: "CallSite"
    callee: "Scope"


def _tensor(node: cst.CSTNode, **traits) -> Value:
    return Value(TENSOR, node, dict(traits))



def _without_adapters(receiver: Value, call: cst.Call) -> Value:
    """``peft_model.merge_and_unload()`` / ``unload()`` / ``get_base_model()``: the transformers model under the
    adapters (merged or dropped), no longer a peft model; what happened to the model after it was wrapped (moved,
    cast) still holds."""
    peft = receiver.carrier(TRAIT_PEFT)
    if peft is None:
        return receiver.derive(call)
    traits: dict[str, Any] = {}
    current: Optional[Value] = receiver
    while current is not None and current is not peft:
        for name, trait in current.traits.items():
            traits.setdefault(name, trait)
        current = current.base
    return Value(receiver.kind, call, traits, base=peft.base)


# The names torch's transfer-learning tutorial (and the posts that copy it) give its dict of DataLoaders.
_LOADER_DICT_NAMES = {"dataloaders", "data_loaders", "dataloaders_dict", "loaders"}

# torchvision's model builders (``torchvision.models.resnet18(...)``, ``models.detection.fasterrcnn_resnet50_fpn``,
# ``get_model("vit_b_16")``) and timm's ``create_model`` return ``nn.Module``s; the weights enums and the registry
# helpers do not.
_VISION_NOT_BUILDERS = {"get_model_weights", "get_weight", "list_models", "get_model_builder"}


def _builds_vision_model(parts: list[str]) -> bool:
    if parts == ["timm", "create_model"]:
        return True
    if parts[:2] != ["torchvision", "models"] or len(parts) < 3:
        return False
    last = parts[-1]
    return not (last.endswith("_Weights") or last in _VISION_NOT_BUILDERS or last.startswith("_"))

class ExpressionValues:
    """Evaluation of expressions that are not library constructors (a mixin of ``FileFacts``)."""

    # -- provided by FileFacts
    def value(self, node, order=None, scope=None) -> Value: ...  # pragma: no cover
    def qualname(self, node) -> Optional[str]: ...  # pragma: no cover
    def binding_at(self, key, order, scope): ...  # pragma: no cover
    def _pipeline_component(self, node, pipeline, order, scope) -> Value: ...  # pragma: no cover
    def trainer_base(self, class_name, depth=0) -> Optional[str]: ...  # pragma: no cover

    # ------------------------------------------------------------------ questions

    def is_tensor(self, node: Optional[cst.CSTNode], order: Optional[int] = None, scope=None) -> bool:
        return self.value(node, order, scope).kind == TENSOR

    def is_device(self, node: Optional[cst.CSTNode], order: Optional[int] = None, scope=None) -> bool:
        return self.value(node, order, scope).kind == DEVICE

    def is_module_class(self, name: str) -> bool:
        """A class of this file that subclasses ``nn.Module`` (directly, through an HF model, or a local base)."""
        if self._module_classes is None:
            found: set[str] = set()
            changed = True
            while changed:
                changed = False
                for class_name, scope in self.classes.items():
                    if class_name in found:
                        continue
                    for base in scope.node.bases:
                        q = self.qualname(base.value) or ""
                        local = name_key(base.value)
                        parts = q.split(".")
                        if (
                            (parts[:2] == ["torch", "nn"] and parts[-1][:1].isupper())
                            or (parts[0] == "transformers" and (q.endswith("PreTrainedModel") or apis.is_model_class(parts[-1])))
                            or local in found
                        ):
                            found.add(class_name)
                            changed = True
                            break
            self._module_classes = found
        return name in self._module_classes

    def callee_scopes(self, site: "CallSite") -> list["Scope"]:
        """The file's own functions a call runs: ``helper(...)``, ``self.helper(...)``, ``Cls(...)`` (its
        ``__init__``)."""
        if self._functions_by_name is None:
            index: dict[str, list] = {}
            for scope in self.functions:
                index.setdefault(scope.name, []).append(scope)
            self._functions_by_name = index
        func = site.node.func
        if isinstance(func, cst.Name) and site.qualname is None:
            if func.value in self.classes:
                return [s for s in self._functions_by_name.get("__init__", ()) if s.class_name == func.value]
            return [s for s in self._functions_by_name.get(func.value, ()) if s.class_name is None or s.parent is self.module_scope]
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
            return self._self_method_scopes(func.attr.value, site.scope.class_name)
        if isinstance(func, cst.Attribute) and (name_key(func.value) is not None or isinstance(func.value, cst.Call)):
            # ``sampler = UniformSampler(n)`` ... ``sampler.sample(b)``: a method of an instance of the file's class,
            # also made in place (``ModelBuilder(cfg).build()``), through parameters (``train(opt, loader, model)``
            # called with ``model = VSE(opt)``) and ``self.x``
            owner = self._instance_class(func.value, site.order, site.scope)
            if owner is not None:
                return self._self_method_scopes(func.attr.value, owner)
        return []

    def _instance_class(self, node: cst.BaseExpression, order: int, scope: "Scope", depth: int = 0,
                        follow_params: Optional[bool] = None) -> Optional[str]:
        """The file's own class whose instance the name (or ``self.x``) ``node`` holds: every source of it is a
        ``Cls(...)`` call of the same class; None otherwise."""
        if depth > 4:
            return None
        if isinstance(node, cst.Call):
            func = node.func
            return func.value if isinstance(func, cst.Name) and func.value in self.classes else None
        if name_key(node) is None or (isinstance(node, cst.Name) and node.value == "self"):
            return None
        # Following a parameter asks for the calls of its function, which resolves their callees again: a
        # resolution entered from there (while another one runs) does not follow parameters, so it cannot recurse.
        outermost = not self.__dict__.get("_resolving_instance", False)
        if follow_params is None:
            follow_params = outermost
        self.__dict__["_resolving_instance"] = True
        try:
            sources = self.follow_name(node, order, scope, attributes=True, params=follow_params)
            found = {self._instance_class(*source, depth + 1, follow_params) for source in sources or ()}
        finally:
            if outermost:
                self.__dict__["_resolving_instance"] = False
        return found.pop() if len(found) == 1 and None not in found else None

    def _self_method_scopes(self, method: str, class_name: Optional[str]) -> list["Scope"]:
        """What ``self.method(...)`` in a method of ``class_name`` runs: the class's own definition, else the one
        it inherits from the nearest of the file's classes it derives from; plus the overrides in the file's
        subclasses of it (their instances run those: a base ``forward`` calling ``self._forward(...)``)."""
        if not class_name:
            return []
        defined: dict[str, list] = {}
        for scope in self._functions_by_name.get(method, ()):
            if scope.class_name:
                defined.setdefault(scope.class_name, []).append(scope)
        found = []
        for owner in (class_name, *self._local_ancestors(class_name)):
            if owner in defined:
                found.extend(defined[owner])
                break
        for owner, scopes in defined.items():
            if owner != class_name and class_name in self._local_ancestors(owner):
                found.extend(s for s in scopes if s not in found)
        return found

    def _local_ancestors(self, class_name: str) -> list[str]:
        """The file's own classes ``class_name`` derives from, nearest first (by name, through local bases)."""
        cache = self.__dict__.setdefault("_local_ancestors_cache", {})
        if class_name not in cache:
            cache[class_name] = []  # a cycle (a base named like a later class) ends here
            found: list[str] = []
            scope = self.classes.get(class_name)
            for base in (scope.node.bases if scope is not None and isinstance(scope.node, cst.ClassDef) else ()):
                local = name_key(base.value)
                if local in self.classes and local != class_name and local not in found:
                    found.append(local)
                    found.extend(a for a in self._local_ancestors(local) if a not in found)
            cache[class_name] = found
        return cache[class_name]

    def every_return(self, site: "CallSite", read: Callable[..., Any], path: tuple[int, ...] = ()) -> Any:
        """``read(value, order, scope, callee)`` of what every ``return`` of the file's function(s) ``site`` calls
        gives back (the element at ``path`` of a returned tuple: ``x, y = get_batch(...)``): the first result when
        every return gives one; None when one gives none, is a bare ``return``, or its shape does not fit ``path``."""
        found = None
        for callee in self.callee_scopes(site):
            for ret in self.returns.get(id(callee), ()):
                value = ret.value
                if ret.kind != "return" or value is None:
                    return None
                for index in path:
                    if not isinstance(value, cst.Tuple) or index >= len(value.elements) or value.elements[index].value is None:
                        return None
                    value = value.elements[index].value
                result = read(value, ret.order, ret.scope, callee)
                if result is None:
                    return None
                if found is None:
                    found = result
        return found

    def call_sites_of(self, scope: "Scope") -> list["CallSite"]:
        """Calls of the file's own function ``scope`` (by name, ``self.name``, or the class for ``__init__``)."""
        cache = self.__dict__.setdefault("_call_sites_of", {})
        found = cache.get(id(scope))
        if found is None:
            by_name = self.__dict__.get("_calls_by_last_name")
            if by_name is None:  # once per file: calls by the last part of their dotted name, in order
                by_name = self.__dict__["_calls_by_last_name"] = {}
                for site in self.calls:
                    by_name.setdefault((dotted(site.node.func) or "").split(".")[-1], []).append(site)
            name = scope.class_name if scope.name == "__init__" and scope.class_name else scope.name
            found = [site for site in by_name.get(name, ()) if scope in self.callee_scopes(site)]
            if not self.__dict__.get("_resolving_instance", False):
                cache[id(scope)] = found  # not while an instance's class is resolved without its parameters
        return found

    def bindings_built_by(self, call: cst.Call) -> list["Binding"]:
        """The assignments (in any scope, ``self.x`` included) that hold the object ``call`` built: directly
        (``opt = SGD(...)``), through temporaries and the file's own helpers (``self.opt = make_opt(...)``)."""
        index = self.__dict__.get("_bindings_built_by")
        if index is None:
            index = {}
            for scope in (self.module_scope, *self.functions):
                for bindings in scope.bindings.values():
                    for b in bindings:
                        if b.kind == "assign" and isinstance(b.value, (cst.Name, cst.Call)):
                            origin = self.value(b.value, b.order, b.scope).origin().node
                        elif b.kind == "unpack" and isinstance(b.value, cst.Call):
                            # ``model, optimizer = load_pretrain(...)``: one element of what the helper returns
                            origin = self._value_of_binding(b).origin().node
                        else:
                            continue
                        if origin is not None:
                            index.setdefault(id(origin), []).append(b)
            self.__dict__["_bindings_built_by"] = index
        return index.get(id(call), [])

    def built_by(self, node: Optional[cst.CSTNode], order: int, scope: "Scope", depth: int = 0) -> Optional[cst.Call]:
        """The library call an expression was built by, through names, temporaries, parameters (the first call
        that passes one) and the file's own helpers (``config = make_config()`` ... ``def make_config():
        return LoraConfig(...)``)."""
        if node is None or depth > 8:
            return None
        key = name_key(node)
        if key is not None:
            binding = self.binding_at(key, order, scope)
            if binding is not None and binding.kind == "param":  # what the caller passes
                passed = self.param_argument(binding)
                return self.built_by(*passed, depth + 1) if passed is not None else None
            if binding is not None and binding.kind == "unpack" and binding.value is not None:
                element = self._unpacked_element(binding, depth)
                return self.built_by(*element, depth + 1) if element is not None else None
            if binding is None or binding.kind != "assign" or binding.value is None:
                return None
            return self.built_by(binding.value, binding.order, binding.scope, depth + 1)
        if not isinstance(node, cst.Call):
            return None
        site = self._call_by_node.get(id(node))
        if site is not None and site.qualname is None:
            for callee in self.callee_scopes(site):
                for ret in self.returns.get(id(callee), ()):
                    found = self.built_by(ret.value, ret.order, ret.scope, depth + 1)
                    if found is not None:
                        return found
        return node

    def _unpacked_element(self, binding: "Binding", depth: int = 0):
        """(expression, order, scope) a tuple unpacking binds to ``binding``: the element of a tuple display
        (``a, b = x, y``), or of the tuple display a helper of the file returns (``model, opt, sched =
        build_everything(args)`` ... ``return model, opt, sched``)."""
        if binding.index is None or len(binding.path) > 1 or depth > 8:
            return None
        value = binding.value
        if isinstance(value, (cst.Tuple, cst.List)):
            elements = value.elements
            if binding.index < len(elements) and not any(isinstance(e, cst.StarredElement) for e in elements):
                return elements[binding.index].value, binding.order, binding.scope
            return None
        site = self._call_by_node.get(id(value)) if isinstance(value, cst.Call) else None
        if site is None or site.qualname is not None:
            return None
        for callee in self.callee_scopes(site):
            for ret in self.returns.get(id(callee), ()):
                if ret.kind != "return" or not isinstance(ret.value, (cst.Tuple, cst.List)):
                    continue
                elements = ret.value.elements
                if binding.index < len(elements) and not any(isinstance(e, cst.StarredElement) for e in elements):
                    return elements[binding.index].value, ret.order, ret.scope
        return None

    # ------------------------------------------------------------------ evaluation of expressions

    def _mapping_entry(self, node: cst.Subscript, order: int, scope: "Scope") -> Value:
        """``loaders[phase]`` where ``loaders`` is a dict whose values are all of one kind: a dict comprehension
        (``{x: DataLoader(sets[x], ...) for x in ["train", "val"]}``, torch's transfer-learning tutorial) or a
        display with the same kind in every value. In a snippet, an unbound ``dataloaders``/``data_loaders``
        subscripted is that tutorial's dict of DataLoaders."""
        key = name_key(node.value)
        if key is None or "." in key:
            return UNKNOWN
        binding = self.binding_at(key, order, scope)
        if binding is None:
            if key in _LOADER_DICT_NAMES and key not in self.imports and not self.assumed_instance(key):
                self.assumed_instances[key] = "torch.utils.data.DataLoader"
                return Value("dataloader", node, {"assumed": key})
            return UNKNOWN
        made = binding.value if binding.kind == "assign" else None
        if isinstance(made, cst.DictComp):
            value = self.value(made.value, binding.order, binding.scope)
            return value if value.kind == "dataloader" else UNKNOWN
        if isinstance(made, cst.Dict) and made.elements:
            values = [self.value(e.value, binding.order, binding.scope) for e in made.elements if isinstance(e, cst.DictElement)]
            if len(values) == len(made.elements) and all(v.kind == "dataloader" for v in values):
                return values[0]
        return UNKNOWN

    def _evaluate_expression(self, node: cst.CSTNode, order: int, scope: "Scope") -> Value:
        if isinstance(node, (cst.Tuple, cst.List)):
            return Value(TUPLE, node, {"items": tuple(e.value for e in node.elements), "at": (order, scope)})
        if isinstance(node, cst.BinaryOperation):
            left = self.value(node.left, order, scope)
            right = self.value(node.right, order, scope)
            if TENSOR in (left.kind, right.kind):
                return Value(TENSOR, node, base=left if left.kind == TENSOR else right)
            return UNKNOWN
        if isinstance(node, cst.UnaryOperation):
            inner = self.value(node.expression, order, scope)
            return Value(TENSOR, node, base=inner) if inner.kind == TENSOR else UNKNOWN
        if isinstance(node, cst.IfExp):
            body = self.value(node.body, order, scope)
            orelse = self.value(node.orelse, order, scope)
            for branch, value in ((node.body, body), (node.orelse, orelse)):
                if _is_unwrap(branch) and value.kind == "model":
                    # ``m.module if isinstance(m, DataParallel) else m``: whichever branch runs, the result is the
                    # unwrapped model (the other branch only runs when ``m`` is not a wrapper).
                    return value
            return body if body.kind != "unknown" else orelse
        if isinstance(node, cst.Subscript):
            base = self.value(node.value, order, scope)
            if base.kind in (BATCH, TOKENIZER_OUTPUT, MODEL_OUTPUT):
                return _tensor(node, batch_item=base) if base.kind == BATCH else _tensor(node)
            if base.kind == TENSOR:
                return Value(TENSOR, node, base=base)
            if base.kind == TUPLE and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
                index = node.slice[0].slice.value
                if isinstance(index, cst.Integer):
                    return self.element(base, (int(index.value),))
            if base.kind == "unknown":
                return self._mapping_entry(node, order, scope)
            return UNKNOWN
        if isinstance(node, cst.Attribute):
            return self._attribute_value(node, order, scope)
        if isinstance(node, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)):
            text = string_value(node)
            if text is None and isinstance(node, cst.FormattedString):
                text = "".join(p.value for p in node.parts if isinstance(p, cst.FormattedStringText))
            if text is not None and text.split(":")[0] in _DEVICE_PREFIXES:
                return Value(DEVICE, node, {"device": text})
            return UNKNOWN
        if isinstance(node, (cst.DictComp,)) or isinstance(node, cst.Dict):
            return UNKNOWN
        return UNKNOWN

    def _attribute_value(self, node: cst.Attribute, order: int, scope: "Scope") -> Value:
        attr = node.attr.value
        if attr == "model":
            built = self._trainer_construction(node.value, order, scope)
            if built is not None:  # ``trainer.model``: the model the Trainer (or the file's subclass) was built with
                return self.value(call_arg(built.node, 0, "model"), built.order, built.scope)
        base = self.value(node.value, order, scope)
        if base.kind == "unknown":
            return UNKNOWN
        if attr == "device" and base.kind in ("accelerator", "model", TENSOR, BATCH):
            return Value(DEVICE, node, {"of": base})
        if base.kind in (MODEL_OUTPUT, BATCH, TOKENIZER_OUTPUT):
            if base.kind == BATCH:
                return _tensor(node, batch_item=base)
            if base.kind == MODEL_OUTPUT and attr == "loss":
                return _tensor(node, output=base, loss=node)
            return _tensor(node, output=base)
        if base.kind == TENSOR and attr in ("T", "mT", "H", "data", "grad", "real", "imag"):
            return Value(TENSOR, node, base=base)
        if base.kind == "model" and attr in ("weight", "bias"):
            return _tensor(node, parameter=base)
        if base.kind == "model" and attr == "module":
            return _unwrapped(base, node)
        if base.kind == DIFFUSION_PIPELINE and attr in apis.DIFFUSION_PIPELINE_MODULES:
            return self._pipeline_component(node, base, order, scope)
        return UNKNOWN

    def _trainer_construction(self, node: cst.BaseExpression, order: int, scope: "Scope") -> Optional["CallSite"]:
        """The construction of a transformers/trl Trainer (or of the file's subclass of one) that the name ``node``
        holds: its one plain assignment is that call."""
        sources = self.follow_name(node, order, scope, params=False) if isinstance(node, cst.Name) else None
        if not sources or len(sources) != 1 or not isinstance(sources[0][0], cst.Call):
            return None
        site = self.call_site(sources[0][0])
        return site if site is not None and site in self.trainer_calls() else None

    def _evaluate_other_call(self, call: cst.Call, q: Optional[str], order: int, scope: "Scope", site) -> Value:
        """Calls that are not library constructors: torch functions, methods of known values, builtins that
        pass items through, and the file's own functions and classes."""
        if q:
            parts = q.split(".")
            if parts[0] == "torch":
                return self._torch_call(call, parts, order, scope)
            if parts[:2] == ["torchvision", "transforms"] and parts[-1] in _TENSOR_TRANSFORM_FUNCTIONS:
                return _tensor(call, created=q)  # TF.to_tensor(img)
            if q == "copy.deepcopy" and call.args:
                return self._copied_model(call, order, scope)
            if _builds_vision_model(parts):
                return Value("model", call, {"class": parts[-1], "module": True})
            return self._module_by_use(call, call) or UNKNOWN
        transformed = self._transformed_tensor(call, order, scope)
        if transformed is not None:
            return transformed
        func = call.func
        if isinstance(func, cst.Name):
            name = func.value
            if name == "next" and call.args:
                return self.item_of(call.args[0].value, order, scope, ())
            if name in ("iter", "tqdm", "list", "tuple") and call.args and self.binding_at(name, order, scope) is None:
                return self.value(call.args[0].value, order, scope)
            if _is_unwrap(call) and self.binding_at(name, order, scope) is None:
                # ``getattr(m, "module", m)``: the inner model when ``m`` is a wrapper, else ``m`` itself (not one)
                wrapped = self.value(call.args[0].value, order, scope)
                return _unwrapped(wrapped, call) if wrapped.has("wrapper") else wrapped
        if isinstance(func, cst.Attribute):
            receiver = self.value(func.value, order, scope)
            method = func.attr.value
            known = self._method_value(call, receiver, method, order, scope)
            if known is not None:
                return known
        if site is not None:
            return self._own_call_value(call, site)
        return UNKNOWN

    def _copied_model(self, call: cst.Call, order: int, scope: "Scope") -> Value:
        """``ema = copy.deepcopy(model)``: another model of the same class, a new object (its own origin: what is
        done to ``model`` later, a move or ``prepare``, is not done to the copy)."""
        copied = self.value(call.args[0].value, order, scope)
        if copied.kind != "model":
            return UNKNOWN
        traits = {k: copied.trait(k) for k in ("class", "module") if copied.has(k)}
        return Value("model", call, traits)

    def _transformed_tensor(self, call: cst.Call, order: int, scope: "Scope") -> Optional[Value]:
        """``tfms(img)`` where ``tfms`` is a torchvision transform (or ``Compose`` pipeline) that ends in a
        tensor step: the result is a (CPU) tensor."""
        if not isinstance(call.func, (cst.Name, cst.Call)):
            return None
        built = call.func if isinstance(call.func, cst.Call) else self.built_by(call.func, order, scope)
        step = built
        q = self.qualname(built.func) if isinstance(built, cst.Call) else None
        if q in ("torchvision.transforms.Compose", "torchvision.transforms.v2.Compose"):
            steps = call_arg(built, 0, "transforms")
            step = steps.elements[-1].value if isinstance(steps, cst.List) and steps.elements else None
        q = self.qualname(step.func) if isinstance(step, cst.Call) else None
        if q and q.startswith("torchvision.transforms.") and q.rsplit(".", 1)[1] in _TENSOR_TRANSFORMS:
            return _tensor(call, created=q)
        return None

    def _torch_call(self, call: cst.Call, parts: list[str], order: int, scope: "Scope") -> Value:
        last = parts[-1]
        if len(parts) == 2 and last == "device":
            text = string_value(call_arg(call, 0, "type"))
            return Value(DEVICE, call, {"device": text})
        if len(parts) == 2 and last == "compile":
            return self.value(call_arg(call, 0, "model"), order, scope)
        if parts[1] == "nn" and last[:1].isupper():
            if last in ("Parameter", "Buffer"):
                return _tensor(call)
            if len(parts) == 3 or parts[2] == "modules":
                return Value("model", call, {"class": last, "module": True})
            return UNKNOWN
        if parts[1] in ("cuda", "distributed", "utils", "backends", "optim", "amp", "jit", "onnx", "hub", "multiprocessing"):
            return UNKNOWN
        if last in _TORCH_NOT_TENSOR or last.startswith(("is_", "set_", "get_")):
            return UNKNOWN
        if parts[:3] == ["torch", "nn", "functional"] and ("loss" in last or "entropy" in last):
            return _tensor(call, loss=call)
        if len(parts) == 2 or parts[1] in ("nn", "linalg", "fft", "special") or last[:1].isupper():
            return _tensor(call, created=".".join(parts))
        return UNKNOWN

    def _method_value(self, call: cst.Call, receiver: Value, method: str, order: int, scope: "Scope") -> Optional[Value]:
        kind = receiver.kind
        if kind == TENSOR:
            if method in _TENSOR_TO_PYTHON:
                return UNKNOWN
            return Value(TENSOR, call, base=receiver)
        if kind == "model":
            if method in _MODULE_SELF:
                return receiver
            if method == "forward":
                return Value(MODEL_OUTPUT, call, {"model": receiver})
            if method == "generate":
                return _tensor(call)
            if method in ("merge_and_unload", "unload", "get_base_model"):
                return _without_adapters(receiver, call)
            return None
        if kind == "tokenizer" and method in ("__call__", "encode_plus", "batch_encode_plus", "pad"):
            return Value(TOKENIZER_OUTPUT, call)
        if kind == TOKENIZER_OUTPUT and method in ("to", "cuda"):
            return receiver  # BatchEncoding.to moves in place and returns itself
        if kind == BATCH:
            if method in ("pop", "get", "__getitem__"):
                return _tensor(call, batch_item=receiver)
            if method in ("to", "cuda"):
                return receiver
        if kind == "accelerator":
            if method == "unwrap_model" and call.args:
                return self.value(call.args[0].value, order, scope)
            if method in ("gather", "gather_for_metrics", "reduce", "pad_across_processes"):
                return _tensor(call)
        return None

    def _own_call_value(self, call: cst.Call, site: "CallSite") -> Value:
        func = call.func
        if isinstance(func, cst.Name) and func.value in self.classes and self.binding_at(func.value, site.order, site.scope) is not None:
            if self.is_module_class(func.value):
                return Value("model", call, {"class": func.value, "module": True})
            return UNKNOWN
        for callee in self.callee_scopes(site):
            for ret in self.returns.get(id(callee), ()):
                if ret.value is None:
                    continue
                value = self.value(ret.value, ret.order, ret.scope)
                if value.kind != "unknown":
                    return value
        # A call of a model: the forward pass (of a loss module: the loss).
        callee = self.value(func, site.order, site.scope) if name_key(func) is not None else UNKNOWN
        if callee.kind == "model":
            if str(callee.trait("class") or "").endswith("Loss"):
                return _tensor(call, loss=call)
            return Value(MODEL_OUTPUT, call, {"model": callee})
        if callee.kind == "tokenizer":
            return Value(TOKENIZER_OUTPUT, call)
        if isinstance(func, cst.Name) and func.value not in self.classes and self.binding_at(func.value, site.order, site.scope) is None:
            return self._module_by_use(call, call) or UNKNOWN  # a class imported relatively or from a star import
        return UNKNOWN

    def _module_by_use(self, call: cst.Call, bound: cst.CSTNode, chained: frozenset = frozenset()) -> Optional[Value]:
        """An instance of a class the file does not show (``Darknet(cfg)`` from the project's own ``models``) is a
        module when a name bound to ``bound`` (the call, or a move/cast of it) is used as only an ``nn.Module`` is:
        ``.parameters()``, ``.named_modules()``, ``.register_forward_hook()``..., or both a state-dict load or a
        mode switch and a move (``net.load_state_dict(sd); net.to(device)``). ``chained``: the methods called on the
        call itself before the binding (``Darknet(cfg).to(device)``)."""
        name = dotted(call.func) or ""
        class_name = name.rsplit(".", 1)[-1]
        if not class_name[:1].isupper() or class_name.isupper():
            return None  # a function, or a CONSTANT-like callable: not a class
        for binding in self._bindings_by_value.get(id(bound), ()):
            if apis.used_as_module(self.member_uses.get(binding.key, set()) | chained):
                return Value("model", call, {"class": class_name, "module": True, "by_use": binding.key})
        return None

    # ------------------------------------------------------------------ bindings that are not plain assignments

    def _flow_binding_value(self, binding: "Binding") -> Value:
        if binding.kind == "for" and binding.value is not None:
            return self.item_of(binding.value, binding.order, binding.scope, binding.path)
        if binding.kind == "unpack" and binding.value is not None:
            nxt = binding.value
            if isinstance(nxt, cst.Call) and isinstance(nxt.func, cst.Name) and nxt.func.value == "next" and nxt.args:
                return self.item_of(nxt.args[0].value, binding.order, binding.scope, binding.path)
            whole = self.value(binding.value, binding.order, binding.scope)
            return self.element(whole, binding.path or ((binding.index,) if binding.index is not None else ()))
        if binding.kind == "with" and binding.value is not None:
            return self.element(self.value(binding.value, binding.order, binding.scope), binding.path)
        if binding.kind == "param":
            return self._param_value(binding)
        return UNKNOWN

    def _param_value(self, binding: "Binding") -> Value:
        """A parameter is what the file's calls pass to it (the first call that passes something known),
        else its default. ``self`` of a method of the file's ``nn.Module`` subclass is that module."""
        owner = self._instance_param_class(binding)
        if owner is not None and self.is_module_class(owner):
            return Value("model", binding.target, {"class": owner, "module": True})
        for arg, order, scope in self.param_arguments(binding):
            value = self.value(arg, order, scope)
            if value.kind != "unknown":
                return value
        param = binding.target
        if isinstance(param, cst.Param) and param.default is not None:
            return self.value(param.default, binding.order, binding.scope)
        return UNKNOWN

    def follow_name(
        self, node: Optional[cst.CSTNode], order: int, scope: "Scope", *, params: bool = True, attributes: bool = False,
        stop: Optional[Callable[["Binding", int], bool]] = None, passed: Optional[FollowedCall] = None,
    ) -> Optional[list[tuple[cst.BaseExpression, int, "Scope"]]]:
        """What the name ``node`` (``self.x`` too when ``attributes``) stands for at ``order``, as (expression,
        order, scope) to read: the value of its plain assignment; for a parameter (when ``params``), the
        argument of every call of the file that passes one (see ``param_sources``: possibly none). None when
        it is not followed: not a name, unbound, bound otherwise (a loop target, an unpacking, ``with``,
        ``def``), or ``stop(binding, order)`` says the binding no longer holds at ``order``."""
        key = name_key(node) if node is not None else None
        if key is None or (key.startswith("self.") and not attributes):
            return None
        binding = self.binding_at(key, order, scope)
        if binding is None or (stop is not None and stop(binding, order)):
            return None
        if binding.kind == "param":
            return self.param_sources(binding, passed) if params else None
        if binding.kind == "unpack" and binding.value is not None and binding.path:
            return self._unpacked_sources(binding)
        if binding.kind != "assign" or binding.value is None:
            return None
        return [(binding.value, binding.order, binding.scope)]

    def _unpacked_sources(self, binding: "Binding") -> Optional[list[tuple[cst.BaseExpression, int, "Scope"]]]:
        """The element an unpacking binds: ``a, b = x, y`` -> ``y`` for b; ``loader, labels = build(cfg)`` -> the
        element at that position of every ``return`` of the file's own ``build`` (None when one return is not a
        tuple display of that shape: not followed)."""
        value = binding.value
        if isinstance(value, cst.Tuple):
            sources = [(value, binding.order, binding.scope)]
        elif isinstance(value, cst.Call):
            site = self.call_site(value)
            callees = self.callee_scopes(site) if site is not None and site.qualname is None else []
            if not callees or any(callee.name == "__init__" for callee in callees):
                return None
            returns = [ret for callee in callees for ret in self.returns.get(id(callee), ())]
            if not returns or any(ret.kind != "return" or ret.value is None for ret in returns):
                return None
            sources = [(ret.value, ret.order, ret.scope) for ret in returns]
        else:
            return None
        found = []
        for element, order, scope in sources:
            for index in binding.path:
                if not isinstance(element, (cst.Tuple, cst.List)) or index >= len(element.elements):
                    return None
                item = element.elements[index]
                if isinstance(item, cst.StarredElement) or any(isinstance(e, cst.StarredElement) for e in element.elements):
                    return None
                element = item.value
            found.append((element, order, scope))
        return found

    def through_name(self, read: Callable[..., Any], node: Optional[cst.CSTNode], order: int, scope: "Scope", **follow) -> Any:
        """``read(expression, order, scope)`` of what the name ``node`` stands for (``follow_name``, with its
        options): the first result when every source gives one (a parameter: every call's argument agrees),
        else None."""
        sources = self.follow_name(node, order, scope, **follow)
        found = [read(*source) for source in sources or ()]
        return found[0] if found and all(found) else None

    def param_sources(self, binding: "Binding", passed: Optional[FollowedCall] = None) -> list:
        """(argument, order, scope) for parameter ``binding``: what every call of the file passes, or only what
        ``passed.site`` passes when the parameter belongs to ``passed.callee`` (the call being followed; none
        when that call passes it by keyword-star or not at all)."""
        arguments = list(self.param_arguments(binding))
        if passed is not None and passed.callee is binding.scope:
            return [a for a in arguments if a[1] == passed.site.order and a[2] is passed.site.scope][:1]
        return arguments

    def param_argument(self, binding: "Binding"):
        """(the argument, order, scope) the first call of the function passes for parameter ``binding``."""
        return next(self.param_arguments(binding), None)

    @staticmethod
    def _instance_param_class(binding: "Binding") -> Optional[str]:
        """The class whose instance the parameter ``binding`` is: the first parameter of a plain method
        (``self``; not of a staticmethod/classmethod)."""
        function, param = binding.scope, binding.target
        if not isinstance(function.node, cst.FunctionDef) or not isinstance(param, cst.Param):
            return None
        if function.parent is None or function.parent.kind != "class":
            return None
        if any(d.split(".")[-1] in ("staticmethod", "classmethod") for d in function.decorators):
            return None
        params = [*function.node.params.posonly_params, *function.node.params.params]
        return function.class_name if params and params[0] is param else None

    def _trainer_hook_params(self, function: "Scope", hooks) -> Optional[list]:
        """The positional parameters of ``function`` when it is a method named in ``hooks`` of the file's subclass of
        a transformers/trl trainer (a method the trainer itself calls), else None."""
        if function.name not in hooks or not isinstance(function.node, cst.FunctionDef):
            return None
        if function.parent is None or function.parent.kind != "class" or self.trainer_base(function.parent.name) is None:
            return None
        return [*function.node.params.posonly_params, *function.node.params.params]

    def trainer_prepared_batch(self, binding: "Binding") -> bool:
        """``binding`` is the batch parameter of ``compute_loss(self, model, inputs, ...)`` in the file's subclass
        of a transformers/trl trainer: the trainer calls it with the batch its ``_prepare_inputs`` already moved to
        the training device (``training_step`` and ``prediction_step`` receive the batch before that move)."""
        function, param = binding.scope, binding.target
        if binding.kind != "param" or not isinstance(param, cst.Param):
            return False
        if any(d.split(".")[-1] in ("staticmethod", "classmethod") for d in function.decorators):
            return False
        params = self._trainer_hook_params(function, ("compute_loss",))
        return params is not None and len(params) > 2 and params[2] is param  # (self, model, inputs, ...)

    def param_arguments(self, binding: "Binding"):
        """(argument, order, scope) for each call of the file that passes parameter ``binding``; for the ``model``
        parameter of a Trainer hook the file overrides (``compute_loss(self, model, inputs)``), which the Trainer
        calls with the model it was built with, the ``model=`` of each construction of the file's subclass."""
        function, param = binding.scope, binding.target
        if not isinstance(function.node, cst.FunctionDef) or not isinstance(param, cst.Param):
            return
        for site in self.call_sites_of(function):
            arg = self.argument_for(site, function, param)
            if arg is not None:
                yield arg, site.order, site.scope
        yield from self._trainer_hook_model(function, param)

    def is_trainer_hook_model(self, binding: "Binding") -> bool:
        """``binding`` is the ``model`` parameter of a Trainer hook the file overrides (``compute_loss(self, model,
        inputs)``): the model the Trainer was built with, which the Trainer placed on its device."""
        function, param = binding.scope, binding.target
        if binding.kind != "param" or not isinstance(param, cst.Param):
            return False
        return self._hook_model_param(function, param)

    def _hook_model_param(self, function: "Scope", param: cst.Param) -> bool:
        params = self._trainer_hook_params(function, apis.TRAINER_MODEL_HOOKS)
        return params is not None and len(params) >= 2 and params[1] is param

    def _trainer_hook_model(self, function: "Scope", param: cst.Param):
        """``model`` of ``compute_loss``/``training_step``/``prediction_step`` (the first parameter after ``self``)
        in the file's subclass of a transformers/trl Trainer: the ``model=`` (or first positional argument) of each
        ``MyTrainer(...)`` call of the file (the Trainer hands its own model, wrapped only for DDP/DataParallel)."""
        owner = function.class_name
        if not self._hook_model_param(function, param):
            return
        classes = {owner, *(c for c in self.classes if owner in self._local_ancestors(c))}
        for site in self.trainer_calls():
            func = site.node.func
            if site.qualname is None and isinstance(func, cst.Name) and func.value in classes:
                arg = call_arg(site.node, 0, "model")
                if arg is not None:
                    yield arg, site.order, site.scope

    def argument_for(self, site: "CallSite", function: "Scope", param: cst.Param) -> Optional[cst.BaseExpression]:
        """The argument the call ``site`` of the file's function ``function`` passes for its parameter ``param``:
        by keyword, or by position (after the ``self``/``cls`` a method receives from its instance or class; a
        ``staticmethod`` receives none); None when it passes none, or a ``*args`` before it hides its position."""
        params = [*function.node.params.posonly_params, *function.node.params.params]
        position = next((i for i, p in enumerate(params) if p is param), None)  # None: keyword-only, *args
        is_method = function.parent is not None and function.parent.kind == "class" and "staticmethod" not in (
            d.split(".")[-1] for d in function.decorators
        )
        if is_method and position is not None:
            position -= 1
            if position < 0:
                return None  # self / cls
        if position is not None:
            positional = [a for a in site.node.args if a.keyword is None]
            if any(a.star for a in positional[: position + 1]):
                position = None  # ``f(*xs, y)``: where ``y`` lands is not shown
        return call_arg(site.node, position, param.name.value)

    def iterated(self, loop) -> Optional[tuple[cst.BaseExpression, cst.CSTNode]]:
        """(the collection a loop really iterates, the node that shows it): ``for b in tqdm(enumerate(dl))`` ->
        ``dl``; ``it = iter(dl)`` / ``while True: b = next(it)`` -> ``dl``; the file's own generators are
        followed to what they iterate (their parameter's argument)."""
        if isinstance(loop.node, cst.For):
            return self.source_of(loop.iter, loop.order, loop.scope), loop.iter
        pulled = self._next_in(loop)
        if pulled is not None:
            return self.source_of(pulled.value.args[0].value, pulled.order, pulled.scope), pulled.value
        return None

    def _next_in(self, loop) -> Optional["Binding"]:
        """The binding of a ``while`` loop's items by ``next(it)`` (``batch = next(it)``), if any."""
        for bindings in (loop.scope.bindings.values() if loop.scope is not None else ()):
            for binding in bindings:
                value = binding.value
                if (
                    loop.order < binding.order < loop.end_order
                    and isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "next" and value.args
                ):
                    return binding
        return None

    def source_of(self, iterable: cst.BaseExpression, order: int, scope: "Scope", depth: int = 0) -> cst.BaseExpression:
        if depth > 6:
            return iterable
        key = name_key(iterable)
        if key is not None:
            binding = self.binding_at(key, order, scope)
            if binding is not None and binding.kind == "assign" and isinstance(binding.value, cst.Name):
                # ``it = tmp`` where ``tmp = iter(loader)``: follow; a plain alias of a loader stays as written.
                found = self.source_of(binding.value, binding.order, binding.scope, depth + 1)
                return iterable if found is binding.value else found
            if binding is not None and binding.kind == "assign" and isinstance(binding.value, cst.Call):
                name = (dotted(binding.value.func) or "").split(".")[-1]
                if name in PASS_ITEMS | {"enumerate", "zip"}:
                    return self.source_of(binding.value, binding.order, binding.scope, depth + 1)
            if binding is not None and binding.kind == "param":
                arg = self.param_argument(binding)
                if arg is not None:
                    return self.source_of(*arg, depth + 1)
            return iterable
        if isinstance(iterable, cst.Call):
            name = (dotted(iterable.func) or "").split(".")[-1]
            args = [a.value for a in iterable.args if a.keyword is None and not a.star]
            if name in PASS_ITEMS | {"enumerate", "zip"} and args and (self.qualname(iterable.func) or "").split(".")[0] in ("", "tqdm", "rich"):
                return self.source_of(args[0], order, scope, depth + 1)
            site = self._call_by_node.get(id(iterable))
            if site is not None and site.qualname is None:
                for callee in self.callee_scopes(site):
                    for yielded in self.yields.get(id(callee), ()):
                        if yielded.kind == "yield from" and yielded.value is not None:
                            return self._source_in_call(yielded.value, yielded.order, callee, site, depth)
                        for loop in reversed(self._loops_around(yielded)):
                            if loop.iter is not None:
                                return self._source_in_call(loop.iter, loop.order, callee, site, depth)
                            pulled = self._next_in(loop)  # ``it = iter(dl)`` ... ``while True: yield next(it)``
                            if pulled is not None:
                                return self._source_in_call(pulled.value.args[0].value, pulled.order, callee, site, depth)
        return iterable

    def _source_in_call(self, iterable: cst.BaseExpression, order: int, callee: "Scope", site, depth: int) -> cst.BaseExpression:
        """``source_of`` for what the generator ``callee`` iterates, as called by ``site``: its parameter stands
        for the argument of this call (``_batches(model.parameters())``), not of the generator's first call."""
        key = name_key(iterable)
        binding = self.binding_at(key, order, callee) if key is not None else None
        if binding is not None and binding.kind == "param" and isinstance(binding.target, cst.Param):
            arg = self.argument_for(site, callee, binding.target)
            if arg is not None:
                return self.source_of(arg, site.order, site.scope, depth + 1)
        return self.source_of(iterable, order, callee, depth + 1)

    def _loops_around(self, site) -> list:
        return [loop for loop in self.loops if loop.scope is site.scope and loop.order < site.order < loop.end_order]

    def item_of(self, iterable: cst.CSTNode, order: int, scope: "Scope", path: tuple[int, ...]) -> Value:
        """What ``for <target> in iterable`` binds at ``path`` inside the target."""
        key = name_key(iterable)
        if key is not None:
            binding = self.binding_at(key, order, scope)
            # ``it = iter(enumerate(loader))`` ... ``next(it)``: the items of what the name was made from.
            if binding is not None and binding.kind == "assign" and isinstance(binding.value, (cst.Call, cst.Name)):
                # ``it = iter(enumerate(loader))`` / ``it = batches(loader)`` ... ``next(it)``: the items of
                # what the name was made from.
                return self.item_of(binding.value, binding.order, binding.scope, path)
        if isinstance(iterable, cst.Call):
            func = iterable.func
            name = (dotted(func) or "").split(".")[-1]
            args = [a.value for a in iterable.args if a.keyword is None and not a.star]
            if name in PASS_ITEMS and args and (self.qualname(func) or "").split(".")[0] in ("", "tqdm", "rich"):
                return self.item_of(args[0], order, scope, path)
            if name == "enumerate" and args:
                if not path or path[0] == 0:
                    return UNKNOWN
                return self.item_of(args[0], order, scope, path[1:])
            if name == "zip" and args:
                if not path or path[0] >= len(args):
                    return UNKNOWN
                return self.item_of(args[path[0]], order, scope, path[1:])
            if isinstance(func, cst.Attribute) and func.attr.value in ("items", "values") and not iterable.args:
                container = self.value(func.value, order, scope)
                if container.kind in (BATCH, TOKENIZER_OUTPUT, MODEL_OUTPUT):
                    if func.attr.value == "values" and not path:
                        return _tensor(iterable, batch_item=container)
                    if func.attr.value == "items" and path[:1] == (1,):
                        return _tensor(iterable, batch_item=container)
                return UNKNOWN
            site = self._call_by_node.get(id(iterable))
            if site is not None and iterable.func is not None and self.qualname(func) is None:
                for callee in self.callee_scopes(site):
                    for yielded in self.yields.get(id(callee), ()):
                        if yielded.value is None:
                            continue
                        if yielded.kind == "yield from":
                            value = self.item_of(yielded.value, yielded.order, yielded.scope, path)
                        else:
                            value = self.element(self.value(yielded.value, yielded.order, yielded.scope), path)
                        if value.kind != "unknown":
                            return value
        value = self.element(self._item(self.value(iterable, order, scope)), path)
        if value.kind == "unknown":
            return self._dataset_item(iterable, order, scope, path)
        return value

    def _dataset_item(self, iterable: cst.CSTNode, order: int, scope: "Scope", path: tuple[int, ...]) -> Value:
        """``for x, y in MyDataset(...)``: what the file's own class returns from ``__getitem__`` (or yields
        from ``__iter__``)."""
        made = iterable
        key = name_key(iterable)
        if key is not None:
            binding = self.binding_at(key, order, scope)
            made = binding.value if binding is not None and binding.kind == "assign" else None
        if not (isinstance(made, cst.Call) and isinstance(made.func, cst.Name) and made.func.value in self.classes):
            return UNKNOWN
        for callee in self.functions:
            if callee.class_name != made.func.value or callee.name not in ("__getitem__", "__iter__"):
                continue
            sites = self.yields.get(id(callee), ()) if callee.name == "__iter__" else self.returns.get(id(callee), ())
            for ret in sites:
                if ret.value is None or ret.kind == "yield from":
                    continue
                value = self.element(self.value(ret.value, ret.order, ret.scope), path)
                if value.kind != "unknown":
                    return value
        return UNKNOWN

    def _item(self, iterable: Value) -> Value:
        if iterable.kind == "dataloader":
            return Value(BATCH, iterable.node, {"loader": iterable})
        if iterable.kind == TUPLE:
            for item in iterable.traits["items"]:
                order, scope = iterable.traits["at"]
                value = self.value(item, order, scope)
                if value.kind != "unknown":
                    return value
            return UNKNOWN
        if iterable.kind in (TENSOR, BATCH):
            return _tensor(iterable.node, batch_item=iterable) if iterable.kind == BATCH else _tensor(iterable.node)
        return UNKNOWN

    def element(self, value: Value, path: tuple[int, ...]) -> Value:
        """The part of ``value`` at ``path`` when it is unpacked (``a, (b, c) = value``)."""
        for index in path:
            if value.kind == TUPLE:
                items = value.traits["items"]
                if index >= len(items) or isinstance(items[index], cst.StarredElement):
                    return UNKNOWN
                order, scope = value.traits["at"]
                prepared = value.traits.get(TRAIT_PREPARED)
                value = self.value(items[index], order, scope)
                if prepared is not None:
                    value = Value(value.kind, items[index], {TRAIT_PREPARED: prepared}, base=value)
            elif value.kind == BATCH:
                value = _tensor(value.node, batch_item=value)
            elif value.kind in (TENSOR, MODEL_OUTPUT):
                value = _tensor(value.node)
            else:
                return UNKNOWN
        return value


def _is_unwrap(node: cst.CSTNode) -> bool:
    """``m.module`` or ``getattr(m, "module", m)``: the unwrapping idioms for a DataParallel/DDP wrapper."""
    if isinstance(node, cst.Attribute):
        return node.attr.value == "module"
    return (
        isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "getattr"
        and len(node.args) == 3 and string_value(node.args[1].value) == "module"
    )


def _unwrapped(model: Value, node: cst.CSTNode) -> Value:
    """What ``node`` (``.module`` of a model value) is: the model a DataParallel/DDP wrapper holds (its ``base``;
    a model of unknown make when the wrapped expression is not known), or unknown when the value is not such a
    wrapper (``.module`` of another object says nothing)."""
    wrapper = model.carrier("wrapper")
    if wrapper is None:
        return UNKNOWN
    return wrapper.base if wrapper.base is not None and wrapper.base.kind == "model" else Value("model", node)
