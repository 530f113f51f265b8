"""The data-flow layer: aliases, bindings (names and self attributes), values and in-place changes."""

from __future__ import annotations

import textwrap

import libcst as cst

from gpudoctor.check.facts import (
    TRAIT_CAST,
    TRAIT_DISPATCHED,
    TRAIT_EMPTY,
    TRAIT_FP16,
    TRAIT_OFFLOADED,
    TRAIT_PEFT,
    TRAIT_PREPARED,
    FollowedCall,
    collect,
    string_value,
)


def facts_of(source: str):
    source = textwrap.dedent(source)
    return collect(cst.parse_module(source), source)


def calls_named(facts, name: str):
    return [s for s in facts.calls if getattr(s.node.func, "value", None) == name or s.method == name]


def value_at_call(facts, name: str, arg: int = 0):
    site = calls_named(facts, name)[0]
    return facts.value(site.node.args[arg].value, site.order, site.scope)


def test_qualified_names_through_aliases():
    facts = facts_of(
        """
        import torch.nn as nn
        import torch
        from accelerate import Accelerator as Acc
        from torch.nn.utils import clip_grad_norm_
        from transformers.models.llama.modeling_llama import LlamaForCausalLM
        nn.utils.clip_grad_norm_(p, 1)
        clip_grad_norm_(p, 1)
        torch.nn.parallel.DataParallel(m)
        Acc()
        LlamaForCausalLM.from_pretrained("x")
        """
    )
    assert [s.qualname for s in facts.calls] == [
        "torch.nn.utils.clip_grad_norm_",
        "torch.nn.utils.clip_grad_norm_",
        "torch.nn.DataParallel",
        "accelerate.Accelerator",
        "transformers.LlamaForCausalLM.from_pretrained",
    ]


def test_dispatch_through_peft_and_prepare_unpacking():
    facts = facts_of(
        """
        from accelerate import Accelerator, init_empty_weights, load_checkpoint_and_dispatch
        from peft import get_peft_model
        from transformers import AutoModel
        with init_empty_weights():
            model = AutoModel.from_config(cfg).half()
        model = load_checkpoint_and_dispatch(model, path, device_map={"a": 0, "b": "cpu"})
        model = get_peft_model(model, lora)
        acc = Accelerator()
        loader, model2 = acc.prepare(loader, model)
        use(model2)
        """
    )
    value = value_at_call(facts, "use")
    assert value.kind == "model"
    assert value.has(TRAIT_PREPARED) and value.has(TRAIT_PEFT) and value.has(TRAIT_EMPTY)
    assert value.trait(TRAIT_DISPATCHED).certainly_dispatched
    assert "cpu" in value.trait(TRAIT_OFFLOADED)
    assert value.trait(TRAIT_CAST)[0] == "float16"


def test_in_place_dispatch_and_device_map_mutation():
    facts = facts_of(
        """
        from accelerate import dispatch_model
        from transformers import AutoModelForCausalLM
        device_map = {"model.embed": 0}
        device_map["lm_head"] = "disk"
        model = AutoModelForCausalLM.from_pretrained("m")
        use(model)
        dispatch_model(model, device_map)
        use(model)
        """
    )
    uses = calls_named(facts, "use")
    before = facts.value(uses[0].node.args[0].value, uses[0].order, uses[0].scope)
    after = facts.value(uses[1].node.args[0].value, uses[1].order, uses[1].scope)
    assert not before.has(TRAIT_DISPATCHED)
    device_map = after.trait(TRAIT_DISPATCHED)
    assert device_map.certainly_dispatched and device_map.devices == {"0", "disk"}


def test_self_attributes_flow_between_methods():
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM
        class Runner:
            def __init__(self):
                self.model = AutoModelForCausalLM.from_pretrained("m", device_map="auto")
            def run(self):
                use(self.model)
        """
    )
    value = value_at_call(facts, "use")
    assert value.kind == "model" and value.trait(TRAIT_DISPATCHED).strategy == "auto"


def test_function_locals_shadow_globals():
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("m", device_map="auto")
        def f():
            model = make()
            use(model)
        """
    )
    assert value_at_call(facts, "use").kind == "unknown"


