"""Load diffusers pipeline inside a real ComfyUI: what it lists, what it loads, and how each broken
folder fails (its own named error, no file changed: folders are hashed before and after)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import harness

pytest_plugins = ["comfyhost.fixtures"]

LOADER = "DiffusersOffloadLoadPipeline"
TRANSFORMER_WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def diffusers_dir(comfy: harness.ComfyHost) -> Path:
    return Path(comfy.folder_paths.get_folder_paths("diffusers")[0])


@pytest.fixture(scope="module")
def model(diffusers_dir: Path, tiny_wan_dir: Path) -> str:
    """The tiny Wan pipeline copied under ComfyUI's models/diffusers; returns its listed name."""
    if not (diffusers_dir / "tiny" / "wan").is_dir():
        shutil.copytree(tiny_wan_dir, diffusers_dir / "tiny" / "wan")
    return "tiny/wan"


def prompt(model: str, dtype: str = "fp32") -> dict[str, Any]:
    return {
        "1": {"class_type": LOADER, "inputs": {"model": model, "dtype": dtype}},
        "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}},
    }


def listed(comfy: harness.ComfyHost) -> list[str]:
    """The model choices as the frontend gets them (``/object_info`` is built from INPUT_TYPES)."""
    _type, options = comfy.nodes.NODE_CLASS_MAPPINGS[LOADER].INPUT_TYPES()["required"]["model"]
    return options["options"]


def tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(path.relative_to(folder).as_posix().encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_lists_pipeline_folders_of_every_diffusers_location(comfy: harness.ComfyHost, diffusers_dir: Path,
                                                            model: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (diffusers_dir / "tiny" / "h3").mkdir(exist_ok=True)
    (diffusers_dir / "tiny" / "h3" / "modular_model_index.json").write_text("{}")
    (diffusers_dir / "tiny" / "no_index").mkdir(exist_ok=True)
    (diffusers_dir / "tiny" / "no_index" / "model.safetensors").write_bytes(b"")
    extra = tmp_path / "extra"
    shutil.copytree(diffusers_dir / model, extra / "elsewhere" / "wan")
    paths, exts = comfy.folder_paths.folder_names_and_paths["diffusers"]
    monkeypatch.setitem(comfy.folder_paths.folder_names_and_paths, "diffusers", (list(paths), exts))
    comfy.folder_paths.add_model_folder_path("diffusers", str(extra))  # what extra_model_paths.yaml does

    names = listed(comfy)

    assert {model, "tiny/h3", "elsewhere/wan"} <= set(names)
    assert not {"tiny", "tiny/no_index", f"{model}/vae", f"{model}/transformer"} & set(names)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("tiny/no_index", "is not a diffusers model folder: it has no model_index.json"),
        ("../diffusers/tiny/wan", "no model folder '../diffusers/tiny/wan' under"),
        ("/etc", "no model folder '/etc' under"),
    ],
)
def test_a_name_that_is_not_a_listed_pipeline_is_refused(comfy: harness.ComfyHost, diffusers_dir: Path,
                                                         model: str, name: str, expected: str) -> None:
    (diffusers_dir / "tiny" / "no_index").mkdir(exist_ok=True)
    try:
        result = comfy.run_prompt(prompt(name))
    except harness.PromptValidationError as exc:  # 2026 trees check combo values against the list
        assert "Value not in list" in str(exc)
    else:  # v0.3.75 does not check V3 combo values: the loader refuses by name
        assert not result.success and expected in result.error["exception_message"]


@pytest.mark.parametrize(("dtype", "expected"), [("auto", torch.float32), ("fp16", torch.float16)])
def test_loads_in_the_chosen_dtype_and_leaves_the_folder_untouched(comfy: harness.ComfyHost, diffusers_dir: Path,
                                                                   model: str, dtype: str,
                                                                   expected: torch.dtype) -> None:
    before = tree_hash(diffusers_dir / model)

    result = comfy.run_prompt(prompt(model, dtype)).raise_for_error()

    assert result.outputs["2"]["text"][0].startswith("WanPipeline on cpu")
    ours = comfy.pack_submodule("nodes.host").DiffusersPatcher
    patchers = [lm.model for lm in comfy.model_management.current_loaded_models if isinstance(lm.model, ours)]
    assert any(p.model_dtype() == expected and p.pipe.transformer.dtype == expected for p in patchers)
    assert tree_hash(diffusers_dir / model) == before


def last_patcher(comfy: harness.ComfyHost) -> Any:
    """The pack's model patcher ComfyUI loaded last (ComfyUI puts each newly loaded model first)."""
    ours = comfy.pack_submodule("nodes.host").DiffusersPatcher
    return next(lm.model for lm in comfy.model_management.current_loaded_models if isinstance(lm.model, ours))


