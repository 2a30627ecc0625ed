"""Issue 22, item 8, engine side: always/never entries that match nothing are warned about (names
and classes matched case-insensitively); attention-only musubi Wan LoRAs load like the same weights
under original Wan keys, and the user's file is never changed; `make demo` with a missing model path
says so and links nothing."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline
from diffusers.loaders.lora_conversion_utils import _convert_musubi_wan_lora_to_diffusers
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.components import describe, iter_modules
from diffusers_offload.offload_core.lora.files import read_lora
from diffusers_offload.offload_core.roles import Role, decide, unknown_entries, warn_unknown_entries
from fixtures.musubi_loras import PROJECTIONS, musubi_wan_lora
from safetensors.torch import load_file

pytest_plugins = ["fixtures.tiny_loras"]

ROOT = Path(__file__).resolve().parents[2]


# -- always / never ---------------------------------------------------------------------------------
def test_list_entries_match_names_and_classes_in_any_case(wan_pipe: WanPipeline) -> None:
    info = describe("vae", wan_pipe.vae)
    assert decide(info, OffloadConfig(never=("VAE",))).role is Role.RESIDENT
    assert decide(info, OffloadConfig(never=("autoencoderklwan",))).reason == "never list ('autoencoderklwan')"
    assert unknown_entries(OffloadConfig(always=("Transformer",), never=("AUTOENCODERKLWAN",)),
                           iter_modules(wan_pipe)) == ()


def test_unknown_list_entries_are_warned_about_with_the_pipelines_components(
        wan_pipe: WanPipeline, caplog: pytest.LogCaptureFixture) -> None:
    config = OffloadConfig(always=("transfomer", "vae"), never=("text_encoder_2",))
    components = list(iter_modules(wan_pipe))

    with caplog.at_level(logging.WARNING):
        message = warn_unknown_entries(config, components, "WanPipeline")
        again = warn_unknown_entries(config, components, "WanPipeline")

    classes = {"text_encoder": "UMT5EncoderModel", "transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan"}
    assert {n for n, _ in components} == set(classes)
    layout = ", ".join(f"{name} ({classes[name]})" for name, _ in components)  # in the pipeline's own order
    assert message == again == (
        "offload list entries always 'transfomer', never 'text_encoder_2' match no component of WanPipeline and "
        f"are ignored; its components are {layout} (names and classes match case-insensitively)"
    )
    warned = [r.getMessage() for r in caplog.records if "match no component" in r.getMessage()]
    assert warned == [message]  # once, not on every placement
    assert warn_unknown_entries(OffloadConfig(always=("VAE",)), components) is None


# -- musubi Wan LoRAs ----------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def deltas(layers: dict[str, object]) -> dict[str, torch.Tensor]:
    return {m: layer.scale * (layer.up @ layer.down) for m, layer in layers.items()}


def test_an_attention_only_musubi_wan_lora_loads_like_the_same_weights_under_original_keys(
        wan_pipe: WanPipeline, wan_loras: dict[str, Path], tmp_path: Path) -> None:
    musubi = musubi_wan_lora(wan_loras["a"], tmp_path / "musubi_self_attn.safetensors", ("attn1",))
    original = musubi_wan_lora(wan_loras["a"], tmp_path / "original_self_attn.safetensors", ("attn1",), original=True)
    before = {p: sha256(p) for p in (musubi, original)}
    with pytest.raises(KeyError, match="cross_attn"):  # diffusers' own musubi path wants every block part
        _convert_musubi_wan_lora_to_diffusers(load_file(musubi))

    got, want = read_lora(musubi, wan_pipe), read_lora(original, wan_pipe)

    assert got.skipped == want.skipped == 0
    assert set(got.layers["transformer"]) == {f"blocks.{b}.attn1.{p}" for b in range(len(wan_pipe.transformer.blocks))
                                              for p in PROJECTIONS}
    reference = deltas(read_lora(wan_loras["a"], wan_pipe).layers["transformer"])
    for module, delta in deltas(got.layers["transformer"]).items():
        torch.testing.assert_close(delta, deltas(want.layers["transformer"])[module])
        torch.testing.assert_close(delta, reference[module])  # alpha 8 on rank 4, as the diffusers file
    assert {p: sha256(p) for p in before} == before


def test_a_complete_musubi_wan_lora_reads_as_diffusers_own_musubi_conversion(
        wan_pipe: WanPipeline, wan_loras: dict[str, Path], tmp_path: Path) -> None:
    """Self- and cross-attention and feed-forward in every block: the renamed path gives what
    diffusers' musubi converter gives."""
    gen = torch.Generator().manual_seed(3)
    ffn = {}
    for b, block in enumerate(wan_pipe.transformer.blocks):
        ffn[b] = {}
        for index, layer in (("0", block.ffn.net[0].proj), ("2", block.ffn.net[2])):
            ffn[b][f"down{index}"] = torch.randn(4, layer.in_features, generator=gen)
            ffn[b][f"up{index}"] = torch.randn(layer.out_features, 4, generator=gen)
    musubi = musubi_wan_lora(wan_loras["a"], tmp_path / "musubi_full.safetensors", ("attn1", "attn2"), ffn=ffn)
    digest = sha256(musubi)

    got = deltas(read_lora(musubi, wan_pipe).layers["transformer"])

    converted = _convert_musubi_wan_lora_to_diffusers(load_file(musubi))
    expected = {k.removeprefix("transformer.").removesuffix(".lora_A.weight"):
                converted[k.replace("lora_A", "lora_B")] @ v for k, v in converted.items() if ".lora_A." in k}
    assert set(got) == set(expected) and len(got) == 10 * len(wan_pipe.transformer.blocks)
    for module, delta in got.items():
        torch.testing.assert_close(delta, expected[module])
    assert sha256(musubi) == digest


# -- make demo MODEL=<missing> ----------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["--example", "wan_text_to_video"]])
def test_demo_with_a_missing_model_path_says_so_and_links_nothing(tmp_path: Path, extra: list[str]) -> None:
    missing = tmp_path / "no_such_model"
    models = ROOT / ".comfy_base" / "models" / "diffusers"
    before = sorted(p.name for p in models.iterdir()) if models.is_dir() else []

    done = subprocess.run([sys.executable, str(ROOT / "tools" / "demo.py"), "--model", str(missing), *extra],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)

    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        f"--model {missing}: {missing} does not exist; give the path of a diffusers pipeline folder "
        "(the one holding model_index.json or modular_model_index.json)")
    assert (sorted(p.name for p in models.iterdir()) if models.is_dir() else []) == before
    assert not (models / missing.name).is_symlink()


def test_placing_a_pipeline_warns_about_list_entries_that_match_nothing(
        wan_pipe: WanPipeline, caplog: pytest.LogCaptureFixture) -> None:
    from diffusers_offload.offload_core import Engine

    engine = Engine()
    with caplog.at_level(logging.WARNING):
        engine.place(wan_pipe, OffloadConfig(never=("Vae_typo",), device="cpu"))
    engine.release(wan_pipe)
    assert any("never 'Vae_typo' match no component of WanPipeline" in r.getMessage() for r in caplog.records)