def test_single_device_map_is_not_dispatch():
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM
        from accelerate import PartialState
        model = AutoModelForCausalLM.from_pretrained("m", device_map={"": PartialState().process_index})
        use(model)
        """
    )
    assert not value_at_call(facts, "use").has(TRAIT_DISPATCHED)


def test_launch_hints_need_real_evidence_of_several_processes():
    assert facts_of("n = accelerator.num_processes\n").launch_hints == []  # read for logging, one process too
    assert facts_of("# run: accelerate launch --num_processes 2 train.py\n").launch_hints == ["accelerate launch", "num_processes"]
    assert facts_of("import os\nrank = int(os.environ['LOCAL_RANK'])\n").launch_hints == ["LOCAL_RANK"]


# -- the type lattice (facts/lattice.py) ---------------------------------------------------------


def kind_at(facts, name: str, arg: int = 0) -> str:
    return value_at_call(facts, name, arg).kind


def test_tensors_through_expressions():
    facts = facts_of(
        """
        import torch

        n = 4
        mask = 1 - torch.eye(n)
        scaled = (mask * 2).float().to("cuda")[0]
        count = len([1, 2])
        probe(mask, scaled, count, -mask)
        """
    )
    assert [kind_at(facts, "probe", i) for i in range(4)] == ["tensor", "tensor", "unknown", "tensor"]


def test_batches_and_items_through_loops():
    facts = facts_of(
        """
        from torch.utils.data import DataLoader
        from tqdm import tqdm

        loader = DataLoader(ds, batch_size=8, collate_fn=collate)
        for step, (images, labels) in enumerate(tqdm(loader)):
            probe(images, labels, step)
        for batch, _ in zip(loader, range(10)):
            probe2(batch, batch["x"])
        it = iter(loader)
        first = next(it)
        probe3(first, {k: v for k, v in first.items()})
        for k, v in first.items():
            probe4(v)
        """
    )
    assert [kind_at(facts, "probe", i) for i in range(3)] == ["tensor", "tensor", "unknown"]
    assert [kind_at(facts, "probe2", i) for i in range(2)] == ["batch", "tensor"]
    assert kind_at(facts, "probe3") == "batch"
    assert kind_at(facts, "probe4") == "tensor"


def test_generators_of_the_file_yield_what_they_iterate():
    facts = facts_of(
        """
        from torch.utils.data import DataLoader

        def forever(dl):
            while True:
                for b in dl:
                    yield b

        def chained(dl):
            yield from dl

        loader = DataLoader(ds)
        for batch in forever(loader):
            probe(batch)
        for batch in chained(loader):
            probe2(batch)
        """
    )
    assert kind_at(facts, "probe") == "batch"
    assert kind_at(facts, "probe2") == "batch"


def test_returns_and_parameters_of_the_files_functions():
    facts = facts_of(
        """
        import torch
        from accelerate import Accelerator
        from transformers import AutoModelForCausalLM

        def build(path):
            net = AutoModelForCausalLM.from_pretrained(path, device_map="auto")
            opt = torch.optim.AdamW(net.parameters())
            return net, opt

        def train(model, accelerator):
            model = accelerator.prepare(model)
            probe(model)

        def main():
            model, optimizer = build("x")
            probe2(model, optimizer)
            train(model, Accelerator())

        main()
        """
    )
    prepared = value_at_call(facts, "probe")
    assert prepared.kind == "model" and prepared.has(TRAIT_PREPARED) and prepared.has(TRAIT_DISPATCHED)
    assert [kind_at(facts, "probe2", i) for i in range(2)] == ["model", "optimizer"]


def test_attributes_stored_in_one_method_used_in_another():
    facts = facts_of(
        """
        import torch
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.mask = 1 - torch.eye(n)
                self.head = nn.Linear(n, n)

            def forward(self, x):
                return probe(self.mask, self.head, self.head(x))

        class Runner:
            def __init__(self, model):
                self.model = model

            def run(self):
                probe2(self.model)

        Runner(Net(3)).run()
        """
    )
    assert [kind_at(facts, "probe", i) for i in range(3)] == ["tensor", "model", "model_output"]
    assert kind_at(facts, "probe2") == "model"


def test_devices_through_variables():
    facts = facts_of(
        """
        import os
        import torch
        from accelerate import Accelerator

        rank = int(os.environ["LOCAL_RANK"])
        dev = torch.device(f"cuda:{rank}")
        local = f"cuda:{rank}"
        accelerator = Accelerator()
        fallback = "cuda" if torch.cuda.is_available() else "cpu"
        probe(dev, local, accelerator.device, fallback, rank)
        """
    )
    assert [kind_at(facts, "probe", i) for i in range(5)] == ["device", "device", "device", "device", "unknown"]


def test_unbound_well_known_names_are_read_as_their_library():
    facts = facts_of(
        """
        model = AutoModelForCausalLM.from_pretrained("x", device_map="auto")
        accelerator = Accelerator()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        probe(model, accelerator)
        """
    )
    assert [kind_at(facts, "probe", i) for i in range(2)] == ["model", "accelerator"]
    assert facts.calls_to("torch.nn.utils.clip_grad_norm_")
    assert "Accelerator" in facts.assumption_note and "AutoModelForCausalLM" in facts.assumption_note


def test_a_bound_name_is_never_read_as_a_library():
    facts = facts_of(
        """
        def Accelerator():
            return object()

        accelerator = Accelerator()
        probe(accelerator)
        """
    )
    assert kind_at(facts, "probe") == "unknown"
    assert facts.assumption_note == ""


def test_flow_order_is_respected():
    facts = facts_of(
        """
        import torch
        x = torch.ones(3)
        probe(x)
        x = load_something()
        probe2(x)
        """
    )
    assert kind_at(facts, "probe") == "tensor"
    assert kind_at(facts, "probe2") == "unknown"


def test_snippets_pass_the_prefilter_and_say_what_they_assumed():
    from gpudoctor.check.engine import check_source, is_relevant
    from gpudoctor.check.registry import all_rules

    snippet = b'model = AutoModelForCausalLM.from_pretrained("x", device_map="auto")\nmodel.to("cuda")\n'
    assert is_relevant(snippet)
    assert is_relevant(b"x = torch.ones(3)\n")
    assert not is_relevant(b"import os\nnn = 3\nprint(Adam)\n")  # generic names alone do not count
    # A cell that only trains what earlier cells built names no library: autograd-only methods count.
    assert is_relevant(b"for x, y in trainloader:\n    loss = criterion(net(x), y)\n    loss.backward()\n")
    assert is_relevant(b"net.cuda()\n") and is_relevant(b"opt.zero_grad(set_to_none=True)\n")
    assert not is_relevant(b"import os\nstep = walker.backward\n")  # an attribute, not the autograd call
    assert is_relevant(b"model.eval()\nfor x, y in val_loader:\n    out = model(x.to(device))\n")
    assert not is_relevant(b"import pandas as pd\ndf.eval('c = a + b')\n")
    # A model class pasted on its own, and a constructed model moved in one expression, count too.
    assert is_relevant(b"class Net(nn.Module):\n    def __init__(self):\n        self.layers = []\n")
    assert is_relevant(b"model = Net(cfg).cuda()\n") and not is_relevant(b"class Node(tree.Module):\n    pass\n")
    [finding] = check_source(snippet.decode(), "cell.py", rules=all_rules())
    assert finding.code == "GD110" and "Assumed `AutoModelForCausalLM` as `transformers.AutoModelForCausalLM`" in finding.message


def test_a_well_known_module_name_used_as_an_object_is_not_assumed_to_be_the_module():
    # ``optim`` in a cell is ``torch.optim`` when it builds an optimizer, but an optimizer when it steps.
    module = facts_of("opt = optim.AdamW(model.parameters())\nprobe(opt)\n")
    assert kind_at(module, "probe") == "optimizer" and "`optim` as `torch.optim`" in module.assumption_note
    stepped = facts_of("for x in dl:\n    model(x).sum().backward()\n    optim.step()\n    optim.zero_grad()\n")
    assert "optim" not in stepped.assumed_imports
    assert not any(site.qualname == "torch.optim.step" for site in stepped.calls)


def test_an_instance_of_an_unseen_class_is_a_module_when_used_as_one():
    shown = facts_of(
        """
        from models import Darknet, Tracker
        from .nets import Head
        a = Darknet(cfg)
        a.load_state_dict(sd)
        a.to(device)
        b = Head().cuda()
        b.eval()
        c = Tracker(cfg)
        c.to(device)
        d = Tracker(cfg).cuda()
        e = Head()
        print(e.named_parameters())
        probe_a(a); probe_b(b); probe_c(c); probe_d(d); probe_e(e)
        """
    )
    assert [kind_at(shown, f"probe_{k}") for k in "abcde"] == ["model", "model", "unknown", "unknown", "model"]


def test_keyword_argument_through_kwargs_dicts() -> None:
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM as M
        named = dict(torch_dtype="auto", device_map="auto")
        filled = {"torch_dtype": "auto"}
        filled["device_map"] = "balanced"
        a = M.from_pretrained("m", **named)
        b = M.from_pretrained("m", **filled)
        c = M.from_pretrained("m", **{"device_map": "sequential"})
        d = M.from_pretrained("m", **dict(device_map="cuda:0"))
        e = M.from_pretrained("m", **{"torch_dtype": "auto"})
        """
    )
    sites = calls_named(facts, "from_pretrained")
    found = [facts.keyword_argument(s.node, "device_map", s.order, s.scope) for s in sites]
    assert [string_value(f) if f is not None else None for f in found] == ["auto", "balanced", "sequential", "cuda:0", None]


