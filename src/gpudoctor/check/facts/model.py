"""``FileFacts``: the questions rules ask about one file, and how values are evaluated."""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator, Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts.containers import ContainerItems
from gpudoctor.check.facts.dicts import DictContentsQueries
from gpudoctor.check.facts.lattice import DIFFUSION_PIPELINE, ExpressionValues
from gpudoctor.check.facts.nodes import (
    call_arg,
    dotted,
    int_value,
    is_true,
    name_key,
    receiver_key,
    string_value,
    walk,
)
from gpudoctor.check.facts.records import (
    AttributeAssignSite,
    AugAssignSite,
    Binding,
    CallSite,
    DictEntrySite,
    FunctionFrame,
    IfFrame,
    KeyDeletion,
    LoopFrame,
    ReturnSite,
    Scope,
    SubscriptAssignSite,
    WithFrame,
)
from gpudoctor.check.facts.values import (
    TRAIT_CAST,
    TRAIT_DISPATCHED,
    TRAIT_EMPTY,
    TRAIT_FP16,
    TRAIT_PRECISION_CAST,
    TRAIT_MOVED,
    TRAIT_OFFLOADED,
    TRAIT_FROZEN,
    TRAIT_PEFT,
    TRAIT_PREPARED,
    TRAIT_QUANTIZED,
    UNKNOWN,
    DeviceMap,
    Value,
)

# Words in comments or strings that show the file runs as several processes. ``accelerator.num_processes``
# (read for logging in single-process scripts too) is not evidence; ``--num_processes 2`` is.
_LAUNCH_HINT = re.compile(
    r"accelerate\s+launch|torchrun|torch\.distributed\.(run|launch)|nproc_per_node|(?<![.\w])num_processes|"
    r"LOCAL_RANK|WORLD_SIZE|init_process_group|DistributedDataParallel|notebook_launcher|"
    r"deepspeed(?:\s+-{1,2}\w[\w-]*(?:[= ][^\s-]\S*)?){0,12}\s+[\w./-]+\.py"
)
# A negation ending just before a launch hint (``don't use torchrun``, ``不要用 torchrun``, ``instead of
# accelerate launch``): the comment names the launcher to say it is not used. Only the few words before the
# hint on its line count (``_NEGATION_REACH`` characters), so "no GPU; run with torchrun" still is a hint.
_NEGATED_LAUNCHER = re.compile(
    r"(\b(do ?n[o']t|do not|never|not|no need (to|for)|without|instead of|rather than|avoid)\b|"
    r"不要|不用|别|勿|无需|不需要|不能|而不是|而非)[^\n,;.，；。]{0,12}$",
    re.IGNORECASE,
)
_NEGATION_REACH = 24
# The process count a launch line states: ``--num_processes=1``, ``--nproc_per_node 1``, ``num_processes=1``.
_HELPER_DEPTH = 3  # how many of the file's own functions to follow for a device map they return
_STATED_COUNT = re.compile(r"""(num_processes|nproc[_-]per[_-]node|num_gpus)["']?\s*[=:\s]\s*["']?(\d+)\b""")
# A test on the number of processes: ``PartialState().num_processes > 1``, ``world_size != 1``.
_PROCESS_COUNT = re.compile(r"""(num_processes|world_size|WORLD_SIZE|get_world_size\(\))["'\])]*\s*(>\s*1|!=\s*1|>=\s*2)\b""")
# Words that show memory is short, so an "auto" device map will offload.
_MEMORY_SHORT_HINT = re.compile(
    r"out of (gpu |cuda )?memory|\bOOM\b|does ?n[o']t fit|not enough (gpu |v)?ram|offload(ed)? to (the )?(cpu|disk)|"
    r"\b(split|distributed|dispatched|placed|spread)\b[^.\n]{0,40}\b(cpu|gpu)s? and (the )?(cpu|gpu|disk)|"
    r"显存不足|内存不足|CPU和GPU|CPU 和 GPU",
    re.IGNORECASE,
)


