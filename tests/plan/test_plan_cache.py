"""The plan's simulation cache: a case's key depends on the case only."""

from gpudoctor.plan import simulated
from gpudoctor.plan.simulated import Method, Workload
from gpudoctor.simulate.cards import parse_spec


def test_cache_key_does_not_depend_on_which_meta_model_was_built_last(tiny_model):
    info = simulated.resolve(tiny_model)
    card = parse_spec("1x3070Ti")[0]
    lora = Method("lora", "LoRA (bf16 base)", "bfloat16", lora=True)
    keys = []
    for dtype in ("float32", "bfloat16", "float16"):
        # what each method's device map does: the config's dtype becomes the last model's
        simulated._meta_model(info.config, dtype, fresh=True)
        keys.append(simulated.request_key(info, lora, Workload(), False, card, (1,), None))
    assert str(info.config.dtype).removeprefix("torch.") == "float16"  # the mutation the key must ignore
    assert len(set(keys)) == 1