def _live_keys(facts, name: str = "from_pretrained") -> list[list[str]]:
    """The live entries of each ``**`` dict of each ``name(...)`` call, as ``key=value`` texts."""
    out = []
    for site in calls_named(facts, name):
        entries = [e for c in facts.kwargs_contents(site.node, site.order, site.scope) for e in c.entries.values()]
        out.append([f"{e.key}={facts.module.code_for_node(e.value)}" for e in entries])
    return out


def test_dict_contents_replays_stores_updates_and_removals_in_flow_order() -> None:
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM as M
        kw = {"device_map": "auto", "load_in_8bit": True}
        kw["torch_dtype"] = "auto"
        del kw["load_in_8bit"]
        kw.update({"device_map": "balanced"}, low_cpu_mem_usage=True)
        kw.setdefault("device_map", "cuda")
        kw.setdefault("revision", "main")
        kw.pop("torch_dtype", None)
        M.from_pretrained("m", **kw)
        kw["late"] = 1
        cleared = dict(device_map="auto")
        cleared.clear()
        M.from_pretrained("m", **cleared)
        """
    )
    assert _live_keys(facts) == [
        ['device_map="balanced"', "low_cpu_mem_usage=True", 'revision="main"'],
        [],
    ]


def test_dict_contents_follows_aliases_both_ways() -> None:
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM as M
        base = {"load_in_8bit": True}
        kwargs = base
        base["device_map"] = "auto"
        M.from_pretrained("m", **kwargs)
        other = {"load_in_4bit": True, "device_map": "auto"}
        alias = other
        del alias["load_in_4bit"]
        M.from_pretrained("m", **other)
        rebound = {"load_in_4bit": True}
        rebound = {}
        rebound["device_map"] = "auto"
        M.from_pretrained("m", **rebound)
        """
    )
    assert _live_keys(facts) == [
        ["load_in_8bit=True", 'device_map="auto"'],
        ['device_map="auto"'],
        ['device_map="auto"'],
    ]