class FileFacts(DictContentsQueries, ContainerItems, ExpressionValues):
    """Facts about one module. Build with :func:`collect`."""

    def __init__(self, module: cst.Module, source: str, path: str = "<string>") -> None:
        self.module = module
        self.source = source
        self.path = path
        self.imports: dict[str, str] = {}  # local name -> qualified name
        self.calls: list[CallSite] = []
        self.aug_assigns: list[AugAssignSite] = []
        self.subscript_assigns: list[SubscriptAssignSite] = []
        self.key_deletions: list[KeyDeletion] = []
        self.dict_entries: list[DictEntrySite] = []
        self.attribute_assigns: list[AttributeAssignSite] = []
        self.loops: list[LoopFrame] = []
        self.functions: list[Scope] = []
        self.name_loads: dict[str, list[tuple[int, cst.CSTNode, Scope]]] = {}
        self._calls_by_func: Optional[dict[str, list[CallSite]]] = None
        self._alias_index: Optional[dict[str, list[Binding]]] = None
        self.class_attrs: dict[str, dict[str, list[Binding]]] = {}
        self.module_scope = Scope("module", "<module>", module, None)
        self._call_by_node: dict[int, CallSite] = {}
        self._calls_by_qualname: dict[str, list[CallSite]] = {}
        self._calls_on_key: dict[str, list[CallSite]] = {}
        self._value_cache: dict[tuple[int, int], Value] = {}
        self._evaluating: set[tuple[int, int]] = set()
        self._launch_hints: Optional[list[str]] = None
        self.returns: dict[int, list[ReturnSite]] = {}  # id(function scope) -> its return statements
        self.yields: dict[int, list[ReturnSite]] = {}
        self.classes: dict[str, Scope] = {}
        self._bound_names: set[str] = set()
        # Well-known names used without an import (a snippet, a notebook cell): name -> what it was read as.
        self.assumed_imports: dict[str, str] = {}
        # Members read on each name or ``self.x`` (``accelerator.prepare`` -> "accelerator": {"prepare"}).
        self.member_uses: dict[str, set[str]] = {}
        self.star_imports: list[str] = []  # modules of ``from X import *`` ("" for a relative one)
        # Names never bound here but used like a well-known object (see ``assumed_instance``): name -> qualname.
        self.assumed_instances: dict[str, str] = {}
        self._instance_cache: dict[tuple[str, bool], Optional[apis.InstanceProfile]] = {}
        self._functions_by_name: Optional[dict[str, list[Scope]]] = None
        self._module_classes: Optional[set[str]] = None
        self._temporaries: dict[int, Binding] = {}  # id(the one load of a single-use temporary) -> its binding

    def release(self) -> None:
        """Break the facts' reference cycles (a scope holds its bindings, each binding its scope; caches hold sites
        that hold scopes) once the rules are done, so that reference counting frees the file's tree and facts at
        once: left in cycles, every one of them waited for the cyclic garbage collector, which then traversed
        millions of nodes per file (a quarter of the engine's CPU time). The facts are unusable afterwards."""
        for scope in (self.module_scope, *self.functions, *self.classes.values()):
            scope.bindings = {}
            scope.parent = None
        self.__dict__.clear()

    # ---------------------------------------------------------------- questions for rules

    def qualname(self, node: Optional[cst.CSTNode]) -> Optional[str]:
        if node is None:
            return None
        if type(node) is cst.Name:
            q = self.imports.get(node.value)
            if q is None and node.value not in self._bound_names and self.star_imports:
                q = apis.star_imported(node.value, self.star_imports)
            if q is None and node.value not in self._bound_names:
                known = self._well_known_name(node.value) or self._well_known_class(node.value)
                if known:
                    q = self.assumed_imports[node.value] = known
            return apis.canonical(q) if q else None
        if type(node) is cst.Attribute:
            head = self.qualname(node.value)
            return apis.canonical(f"{head}.{node.attr.value}") if head else None
        if type(node) is cst.Call:  # ``torch.no_grad()`` used as a context manager
            return None
        return None

    def _well_known_name(self, name: str) -> Optional[str]:
        """The library object an unbound well-known name stands for, unless its uses refute it (``optim.step()``)."""
        refuting = apis.MODULE_NAME_REFUTED_BY.get(name)
        if refuting is not None and self.member_uses.get(name, set()) & refuting:
            return None
        return apis.WELL_KNOWN_NAMES.get(name)

    def _well_known_class(self, name: str) -> Optional[str]:
        """A model-class-like name, unless a star import from another package may define it."""
        if any(m.split(".")[0] not in ("transformers", "peft", "trl") for m in self.star_imports):
            return None
        return apis.well_known_class(name)

    def assumed_instance(self, key: str, unbound_here: bool = False) -> Optional[apis.InstanceProfile]:
        """The library object ``key`` (a name or ``self.x``) stands for when the file never binds it but uses it
        like one (``accelerator.prepare(...)`` in a notebook cell whose accelerator came from an earlier cell).
        ``unbound_here``: the use is known to come before any binding of the name (``train_dl =
        accelerator.prepare(train_dl)`` in a cell: the argument is the earlier cell's loader)."""
        cache = (key, unbound_here)
        if cache in self._instance_cache:
            return self._instance_cache[cache]
        profile = None
        if (unbound_here or key not in self._bound_names) and key not in self.imports and \
                (key not in apis.WELL_KNOWN_NAMES or self._well_known_name(key) is None):
            attr = key[5:] if key.startswith("self.") else key
            if "." not in attr:
                profile = apis.instance_profile(attr, self.member_uses.get(key, set()))
        self._instance_cache[cache] = profile
        return profile

    def _used_as_module(self, node: cst.CSTNode) -> bool:
        """A name (or ``self.x``) used with ``.parameters()`` / ``.named_parameters()``, which only
        ``torch.nn.Module`` has."""
        key = name_key(node)
        return key is not None and bool(self.member_uses.get(key, set()) & {"parameters", "named_parameters"})

    def _assumed_value(self, key: str) -> Optional[Value]:
        profile = self.assumed_instance(key, unbound_here=True)
        if profile is None:
            return None
        self.assumed_instances[key] = profile.qualname
        # One node stands for the object everywhere (rules compare origins by identity): its first use.
        first = self.name_loads[key][0][1] if self.name_loads.get(key) else None
        return Value(profile.kind, first, {"assumed": key})

    @property
    def assumption_note(self) -> str:
        """For messages: the well-known names this file uses without importing or binding them, as they were read."""
        if not self.assumed_imports and not self.assumed_instances:
            return ""
        names = [
            f"`{name}`" if name == full else f"`{name}` as `{full}`" for name, full in sorted(self.assumed_imports.items())
        ] + [f"`{name}` as {_article(full)} `{full.split('.')[-1]}`" for name, full in sorted(self.assumed_instances.items())]
        return f" (Assumed {', '.join(names)}: used without an import or assignment, as in a snippet or notebook cell.)"

    def calls_to(self, *qualnames: str) -> list[CallSite]:
        out: list[CallSite] = []
        for q in qualnames:
            out.extend(self._calls_by_qualname.get(q, ()))
        out.sort(key=lambda c: c.order)
        return out

    def trainer_base(self, class_name: str, depth: int = 0) -> Optional[str]:
        """The qualified name of the transformers/trl trainer the file's class ``class_name`` derives from (through
        the file's own classes: ``class BunnyTrainer(transformers.Trainer)``), else None."""
        scope = self.classes.get(class_name)
        if scope is None or depth > 5 or not isinstance(scope.node, cst.ClassDef):
            return None
        for base in scope.node.bases:
            q = self.qualname(base.value) or ""
            if q in apis.TRAINERS:
                return q
            if isinstance(base.value, cst.Name) and base.value.value in self.classes and base.value.value != class_name:
                found = self.trainer_base(base.value.value, depth + 1)
                if found is not None:
                    return found
        return None

    def trainer_calls(self) -> list[CallSite]:
        """Constructions of a transformers/trl trainer: the library classes and the file's subclasses of them
        (``CustomTrainer(model=..., args=...)`` passes its arguments on to ``Trainer.__init__``)."""
        found = self.__dict__.get("_trainer_calls")
        if found is None:
            found = list(self.calls_to(*apis.TRAINERS))
            for site in self.calls:
                func = site.node.func
                if site.qualname is None and isinstance(func, cst.Name) and self.trainer_base(func.value) is not None:
                    found.append(site)
            found.sort(key=lambda c: c.order)
            self.__dict__["_trainer_calls"] = found
        return found

    def method_calls(self, *methods: str) -> Iterator[CallSite]:
        by_method = self.__dict__.get("_calls_by_method")
        if by_method is None:  # once per file (calls are in flow order, each list stays so)
            by_method = self.__dict__["_calls_by_method"] = {}
            for site in self.calls:
                if site.method is not None:
                    by_method.setdefault(site.method, []).append(site)
        if len(methods) == 1:
            return iter(by_method.get(methods[0], ()))
        found = [site for method in set(methods) for site in by_method.get(method, ())]
        found.sort(key=lambda c: c.order)
        return iter(found)

    def call_site(self, node: cst.Call) -> Optional[CallSite]:
        return self._call_by_node.get(id(node))

    def imported_names(self) -> set[str]:
        return {apis.canonical(q) for q in self.imports.values()}

    def loads_of(self, key: str, after: int = -1, scope: Optional[Scope] = None) -> list[tuple[int, cst.CSTNode, Scope]]:
        uses = [u for u in self.name_loads.get(key, ()) if u[0] > after]
        if scope is not None:
            uses = [u for u in uses if self._same_namespace(u[2], scope, key)]
        return uses

    def next_use(self, key: str, order: int, scope: Scope) -> Optional[cst.CSTNode]:
        """The first load of ``key`` after ``order`` in ``scope`` that still reads the binding live at ``order``
        (where an unchanged value is used next: ``x.to(dev)`` ... ``model(x)``)."""
        binding = self.binding_at(key, order, scope)
        for at, node, where in self.loads_of(key, order, scope):
            if where is scope and self.binding_at(key, at, scope) is binding:
                return node
        return None

    def calls_of_value(self, value_node: cst.CSTNode) -> list[CallSite]:
        """Calls of a name bound to ``value_node`` while it still holds it (``loss_fn = nn.CrossEntropyLoss(...)``
        ... ``loss_fn(logits, y)``), in source order."""
        found = []
        for binding in self._bindings_of_value(value_node):
            for site in self._calls_by_func_key().get(binding.key, ()):
                if site.order > binding.order and self.binding_at(binding.key, site.order, site.scope) is binding:
                    found.append(site)
        return sorted(found, key=lambda c: c.order)

    def _calls_by_func_key(self) -> dict[str, list[CallSite]]:
        if self._calls_by_func is None:
            self._calls_by_func = {}
            for site in self.calls:
                key = name_key(site.node.func)
                if key is not None:
                    self._calls_by_func.setdefault(key, []).append(site)
        return self._calls_by_func

    @property
    def launch_hints(self) -> list[str]:
        """Evidence, from code or comments, that the file runs as several processes."""
        if self._launch_hints is None:
            hints = sorted({
                m.group(0) for m in _LAUNCH_HINT.finditer(self.source)
                if not self._one_process_launch(m) and not self._launcher_ruled_out(m)
            })
            # ``if PartialState().num_processes > 1: raise SystemExit(...)``: the file refuses to run as
            # several processes, whatever its comments say about launchers.
            self._launch_hints = [] if hints and self._refuses_multi_process() else hints
        return self._launch_hints

    def _one_process_launch(self, match: re.Match) -> bool:
        """The hint's own line says one process: ``accelerate launch --num_processes=1 train.py``,
        ``torchrun --nproc_per_node 1``, ``notebook_launcher(main, num_processes=1)``."""
        end = self.source.find("\n", match.start())
        count = _STATED_COUNT.search(self.source, match.start(), len(self.source) if end < 0 else end)
        return count is not None and count.group(2) == "1"

    def _launcher_ruled_out(self, match: re.Match) -> bool:
        """The words just before the hint, on its own line, rule the launcher out: ``# python train.py (don't use
        torchrun)``, ``# 单进程，不要用 torchrun``, ``# instead of accelerate launch``."""
        line_start = self.source.rfind("\n", 0, match.start()) + 1
        before = self.source[max(line_start, match.start() - _NEGATION_REACH):match.start()]
        return _NEGATED_LAUNCHER.search(before) is not None

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

    def attribute_store(self, node: Optional[cst.CSTNode], order: int, scope: Scope) -> Optional[AttributeAssignSite]:
        """The last ``args.max_train_steps = ...`` before ``order`` that stores the attribute path ``node`` reads
        (a dotted path on a plain name, not ``self.x``, which is a binding), in ``scope`` or at module level."""
        path = dotted(node) if isinstance(node, cst.Attribute) else None
        if path is None or path.startswith("self."):
            return None
        stores = [
            a for a in self.attribute_assigns
            if a.order < order and (a.scope is scope or a.scope is self.module_scope) and dotted(a.target) == path
        ]
        return max(stores, key=lambda a: a.order) if stores else None

    def through_temporary(self, node: Optional[cst.CSTNode]) -> Optional[cst.CSTNode]:
        """The expression a single-use temporary stands for (``tmp = model.to(device)`` ... ``tmp.eval()``:
        ``model.to(device)``, as if written ``model.to(device).eval()``), through chains of them; any other
        node as it is."""
        while node is not None and id(node) in self._temporaries:
            node = self._temporaries[id(node)].value
        return node

    def assignment_of(self, node: Optional[cst.CSTNode], order: int, scope: Scope) -> Optional[Binding]:
        """The plain ``name = value`` (or ``self.x = value``) that ``node`` refers to at ``order``; None for
        anything else (a parameter, a loop target, an unpacking, an unknown name)."""
        key = name_key(node) if node is not None else None
        if key is None:
            return None
        binding = self.binding_at(key, order, scope)
        if binding is None or binding.kind != "assign" or binding.value is None:
            return None
        return binding

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

    def device_map(self, node: Optional[cst.CSTNode], order: int, scope: Scope, depth: int = 0) -> Optional[DeviceMap]:
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
                found = _device_literals(element.value) if isinstance(element, cst.DictElement) else None
                if found is None:
                    return DeviceMap("unknown", node=node)
                keys.append(string_value(element.key))
                devices |= found
            if keys == [""]:
                return DeviceMap("single", frozenset(devices), node=node)
            return DeviceMap("explicit", frozenset(devices), node=node, label="a device map")
        if isinstance(node, cst.DictComp):
            # ``{f"model.layers.{i}": 0 if i < 16 else "disk" for i in range(32)}``
            found = _device_literals(node.value)
            if found is None:
                return DeviceMap("unknown", node=node)
            return DeviceMap("explicit", frozenset(found), node=node, label="a device map")
        key = name_key(node)
        if key is not None:
            binding = self.binding_at(key, order, scope)
            if binding is not None and binding.kind == "param" and isinstance(binding.target, cst.Param):
                # what the file's calls pass for the parameter, else its default (``device_map: str = "auto"``)
                passed = self.param_argument(binding)
                if passed is not None:
                    return self.device_map(*passed, depth)
                if binding.target.default is not None:
                    return self.device_map(binding.target.default, binding.order, binding.scope, depth)
            if binding is None or binding.value is None or binding.kind not in ("assign",):
                return DeviceMap("unknown", node=node)
            inner = self.device_map(binding.value, binding.order, binding.scope, depth)
            if inner is None:
                return None
            if isinstance(binding.value, cst.Call) and self.qualname(binding.value.func) in apis.INFER_DEVICE_MAP:
                inner = DeviceMap("auto", node=binding.value, label="infer_auto_device_map(...)")
            # ``device_map["lm_head"] = "disk"`` or ``device_map.update({...})`` after the binding.
            extra: Optional[set] = set()
            for site in self.subscript_assigns:
                if site.base_key == key and binding.order < site.order < order:
                    found = _device_literals(site.value)
                    extra = extra | found if extra is not None and found is not None else None
            for site in self.method_calls("update"):
                if name_key(site.receiver) == key and binding.order < site.order < order:
                    given = site.arg(0)
                    added = self.device_map(given, site.order, site.scope, depth) if given is not None else None
                    found = set(added.devices) if added is not None and added.strategy in ("explicit", "single") else None
                    for arg in site.node.args:
                        if arg.keyword is not None:
                            more = _device_literals(arg.value)
                            found = found | more if found is not None and more is not None else None
                    extra = extra | found if extra is not None and found is not None else None
            if extra:
                devices = frozenset(inner.devices | extra)
                strategy = "explicit" if inner.strategy in ("explicit", "single") else inner.strategy
                return DeviceMap(strategy, devices, node=inner.node, label=inner.label)
            return inner
        if isinstance(node, cst.Call) and self.qualname(node.func) in apis.INFER_DEVICE_MAP:
            return DeviceMap("auto", node=node, label="infer_auto_device_map(...)")
        if isinstance(node, cst.Call) and depth < _HELPER_DEPTH:
            returned = self._device_map_returned(node, depth)
            if returned is not None:
                return returned
        return DeviceMap("unknown", node=node)

    def _device_map_returned(self, call: cst.Call, depth: int) -> Optional[DeviceMap]:
        """The map the file's own function ``call`` runs returns (``device_map = build_map(n_layers)``), when
        every ``return`` gives a known map of one strategy: their devices together."""
        site = self.call_site(call)
        if site is None:
            return None
        maps: list[DeviceMap] = []

        def read(value, order, scope, _callee):
            found = self.device_map(value, order, scope, depth + 1)
            if found is None or found.strategy == "unknown":
                return None
            maps.append(found)
            return found

        if self.every_return(site, read) is None or len({m.strategy for m in maps}) != 1:
            return None
        first = maps[0]
        return DeviceMap(first.strategy, frozenset().union(*(m.devices for m in maps)), node=first.node, label=first.label)

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
                return self._assumed_value(key) or UNKNOWN
            value = self._value_of_binding(binding)
            return self._apply_mutations(key, value, binding, order, scope)
        if isinstance(node, cst.Call):
            return self._evaluate_call(node, order, scope)
        return self._evaluate_expression(node, order, scope)

    def _value_of_binding(self, binding: Binding) -> Value:
        if binding.kind == "param":
            return self._param_value(binding)
        if binding.value is None:
            return UNKNOWN
        if binding.kind == "assign":
            return self.value(binding.value, binding.order, binding.scope)
        if binding.kind == "unpack" and isinstance(binding.value, cst.Call):
            site = self._call_by_node.get(id(binding.value))
            if site is not None and site.method in ("prepare",) and site.receiver is not None:
                if self.value(site.receiver, site.order, site.scope).kind == "accelerator":
                    inner = site.arg(position=binding.index) if binding.index is not None else None
                    inner_value = self.value(inner, site.order, site.scope) if inner is not None else UNKNOWN
                    return Value(inner_value.kind, binding.target, {TRAIT_PREPARED: site}, base=inner_value)
        return self._flow_binding_value(binding)

    def _apply_mutations(self, key: str, value: Value, binding: Binding, order: int, scope: Scope) -> Value:
        for site in self._mutating_calls(key, binding, order, scope):
            if site.qualname in apis.DISPATCH:
                value = self._dispatched(value, site)
            elif value.kind in ("model", DIFFUSION_PIPELINE) and site.method in apis.MODULE_MOVES | apis.MODULE_CASTS:
                value = self._moved_or_cast(value, site)
        return value

    def _mutating_calls(self, key: str, binding: Binding, order: int, scope: Scope) -> list[CallSite]:
        """Calls on the object ``key`` holds (through ``binding``) between the binding and ``order``: on ``key``
        itself, and on another name for the same object. ``unet = pipe.unet`` then ``unet.to(torch.float32)``
        casts ``pipe.unet``; ``m = model`` bound to ``model`` then ``model.half()`` casts ``m``."""
        sites = [
            site for site in self._calls_on_key.get(key, ())
            if binding.order < site.order < order and self._same_namespace(site.scope, scope, key)
        ]
        for alias in self._aliases().get(key, ()):  # alias = key, bound while key holds the object
            if binding.order < alias.order < order and self._holder(key, alias.order, alias.scope) is binding:
                sites.extend(
                    site for site in self._calls_on_key.get(alias.key, ())
                    if alias.order < site.order < order and self.binding_at(alias.key, site.order, site.scope) is alias
                )
        source = receiver_key(binding.value) if binding.kind == "assign" else None
        if source is not None:  # key = source: mutations of source
            origin = self._holder(source, binding.order, binding.scope)
            if origin is not None and source != key:
                sites.extend(
                    site for site in self._calls_on_key.get(source, ())
                    if binding.order < site.order < order and self._holder(source, site.order, site.scope) is origin
                )
        return sorted(sites, key=lambda c: c.order)

    def _holder(self, key: str, order: int, scope: Scope) -> Optional[Binding]:
        """The binding that decides what ``key`` is at ``order``: its own, or for an attribute path never
        assigned itself (``pipe.unet``) its owner's."""
        found = self.binding_at(key, order, scope)
        if found is None and "." in key and not key.startswith("self."):
            found = self.binding_at(key.split(".")[0], order, scope)
        return found

    def _aliases(self) -> dict[str, list[Binding]]:
        """source key -> plain assignments ``alias = source`` (a name or attribute path) in the file."""
        if self._alias_index is None:
            self._alias_index = {}
            for scope in (self.module_scope, *self.functions):
                for bindings in scope.bindings.values():
                    for b in bindings:
                        source = receiver_key(b.value) if b.kind == "assign" else None
                        if source is not None and source != b.key:
                            self._alias_index.setdefault(source, []).append(b)
        return self._alias_index

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
                traits = {TRAIT_PEFT: call}
                if q in apis.PEFT_LOADERS and _loads_adapter_frozen(call):
                    traits[TRAIT_FROZEN] = call
                return Value("model", call, traits, base=base if base.kind == "model" else None)
            if q in apis.PASSTHROUGH:
                inner = self.value(call_arg(call, 0, "model"), order, scope)
                if q in apis.FREEZE_ALL and inner.kind == "model" and inner.has(TRAIT_PEFT):
                    # prepare_model_for_kbit_training sets requires_grad=False on every parameter it is given: given
                    # the model with its adapters, it freezes the adapters too
                    return Value("model", call, {TRAIT_FROZEN: call}, base=inner)
                return inner
            if q in apis.DATA_PARALLEL or q in apis.DISTRIBUTED_DATA_PARALLEL:
                base = self.value(call_arg(call, 0, "module"), order, scope)
                return Value("model", call, {"wrapper": q}, base=base)
            if q in apis.DATALOADER:
                return Value("dataloader", call)
            if q in apis.GRAD_SCALER:
                return Value("grad_scaler", call)
            if q in apis.TRAINERS:
                return Value("trainer", call)
            if q in apis.TRAINING_ARGS:
                return Value("training_args", call)
            if q in apis.INFER_DEVICE_MAP:
                return Value("device_map", call)
            if q == apis.BNB_CONFIG:
                bits = 8 if is_true(call_arg(call, keyword="load_in_8bit")) else 4 if is_true(call_arg(call, keyword="load_in_4bit")) else 0
                return Value("quantization_config", call, {"bits": bits})
            if apis.is_optimizer(q):
                return Value("optimizer", call)
            if apis.is_scheduler(q):
                return Value("scheduler", call)
            if apis.is_diffusion_pipeline_load(q):
                return self._loaded_pipeline(call, order, scope)
            owner_method = apis.hf_class_method(q)
            if owner_method:
                owner, method = owner_method
                if method in ("from_pretrained", "from_config", "_from_config") and apis.is_model_class(owner):
                    return self._loaded_model(call, owner, method, order, scope, context)
                if method == "from_pretrained" and "Tokenizer" in owner:
                    return Value("tokenizer", call)
            diffusers_load = apis.diffusers_model_load(q)
            if diffusers_load:
                return self._loaded_model(call, *diffusers_load, order, scope, context)
        if isinstance(call.func, cst.Attribute):
            method = call.func.attr.value
            receiver = call.func.value
            if method in apis.MODULE_MOVES | apis.MODULE_CASTS:
                base = self.value(receiver, order, scope)
                if base.kind == "unknown" and method in apis.MODULE_CASTS and self._used_as_module(receiver):
                    # ``model = model.half()`` in a notebook cell whose model came from an earlier cell: a name whose
                    # ``.parameters()`` the file takes is a module, whatever bound it
                    base = Value("model", receiver, {"assumed_module": name_key(receiver)})
                if base.kind == "unknown" and isinstance(receiver, cst.Call) and site is not None:
                    base = self._module_by_use(receiver, call, frozenset({method})) or base  # ``Darknet(cfg).to(dev)``
                if base.kind in ("model", DIFFUSION_PIPELINE) and site is not None:
                    return self._moved_or_cast(base, site)
                if base.kind == "unknown":
                    return UNKNOWN  # a tensor, a module, a batch: ``.to()`` says nothing about which
                return Value(base.kind, call, base=base)
            if method in ("prepare", "prepare_model") and self.value(receiver, order, scope).kind == "accelerator":
                if len(call.args) == 1:
                    inner = self.value(call.args[0].value, order, scope)
                    return Value(inner.kind, call, {TRAIT_PREPARED: site}, base=inner)
                # Several objects: a tuple whose items come back prepared (see ``element``).
                items = tuple(a.value for a in call.args if a.keyword is None and not a.star)
                return Value("tuple", call, {"items": items, "at": (order, scope), TRAIT_PREPARED: site})
        return self._evaluate_other_call(call, q, order, scope, site)

    def keyword_conditions(self, call: cst.Call, order: int, scope: Scope) -> frozenset[str]:
        """The names that decide what ``call``'s ``**kwargs`` dict holds: the parameters its values come from
        (``{"device_map": device_map}``) and the tests of the ``if`` around ``kwargs["k"] = v``. Code guarded by
        a test of one of them (``if device_map is None: model.to(device)``) is on another path."""
        names: set[str] = set()
        for contents in self.kwargs_contents(call, order, scope):
            if not contents.bindings:
                continue  # ``**{"device_map": device_map}`` written in place: as explicit as a keyword
            for entry in contents.entries.values():
                if entry.how == "display" and isinstance(entry.value, cst.Name):
                    source = self.binding_at(entry.value.value, entry.order, entry.scope)
                    if source is not None and source.kind == "param":
                        names.add(entry.value.value)
                for frame in entry.context:
                    if isinstance(frame, IfFrame):
                        names.update(n.value for n in walk(frame.test) if isinstance(n, cst.Name))
        return frozenset(names)

    def on_another_path(self, value: Value, context: tuple) -> bool:
        """``value`` was loaded with ``**kwargs`` decided by some names, and ``context`` is under an ``if`` that
        tests one of them: the finding's premise (the kwargs' content) may not hold there."""
        names: set[str] = set()
        current: Optional[Value] = value
        while current is not None:
            names |= current.traits.get("kwargs_conditions", frozenset())
            current = current.base
        return bool(names) and any(
            isinstance(frame, IfFrame) and any(isinstance(n, cst.Name) and n.value in names for n in walk(frame.test))
            for frame in context
        )

    def _loaded_model(self, call, owner, method, order, scope, context) -> Value:
        traits: dict[str, Any] = {}
        if any(isinstance(f, WithFrame) and f.qualname in apis.INIT_EMPTY for f in context):
            traits[TRAIT_EMPTY] = call
        keyword = functools.partial(self.keyword_argument, call, order=order, scope=scope)
        traits.update(self._placement_traits(call, self.device_map(keyword("device_map"), order, scope), order, scope))
        for kw in ("load_in_8bit", "load_in_4bit"):
            if is_true(keyword(kw)):
                traits[TRAIT_QUANTIZED] = call
        qconfig = keyword("quantization_config")
        if qconfig is not None and self._is_bnb_config(qconfig, order, scope):
            traits[TRAIT_QUANTIZED] = call
        dtype = keyword("dtype") or keyword("torch_dtype")
        if self._fp16_dtype(dtype):
            traits[TRAIT_FP16] = dtype
        traits["class"] = owner
        if owner.split(".")[-1].startswith("AutoPeftModel"):
            traits[TRAIT_PEFT] = call  # peft's ``AutoPeftModelFor*.from_pretrained``: the base with the saved adapters
            if _loads_adapter_frozen(call):
                traits[TRAIT_FROZEN] = call
        conditions = self.keyword_conditions(call, order, scope)
        if TRAIT_QUANTIZED in traits:
            conditions |= self._conditional_names(qconfig, order, scope)
        if conditions:
            traits["kwargs_conditions"] = conditions
        return Value("model", call, traits)

    def _fp16_dtype(self, dtype: Optional[cst.BaseExpression]) -> bool:
        """``torch.float16`` / ``torch.half``, or the string ``from_pretrained`` resolves with ``getattr(torch, dtype)``
        (transformers 5.24 ``modeling_utils.py:858``; diffusers the same): ``dtype="float16"``."""
        if dtype is None:
            return False
        return self.qualname(dtype) in ("torch.float16", "torch.half") or string_value(dtype) in ("float16", "half")

    def _loaded_pipeline(self, call: cst.Call, order: int, scope: Scope) -> Value:
        """A diffusers pipeline; ``torch_dtype=torch.float16`` loads every component in float16."""
        dtype = self.keyword_argument(call, "torch_dtype", order, scope) or self.keyword_argument(call, "dtype", order, scope)
        fp16 = self._fp16_dtype(dtype)
        return Value(DIFFUSION_PIPELINE, call, {TRAIT_FP16: dtype} if fp16 else {})

    def _pipeline_component(self, node: cst.Attribute, pipeline: Value, order: int, scope: Scope) -> Value:
        """``pipe.unet``: a module of the pipeline, with the pipeline's latest dtype and move (``pipe.to(...)``,
        ``torch_dtype=``) and then what the file does to ``pipe.unet`` itself before ``order``."""
        chain: list[Value] = []
        current: Optional[Value] = pipeline
        while current is not None:
            chain.append(current)
            current = current.base
        component = Value("model", node, {"component": node.attr.value, "component_of": pipeline.node})
        for step in reversed(chain):  # oldest first: the latest dtype stays the latest
            carried = {k: v for k, v in step.traits.items() if k in (TRAIT_CAST, TRAIT_FP16, TRAIT_MOVED)}
            if carried:
                component = component.derive(step.node, **carried)
        owner = name_key(node.value)
        binding = self.binding_at(owner, order, scope) if owner is not None else None
        if binding is None:
            return component
        return self._apply_mutations(f"{owner}.{node.attr.value}", component, binding, order, scope)

    def _conditional_names(self, node, order: int, scope: Scope) -> frozenset[str]:
        """The names tested by a conditional expression that decides a loading kwarg
        (``quantization_config=BitsAndBytesConfig(...) if dtype == "int4" else None``, directly or through one
        name): code under a test of them (``if dtype != "int4": model.to(torch.bfloat16)``) is on another path."""
        if isinstance(node, cst.Name):
            binding = self.binding_at(node.value, order, scope)
            node = binding.value if binding is not None else None
        if not isinstance(node, cst.IfExp):
            return frozenset()
        return frozenset(n.value for n in walk(node.test) if isinstance(n, cst.Name))

    def _is_bnb_config(self, node, order, scope) -> bool:
        return self.value(node, order, scope).kind == "quantization_config"

    def _placement_traits(self, call: cst.Call, device_map: Optional[DeviceMap], order: Optional[int] = None,
                          scope: Optional[Scope] = None) -> dict[str, Any]:
        """What a loading/dispatching call's ``device_map`` says: the map, dispatch, offload evidence."""
        if device_map is None:
            return {}
        traits: dict[str, Any] = {"device_map": device_map}
        if device_map.maybe_dispatched:
            traits[TRAIT_DISPATCHED] = device_map
        offload = self._offload_evidence(call, device_map, order, scope)
        if offload:
            traits[TRAIT_OFFLOADED] = offload
        return traits

    def _offload_evidence(self, call: cst.Call, device_map: DeviceMap, order: Optional[int] = None,
                          scope: Optional[Scope] = None) -> Optional[str]:
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
            if order is not None:
                overflow = self._max_memory_overflow(call, order, scope)
                if overflow:
                    return overflow
            hint = self.says_memory_is_short
            if hint:
                return f'the automatic map offloads when memory is short, and the file says "{hint}"'
        return None

    def _max_memory_overflow(self, call: cst.Call, order: int, scope: Scope) -> Optional[str]:
        """``max_memory`` gives the GPUs less than the checkpoint's weights (size from its name) and has a "cpu"
        or "disk" budget: accelerate's automatic map (it uses only the listed devices) puts the rest there."""
        from gpudoctor.check.queries import checkpoint_name, max_memory_entries, params_from_name, weight_bytes

        entries = max_memory_entries(self, self.keyword_argument(call, "max_memory", order, scope), order, scope)
        if entries is None or not {"cpu", "disk"} & set(entries[0]):
            return None
        name = checkpoint_name(self, call, order, scope)
        params = params_from_name(name)
        if params is None:
            return None
        per_weight, note = weight_bytes(self, call)
        gpu_bytes = sum(amount for device, amount in entries[0].items() if device not in ("cpu", "disk"))
        if params * per_weight <= gpu_bytes:
            return None
        return (
            f"`max_memory={entries[1]}` leaves the GPUs {gpu_bytes / 1e9:.0f} GB for `{name}` (~{params * per_weight / 1e9:.0f} GB"
            f" of weights: {note}), so the automatic map offloads the rest"
        )

    def _dispatched(self, base: Value, site: CallSite) -> Value:
        call = site.node
        position = 1 if site.qualname == "accelerate.dispatch_model" else None
        device_map = self.device_map(call_arg(call, keyword="device_map", position=position), site.order, site.scope)
        traits = self._placement_traits(call, device_map)
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
            q = self.qualname(self._sole_dtype_binding(arg.value, site) or arg.value)
            if q and q.startswith("torch.") and q.split(".")[-1] in _DTYPES:
                dtype = _DTYPES[q.split(".")[-1]]
                traits[TRAIT_CAST] = (dtype, site.node)
                if dtype == "float16":
                    traits[TRAIT_FP16] = site.node
            elif self._precision_dtype(arg.value, site):
                traits[TRAIT_PRECISION_CAST] = site.node
            elif arg.keyword is None or arg.keyword.value == "device":
                traits[TRAIT_MOVED] = site.node
        if method != "to":
            traits[TRAIT_MOVED] = site.node
        return base.derive(site.node, **traits)

    def _sole_dtype_binding(self, node: cst.BaseExpression, site: CallSite) -> Optional[cst.BaseExpression]:
        """``dtype = torch.float16`` bound once in its scope (no other assignment, none under an ``if``): the
        value ``.to(device, dtype=dtype)`` casts to. A name assigned on several paths (``weight_dtype =
        torch.float32`` then ``if fp16: weight_dtype = torch.float16``) stays unknown here; the mixed-precision
        form of it is ``_precision_dtype``'s."""
        if not isinstance(node, cst.Name):
            return None
        binding = self.binding_at(node.value, site.order, site.scope)
        if binding is None or binding.kind != "assign" or not isinstance(binding.value, cst.Attribute):
            return None
        if len(binding.scope.bindings.get(node.value, ())) != 1:
            return None
        if any(isinstance(frame, IfFrame) for frame in binding.context):
            return None
        return binding.value

    def _precision_dtype(self, node: cst.BaseExpression, site: CallSite) -> bool:
        """A name holding the mixed-precision dtype: every assignment in its scope is a torch dtype, and each
        ``torch.float16`` one is taken only when fp16 mixed precision is on (``if accelerator.mixed_precision ==
        "fp16": weight_dtype = torch.float16``, or ``torch.float16 if args.mixed_precision == "fp16" else ...``).
        The diffusers examples' ``weight_dtype``: float16 exactly when fp16 AMP runs, whatever the launch says."""
        if not isinstance(node, cst.Name) or self.binding_at(node.value, site.order, site.scope) is None:
            return False
        bindings = self.binding_at(node.value, site.order, site.scope).scope.bindings.get(node.value, ())
        float16 = 0
        for binding in bindings:
            if binding.kind != "assign" or binding.value is None:
                return False
            value = binding.value
            if isinstance(value, cst.Subscript):
                if not self._precision_keyed_dtypes(value):
                    return False
                float16 += 1
                continue
            if isinstance(value, cst.IfExp):
                if not _fp16_precision_test(self.module.code_for_node(value.test)):
                    return False
                if any(_dtype_of(self, leaf) in (None, "float16") for leaf in _if_exp_leaves(value.orelse)):
                    return False  # ``... else (torch.bfloat16 if bf16 else torch.float32)``: no float16 there
                value = value.body
                tested = True
            else:
                tested = any(
                    isinstance(f, IfFrame) and f.branch == "body" and _fp16_precision_test(self.module.code_for_node(f.test))
                    for f in binding.context
                )
            dtype = _dtype_of(self, value)
            if dtype is None or (dtype == "float16" and not tested):
                return False
            float16 += dtype == "float16"
        return float16 > 0

    def _precision_keyed_dtypes(self, subscript: cst.Subscript) -> bool:
        """``{"fp16": torch.float16, "bf16": torch.bfloat16, "no": torch.float32}[accelerator.mixed_precision]``: a
        literal dict of torch dtypes indexed by the mixed-precision setting, float16 only under the "fp16" key."""
        if not isinstance(subscript.value, cst.Dict) or len(subscript.slice) != 1:
            return False
        index = subscript.slice[0].slice
        if not isinstance(index, cst.Index) or "mixed_precision" not in self.module.code_for_node(index.value):
            return False
        entries = [e for e in subscript.value.elements if isinstance(e, cst.DictElement)]
        if len(entries) != len(subscript.value.elements):
            return False
        dtypes = {string_value(e.key): _dtype_of(self, e.value) for e in entries}
        return dtypes.get("fp16") == "float16" and all(
            dtype is not None and (dtype != "float16" or key == "fp16") for key, dtype in dtypes.items()
        )

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


