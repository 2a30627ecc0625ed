"""The fixture factory itself: tiny pipelines load from disk and run deterministically, builds are
reproducible, and the meta geometries have the full-size layout the placement tests rely on."""

from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline
from fixtures.tiny_pipes import (
    RUNNERS,
    VideoAudio,
    build_all,
    meta_h3_pipeline,
    meta_wan14b_pipeline,
    meta_wan14b_transformer,
)

EXPECTED_SHAPES = {
    "flux": [(1, 3, 16, 16)],
    "wan": [(1, 9, 3, 16, 16)],
    "ltx2": [(1, 9, 3, 32, 32), (1, 2, 132)],
    "h3": [(1, 124, 3, 32, 32), (1, 2, 828)],
    "h3_fl2va": [(1, 124, 3, 32, 32), (1, 2, 828)],
}


def _tensors(out: torch.Tensor | VideoAudio) -> list[torch.Tensor]:
    return list(out) if isinstance(out, VideoAudio) else [out]


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(RUNNERS))
def test_tiny_pipeline_runs_deterministically(name: str, request: pytest.FixtureRequest) -> None:
    pipe = request.getfixturevalue(f"{name}_pipe")
    run = RUNNERS[name]
    first, again, other = run(pipe, seed=0), run(pipe, seed=0), run(pipe, seed=1)

    assert [tuple(t.shape) for t in _tensors(first)] == EXPECTED_SHAPES[name]
    for t in _tensors(first):
        assert t.dtype == torch.float32 and t.device.type == "cpu" and torch.isfinite(t).all()
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert not torch.equal(_tensors(other)[0], _tensors(first)[0]), "the seed must reach the noise"


def test_builds_are_reproducible_and_leave_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = build_all(tmp_path / "a")
    assert torch.equal(torch.rand(3), expected_draw)
    second = build_all(tmp_path / "b")

    assert first.keys() == {"flux", "wan", "ltx2", "h3"}
    assert (first["h3"] / "modular_model_index.json").is_file()
    for name, folder in first.items():
        weights = sorted(p.relative_to(folder) for p in folder.rglob("*.safetensors"))
        assert weights, name
        for rel in weights:
            assert (folder / rel).read_bytes() == (second[name] / rel).read_bytes(), f"{name}/{rel}"


def test_meta_wan14b_transformer_is_full_size_and_cast_like_a_load() -> None:
    model = meta_wan14b_transformer()

    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert len(model.blocks) == 40 and not model.training
    assert _param_count(model) == 14_288_491_584
    assert model.blocks[0].ffn.net[0].proj.weight.shape == (13824, 5120)
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    # _keep_in_fp32_modules (rope, time_embedder, scale_shift_table, norm1-3) stay float32
    assert model.scale_shift_table.dtype == torch.float32
    assert model.blocks[0].norm2.weight.dtype == torch.float32
    assert model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32


def test_meta_wan14b_pipeline_is_a_real_wan_pipeline() -> None:
    pipe = meta_wan14b_pipeline()

    assert isinstance(pipe, WanPipeline)
    models = {k: m for k, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert {k: _param_count(m) for k, m in models.items()} == {
        "transformer": 14_288_491_584,
        "text_encoder": 5_680_910_336,  # UMT5-XXL encoder
        "vae": 126_892_531,
    }
    assert all(p.device.type == "meta" for m in models.values() for p in m.parameters())


def test_meta_h3_pipeline_holds_full_size_components() -> None:
    pipe = meta_h3_pipeline("t2va")

    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline"
    transformer, text_encoder, audio_vae = pipe.transformer, pipe.text_encoder, pipe.audio_vae
    assert len(transformer.transformer_blocks) == 50
    assert _param_count(transformer) == 33_122_992_896
    assert text_encoder.config.text_config.num_hidden_layers == 64
    assert {p.dtype for p in text_encoder.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in audio_vae.parameters()} == {torch.float32}  # its keep-in-fp32 list covers it all
    for name in ("transformer", "vae", "audio_vae", "text_encoder"):
        assert {p.device.type for p in getattr(pipe, name).parameters()} == {"meta"}, name
