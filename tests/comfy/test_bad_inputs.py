"""Issue 22, item 8, inside a real ComfyUI: each bad input fails on its own node with a message naming
what to fix, and no file of the involved folder changes (sha256 of every file, before and after)."""

from __future__ import annotations

import hashlib
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from comfyhost import harness
from fixtures.musubi_loras import musubi_wan_lora

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures", "fixtures.tiny_loras"]

LOADER, MODULAR = "DiffusersOffloadLoadPipeline", "DiffusersOffloadLoadModularPipeline"
TOKENIZER_HINT = "copy that folder from the original model or download the model again"


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (links followed), by relative path."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def diffusers_dir(comfy: harness.ComfyHost) -> Path:
    return Path(comfy.folder_paths.get_folder_paths("diffusers")[0])


def broken_copy(source: Path, target: Path, damage: Callable[[Path], None]) -> Path:
    """A damaged copy of ``source``; a modular index's absolute paths are pointed at the copy."""
    if not target.exists():
        shutil.copytree(source, target)
        index = target / "modular_model_index.json"
        if index.is_file():
            index.write_text(index.read_text(encoding="utf-8").replace(str(source.resolve()), str(target)))
        damage(target)
    return target


def _empty(rel: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        for path in (folder / rel).iterdir():
            path.unlink()
    return damage


def _remove(rel: str) -> Callable[[Path], None]:
    return lambda folder: (folder / rel).unlink()


def _write(rel: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / rel).write_text(text)


def run(comfy: harness.ComfyHost, folder: Path, prompt: dict[str, Any]) -> dict[str, Any]:
    """Run ``prompt``; it must fail. The error (its message without ComfyUI's trailing newline), with
    no file of ``folder`` changed."""
    before = hashes(folder)
    result = comfy.run_prompt(prompt)
    assert not result.success and result.error is not None
    assert hashes(folder) == before
    return {**result.error, "exception_message": result.error["exception_message"].rstrip("\n")}


# -- tokenizers and processors -----------------------------------------------------------------------
CLASSIC = {
    "tokenizer_emptied": (_empty("tokenizer"), "spiece.model, tokenizer.json"),
    "tokenizer_without_json": (_remove("tokenizer/tokenizer.json"), "spiece.model, tokenizer.json"),
    "tokenizer_json_empty": (_write("tokenizer/tokenizer.json", ""), "spiece.model, tokenizer.json"),
}


@pytest.mark.parametrize("case", sorted(CLASSIC))
def test_a_tokenizer_without_its_vocabulary_is_refused_naming_the_folder(
        comfy: harness.ComfyHost, diffusers_dir: Path, tiny_wan_dir: Path, case: str) -> None:
    damage, files = CLASSIC[case]
    folder = broken_copy(tiny_wan_dir, diffusers_dir / "bad_inputs" / case, damage)
    prompt = {"1": {"class_type": LOADER, "inputs": {"model": f"bad_inputs/{case}", "dtype": "fp32"}},
              "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}}}

    error = run(comfy, folder, prompt)

    assert error["node_id"] == "1" and error["exception_type"].endswith("PipelineFolderError")
    assert error["exception_message"] == (
        f"component 'tokenizer' (transformers.T5Tokenizer) has no tokenizer file in {folder / 'tokenizer'}: it "
        f"needs one of {files} (non-empty); without one every prompt would become unknown tokens; {TOKENIZER_HINT}")


MODULAR_CASES = {
    "processor_without_json": (_remove("processor/tokenizer.json"),
                               "has no tokenizer file in {p}: it needs one of vocab.json, merges.txt, tokenizer.json "
                               "(non-empty); without one every prompt would become unknown tokens"),
    "processor_emptied": (_empty("processor"),
                          "has no processor config in {p}: it needs one of processor_config.json, "
                          "preprocessor_config.json (non-empty)"),
}


@pytest.mark.parametrize("case", sorted(MODULAR_CASES))
def test_a_modular_processor_without_its_files_is_refused_naming_the_folder(
        comfy: harness.ComfyHost, diffusers_dir: Path, tiny_h3_dir: Path, case: str) -> None:
    damage, expected = MODULAR_CASES[case]
    folder = broken_copy(tiny_h3_dir, diffusers_dir / "bad_inputs" / case, damage)
    prompt = {"1": {"class_type": MODULAR, "inputs": {"model": f"bad_inputs/{case}", "workflow": "t2va",
                                                       "dtype": "fp32"}},
              "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}}}

    error = run(comfy, folder, prompt)

    assert error["node_id"] == "1" and error["exception_type"].endswith("PipelineFolderError")
    assert error["exception_message"] == (
        f"component 'processor' (Qwen3VLProcessor) {expected.format(p=folder / 'processor')}; {TOKENIZER_HINT}")


def test_tokenizer_folders_are_accepted_with_any_file_their_class_loads_from(
        comfy: harness.ComfyHost, tmp_path: Path) -> None:
    """Not one hard-coded file: a T5 folder with only spiece.model, a CLIP one with vocab.json and
    merges.txt, an AutoTokenizer folder whose config names its class, a byte-level class with none."""
    folders = comfy.pack_submodule("nodes.folders")
    cases = {
        "transformers.T5Tokenizer": {"spiece.model": "x"},
        "transformers.CLIPTokenizer": {"vocab.json": "{}", "merges.txt": "#"},
        "transformers.AutoTokenizer": {"tokenizer_config.json": '{"tokenizer_class": "BertTokenizer"}',
                                       "vocab.txt": "[UNK]"},
        "transformers.ByT5Tokenizer": {},
    }
    for i, (what, files) in enumerate(cases.items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
        folders.check_component(folder, "tokenizer", what)
    (tmp_path / "2" / "vocab.txt").unlink()
    with pytest.raises(folders.PipelineFolderError, match=r"needs one of vocab\.txt, tokenizer\.json \(non-empty\)"):
        folders.check_component(tmp_path / "2", "tokenizer", "transformers.AutoTokenizer")


# -- a modular index that is not JSON ------------------------------------------------------------------
def test_an_invalid_modular_index_is_reported_as_invalid_json_with_the_parsers_position(
        comfy: harness.ComfyHost, diffusers_dir: Path, tiny_h3_dir: Path) -> None:
    folder = broken_copy(tiny_h3_dir, diffusers_dir / "bad_inputs" / "modular_index_not_json",
                         _write("modular_model_index.json", '{"_class_name": "MiniMaxH3ModularPipeline",\n  oops}'))
    prompt = {"1": {"class_type": MODULAR, "inputs": {"model": "bad_inputs/modular_index_not_json",
                                                       "workflow": "t2va", "dtype": "fp32"}},
              "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["1", 0]}}}

    error = run(comfy, folder, prompt)

    assert error["node_id"] == "1" and error["exception_type"].endswith("PipelineFolderError")
    assert error["exception_message"] == (
        f"{folder / 'modular_model_index.json'} cannot be read as JSON (Expecting property name enclosed in double "
        "quotes: line 2 column 3 (char 46)): the download is incomplete or the file was edited; restore it or "
        "download the model again")


# -- preload nan / inf -----------------------------------------------------------------------------------
SETTINGS = {"mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
            "on_demand_threshold_gb": 1.0, "resident_floor_mb": 64.0, "always": "", "never": "",
            "prefetch_window": 1, "device": "", "measures_path": ""}


@pytest.mark.parametrize(("option", "value", "message"), [
    *[("preload", v, f"preload {v!r} is not understood: use 'auto', 'off' or a budget in GiB such as '12'")
      for v in ("nan", "inf", "-1", "NaN GB", "1e999")],
    ("pin_reserve_gb", float("nan"), "pin_reserve_gb must be a finite number >= 0, got nan"),  # passes min/max
    ("prompt_cache_gb", float("nan"), "prompt_cache_gb must be a finite number >= 0, got nan"),
    ("host_ram_gb", "lots", "host_ram_gb must be 'auto' or a finite number of GiB >= 0 (such as 24), got 'lots'"),
    ("host_ram_gb", "-2", "host_ram_gb must be 'auto' or a finite number of GiB >= 0 (such as 24), got '-2'"),
])
def test_preload_nan_or_inf_is_refused_at_the_settings_node_naming_the_option(
        comfy: harness.ComfyHost, diffusers_dir: Path, tiny_wan_dir: Path, option: str, value: object,
        message: str) -> None:
    model = ex.link_model(diffusers_dir, tiny_wan_dir)
    prompt = {
        "s": {"class_type": "DiffusersOffloadSettings", "inputs": {**SETTINGS, "preload": "auto", option: value}},
        "1": {"class_type": LOADER, "inputs": {"model": model, "dtype": "fp32", "offload": ["s", 0]}},
        "2": {"class_type": "DiffusersOffloadGenerateVideo", "inputs": {
            "pipe": ["1", 0], "prompt": "a cat", "negative_prompt": "", "seed": 0, "steps": 1, "guidance": 0.0,
            "width": 16, "height": 16, "frames": 5, "fps": 0.0}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 3]}},
    }

    error = run(comfy, tiny_wan_dir, prompt)

    assert error["node_id"] == "s" and error["exception_type"].endswith("OffloadConfigError")
    assert error["exception_message"] == message


# -- an attention-only musubi Wan LoRA ---------------------------------------------------------------------
def test_an_attention_only_musubi_wan_lora_loads_on_the_lora_node(
        comfy: harness.ComfyHost, diffusers_dir: Path, tiny_wan_dir: Path, wan_loras: dict[str, Path],
        tmp_path: Path) -> None:
    loras = Path(comfy.folder_paths.get_folder_paths("loras")[0])
    musubi = musubi_wan_lora(wan_loras["a"], tmp_path / "musubi_self_attn.safetensors", ("attn1",))
    link = loras / "bad_inputs_musubi_self_attn.safetensors"
    link.unlink(missing_ok=True)
    link.symlink_to(musubi)
    model = ex.link_model(diffusers_dir, tiny_wan_dir)
    prompt = {
        "1": {"class_type": LOADER, "inputs": {"model": model, "dtype": "fp32"}},
        "l": {"class_type": "DiffusersOffloadLoadLora", "inputs": {"pipe": ["1", 0], "lora_name": link.name,
                                                                  "strength": 1.0}},
        "2": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": ["l", 0]}},
    }
    before = hashes(tmp_path)

    result = comfy.run_prompt(prompt)

    link.unlink()
    assert result.success, result.error
    assert hashes(tmp_path) == before
