"""Re-applying a placement: idempotent for the same config, clean for a changed one."""

import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from fixtures.tiny_pipes import run_wan

CFG = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
STREAM = "diffusers_offload_stream"
GROUP = "group_offloading"


def _hooks(pipe) -> dict[tuple[str, str, str], object]:
    out = {}
    for comp in ("transformer", "text_encoder", "vae"):
        for path, m in getattr(pipe, comp).named_modules():
            reg = m.__dict__.get("_diffusers_hook")
            if reg is not None:
                for name, hook in reg.hooks.items():
                    out[(comp, path, name)] = hook
    return out


def test_same_config_reapplied_keeps_hook_and_state_objects(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, CFG)
    hooks, states = _hooks(wan_pipe), engine.states(wan_pipe)
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu"))
    again, states2 = _hooks(wan_pipe), engine.states(wan_pipe)
    assert hooks and again.keys() == hooks.keys()
    assert all(again[k] is hooks[k] for k in hooks)
    assert all(states2[n] is states[n] for n in states)


def test_changed_prefetch_window_reapplies_with_new_hooks_and_same_output(wan_pipe):
    expected = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, CFG)
    before = _hooks(wan_pipe)
    engine.place(wan_pipe, CFG.replace(prefetch_window=2))
    after = _hooks(wan_pipe)
    stream_keys = [k for k in after if k[2] == STREAM]
    assert stream_keys and all(after[k] is not before[k] for k in stream_keys)
    assert engine.states(wan_pipe)["transformer"].transport.ctx.prefetch_window == 2
    out = run_wan(wan_pipe)
    engine.after_run(wan_pipe)
    torch.testing.assert_close(out, expected)


def test_changed_never_list_reapplies_transformer_as_resident(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, CFG)
    engine.place(wan_pipe, CFG.replace(never=("transformer",)))
    hooks = _hooks(wan_pipe)
    assert engine.states(wan_pipe)["transformer"].decision.role.value == "resident"
    assert [k for k in hooks if k[0] == "transformer"] == [("transformer", "", GROUP)]


def test_mode_switch_auto_leaf_auto_leaves_no_hooks_of_the_old_mode(wan_pipe):
    expected = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, CFG)
    engine.place(wan_pipe, CFG.replace(mode="leaf"))
    leaf = _hooks(wan_pipe)
    assert not [k for k in leaf if k[2] == STREAM], "stream hooks left after switching to leaf"
    assert engine.states(wan_pipe)["transformer"].decision.role.value == "leaf"
    # leaf groups on the transformer's inner leaves
    assert any(k[0] == "transformer" and k[1] and k[2] == GROUP for k in leaf)
    out = run_wan(wan_pipe)
    engine.after_run(wan_pipe)
    torch.testing.assert_close(out, expected)

    engine.place(wan_pipe, CFG)
    back = _hooks(wan_pipe)
    tr = [k for k in back if k[0] == "transformer"]
    # only the marker on the top-level module plus one stream hook per tower block, per part and
    # per child of the non-block part (its graphs)
    assert ("transformer", "", GROUP) in tr
    assert not [k for k in tr if k[2] == GROUP and k[1]], "leaf groups left inside the transformer"
    blocks = [f"blocks.{i}" for i in range(len(wan_pipe.transformer.blocks))]
    parts = [f"{b}.{child}" for b in blocks for child in ("attn1", "attn2", "ffn")]
    head = [name for name, _child in wan_pipe.transformer.named_children() if name != "blocks"]
    assert sorted(k[1] for k in tr if k[2] == STREAM) == sorted([*blocks, *parts, *head])
    assert set(k[2] for k in tr) == {GROUP, STREAM}
    vae = [k for k in back if k[0] == "vae"]
    assert vae == [("vae", "", GROUP)], "vae must only carry the on-demand marker"
    out = run_wan(wan_pipe)
    engine.after_run(wan_pipe)
    torch.testing.assert_close(out, expected)