def test_dict_contents_of_what_the_file_does_not_build() -> None:
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM as M
        def load(kwargs, dict):
            kwargs["device_map"] = "auto"
            M.from_pretrained("m", **kwargs)
            M.from_pretrained("m", **dict(device_map="auto"))
        """
    )
    assert _live_keys(facts) == [[], []]  # a parameter, and a shadowed ``dict``
    [first, _] = calls_named(facts, "from_pretrained")
    assert facts.dict_contents(first.node.args[1].value, first.order, first.scope) is None


def test_dict_contents_of_a_star_kwargs_parameter_called_once() -> None:
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM as M
        def load(path, dtype=None, **kw):
            return M.from_pretrained(path, **kw)
        extra = {"low_cpu_mem_usage": True, "dtype": "x"}
        load("m", dtype="auto", load_in_8bit=True, **extra)
        def twice(**kw):
            return M.from_pretrained("m", **kw)
        twice(device_map="auto")
        twice(device_map="cpu")
        """
    )
    # the one call fills ``kw`` (named parameters excluded); two calls fill it differently: unknown
    assert _live_keys(facts) == [["load_in_8bit=True", "low_cpu_mem_usage=True"], []]


def test_keyword_argument_skips_a_deleted_entry() -> None:
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM as M
        kw = {"device_map": "auto"}
        kw.pop("device_map")
        M.from_pretrained("m", **kw)
        """
    )
    [site] = calls_named(facts, "from_pretrained")
    assert facts.keyword_argument(site.node, "device_map", site.order, site.scope) is None


def test_follow_name_to_assignments_and_every_argument() -> None:
    facts = facts_of(
        """
        class Net:
            def __init__(self):
                self.path = "ckpt.pt"

            def go(self):
                return self.path

        def helper(x, unused):
            y = x
            return y

        helper("a", 1)
        helper("b", 2)
        for z in range(3):
            print(z)
        """
    )
    [_, go, helper_scope] = facts.functions
    text = lambda sources: [(facts.module.code_for_node(n), order) for n, order, _ in sources]  # noqa: E731
    [ret] = facts.returns[id(helper_scope)]
    [(value, order, scope)] = facts.follow_name(ret.value, ret.order, ret.scope)
    assert facts.module.code_for_node(value) == "x"
    assert [t for t, _ in text(facts.follow_name(value, order, scope))] == ['"a"', '"b"']
    assert facts.follow_name(value, order, scope, params=False) is None
    first_call = calls_named(facts, "helper")[0]
    only = facts.follow_name(value, order, scope, passed=FollowedCall(first_call, helper_scope))
    assert [t for t, _ in text(only)] == ['"a"']
    assert facts.follow_name(value, order, scope, stop=lambda binding, at: binding.kind == "param") is None
    # ``self.x`` only when asked; a loop target is not followed
    [self_ret] = facts.returns[id(go)]
    assert facts.follow_name(self_ret.value, self_ret.order, self_ret.scope) is None
    [(path, _, _)] = facts.follow_name(self_ret.value, self_ret.order, self_ret.scope, attributes=True)
    assert string_value(path) == "ckpt.pt"
    [printed] = calls_named(facts, "print")
    assert facts.follow_name(printed.node.args[0].value, printed.order, printed.scope) is None
    # through_name: the first result when every source gives one
    read = lambda node, order, scope: string_value(node)  # noqa: E731
    assert facts.through_name(read, value, order, scope) == "a"
    assert facts.through_name(lambda node, order, scope: string_value(node) == "b" or None, value, order, scope) is None


def test_diffusers_pipeline_components_are_models() -> None:
    facts = facts_of(
        """
        import torch
        from diffusers import OnnxStableDiffusionPipeline, StableDiffusionPipeline
        pipe = StableDiffusionPipeline.from_pretrained("sd", torch_dtype=torch.float16)
        pipe.unet.to(dtype=torch.float32)
        unet = pipe.unet
        print(unet, pipe.vae, pipe.tokenizer, pipe.scheduler)
        onnx = OnnxStableDiffusionPipeline.from_pretrained("sd")
        print(onnx.unet)
        """
    )
    [first, second] = calls_named(facts, "print")
    unet, vae, tokenizer, scheduler = (facts.value(a.value, first.order, first.scope) for a in first.node.args)
    assert facts.value(facts.calls[0].node).kind == "diffusion_pipeline"
    assert (unet.kind, vae.kind, tokenizer.kind, scheduler.kind) == ("model", "model", "unknown", "unknown")
    assert unet.carrier(TRAIT_CAST).traits[TRAIT_CAST][0] == "float32"  # its own cast is the latest
    assert vae.carrier(TRAIT_FP16) is not None and vae.carrier(TRAIT_CAST) is None  # the pipeline's torch_dtype
    assert unet.origin().trait("component") == "unet"
    assert facts.value(second.node.args[0].value, second.order, second.scope).kind == "unknown"


def test_torchvision_pipeline_output_is_a_tensor() -> None:
    facts = facts_of(
        """
        import torchvision.transforms as T
        import torchvision.transforms.functional as TF
        tensor_out = T.Compose([T.Resize(224), T.ToTensor()])
        image_out = T.Compose([T.Resize(224), T.RandomHorizontalFlip()])
        a = tensor_out(img)
        b = image_out(img)
        c = TF.to_tensor(img)
        d = T.Normalize([0.5], [0.5])(a)
        """
    )
    kinds = {key: facts.value(facts.module_scope.bindings[key][0].value).kind for key in "abcd"}
    assert kinds == {"a": "tensor", "b": "unknown", "c": "tensor", "d": "tensor"}


def test_next_use_reads_the_same_binding_only():
    facts = facts_of(
        """
        import torch
        def step(model, x, y):
            x.cuda()
            log("moving")
            out = model(x)
            x = other()
            use(x)
        """
    )
    (site,) = calls_named(facts, "cuda")
    use = facts.next_use("x", site.order, site.scope)
    (model_call,) = calls_named(facts, "model")
    assert use is model_call.node.args[0].value
    rebound = facts_of(
        """
        def step(x):
            x.cuda()
            x = other()
            use(x)
        """
    )
    (site,) = calls_named(rebound, "cuda")
    assert rebound.next_use("x", site.order, site.scope) is None  # `use(x)` reads another binding
    assert facts.next_use("y", site.order, site.scope) is None  # never read again


def test_calls_of_a_value_follow_its_name_while_it_holds_it():
    facts = facts_of(
        """
        import torch.nn as nn
        loss_fn = nn.CrossEntropyLoss(weight=w)
        a = loss_fn(p, y)
        b = loss_fn(q, y)
        loss_fn = nn.MSELoss()
        c = loss_fn(r, y)
        """
    )
    first = calls_named(facts, "CrossEntropyLoss")[0]
    calls = facts.calls_of_value(first.node)
    assert [facts.module.code_for_node(c.node) for c in calls] == ["loss_fn(p, y)", "loss_fn(q, y)"]


def test_snippet_loader_assumed_from_its_conventional_name():
    facts = facts_of(
        """
        for i, data in enumerate(trainloader, 0):
            inputs, labels = data
            probe(inputs)
        for batch in train_loader:
            probe2(batch)
        val_loader.reset()
        for batch in val_loader:
            probe3(batch)
        """
    )
    assert kind_at(facts, "probe") == "tensor"
    assert kind_at(facts, "probe2") == "batch"
    assert kind_at(facts, "probe3") == "unknown"  # used with a member no DataLoader has: not assumed
    assert facts.assumed_instances == {"trainloader": "torch.utils.data.DataLoader", "train_loader": "torch.utils.data.DataLoader"}


def test_star_imports_of_torch_bind_only_what_torch_exports():
    facts = facts_of(
        """
        from torch import *
        from torch.nn import *

        w = tensor([1.0, 3.0])
        loss_fn = CrossEntropyLoss(weight=w)
        probe(w)
        probe2(cuda)
        """
    )
    assert kind_at(facts, "probe") == "tensor"
    assert facts.qualname(calls_named(facts, "probe2")[0].node.args[0].value) is None  # torch.__all__ has no `cuda`
    assert facts.qualname(calls_named(facts, "CrossEntropyLoss")[0].node.func) == "torch.nn.CrossEntropyLoss"
    later = facts_of(
        """
        from torch import *
        from numpy import *

        probe(zeros(3))
        """
    )
    assert kind_at(later, "probe") == "unknown"  # numpy's star import may bind `zeros` after torch's


def test_vision_model_builders_are_models():
    facts = facts_of(
        """
        import timm
        import torchvision
        from torchvision import models

        probe(torchvision.models.resnet18(num_classes=10))
        probe2(models.detection.fasterrcnn_resnet50_fpn())
        probe3(timm.create_model("efficientnet_b0", pretrained=True))
        probe4(models.ResNet18_Weights.DEFAULT)
        probe5(models.list_models())
        """
    )
    assert [kind_at(facts, p) for p in ("probe", "probe2", "probe3")] == ["model"] * 3
    assert kind_at(facts, "probe4") == "unknown" and kind_at(facts, "probe5") == "unknown"


def test_dict_of_dataloaders_subscripted():
    facts = facts_of(
        """
        from torch.utils.data import DataLoader

        loaders = {x: DataLoader(sets[x], batch_size=4) for x in ["train", "val"]}
        shown = {"train": DataLoader(a), "val": DataLoader(b)}
        mixed = {"train": DataLoader(a), "n": 3}
        probe(loaders[phase])
        probe2(shown["val"])
        probe3(mixed["train"])
        probe4(dataloaders[phase])
        """
    )
    assert [kind_at(facts, p) for p in ("probe", "probe2", "probe4")] == ["dataloader"] * 3
    assert kind_at(facts, "probe3") == "unknown"
    assert facts.assumed_instances.get("dataloaders") == "torch.utils.data.DataLoader"


def _items_at_call(facts, name: str):
    site = calls_named(facts, name)[0]
    items = facts.items_of(site.node.args[0].value, site.order, site.scope)
    return None if items is None else sorted(facts.module.code_for_node(node) for node, _order, _scope in items)


def test_items_of_a_filled_deque_through_sampling_and_transposed_records():
    facts = facts_of(
        """
        import random
        from collections import deque, namedtuple
        from dataclasses import dataclass
        from typing import NamedTuple

        Step = namedtuple("Step", "state, action next_state")

        class Pair(NamedTuple):
            first: object
            second: object

        @dataclass
        class Row:
            x: object
            y: object

        memory = deque(maxlen=100)
        memory.append(Step(a, b, c1))
        memory.appendleft(Step(a, b, next_state=c2))
        memory.extend([Step(a, b, c3)])
        pairs = [Pair(p1, q1)] + []
        rows = [Row(x1, y1), Row(x2, y=y2)]

        batch = Step(*zip(*random.sample(memory, 2)))
        first(batch.next_state)
        firsts, seconds = zip(*list(pairs))
        second(seconds)
        xs, ys = zip(*rows[:1])
        third(ys)
        """
    )
    assert _items_at_call(facts, "first") == ["c1", "c2", "c3"]
    assert _items_at_call(facts, "second") is None  # ``pairs`` is bound to ``[...] + []``: not followed
    assert _items_at_call(facts, "third") == ["y1", "y2"]


def test_items_of_a_container_handed_to_an_unknown_call_are_not_known():
    facts = facts_of(
        """
        import random
        buffer = []
        buffer.append((s1, t1))
        fill(buffer)
        states, targets = zip(*random.sample(buffer, 4))
        use(targets)
        """
    )
    assert _items_at_call(facts, "use") is None
    facts = facts_of(
        """
        import random
        buffer = []
        buffer.append((s1, t1))
        print(len(buffer))
        states, targets = zip(*random.sample(buffer, 4))
        use(targets)
        """
    )
    assert _items_at_call(facts, "use") == ["t1"]


def test_argument_for_a_parameter_skips_self_but_not_for_a_staticmethod():
    facts = facts_of(
        """
        class Helper:
            def method(self, a, b, *, c=None):
                pass

            @staticmethod
            def static(a, b):
                pass

        h = Helper()
        h.method(x1, y1, c=z1)
        h.static(x2, y2)
        h.method(*xs, y3)
        """
    )
    functions = {f.name: f for f in facts.functions}
    code = facts.module.code_for_node

    def passed(function: str, call_index: int) -> list:
        function = functions[function]
        site = facts.call_sites_of(function)[call_index]
        params = [*function.node.params.params, *function.node.params.kwonly_params]
        return [(p.name.value, code(a) if (a := facts.argument_for(site, function, p)) is not None else None) for p in params]

    assert passed("method", 0) == [("self", None), ("a", "x1"), ("b", "y1"), ("c", "z1")]
    assert passed("static", 0) == [("a", "x2"), ("b", "y2")]
    assert passed("method", 1) == [("self", None), ("a", None), ("b", None), ("c", None)]  # ``*xs`` hides positions


def test_single_use_temporaries_are_resolved_once_for_every_rule():
    facts = facts_of(
        """
        import deepspeed

        def train(model, ds, cfg):
            tmp = deepspeed.initialize(model=model, config=cfg)
            engine, _, _, _ = tmp
            tmp2 = self.net
            tmp2.to("cuda")
            tmp3 = model.to("cuda")
            tmp3.eval()
            shared = deepspeed.initialize(model=model, config=cfg)
            a = shared
            b = shared
        """
    )
    init = facts.calls_to("deepspeed.initialize")[0]
    holders = facts._bindings_of_value(init.node)
    # ``engine, ... = tmp`` unpacks the call itself; the temporary is only a conduit
    assert [(b.key, b.kind, b.index) for b in holders if b.key == "engine"] == [("engine", "unpack", 0)]
    assert all(b.key != "tmp" for b in holders)
    # ``tmp2 = self.net; tmp2.to(...)`` is a call on ``self.net``
    move = next(s for s in facts.calls if s.method == "to" and s.order > init.order and facts.module.code_for_node(s.receiver) == "self.net")
    assert move in facts._calls_on_key["self.net"]
    # a temporary that holds another expression keeps its name as the receiver; through_temporary gives the expression
    evaluated = next(s for s in facts.calls if s.method == "eval")
    assert facts.module.code_for_node(evaluated.receiver) == "tmp3"
    assert facts.module.code_for_node(facts.through_temporary(evaluated.receiver)) == 'model.to("cuda")'
    # a name read twice is no temporary: its copies keep reading the name
    second = facts.calls_to("deepspeed.initialize")[1]
    assert [b.key for b in facts._bindings_of_value(second.node)] == ["shared"]
    assert facts.binding_at("a", 1 << 30, facts.functions[0]).value.value == "shared"


def test_method_of_an_instance_handed_in_as_a_parameter():
    facts = facts_of(
        """
        class Agent:
            def act(self, state):
                return state

        class Other:
            def act(self, state):
                return None

        def train(env, agent):
            agent.act(env)

        def main():
            agent = Agent()
            train(None, agent)
        """
    )
    site = next(s for s in facts.calls if s.method == "act")
    callees = facts.callee_scopes(site)
    assert [(c.class_name, c.name) for c in callees] == [("Agent", "act")]


def test_self_device_attribute_is_followed_as_a_device():
    from gpudoctor.check.rules.placement._common import accelerator_device

    facts = facts_of(
        """
        import torch

        class Trainer:
            def __init__(self, model, on_gpu):
                self.device = torch.device("cuda")
                self.model = model.to(self.device)
                self.cpu_device = torch.device("cpu")
                self.other = model.to(self.cpu_device)
        """
    )
    moves = [s for s in facts.calls if s.method == "to"]
    assert [accelerator_device(facts, s.arg(0), s.order, s.scope) for s in moves] == [True, False]