def _device_literals(node: cst.CSTNode) -> Optional[set]:
    """The devices a map's value can be: a literal, or either branch of ``0 if i < 16 else "disk"``."""
    if isinstance(node, cst.IfExp):
        body, orelse = _device_literals(node.body), _device_literals(node.orelse)
        return body | orelse if body is not None and orelse is not None else None
    found = _device_literal(node)
    return {found} if found is not None else None


def _device_literal(node: cst.CSTNode) -> Optional[str]:
    text = string_value(node)
    if text is not None:
        return text
    number = int_value(node)
    if number is not None:
        return str(number)
    return None


def _article(qualname: str) -> str:
    return "an" if qualname.split(".")[-1][:1] in "AEIOU" else "a"


def _dtype_of(facts: "FileFacts", node: cst.BaseExpression) -> Optional[str]:
    """``torch.float16`` -> "float16"; None for anything but a torch dtype."""
    q = facts.qualname(node)
    return _DTYPES.get(q.split(".")[-1]) if q and q.startswith("torch.") else None


def _fp16_precision_test(text: str) -> bool:
    """``accelerator.mixed_precision == "fp16"``, ``args.mixed_precision == 'fp16'``: the test of fp16 AMP."""
    return "mixed_precision" in text and "fp16" in text and "!=" not in text and " not " not in f" {text} "


def _if_exp_leaves(node: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The values a nested conditional expression can take: ``a if x else (b if y else c)`` -> a, b, c."""
    if isinstance(node, cst.IfExp):
        return [*_if_exp_leaves(node.body), *_if_exp_leaves(node.orelse)]
    return [node]


def _loads_adapter_frozen(call: cst.Call) -> bool:
    """``PeftModel.from_pretrained(model, model_id, ...)`` that loads the adapter for inference: peft 0.21's
    ``is_trainable`` defaults to False, which sets ``inference_mode`` and leaves every adapter weight frozen. Not
    when ``is_trainable`` is given anything but a literal False, as the fourth positional argument, or through
    ``**kwargs``."""
    positional = [a for a in call.args if a.keyword is None]
    if any(a.star for a in call.args) or len(positional) >= 4:
        return False
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "is_trainable":
            return isinstance(arg.value, cst.Name) and arg.value.value == "False"
    return True
