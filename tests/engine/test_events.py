"""Named subscriptions: a listener is removed by its own name only, and a placed streamer's
planner leaves other subscribers alone when it goes."""

import pytest
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.transport.events import Events
from fixtures.tiny_pipes import run_wan


def test_unsubscribe_removes_only_the_named_listener_and_emit_reports_who_acted():
    events, calls = Events(), []
    events.subscribe("a", lambda event, source, **info: calls.append(("a", event, info)))
    events.subscribe("b", lambda event, source, **info: calls.append(("b", event)) or True, first=True)
    assert events.names() == ("b", "a")
    assert events.emit("oom", None, block=3) is True
    assert calls == [("b", "oom"), ("a", "oom", {"block": 3})]
    with pytest.raises(ValueError, match="'a' is already subscribed"):
        events.subscribe("a", print)
    events.unsubscribe("b")
    assert events.names() == ("a",) and events.emit("end", None) is False


def test_a_probe_sees_one_cycle_per_forward_and_survives_the_planner_leaving(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    seen = []
    streamer.events.subscribe("probe", lambda event, source, **info: seen.append(event))
    assert streamer.events.names() == ("park_idle", "preload", "probe")  # the engine's park listener first
    run_wan(wan_pipe)
    engine.after_run(wan_pipe)
    assert seen.count("forward") == seen.count("cycle") > 0 and seen[-1] == "end"
    streamer.remove(wan_pipe.transformer)  # the planner unsubscribes itself, and only itself
    assert streamer.events.names() == ("park_idle", "probe")
    engine.release(wan_pipe)
