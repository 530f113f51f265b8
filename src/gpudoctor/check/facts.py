"""What a file says, collected in one walk: imports, bindings, calls in context, and values.

Rules ask questions here instead of matching text:

* ``facts.qualname(expr)``: ``nn.utils.clip_grad_norm_`` -> ``torch.nn.utils.clip_grad_norm_``;
* ``facts.value(expr)``: what a name, ``self.model`` or call evaluates to, with traits such as
  ``dispatched`` (placed over several devices by accelerate), ``offloaded``, ``empty``, ``peft``,
  ``prepared``; in-place changes (``dispatch_model(model, ...)``, ``model.half()``) are applied;
* ``facts.calls``: every call in source order, with its enclosing loops, ``with`` blocks, ``if``
  tests and function.

The walk is our own over the dataclass fields of libcst nodes: libcst's visitor rebuilds every
node and its metadata providers cost 100-400 ms per file, which we never pay here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Union

import libcst as cst

from gpudoctor.check import apis

# --------------------------------------------------------------------------------------------
# Records


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


@dataclass(eq=False, repr=False)
class LoopFrame:
    node: Union[cst.For, cst.While]
    order: int
    iter: Optional[cst.BaseExpression]
    end_order: int = 0


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

    def kwarg_names(self) -> set[str]:
        return {a.keyword.value for a in self.node.args if a.keyword is not None}

    @property
    def loops(self) -> list[LoopFrame]:
        return [f for f in self.context if isinstance(f, LoopFrame)]

    @property
    def withs(self) -> list[WithFrame]:
        return [f for f in self.context if isinstance(f, WithFrame)]


@dataclass(eq=False, repr=False)
class AugAssignSite:
    node: cst.AugAssign
    order: int
    target_key: Optional[str]
    scope: Scope
    context: tuple


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


# --------------------------------------------------------------------------------------------
# Values


TRAIT_DISPATCHED = "dispatched"  # placed by accelerate with hooks (hf_device_map), or may be
TRAIT_OFFLOADED = "offloaded"  # some weights live on cpu/disk as meta placeholders
TRAIT_QUANTIZED = "quantized"  # bitsandbytes 8/4-bit
TRAIT_EMPTY = "empty"  # created under init_empty_weights
TRAIT_CAST = "cast"  # .half()/.to(dtype) applied; detail: (dtype, node)
TRAIT_MOVED = "moved"  # .to(device)/.cuda() applied; detail: node
TRAIT_FP16 = "fp16"  # weights loaded or cast to float16
TRAIT_PEFT = "peft"  # wrapped by get_peft_model; detail: the call
TRAIT_PREPARED = "prepared"  # returned by accelerator.prepare; detail: the prepare call


@dataclass
class DeviceMap:
    """What a ``device_map=`` argument says about placement."""

    strategy: str  # "auto" (auto/balanced/sequential/inferred) | "explicit" | "single" | "unknown"
    devices: frozenset = frozenset()
    node: Optional[cst.CSTNode] = None
    label: str = ""

    @property
    def explicit_offload(self) -> set[str]:
        return {d for d in self.devices if d in ("cpu", "disk")}

    @property
    def certainly_dispatched(self) -> bool:
        """More than one device, or disk: accelerate installs hooks and sets hf_device_map."""
        return self.strategy == "explicit" and (len(self.devices) > 1 or "disk" in self.devices)

    @property
    def maybe_dispatched(self) -> bool:
        return self.certainly_dispatched or self.strategy == "auto"


@dataclass
class Value:
    kind: str  # model | accelerator | optimizer | dataloader | scheduler | trainer | training_args |
    #            tokenizer | device_map | tensor | unknown
    node: Optional[cst.CSTNode] = None
    traits: dict[str, Any] = field(default_factory=dict)
    base: Optional["Value"] = None

    def carrier(self, name: str) -> Optional["Value"]:
        """The value in this wrapper chain (self, base, base's base...) that holds trait ``name``."""
        value: Optional[Value] = self
        while value is not None:
            if name in value.traits:
                return value
            value = value.base
        return None

    def trait(self, name: str) -> Any:
        carrier = self.carrier(name)
        return carrier.traits[name] if carrier is not None else None

    def has(self, name: str) -> bool:
        return self.trait(name) is not None

    def derive(self, node: cst.CSTNode, **traits: Any) -> "Value":
        return Value(self.kind, node, dict(traits), base=self)

    def origin(self) -> "Value":
        value = self
        while value.base is not None:
            value = value.base
        return value


UNKNOWN = Value("unknown")

# --------------------------------------------------------------------------------------------
# Small helpers shared by rules


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
    if isinstance(node, cst.SimpleString):
        try:
            value = node.evaluated_value
        except Exception:  # noqa: BLE001 - odd prefixes
            return None
        return value if isinstance(value, str) else None
    if isinstance(node, cst.ConcatenatedString):
        try:
            value = node.evaluated_value
        except Exception:  # noqa: BLE001
            return None
        return value if isinstance(value, str) else None
    return None


def int_value(node: Optional[cst.CSTNode]) -> Optional[int]:
    if isinstance(node, cst.Integer):
        try:
            return int(node.value.replace("_", ""), 0)
        except ValueError:
            return None
    return None


def is_true(node: Optional[cst.CSTNode]) -> bool:
    return isinstance(node, cst.Name) and node.value == "True"


def name_key(node: Optional[cst.CSTNode]) -> Optional[str]:
    """``model`` -> "model"; ``self.model`` -> "self.model"; anything else -> None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
        return "self." + node.attr.value
    return None


def dotted(node: cst.CSTNode) -> Optional[str]:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = dotted(node.value)
        return f"{head}.{node.attr.value}" if head else None
    return None


def unwrap_iterable(node: cst.BaseExpression) -> cst.BaseExpression:
    """``tqdm(enumerate(loader), ...)`` -> ``loader``: what a loop really iterates."""
    while isinstance(node, cst.Call) and node.args:
        name = dotted(node.func) or ""
        if name.split(".")[-1] in {"tqdm", "enumerate", "iter", "zip", "track", "list"}:
            node = node.args[0].value
            continue
        break
    return node


# --------------------------------------------------------------------------------------------
# The walk

_SKIP_FIELD = re.compile(
    r"whitespace|^(lpar|rpar|leading_lines|lines_after_decorators|header|footer|semicolon|comma|"
    r"colon|equal|dot|newline|trailing_whitespace|indent|operator|star|asynchronous|"
    r"lbrace|rbrace|lbracket|rbracket|arrow)$"
)
_FIELDS: dict[type, tuple[str, ...]] = {}


def _child_fields(node_type: type) -> tuple[str, ...]:
    names = _FIELDS.get(node_type)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(node_type) if not _SKIP_FIELD.search(f.name))
        _FIELDS[node_type] = names
    return names


# Words in comments or strings that show the file runs as several processes.
_LAUNCH_HINT = re.compile(
    r"accelerate\s+launch|torchrun|torch\.distributed\.(run|launch)|nproc_per_node|num_processes|"
    r"LOCAL_RANK|WORLD_SIZE|init_process_group|DistributedDataParallel|notebook_launcher|"
    r"deepspeed\s+\S+\.py"
)
# A test on the number of processes: ``PartialState().num_processes > 1``, ``world_size != 1``.
_PROCESS_COUNT = re.compile(r"""(num_processes|world_size|WORLD_SIZE|get_world_size\(\))["'\])]*\s*(>\s*1|!=\s*1|>=\s*2)\b""")
# Words that show memory is short, so an "auto" device map will offload.
_MEMORY_SHORT_HINT = re.compile(
    r"out of (gpu |cuda )?memory|\bOOM\b|does ?n[o']t fit|not enough (gpu |v)?ram|offload(ed)? to (the )?(cpu|disk)|"
    r"\b(split|distributed|dispatched|placed|spread)\b[^.\n]{0,40}\b(cpu|gpu)s? and (the )?(cpu|gpu|disk)|"
    r"显存不足|内存不足|CPU和GPU|CPU 和 GPU",
    re.IGNORECASE,
)


class FileFacts:
    """Facts about one module. Build with :func:`collect`."""

    def __init__(self, module: cst.Module, source: str, path: str = "<string>") -> None:
        self.module = module
        self.source = source
        self.path = path
        self.imports: dict[str, str] = {}  # local name -> qualified name
        self.calls: list[CallSite] = []
        self.aug_assigns: list[AugAssignSite] = []
        self.subscript_assigns: list[SubscriptAssignSite] = []
        self.dict_entries: list[DictEntrySite] = []
        self.attribute_assigns: list[AttributeAssignSite] = []
        self.loops: list[LoopFrame] = []
        self.functions: list[Scope] = []
        self.name_loads: dict[str, list[tuple[int, cst.CSTNode, Scope]]] = {}
        self.class_attrs: dict[str, dict[str, list[Binding]]] = {}
        self.module_scope = Scope("module", "<module>", module, None)
        self._call_by_node: dict[int, CallSite] = {}
        self._calls_by_qualname: dict[str, list[CallSite]] = {}
        self._calls_on_key: dict[str, list[CallSite]] = {}
        self._value_cache: dict[tuple[int, int], Value] = {}
        self._evaluating: set[tuple[int, int]] = set()
        self._launch_hints: Optional[list[str]] = None

    # ---------------------------------------------------------------- questions for rules

    def qualname(self, node: Optional[cst.CSTNode]) -> Optional[str]:
        if node is None:
            return None
        if isinstance(node, cst.Name):
            q = self.imports.get(node.value)
            return apis.canonical(q) if q else None
        if isinstance(node, cst.Attribute):
            head = self.qualname(node.value)
            return apis.canonical(f"{head}.{node.attr.value}") if head else None
        if isinstance(node, cst.Call):  # ``torch.no_grad()`` used as a context manager
            return None
        return None

    def calls_to(self, *qualnames: str) -> list[CallSite]:
        out: list[CallSite] = []
        for q in qualnames:
            out.extend(self._calls_by_qualname.get(q, ()))
        out.sort(key=lambda c: c.order)
        return out

    def calls_matching(self, predicate) -> Iterator[CallSite]:
        return (c for c in self.calls if c.qualname and predicate(c.qualname))

    def method_calls(self, *methods: str) -> Iterator[CallSite]:
        wanted = set(methods)
        return (c for c in self.calls if c.method in wanted)

    def call_site(self, node: cst.Call) -> Optional[CallSite]:
        return self._call_by_node.get(id(node))

    def references(self, predicate) -> bool:
        return any(predicate(apis.canonical(q)) for q in self.imports.values())

    def imported_names(self) -> set[str]:
        return {apis.canonical(q) for q in self.imports.values()}

    def loads_of(self, key: str, after: int = -1, scope: Optional[Scope] = None) -> list[tuple[int, cst.CSTNode, Scope]]:
        uses = [u for u in self.name_loads.get(key, ()) if u[0] > after]
        if scope is not None:
            uses = [u for u in uses if self._same_namespace(u[2], scope, key)]
        return uses

    @property
    def launch_hints(self) -> list[str]:
        """Evidence, from code or comments, that the file runs as several processes."""
        if self._launch_hints is None:
            hints = sorted({m.group(0) for m in _LAUNCH_HINT.finditer(self.source)})
            # ``if PartialState().num_processes > 1: raise SystemExit(...)``: the file refuses to run as
            # several processes, whatever its comments say about launchers.
            self._launch_hints = [] if hints and self._refuses_multi_process() else hints
        return self._launch_hints

    def _refuses_multi_process(self) -> bool:
        for statement in self.module.body:
            if not isinstance(statement, cst.If) or not _PROCESS_COUNT.search(self.module.code_for_node(statement.test)):
                continue
            body = statement.body.body
            if len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine):
                small = body[0].body[0] if body[0].body else None
                if isinstance(small, cst.Raise):
                    return True
                if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                    if (dotted(small.value.func) or "") in ("exit", "quit", "sys.exit", "os._exit"):
                        return True
        return False

    @property
    def says_memory_is_short(self) -> Optional[str]:
        match = _MEMORY_SHORT_HINT.search(self.source)
        return match.group(0) if match else None

    def accelerators(self) -> list[tuple[str, Binding]]:
        """Names bound to ``Accelerator(...)`` anywhere in the file, in source order."""
        found = []
        for site in self.calls_to(*apis.ACCELERATOR):
            for binding in self._bindings_of_value(site.node):
                found.append((binding.key, binding))
        return found

    def prepare_calls(self) -> list[CallSite]:
        """``<accelerator>.prepare(...)`` calls whose receiver evaluates to an Accelerator."""
        out = []
        for site in self.method_calls("prepare", "prepare_model"):
            if site.receiver is not None and self.value(site.receiver, site.order, site.scope).kind == "accelerator":
                out.append(site)
        return out

    def binding_at(self, key: str, order: int, scope: Scope) -> Optional[Binding]:
        if key.startswith("self."):
            own = [b for b in scope.bindings.get(key, ()) if b.order < order]
            if own:
                return own[-1]
            attrs = self.class_attrs.get(scope.class_name or "", {}).get(key)
            if attrs:
                init = [b for b in attrs if b.scope.name == "__init__"]
                return (init or attrs)[-1]
            return None
        current: Optional[Scope] = scope
        while current is not None:
            bindings = current.bindings.get(key)
            if bindings:
                before = [b for b in bindings if b.order < order]
                if before:
                    return before[-1]
                if current is scope and current.kind == "function":
                    # A local bound later in a loop body can still reach this use.
                    return bindings[-1] if self._inside_same_loop(bindings[-1], order) else None
                if current is not scope:
                    return bindings[-1]
            current = current.parent
            if current is not None and current.kind == "class":
                current = current.parent  # class bodies are not enclosing scopes for methods
        return None

    def value(self, node: Optional[cst.CSTNode], order: Optional[int] = None, scope: Optional[Scope] = None) -> Value:
        """Evaluate ``node`` as seen at ``order`` in ``scope`` (defaults: where the node is)."""
        if node is None:
            return UNKNOWN
        if order is None or scope is None:
            order, scope = self._position_of(node)
        key = (id(node), order)
        cached = self._value_cache.get(key)
        if cached is not None:
            return cached
        if key in self._evaluating:
            return UNKNOWN
        self._evaluating.add(key)
        try:
            result = self._evaluate(node, order, scope)
        finally:
            self._evaluating.discard(key)
        self._value_cache[key] = result
        return result

    def device_map(self, node: Optional[cst.CSTNode], order: int, scope: Scope) -> Optional[DeviceMap]:
        if node is None:
            return None
        text = string_value(node)
        if text is not None:
            if text in apis.AUTO_STRATEGIES:
                return DeviceMap("auto", node=node, label=repr(text))
            return DeviceMap("single", frozenset({text}), node=node, label=repr(text))
        if isinstance(node, cst.Dict):
            devices = set()
            keys = []
            for element in node.elements:
                if not isinstance(element, cst.DictElement):
                    return DeviceMap("unknown", node=node)
                keys.append(string_value(element.key))
                devices.add(_device_literal(element.value))
            if None in devices:
                return DeviceMap("unknown", node=node)
            if keys == [""]:
                return DeviceMap("single", frozenset(devices), node=node)
            return DeviceMap("explicit", frozenset(devices), node=node, label="a device map")
        key = name_key(node)
        if key is not None:
            binding = self.binding_at(key, order, scope)
            if binding is None or binding.value is None or binding.kind not in ("assign",):
                return DeviceMap("unknown", node=node)
            inner = self.device_map(binding.value, binding.order, binding.scope)
            if inner is None:
                return None
            if isinstance(binding.value, cst.Call) and self.qualname(binding.value.func) in apis.INFER_DEVICE_MAP:
                inner = DeviceMap("auto", node=binding.value, label="infer_auto_device_map(...)")
            # ``device_map["lm_head"] = "disk"`` after the binding.
            extra = set()
            for site in self.subscript_assigns:
                if site.base_key == key and binding.order < site.order < order:
                    extra.add(_device_literal(site.value))
            if extra and None not in extra:
                devices = frozenset(inner.devices | extra)
                strategy = "explicit" if inner.strategy in ("explicit", "single") else inner.strategy
                return DeviceMap(strategy, devices, node=inner.node, label=inner.label)
            return inner
        if isinstance(node, cst.Call) and self.qualname(node.func) in apis.INFER_DEVICE_MAP:
            return DeviceMap("auto", node=node, label="infer_auto_device_map(...)")
        return DeviceMap("unknown", node=node)

    def enclosing_function(self, site_context: tuple) -> Optional[Scope]:
        for frame in reversed(site_context):
            if isinstance(frame, FunctionFrame):
                return frame.scope
        return None

    def under_no_grad(self, context: tuple) -> bool:
        for frame in context:
            if isinstance(frame, WithFrame) and frame.qualname in apis.NO_GRAD:
                return True
            if isinstance(frame, FunctionFrame) and any(d in apis.NO_GRAD for d in frame.scope.decorators):
                return True
        return False

    def statement_of(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self._statement_by_node.get(id(node))

    # ---------------------------------------------------------------- evaluation

    def _position_of(self, node: cst.CSTNode) -> tuple[int, Scope]:
        site = self._call_by_node.get(id(node))
        if site is not None:
            return site.order + 1, site.scope
        found = self._node_position.get(id(node))
        if found is not None:
            return found
        return 1 << 30, self.module_scope

    def _evaluate(self, node: cst.CSTNode, order: int, scope: Scope) -> Value:
        key = name_key(node)
        if key is not None:
            binding = self.binding_at(key, order, scope)
            if binding is None:
                return UNKNOWN
            value = self._value_of_binding(binding)
            return self._apply_mutations(key, value, binding, order, scope)
        if isinstance(node, cst.Call):
            return self._evaluate_call(node, order, scope)
        return UNKNOWN

    def _value_of_binding(self, binding: Binding) -> Value:
        if binding.value is None:
            return UNKNOWN
        if binding.kind == "assign":
            return self.value(binding.value, binding.order, binding.scope)
        if binding.kind == "unpack" and isinstance(binding.value, (cst.Tuple, cst.List)):
            elements = binding.value.elements
            if binding.index is not None and binding.index < len(elements):
                element = elements[binding.index].value
                if not isinstance(element, cst.StarredElement):
                    return self.value(element, binding.order, binding.scope)
            return UNKNOWN
        if binding.kind == "unpack" and isinstance(binding.value, cst.Call):
            site = self._call_by_node.get(id(binding.value))
            if site is not None and site.method in ("prepare",) and site.receiver is not None:
                if self.value(site.receiver, site.order, site.scope).kind == "accelerator":
                    inner = site.arg(position=binding.index) if binding.index is not None else None
                    inner_value = self.value(inner, site.order, site.scope) if inner is not None else UNKNOWN
                    return Value(inner_value.kind, binding.target, {TRAIT_PREPARED: site}, base=inner_value)
        return UNKNOWN

    def _apply_mutations(self, key: str, value: Value, binding: Binding, order: int, scope: Scope) -> Value:
        for site in self._calls_on_key.get(key, ()):
            if not (binding.order < site.order < order) or not self._same_namespace(site.scope, scope, key):
                continue
            if site.qualname in apis.DISPATCH:
                value = self._dispatched(value, site)
            elif value.kind == "model" and site.method in apis.MODULE_MOVES | apis.MODULE_CASTS:
                value = self._moved_or_cast(value, site)
        return value

    def _same_namespace(self, a: Scope, b: Scope, key: str) -> bool:
        if a is b:
            return True
        if key.startswith("self."):
            return a.class_name is not None and a.class_name == b.class_name
        # A global name: both scopes see the same binding unless one shadows it.
        return key not in a.bindings or key not in b.bindings or a.kind == "module" or b.kind == "module"

    def _evaluate_call(self, call: cst.Call, order: int, scope: Scope) -> Value:
        q = self.qualname(call.func)
        site = self._call_by_node.get(id(call))
        context = site.context if site else ()
        if q:
            if q in apis.ACCELERATOR:
                return Value("accelerator", call)
            if q in apis.DISPATCH:
                base = self.value(call_arg(call, 0, "model"), order, scope)
                return self._dispatched(base, site) if site else base
            if q in apis.GET_PEFT_MODEL or q in apis.PEFT_LOADERS:
                base = self.value(call_arg(call, 0, "model"), order, scope)
                return Value("model", call, {TRAIT_PEFT: call}, base=base if base.kind == "model" else None)
            if q in apis.PASSTHROUGH:
                return self.value(call_arg(call, 0, "model"), order, scope)
            if q in apis.DATA_PARALLEL or q in apis.DISTRIBUTED_DATA_PARALLEL:
                base = self.value(call_arg(call, 0, "module"), order, scope)
                return Value("model", call, {"wrapper": q}, base=base)
            if q in apis.DATALOADER:
                return Value("dataloader", call)
            if q in apis.TRAINERS:
                return Value("trainer", call)
            if q in apis.TRAINING_ARGS:
                return Value("training_args", call)
            if q in apis.INFER_DEVICE_MAP:
                return Value("device_map", call)
            if apis.is_optimizer(q):
                return Value("optimizer", call)
            if apis.is_scheduler(q):
                return Value("scheduler", call)
            owner_method = apis.hf_class_method(q)
            if owner_method:
                owner, method = owner_method
                if method in ("from_pretrained", "from_config", "_from_config") and apis.is_model_class(owner):
                    return self._loaded_model(call, owner, method, order, scope, context)
                if method == "from_pretrained" and "Tokenizer" in owner:
                    return Value("tokenizer", call)
        if isinstance(call.func, cst.Attribute):
            method = call.func.attr.value
            receiver = call.func.value
            if method in apis.MODULE_MOVES | apis.MODULE_CASTS:
                base = self.value(receiver, order, scope)
                if base.kind == "model" and site is not None:
                    return self._moved_or_cast(base, site)
                return Value("tensor" if base.kind in ("unknown", "tensor") else base.kind, call, base=base)
            if method in ("prepare", "prepare_model") and len(call.args) == 1:
                if self.value(receiver, order, scope).kind == "accelerator":
                    inner = self.value(call.args[0].value, order, scope)
                    return Value(inner.kind, call, {TRAIT_PREPARED: site}, base=inner)
        return UNKNOWN

    def _loaded_model(self, call, owner, method, order, scope, context) -> Value:
        traits: dict[str, Any] = {}
        if any(isinstance(f, WithFrame) and f.qualname in apis.INIT_EMPTY for f in context):
            traits[TRAIT_EMPTY] = call
        device_map = self.device_map(call_arg(call, keyword="device_map"), order, scope)
        if device_map is not None:
            traits["device_map"] = device_map
            if device_map.maybe_dispatched:
                traits[TRAIT_DISPATCHED] = device_map
            offload = self._offload_evidence(call, device_map)
            if offload:
                traits[TRAIT_OFFLOADED] = offload
        for kw in ("load_in_8bit", "load_in_4bit"):
            if is_true(call_arg(call, keyword=kw)):
                traits[TRAIT_QUANTIZED] = call
        qconfig = call_arg(call, keyword="quantization_config")
        if qconfig is not None and self._is_bnb_config(qconfig, order, scope):
            traits[TRAIT_QUANTIZED] = call
        dtype = call_arg(call, keyword="dtype") or call_arg(call, keyword="torch_dtype")
        if dtype is not None and self.qualname(dtype) in ("torch.float16", "torch.half"):
            traits[TRAIT_FP16] = dtype
        traits["class"] = owner
        return Value("model", call, traits)

    def _is_bnb_config(self, node, order, scope) -> bool:
        if isinstance(node, cst.Call):
            return self.qualname(node.func) == apis.BNB_CONFIG
        key = name_key(node)
        if key:
            binding = self.binding_at(key, order, scope)
            if binding and isinstance(binding.value, cst.Call):
                return self.qualname(binding.value.func) == apis.BNB_CONFIG
        return False

    def _offload_evidence(self, call: cst.Call, device_map: DeviceMap) -> Optional[str]:
        if device_map.explicit_offload and device_map.strategy == "explicit":
            return "the device map puts modules on " + " and ".join(sorted(device_map.explicit_offload))
        if device_map.strategy == "auto":
            for kw in ("offload_folder", "offload_dir"):
                if call_arg(call, keyword=kw) is not None:
                    return f"`{kw}=` is given, so the automatic map is expected to offload"
            max_memory = call_arg(call, keyword="max_memory")
            if isinstance(max_memory, cst.Dict) and all(
                isinstance(e, cst.DictElement) and _device_literal(e.key) not in (None, "cpu", "disk")
                for e in max_memory.elements
            ):
                return None  # GPUs only and no folder: what does not fit raises instead of being offloaded
            hint = self.says_memory_is_short
            if hint:
                return f'the automatic map offloads when memory is short, and the file says "{hint}"'
        return None

    def _dispatched(self, base: Value, site: CallSite) -> Value:
        call = site.node
        device_map = self.device_map(call_arg(call, keyword="device_map", position=1 if site.qualname == "accelerate.dispatch_model" else None), site.order, site.scope)
        traits: dict[str, Any] = {}
        if device_map is not None:
            traits["device_map"] = device_map
            if device_map.maybe_dispatched:
                traits[TRAIT_DISPATCHED] = device_map
            offload = self._offload_evidence(call, device_map)
            if offload:
                traits[TRAIT_OFFLOADED] = offload
        dtype = call_arg(call, keyword="dtype")
        if dtype is not None:
            traits["dispatch_dtype"] = dtype
        traits["dispatch_call"] = call
        kind = base.kind if base.kind != "unknown" else "model"
        return Value(kind, call, traits, base=base)

    def _moved_or_cast(self, base: Value, site: CallSite) -> Value:
        method = site.method or ""
        if method in apis.MODULE_CASTS:
            dtype = apis.CAST_DTYPE[method]
            traits: dict[str, Any] = {TRAIT_CAST: (dtype, site.node)}
            if dtype == "float16":
                traits[TRAIT_FP16] = site.node
            return base.derive(site.node, **traits)
        # .to(...): a dtype argument casts, anything else moves.
        traits = {}
        for arg in site.node.args:
            q = self.qualname(arg.value)
            if q and q.startswith("torch.") and q.split(".")[-1] in _DTYPES:
                dtype = _DTYPES[q.split(".")[-1]]
                traits[TRAIT_CAST] = (dtype, site.node)
                if dtype == "float16":
                    traits[TRAIT_FP16] = site.node
            elif arg.keyword is None or arg.keyword.value == "device":
                traits[TRAIT_MOVED] = site.node
        if method != "to":
            traits[TRAIT_MOVED] = site.node
        return base.derive(site.node, **traits)

    def _bindings_of_value(self, value_node: cst.CSTNode) -> list[Binding]:
        return self._bindings_by_value.get(id(value_node), [])

    def _inside_same_loop(self, binding: Binding, order: int) -> bool:
        for frame in binding.context:
            if isinstance(frame, LoopFrame) and frame.order < order <= frame.end_order:
                return True
        return False


_DTYPES = {
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float": "float32",
    "float64": "float64",
    "double": "float64",
}


def _device_literal(node: cst.CSTNode) -> Optional[str]:
    text = string_value(node)
    if text is not None:
        return text
    number = int_value(node)
    if number is not None:
        return str(number)
    return None


class _Collector:
    """Walks the module once and fills a :class:`FileFacts`."""

    def __init__(self, facts: FileFacts) -> None:
        self.facts = facts
        self.order = 0
        self.frames: list[Frame] = []
        self.scope = facts.module_scope
        self.statement: Optional[cst.CSTNode] = None
        facts._statement_by_node = {}
        facts._node_position = {}
        facts._bindings_by_value = {}
        self.enter = {
            cst.Import: self.on_import,
            cst.ImportFrom: self.on_import_from,
            cst.FunctionDef: self.on_function,
            cst.ClassDef: self.on_class,
            cst.For: self.on_for,
            cst.While: self.on_while,
            cst.With: self.on_with,
            cst.If: self.on_if,
            cst.Assign: self.on_assign,
            cst.AnnAssign: self.on_ann_assign,
            cst.AugAssign: self.on_aug_assign,
            cst.Call: self.on_call,
            cst.Name: self.on_name,
            cst.Attribute: self.on_attribute,
            cst.Dict: self.on_dict,
            cst.SimpleStatementLine: self.on_statement,
            cst.Expr: self.on_expr,
        }

    # -- traversal

    def walk(self, node: cst.CSTNode) -> None:
        handler = self.enter.get(type(node))
        if handler is not None and handler(node) is False:
            return
        self.walk_children(node)

    def walk_children(self, node: cst.CSTNode) -> None:
        for name in _child_fields(type(node)):
            child = getattr(node, name)
            if isinstance(child, cst.CSTNode):
                self.walk(child)
            elif isinstance(child, (tuple, list)):
                for item in child:
                    if isinstance(item, cst.CSTNode):
                        self.walk(item)

    def tick(self) -> int:
        self.order += 1
        return self.order

    def bind(self, key: str, target, value, kind="assign", index=None) -> None:
        binding = Binding(key, self.tick(), self.scope, target, value, kind, index, tuple(self.frames))
        self.scope.bindings.setdefault(key, []).append(binding)
        if key.startswith("self.") and self.scope.class_name:
            self.facts.class_attrs.setdefault(self.scope.class_name, {}).setdefault(key, []).append(binding)
        if value is not None:
            self.facts._bindings_by_value.setdefault(id(value), []).append(binding)

    def bind_target(self, target: cst.BaseExpression, value, kind="assign", index=None) -> None:
        key = name_key(target)
        if key is not None:
            self.bind(key, target, value, kind, index)
            return
        if isinstance(target, (cst.Tuple, cst.List)):
            for i, element in enumerate(target.elements):
                inner = element.value
                if isinstance(inner, cst.StarredElement):
                    continue
                self.bind_target(inner, value, "unpack" if kind == "assign" else kind, i)
            return
        # Subscript and other attribute targets: their parts are loads.
        self.walk(target)

    # -- handlers (return False when they walked the children themselves)

    def on_statement(self, node: cst.SimpleStatementLine):
        previous, self.statement = self.statement, node
        self.walk_children(node)
        self.statement = previous
        return False

    def on_expr(self, node: cst.Expr):
        if isinstance(node.value, cst.Call):
            self._statement_call = node.value
        return None

    def on_import(self, node: cst.Import):
        for alias in node.names:
            full = dotted(alias.name) or ""
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                self.facts.imports[alias.asname.name.value] = full
            else:
                head = full.split(".")[0]
                self.facts.imports[head] = head
        return False

    def on_import_from(self, node: cst.ImportFrom):
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return False
        module = dotted(node.module) or ""
        for alias in node.names:
            name = dotted(alias.name) or ""
            local = alias.asname.name.value if alias.asname is not None and isinstance(alias.asname.name, cst.Name) else name
            self.facts.imports[local] = f"{module}.{name}"
        return False

    def on_function(self, node: cst.FunctionDef):
        for decorator in node.decorators:
            self.walk(decorator)
        decorators = tuple(
            q
            for q in (
                self.facts.qualname(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator)
                for d in node.decorators
            )
            if q
        )
        class_name = self.scope.name if self.scope.kind == "class" else self.scope.class_name
        self.bind(node.name.value, node, None, "def")
        scope = Scope("function", node.name.value, node, self.scope, class_name, decorators=decorators)
        self.facts.functions.append(scope)
        outer_scope, outer_frames = self.scope, self.frames
        self.scope, self.frames = scope, [*self.frames, FunctionFrame(scope)]
        for param in _params(node.params):
            self.bind(param.name.value, param, param.default, "param")
        self.walk(node.body)
        self.scope, self.frames = outer_scope, outer_frames
        return False

    def on_class(self, node: cst.ClassDef):
        for base in node.bases:
            self.walk(base.value)
        self.bind(node.name.value, node, None, "def")
        scope = Scope("class", node.name.value, node, self.scope, node.name.value)
        outer = self.scope
        self.scope = scope
        self.walk(node.body)
        self.scope = outer
        return False

    def on_for(self, node: cst.For):
        self.walk(node.iter)
        self._loop(node, node.iter, lambda: self.bind_target(node.target, node.iter, "for"))
        return False

    def on_while(self, node: cst.While):
        self.walk(node.test)
        self._loop(node, None, lambda: None)
        return False

    def _loop(self, node: Union[cst.For, cst.While], iterated, bind_target) -> None:
        frame = LoopFrame(node, self.tick(), iterated)
        self.facts.loops.append(frame)
        self.frames.append(frame)
        bind_target()
        self.walk(node.body)
        frame.end_order = self.tick()
        self.frames.pop()
        if node.orelse is not None:
            self.walk(node.orelse)

    def on_with(self, node: cst.With):
        pushed = 0
        for item in node.items:
            self.walk(item.item)
            expr = item.item
            call = expr if isinstance(expr, cst.Call) else None
            func = call.func if call is not None else expr
            receiver = func.value if isinstance(func, cst.Attribute) else None
            method = func.attr.value if isinstance(func, cst.Attribute) else None
            self.frames.append(WithFrame(node, item, self.facts.qualname(func), receiver, method))
            pushed += 1
            if item.asname is not None:
                self.bind_target(item.asname.name, expr, "with")
        self.walk(node.body)
        del self.frames[len(self.frames) - pushed :]
        return False

    def on_if(self, node: cst.If):
        self.walk(node.test)
        self.frames.append(IfFrame(node, node.test, "body"))
        self.walk(node.body)
        self.frames.pop()
        if node.orelse is not None:
            self.frames.append(IfFrame(node, node.test, "orelse"))
            self.walk(node.orelse)
            self.frames.pop()
        return False

    def on_assign(self, node: cst.Assign):
        self.walk(node.value)
        for target in node.targets:
            t = target.target
            if isinstance(t, cst.Subscript):
                self.walk(t)
                self.facts.subscript_assigns.append(
                    SubscriptAssignSite(node, self.tick(), name_key(t.value), t, node.value, self.scope, tuple(self.frames))
                )
                continue
            if isinstance(t, cst.Attribute) and name_key(t) is None:
                self.facts.attribute_assigns.append(
                    AttributeAssignSite(node, self.order + 1, t, node.value, self.scope, tuple(self.frames))
                )
            self.bind_target(t, node.value)
        return False

    def on_ann_assign(self, node: cst.AnnAssign):
        if node.value is not None:
            self.walk(node.value)
            self.bind_target(node.target, node.value)
        return False

    def on_aug_assign(self, node: cst.AugAssign):
        self.walk(node.value)
        key = name_key(node.target)
        self.facts.aug_assigns.append(AugAssignSite(node, self.tick(), key, self.scope, tuple(self.frames)))
        if key is not None:
            self.bind(key, node.target, None, "augassign")
        else:
            self.walk(node.target)
        return False

    def on_call(self, node: cst.Call):
        func = node.func
        method = func.attr.value if isinstance(func, cst.Attribute) else None
        receiver = func.value if isinstance(func, cst.Attribute) else None
        statement = getattr(self, "_statement_call", None) is node
        # Walk the receiver first so nested calls get lower orders (they run first).
        self.walk(func)
        site = CallSite(
            node, self.tick(), self.facts.qualname(func), method, receiver, self.scope, tuple(self.frames), statement
        )
        self.facts.calls.append(site)
        self.facts._call_by_node[id(node)] = site
        if site.qualname:
            self.facts._calls_by_qualname.setdefault(site.qualname, []).append(site)
        if self.statement is not None:
            self.facts._statement_by_node[id(node)] = self.statement
        key = name_key(receiver) if receiver is not None else None
        if key is not None:
            self.facts._calls_on_key.setdefault(key, []).append(site)
        if site.qualname in apis.DISPATCH:
            first = call_arg(node, 0, "model")
            first_key = name_key(first)
            if first_key is not None:
                self.facts._calls_on_key.setdefault(first_key, []).append(site)
        for arg in node.args:
            self.walk(arg.value)
        return False

    def on_name(self, node: cst.Name):
        self.facts.name_loads.setdefault(node.value, []).append((self.tick(), node, self.scope))
        self.facts._node_position[id(node)] = (self.order + 1, self.scope)
        return False

    def on_attribute(self, node: cst.Attribute):
        key = name_key(node)
        if key is not None:
            self.facts.name_loads.setdefault(key, []).append((self.tick(), node, self.scope))
            self.facts._node_position[id(node)] = (self.order + 1, self.scope)
            return False
        self.walk(node.value)
        return False

    def on_dict(self, node: cst.Dict):
        for element in node.elements:
            if isinstance(element, cst.DictElement):
                key = string_value(element.key)
                self.walk(element.value)
                if key is not None:
                    self.facts.dict_entries.append(
                        DictEntrySite(key, element.value, element, self.tick(), self.scope, tuple(self.frames), node)
                    )
                else:
                    self.walk(element.key)
            else:
                self.walk(element.value)
        return False


def _params(params: cst.Parameters) -> Iterable[cst.Param]:
    yield from params.posonly_params
    yield from params.params
    if isinstance(params.star_arg, cst.Param):
        yield params.star_arg
    yield from params.kwonly_params
    if params.star_kwarg is not None:
        yield params.star_kwarg


def collect(module: cst.Module, source: str, path: str = "<string>") -> FileFacts:
    facts = FileFacts(module, source, path)
    collector = _Collector(facts)
    collector.walk(module)
    return facts
