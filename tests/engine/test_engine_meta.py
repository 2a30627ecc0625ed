"""Full-size geometries on the meta device: roles, towers and sizes without allocating weights."""

import psutil
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.components import describe, iter_modules
from diffusers_offload.offload_core.roles import Role, decide
from diffusers_offload.offload_core.transport.towers import find_towers
from fixtures.tiny_pipes import meta_h3_pipeline, meta_wan14b_pipeline

DEFAULT = OffloadConfig(device="cpu")
RSS_SLACK = 512 * 2**20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _decisions(pipe, config=DEFAULT):
    return {name: (describe(name, m), decide(describe(name, m), config), m) for name, m in iter_modules(pipe)}


def test_wan14b_meta_transformer_is_per_step_with_one_40_block_tower_of_28_6_gb():
    before = _rss()
    pipe = meta_wan14b_pipeline()
    assert _rss() - before < RSS_SLACK
    info, decision, module = _decisions(pipe)["transformer"]
    assert decision.role is Role.PER_STEP
    assert 28.3e9 < info.nbytes < 28.9e9
    towers = find_towers(module)
    assert [(t.name, len(t.blocks)) for t in towers] == [("blocks", 40)]


def test_wan14b_meta_text_encoder_leaf_and_vae_by_threshold():
    d = _decisions(meta_wan14b_pipeline())
    assert d["text_encoder"][1].role is Role.LEAF
    vae_info = d["vae"][0]
    expected = Role.ON_DEMAND if vae_info.nbytes >= DEFAULT.on_demand_threshold_bytes else Role.RESIDENT
    assert d["vae"][1].role is expected
    assert decide(vae_info, DEFAULT.replace(on_demand_threshold_gb=0)).role is Role.ON_DEMAND


def test_h3_meta_transformer_tower_of_50_blocks_and_refiner_is_not_a_tower():
    before = _rss()
    pipe = meta_h3_pipeline("t2va")
    assert _rss() - before < RSS_SLACK
    info, decision, module = _decisions(pipe)["transformer"]
    assert decision.role is Role.PER_STEP
    towers = find_towers(module)
    assert [len(t.blocks) for t in towers] == [50]
    assert not any("refiner" in t.name for t in towers)


def test_h3_meta_audio_vae_on_demand_by_opt_out_and_text_encoder_leaf():
    d = _decisions(meta_h3_pipeline("t2va"), DEFAULT.replace(on_demand_threshold_gb=0))
    assert d["audio_vae"][0].opts_out
    assert d["audio_vae"][1].role is Role.ON_DEMAND and "opts out" in d["audio_vae"][1].reason
    assert d["text_encoder"][1].role is Role.LEAF
