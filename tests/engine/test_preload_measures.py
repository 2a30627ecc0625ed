"""The measure store: largest peak per key, persisted atomically, tolerant of a bad file."""

import json
import logging

from diffusers_offload.offload_core.preload.fit import GIB, MemoryReading
from diffusers_offload.offload_core.preload.measures import MeasureKey, MeasureStore
from diffusers_offload.offload_core.preload.planner import CycleUsage, PreloadPlanner
from diffusers_offload.offload_core.preload.ranking import BlockInfo

KEY = MeasureKey("WanTransformer3DModel", "/models/wan", 40, 28 * GIB, 75600)


def test_keeps_the_largest_peak():
    store = MeasureStore()
    store.record(KEY, 3 * GIB)
    store.record(KEY, 2 * GIB)
    assert store.get(KEY) == 3 * GIB
    assert store.get(MeasureKey("WanTransformer3DModel", "/models/wan", 40, 28 * GIB, 1)) is None


def test_measures_are_read_back_by_a_new_store(tmp_path):
    path = tmp_path / "sub" / "preload.json"
    MeasureStore(path).record(KEY, 3 * GIB)
    assert MeasureStore(path).get(KEY) == 3 * GIB
    assert [p.name for p in path.parent.iterdir()] == ["preload.json"]  # no temporary left


def test_missing_file_starts_empty_quietly(tmp_path, caplog):
    store = MeasureStore(tmp_path / "none.json")
    assert store.get(KEY) is None
    assert not caplog.records


def test_corrupt_file_is_tolerated_and_replaced(tmp_path, caplog):
    path = tmp_path / "preload.json"
    path.write_text("{not json", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        store = MeasureStore(path)
    assert store.get(KEY) is None
    assert "unreadable" in caplog.text
    store.record(KEY, GIB)
    assert MeasureStore(path).get(KEY) == GIB


def test_file_of_another_shape_is_tolerated(tmp_path, caplog):
    path = tmp_path / "preload.json"
    for text in ("[]", '{"version": 99, "measures": []}', '{"version": 1, "measures": [{"peak": 1}]}'):
        path.write_text(text, encoding="utf-8")
        assert MeasureStore(path).get(KEY) is None
    assert caplog.text.count("unreadable") == 3


def test_attach_merges_memory_and_file(tmp_path):
    path = tmp_path / "preload.json"
    other = MeasureKey("Flux", "", 57, 22 * GIB, 4096)
    MeasureStore(path).record(KEY, 3 * GIB)
    store = MeasureStore()
    store.record(other, GIB)
    store.record(KEY, 2 * GIB)
    store.attach(path)
    assert store.get(KEY) == 3 * GIB
    store.record(other, 2 * GIB)  # a change saves everything
    saved = json.loads(path.read_text(encoding="utf-8"))["measures"]
    assert {(m["model_class"], m["peak"]) for m in saved} == {
        ("WanTransformer3DModel", 3 * GIB),
        ("Flux", 2 * GIB),
    }


def test_first_run_after_a_restart_is_already_planned(tmp_path):
    path = tmp_path / "preload.json"
    blocks = [BlockInfo(i, "t", i, GIB) for i in range(16)]

    def reader() -> MemoryReading:
        return MemoryReading(40 * GIB, 0, 0)

    def run(store: MeasureStore) -> frozenset[int]:
        planner = PreloadPlanner(blocks, reader, model_class="M", identity="/m", store=store)
        planner.on_load()
        first = planner.begin_cycle(100)
        planner.begin_cycle(100, CycleUsage(peak=2 * GIB, weights_floor=0))
        return first

    assert run(MeasureStore(path)) == frozenset()
    assert len(run(MeasureStore(path))) == 16


def test_a_learnt_penalty_is_planned_with_after_a_restart(tmp_path):
    path = tmp_path / "preload.json"
    blocks = [BlockInfo(i, "t", i, GIB) for i in range(16)]

    def reader() -> MemoryReading:
        return MemoryReading(12 * GIB, 0, 0)

    def planner() -> PreloadPlanner:
        made = PreloadPlanner(blocks, reader, model_class="M", identity="/m", store=MeasureStore(path))
        made.on_load()
        return made

    first = planner()
    first.begin_cycle(100)
    fitted = first.begin_cycle(100, CycleUsage(peak=2 * GIB, weights_floor=0))
    assert len(fitted) == 7  # 12 - 2 - margin 0.6: 7 kept + 2 slots
    first.on_shortage()
    restarted = planner()
    learnt = first.penalty(100)
    assert learnt > 0
    assert restarted.penalty(100) == learnt
    assert len(restarted.begin_cycle(100)) == 6  # the penalty is remembered: the 7 that ran short are not met again
    for _ in range(8):  # and it decays after a restart as it would have before
        restarted.begin_cycle(100, CycleUsage(peak=2 * GIB, weights_floor=0))
    assert restarted.penalty(100) == learnt // 2


def test_a_file_of_the_first_version_is_read_without_penalties(tmp_path):
    path = tmp_path / "preload.json"
    entry = {"model_class": "M", "identity": "/m", "block_count": 40, "total_bytes": 28 * GIB, "workload": 7}
    path.write_text(json.dumps({"version": 1, "measures": [{**entry, "peak": GIB}]}), encoding="utf-8")
    store = MeasureStore(path)
    key = MeasureKey("M", "/m", 40, 28 * GIB, 7)
    assert store.get(key) == GIB
    assert store.penalty(key) == 0


def test_graph_bytes_keep_their_largest_persist_and_serve_near_workloads(tmp_path):
    path = tmp_path / "preload.json"
    store = MeasureStore(path)
    assert store.graph_bytes(KEY) is None  # never ran: not known to be graphed
    store.record_graphs(KEY, 0)
    assert store.graph_bytes(KEY) == 0
    store.record_graphs(KEY, 2 * GIB)
    store.record_graphs(KEY, GIB)
    reread = MeasureStore(path)
    assert reread.graph_bytes(KEY) == 2 * GIB and reread.get(KEY) is None
    near = MeasureKey(*KEY.model, KEY.workload + KEY.workload // 32)  # a few more prompt tokens
    far = MeasureKey(*KEY.model, 4 * KEY.workload)  # a video
    assert reread.graph_bytes(near) == 2 * GIB and reread.graph_bytes(far) is None


def test_a_file_of_the_second_version_is_read_without_graph_bytes(tmp_path):
    path = tmp_path / "preload.json"
    entry = {"model_class": "M", "identity": "/m", "block_count": 40, "total_bytes": 28 * GIB, "workload": 7}
    path.write_text(json.dumps({"version": 2, "measures": [{**entry, "peak": GIB, "penalty": GIB}]}), encoding="utf-8")
    store = MeasureStore(path)
    key = MeasureKey("M", "/m", 40, 28 * GIB, 7)
    assert (store.get(key), store.penalty(key), store.graph_bytes(key)) == (GIB, GIB, None)
