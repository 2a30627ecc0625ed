"""The host-RAM budget (issue 21.4, 21.5): ``host_ram_gb`` is validated, caps the pin grant beside
free memory and a host's own pin limit (the binding one named), and the report shows RAM per
component (pinned, pageable). On the CPU nothing is page-locked; the grant is what is checked."""

import logging

import pytest
from diffusers_offload.offload_core import Engine, OffloadConfig, OffloadConfigError
from diffusers_offload.offload_core.components import describe
from diffusers_offload.offload_core.memory import MemoryReader, PinLimit, pin_budget

GiB = 2**30
CFG = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


class Scripted(MemoryReader):
    def __init__(self, available: int, limit: PinLimit | None = None) -> None:
        self.available, self.limit = available, limit

    def host_available(self) -> int:
        return self.available

    def pin_limit(self) -> PinLimit | None:
        return self.limit


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "lots", "-3", "12 apples", True, None, [4]])
def test_nonsense_budgets_are_refused_naming_the_option(bad):
    with pytest.raises(OffloadConfigError, match="host_ram_gb"):
        OffloadConfig(host_ram_gb=bad)


@pytest.mark.parametrize(("value", "parsed", "nbytes"), [
    ("auto", "auto", None), (" AUTO ", "auto", None), (24, 24.0, 24 * GiB), ("12 GB", 12.0, 12 * GiB),
    ("0.5", 0.5, GiB // 2), (0, 0.0, 0),
])
def test_budgets_are_auto_or_gib(value, parsed, nbytes):
    config = OffloadConfig(host_ram_gb=value)
    assert (config.host_ram_gb, config.host_ram_bytes) == (parsed, nbytes)


def test_each_cap_bounds_the_grant_and_the_binding_one_is_named():
    free = Scripted(available=100 * GiB)
    assert pin_budget(10 * GiB, free, reserve=4 * GiB).granted
    by_budget = pin_budget(10 * GiB, free, reserve=4 * GiB, budget=6 * GiB, held=2 * GiB)
    assert by_budget.grant == 4 * GiB and "host_ram_gb 6.00 GiB" in by_budget.describe()
    capped = Scripted(available=100 * GiB, limit=PinLimit(3 * GiB, "the host's cap"))
    by_limit = pin_budget(10 * GiB, capped, reserve=4 * GiB, budget=6 * GiB)
    assert by_limit.grant == 3 * GiB and by_limit.word == "partly granted" and "the host's cap" in by_limit.describe()
    short = pin_budget(10 * GiB, Scripted(available=3 * GiB), reserve=4 * GiB)
    assert short.grant == 0 and short.word == "denied" and "host free less reserve" in short.describe()


def test_the_engine_grants_part_under_host_ram_gb_and_logs_the_path(wan_pipe, caplog):
    need = describe("transformer", wan_pipe.transformer).nbytes
    engine = Engine(memory=Scripted(available=1 << 50))
    with caplog.at_level(logging.INFO, logger="diffusers_offload"):
        engine.place(wan_pipe, CFG.replace(host_ram_gb=need / 2 / GiB))
    ctx = engine.states(wan_pipe)["transformer"].transport.ctx
    assert ctx.pin and ctx.pin_bytes == pytest.approx(need / 2, abs=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("transformer: pin")]
    assert len(lines) == 1 and "partly granted" in lines[0] and "host_ram_gb" in lines[0]
    engine.release(wan_pipe)


def test_a_changed_budget_reads_the_verdict_again_and_re_places(wan_pipe):
    engine = Engine(memory=Scripted(available=1 << 50))
    engine.place(wan_pipe, CFG)
    assert engine.states(wan_pipe)["transformer"].transport.ctx.pin_bytes is None  # all granted
    engine.place(wan_pipe, CFG.replace(host_ram_gb=0))
    ctx = engine.states(wan_pipe)["transformer"].transport.ctx
    assert not ctx.pin
    engine.release(wan_pipe)


def test_the_report_shows_ram_per_component(wan_pipe):
    engine = Engine(memory=Scripted(available=1 << 50))
    report = engine.place(wan_pipe, CFG)
    streamer = engine.states(wan_pipe)["transformer"].transport
    masters = sum(s.nbytes for b in streamer.blocks for s in b.slots)
    transformer = report.component("transformer")
    assert transformer.ram_bytes == masters > 0  # every block's master stays in RAM
    assert transformer.pageable_bytes == masters - transformer.pinned_bytes
    text = report.text()
    for comp in report.components:
        line = next(line for line in text.splitlines() if line.strip().startswith(comp.name + " "))
        assert "RAM " in line and "pinned " in line and "pageable " in line
    row = report.to_dict()["components"][[c.name for c in report.components].index("transformer")]
    assert (row["ram_bytes"], row["pageable_bytes"]) == (transformer.ram_bytes, transformer.pageable_bytes)
    assert report.ram_bytes >= masters
    engine.release(wan_pipe)
