"""Wan 2.2 A14B from two single files, as its ComfyUI users hold it (a high-noise and a low-noise
expert, often in different formats): ``load_pipeline_with_denoiser(..., denoiser_2_file=)`` puts the
high-noise file in ``transformer`` and the low-noise one in ``transformer_2`` of a configs-only A14B
folder, each keeping its storage; placed, the pipeline runs as the folder's pipeline holding those
two models. A folder without ``transformer_2`` refuses a second file by name, a configs-only A14B
folder without one names the file to pick, and files picked the wrong way round by their names are
warned about."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import table_of
from diffusers_offload.offload_core.formats.inspect import SingleFileError
from diffusers_offload.offload_core.formats.single_file import load_denoiser
from diffusers_offload.offload_core.formats.single_file_pipeline import load_pipeline_with_denoiser
from fixtures.comfy_files import configs_only_copy, write_comfy_wan, write_component_file
from fixtures.gguf_files import write_wan_gguf
from fixtures.placements import run_placed
from fixtures.tiny_wan_families import run_wan_family

BF16 = torch.bfloat16
CONFIG = OffloadConfig(mode="auto", on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")


@pytest.fixture(scope="module")
def a14b(tiny_wan_family, tmp_path_factory) -> dict[str, Path]:
    """The tiny T2V-A14B folder, its configs-only copy, its experts as a GGUF Q8_0 high-noise file
    and an fp8_scaled low-noise file (ComfyUI's key layout, community names), and its text-encoder
    and VAE files."""
    folder = tiny_wan_family("wan22_a14b")
    root = tmp_path_factory.mktemp("a14b-files")
    return {
        "folder": folder,
        "configs": configs_only_copy(folder, root / "configs"),
        "high": write_wan_gguf(folder, root / "Wan2.2-T2V-A14B-HighNoise-Q8_0.gguf", "Q8_0"),
        "low": write_comfy_wan(folder, root / "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", "fp8_scaled",
                               component="transformer_2"),
        "text_encoder": write_component_file(folder, "text_encoder", root / "umt5-tiny.safetensors"),
        "vae": write_component_file(folder, "vae", root / "wan-vae-tiny.safetensors"),
    }


def _load(a14b: dict[str, Path], denoiser: Path, denoiser_2: Path | None, folder: Path | None = None):
    return load_pipeline_with_denoiser(folder or a14b["configs"], denoiser, BF16, a14b["text_encoder"], a14b["vae"],
                                       denoiser_2_file=denoiser_2)


def _run_placed(pipe) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return run_placed(pipe, CONFIG, run_wan_family)


def _with_experts(folder: Path, high, low):
    """The full tiny folder loaded by diffusers in bf16, ``high`` and ``low`` in place of its experts."""
    pipe = DiffusionPipeline.from_pretrained(str(folder), dtype=BF16)
    pipe.register_modules(transformer=high, transformer_2=low)
    return pipe


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_expert_comes_from_its_own_file_and_keeps_its_storage(a14b) -> None:
    before = {k: _digest(a14b[k]) for k in ("high", "low")}
    pipe = _load(a14b, a14b["high"], a14b["low"])
    assert any(type(p).__name__ == "GGUFParameter" for p in pipe.transformer.parameters())
    assert table_of(pipe.transformer) is None
    low_table = table_of(pipe.transformer_2)
    assert low_table is not None and low_table.scales and low_table.storage == torch.float8_e4m3fn
    assert pipe.config.boundary_ratio == 0.9  # the folder's, which splits the steps between them
    high, low = load_denoiser(a14b["high"], a14b["folder"], BF16), \
        load_denoiser(a14b["low"], a14b["folder"], BF16, subfolder="transformer_2")
    got = _run_placed(pipe)
    expected = _run_placed(_with_experts(a14b["folder"], high, low))
    assert torch.equal(got, expected)
    # the low-noise file matters: the high-noise model in both places gives other frames
    same = load_denoiser(a14b["high"], a14b["folder"], BF16, subfolder="transformer_2")
    assert not torch.allclose(_run_placed(_with_experts(a14b["folder"], high, same)), expected, atol=1e-3)
    assert {k: _digest(a14b[k]) for k in ("high", "low")} == before


def test_a_configs_only_a14b_folder_names_the_second_file_to_pick(a14b) -> None:
    with pytest.raises(SingleFileError, match=r"no weights for transformer_2 \(WanTransformer3DModel\): pick a "
                                              r"second denoiser file \(Wan 2.2 A14B's low-noise expert\)"):
        _load(a14b, a14b["high"], None)


def test_a_second_denoiser_for_a_folder_without_one_is_refused(a14b, tiny_wan_dir, tmp_path) -> None:
    wan21 = configs_only_copy(tiny_wan_dir, tmp_path / "wan21-configs")
    with pytest.raises(SingleFileError, match=r"WanPipeline .* has no transformer_2: leave its second denoiser "
                                              r"file .* at 'none'"):
        _load(a14b, a14b["high"], a14b["low"], folder=wan21)


def test_a_second_denoiser_that_is_no_denoiser_is_refused_naming_it(a14b) -> None:
    with pytest.raises(SingleFileError, match=r"umt5-tiny.safetensors looks like .*text encoder.*, not a denoiser"):
        _load(a14b, a14b["high"], a14b["text_encoder"])


@pytest.mark.parametrize("swapped", [False, True])
def test_experts_picked_the_wrong_way_round_by_their_names_are_warned_about(a14b, caplog, swapped) -> None:
    first, second = (a14b["low"], a14b["high"]) if swapped else (a14b["high"], a14b["low"])
    with caplog.at_level(logging.WARNING, logger="diffusers_offload"):
        _load(a14b, first, second)
    warned = [r.getMessage() for r in caplog.records if "low-noise expert" in r.getMessage()]
    assert bool(warned) is swapped
    if swapped:
        assert a14b["low"].name in warned[0] and "the high-noise file goes in denoiser" in warned[0]
