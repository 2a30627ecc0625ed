"""The LTX-2 19B configs the pack carries (dev and distilled): the models they build, the values the
classes' defaults get wrong for LTX-2 (split RoPE, a non-causal decoder, 32 / 8 compression), the
schedulers that tell dev from distilled; a file of LTX-2 19B's shape picks dev or distilled by its
name, as diffusers' own conversion tells them; other shapes are refused saying what they are."""

from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch
import transformers
from accelerate import init_empty_weights
from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
from diffusers_offload.offload_core.formats import carried
from diffusers_offload.offload_core.formats.inspect import SingleFileError, describe_keys
from fixtures.ltx2_files import original_ltx2_transformer_state

LTX2 = [f for f in carried.carried() if f.name.startswith("LTX-2")]
# billions of parameters: the transformer of "19B" and the rest of the checkpoint; Gemma 3 12B (its head tied)
TRANSFORMER, REST, GEMMA_12B = 18.88, 2.763, 12.19


def _billions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e9


def _meta(cls: type, folder: Path) -> torch.nn.Module:
    with init_empty_weights():
        return cls.from_config(cls.load_config(str(folder)))


def test_the_pack_carries_ltx2_dev_and_distilled() -> None:
    assert [f.name for f in LTX2] == ["LTX-2-19B-dev", "LTX-2-19B-distilled"]


@pytest.mark.parametrize("folder", LTX2, ids=lambda p: p.name)
def test_each_carried_ltx2_folder_builds_ltx2_19b(folder: Path) -> None:
    transformer = _meta(diffusers.LTX2VideoTransformer3DModel, folder / "transformer")
    assert _billions(transformer) == pytest.approx(TRANSFORMER, rel=5e-3) and transformer.config.rope_type == "split"
    connectors = _meta(LTX2TextConnectors, folder / "connectors")
    assert connectors.config.rope_type == "split"
    vae = _meta(diffusers.AutoencoderKLLTX2Video, folder / "vae")
    assert (vae.spatial_compression_ratio, vae.temporal_compression_ratio, vae.config.decoder_causal) == (32, 8, False)
    rest = [connectors, vae, _meta(diffusers.AutoencoderKLLTX2Audio, folder / "audio_vae"),
            _meta(LTX2Vocoder, folder / "vocoder")]
    assert sum(_billions(m) for m in rest) == pytest.approx(REST, rel=5e-3)
    with init_empty_weights():
        gemma = transformers.Gemma3ForConditionalGeneration(
            transformers.Gemma3Config.from_pretrained(str(folder / "text_encoder")))
    gemma.tie_weights()
    assert _billions(gemma) == pytest.approx(GEMMA_12B, rel=5e-3)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(str(folder / "scheduler"))
    dev = folder.name.endswith("dev")
    assert (scheduler.config.use_dynamic_shifting, scheduler.config.shift_terminal) == ((True, 0.1) if dev else
                                                                                        (False, None))
    assert not any(folder.rglob("*.safetensors")) and not (folder / "tokenizer").exists()


def _ltx2_19b_info(name: str, extra: dict[str, tuple[int, ...]] | None = None):
    """A file of LTX-2 19B's transformer (its header: the meta model's shapes, LTX-2's original names)."""
    model = _meta(diffusers.LTX2VideoTransformer3DModel, carried.by_name("LTX-2-19B-dev") / "transformer")
    state = original_ltx2_transformer_state({k: v for k, v in model.state_dict().items()})
    return describe_keys(Path(name), {**{k: tuple(v.shape) for k, v in state.items()}, **(extra or {})})


def test_an_ltx2_19b_file_picks_dev_or_distilled_by_its_name() -> None:
    assert carried.choose(_ltx2_19b_info("ltx-2-19b-dev-fp8.safetensors"), False, carried.carried()).name == \
        "LTX-2-19B-dev"
    assert carried.choose(_ltx2_19b_info("ltx-2-19b-distilled.safetensors"), False, carried.carried()).name == \
        "LTX-2-19B-distilled"


def test_an_ltx23_file_fits_no_carried_config() -> None:
    info = _ltx2_19b_info("ltx-2.3-22b-dev.safetensors",
                          {"model.diffusion_model.transformer_blocks.0.attn1.to_gate_logits.weight": (32, 4096)})
    with pytest.raises(SingleFileError, match=r"gated attention \(LTX-2\.3\): none of the configs the pack carries"):
        carried.choose(info, False, carried.carried())