def test_fp8_dtype_stores_the_denoiser_in_fp8_and_computes_in_the_auto_dtype(comfy: harness.ComfyHost,
                                                                             diffusers_dir: Path, model: str) -> None:
    before = tree_hash(diffusers_dir / model)

    comfy.run_prompt(prompt(model, "fp8_e4m3fn")).raise_for_error()

    patcher = last_patcher(comfy)
    transformer = patcher.pipe.transformer
    block_weights = [m.weight for m in transformer.blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert block_weights and all(w.dtype == torch.float8_e4m3fn for w in block_weights)
    assert transformer.dtype == patcher.model_dtype() == torch.float32  # the auto dtype on the CPU
    stored = sum(t.numel() * t.element_size() for c in (transformer, patcher.pipe.vae, patcher.pipe.text_encoder)
                 for t in {id(t): t for t in (*c.parameters(), *c.buffers())}.values())
    assert patcher.model_size() == stored  # ComfyUI is told the storage bytes
    assert tree_hash(diffusers_dir / model) == before


def test_fp8_fast_dtype_computes_the_denoiser_through_fp8_matmuls(comfy: harness.ComfyHost, diffusers_dir: Path,
                                                                  model: str) -> None:
    """ComfyUI's ``fp8_e4m3fn_fast``: fp8 storage, and the fp8 layers carry the fp8 matmul hook
    once placed (the CPU has ``_scaled_mm``); the folder is untouched."""
    before = tree_hash(diffusers_dir / model)

    comfy.run_prompt(prompt(model, "fp8_e4m3fn_fast")).raise_for_error()

    patcher = last_patcher(comfy)
    transformer = patcher.pipe.transformer
    table = comfy.pack_submodule("offload_core.formats.fp8").table_of(transformer)
    assert table.storage == torch.float8_e4m3fn and table.matmul and len(table.weights) > 0
    layer = transformer.blocks[0].attn1.to_q
    hook = layer._diffusers_hook.get_hook("layerwise_casting")
    assert type(hook).__name__ == "Fp8MatmulHook"
    assert tree_hash(diffusers_dir / model) == before


def _write(rel: str, data: bytes | str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / rel
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    return damage


def _remove(rel: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / rel
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return damage


def _truncate(folder: Path) -> None:
    path = folder / TRANSFORMER_WEIGHTS
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])


def _scramble_header(folder: Path) -> None:
    path = folder / TRANSFORMER_WEIGHTS
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))


def _modular_only(folder: Path) -> None:
    (folder / "model_index.json").rename(folder / "modular_model_index.json")


SHARD_INDEX = json.dumps({"weight_map": {"proj.weight": "diffusion_pytorch_model-00002-of-00002.safetensors"}})
BROKEN = {
    "index_not_json": (_write("model_index.json", "{not json"), ["model_index.json", "cannot be read as JSON"]),
    "index_not_a_pipeline": (_write("model_index.json", '{"a": 1}'), ["model_index.json", "_class_name"]),
    "missing_component": (_remove("vae"), ["'vae'", "is missing", "/vae does not exist"]),
    "missing_weights": (_remove("vae/diffusion_pytorch_model.safetensors"), ["'vae'", "no weights file"]),
    "truncated_weights": (_truncate, [TRANSFORMER_WEIGHTS, "truncated or corrupt", "the file has"]),
    "corrupt_header": (_scramble_header, [TRANSFORMER_WEIGHTS, "truncated or corrupt"]),
    "missing_shard": (
        _write("transformer/diffusion_pytorch_model.safetensors.index.json", SHARD_INDEX),
        ["transformer/diffusion_pytorch_model-00002-of-00002.safetensors is missing"],
    ),
    "modular_folder": (_modular_only, ["modular diffusers pipeline", "modular pipeline loader"]),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_folder_fails_with_its_named_error_and_no_file_changes(comfy: harness.ComfyHost,
                                                                        diffusers_dir: Path, model: str,
                                                                        case: str) -> None:
    damage, expected = BROKEN[case]
    folder = diffusers_dir / "broken" / case
    if not folder.exists():
        shutil.copytree(diffusers_dir / model, folder)
        damage(folder)
    before = tree_hash(folder)

    result = comfy.run_prompt(prompt(f"broken/{case}"))

    assert not result.success and result.error["node_id"] == "1"
    assert result.error["exception_type"].endswith("PipelineFolderError")
    message = result.error["exception_message"]
    assert all(part in message for part in expected), message
    assert tree_hash(folder) == before
