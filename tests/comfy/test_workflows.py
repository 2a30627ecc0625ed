"""The shipped example workflows against the node schemas of a real ComfyUI, and their API twins
run end to end on tiny models.

The UI JSON (``example_workflows/*.json``) is what users drag in: every node type must be
registered, ``widgets_values`` must match each schema's widgets in count, order and range, every
link must join the same type on both ends, and the graph must convert to exactly its API twin
(what the frontend would queue). The twins (``example_workflows/api/*.json``) then run through
ComfyUI's own validation and executor on the tiny model of their family. Schemas come from the
``/object_info`` route of the running host, so both ComfyUI trees are checked as they are.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import av
import pytest
import torch
from comfyhost import harness
from fixtures import (
    comfy_files,
    flux2_dev_files,
    flux2_klein_files,
    flux_files,
    gguf_files,
    qwen_image_edit_files,
    qwen_image_files,
    z_image_files,
)
from fixtures.tiny_tok import tiny_gemma_spiece, tiny_t5_spiece
from PIL import Image
from safetensors.torch import save_file

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]
_comfy_wan, _component_files, _wan_gguf = (comfy_files.comfy_wan, comfy_files.wan_component_files,
                                           gguf_files.wan_gguf_fixture)
_bfl_flux, _flux_tiny_width = flux_files.bfl_flux, flux_files.flux_tiny_width
_tiny_z_image = z_image_files.tiny_z_image_dir
_tiny_qwen_image = qwen_image_files.tiny_qwen_image_dir
_tiny_qwen_image_edit = qwen_image_edit_files.tiny_qwen_image_edit_dir
_tiny_flux2_klein = flux2_klein_files.tiny_flux2_klein_dir
_tiny_flux2_dev = flux2_dev_files.tiny_flux2_dev_dir

NAMES = [e.name for e in ex.EXAMPLES]
# combos listing the user's disk: any name is a valid value
SINGLE_FILE_LISTS = ("config", "denoiser", "denoiser_2", "text_encoder", "text_encoder_2", "vae", "image_encoder")
FILE_LISTS = {(ex.LOADER, "model"), ("DiffusersOffloadLoadModularPipeline", "model"), ("LoadImage", "image"),
              *((ex.sf.SINGLE_FILE_LOADER, name) for name in SINGLE_FILE_LISTS)}


def ui(name: str) -> dict[str, Any]:
    """The UI workflow's graph: its Note (frontend-only, never queued) is checked in test_templates."""
    workflow = json.loads((ex.EXAMPLES_DIR / f"{name}.json").read_text(encoding="utf-8"))
    workflow["nodes"] = [node for node in workflow["nodes"] if node["type"] not in ex.UI_ONLY]
    return workflow


@pytest.fixture(scope="module")
def schemas(comfy: harness.ComfyHost) -> dict[str, dict[str, Any]]:
    """``/object_info`` of every node type the examples use (UI files and twins)."""
    types = {node["type"] for name in NAMES for node in ui(name)["nodes"]}
    types |= {node["class_type"] for name in NAMES for node in ex.api_prompt(name, "m").values()}
    missing = sorted(t for t in types if t not in comfy.nodes.NODE_CLASS_MAPPINGS)
    assert not missing, f"node types not registered in this ComfyUI: {missing}"
    return {t: ex.object_info(comfy, t) for t in types}


def widget_problem(kind: Any, options: dict[str, Any], value: Any, file_list: bool) -> str | None:
    """Why ``value`` cannot sit in a widget of this schema type, or None."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "INT" or kind == "FLOAT":
        if not number or (kind == "INT" and not isinstance(value, int)):
            return f"{value!r} is not {kind}"
        if not options.get("min", value) <= value <= options.get("max", value):
            return f"{value!r} outside {options.get('min')}..{options.get('max')}"
        return None
    if kind == "STRING" or file_list:
        return None if isinstance(value, str) else f"{value!r} is not a string"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not a boolean"
    choices = kind if isinstance(kind, list) else options.get("options", [])
    choices = [c["key"] if isinstance(c, dict) else c for c in choices]  # dynamic combos: option keys
    return None if value in choices else f"{value!r} not among {choices}"


def api_from_ui(workflow: dict[str, Any], schemas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the frontend queues for a UI workflow: widget values by schema order, links as [id, slot]."""
    links = {link[0]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        values = iter(node["widgets_values"])
        inputs = {}
        for name, kind, options, _ in ex.schema_inputs(schemas[node["type"]]):
            if ex.is_widget(kind, options):
                inputs[name] = next(values)
                if options.get("control_after_generate"):
                    next(values)
        for entry in node["inputs"]:
            if entry.get("link") is not None:
                link = links[entry["link"]]
                inputs[entry["name"]] = [str(link[1]), link[2]]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def types_match(a: str, b: str) -> bool:
    return a == b or "*" in (a, b)


def test_every_example_ships_a_ui_workflow_and_an_api_twin() -> None:
    assert sorted(p.stem for p in ex.EXAMPLES_DIR.glob("*.json")) == sorted(NAMES)
    assert sorted(p.stem for p in ex.API_DIR.glob("*.json")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_widgets_match_the_schemas(name: str, schemas: dict[str, dict[str, Any]]) -> None:
    for node in ui(name)["nodes"]:
        assert node["mode"] == 0, f"node {node['id']} is muted or bypassed"
        values = list(node["widgets_values"])
        for input_name, kind, options, _ in ex.schema_inputs(schemas[node["type"]]):
            if not ex.is_widget(kind, options):
                continue
            where = f"node {node['id']} ({node['type']}) widget {input_name!r}"
            assert values, f"{where}: widgets_values ends early"
            problem = widget_problem(kind, options, values.pop(0), (node["type"], input_name) in FILE_LISTS)
            assert problem is None, f"{where}: {problem}"
            if options.get("control_after_generate"):
                assert values and values.pop(0) in ex.CONTROL_VALUES, f"{where}: no control_after_generate value"
        assert values == [], f"node {node['id']} ({node['type']}): extra widgets_values {values}"


@pytest.mark.parametrize("name", NAMES)
def test_sockets_and_links_join_matching_types(name: str, schemas: dict[str, dict[str, Any]]) -> None:
    workflow = ui(name)
    nodes = {node["id"]: node for node in workflow["nodes"]}
    for node in nodes.values():
        info = schemas[node["type"]]
        declared = {n: (k, o) for n, k, o, _ in ex.schema_inputs(info)}
        for entry in node["inputs"]:
            kind, options = declared[entry["name"]]
            if "widget" in entry:  # the frontend rebuilds widgets from the schema; only the name counts
                assert ex.is_widget(kind, options), (node["id"], entry["name"])
            else:
                assert entry["type"] == kind, (node["id"], entry["name"])
        outputs = [(o["name"], o["type"]) for o in node["outputs"]]
        schema_outputs = list(zip(info["output_name"], info["output"], strict=True))
        assert outputs == schema_outputs[: len(outputs)], node["id"]  # newer trees may add outputs (SaveImage)
    linked = set()
    for link_id, origin, origin_slot, target, target_slot, kind in workflow["links"]:
        out, entry = nodes[origin]["outputs"][origin_slot], nodes[target]["inputs"][target_slot]
        assert out["type"] == kind == schemas[nodes[origin]["type"]]["output"][origin_slot], link_id
        assert types_match(entry["type"], kind), f"link {link_id}: {kind} into {entry['name']} ({entry['type']})"
        assert link_id in out["links"] and entry["link"] == link_id, link_id
        linked.add(link_id)
    assert {i["link"] for n in nodes.values() for i in n["inputs"]} - {None} == linked
    assert {x for n in nodes.values() for o in n["outputs"] for x in o["links"]} == linked
    every_id = [node["id"] for node in json.loads((ex.EXAMPLES_DIR / f"{name}.json").read_text(encoding="utf-8"))["nodes"]]
    assert (workflow["last_node_id"], workflow["last_link_id"]) == (max(every_id), len(linked))  # the Note counts


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_queues_exactly_its_api_twin(name: str, schemas: dict[str, dict[str, Any]]) -> None:
    assert api_from_ui(ui(name), schemas) == ex.api_prompt(name, ex.example(name).model)


def tiny_stand_in(file: Any, example: ex.Example, request: pytest.FixtureRequest, tmp: Path) -> Path:
    """The tiny file of a template file's role and format (``ComfyFile.tiny``; a text encoder in fp8
    as the named file is, a UMT5 one with its own tokenizer entry as Comfy-Org's): the tiny Wan's,
    for a Wan family (A14B) one written from its tiny folder, each expert from its own transformer,
    for Flux the tiny Flux's in BFL's layouts."""
    source = _stand_in(file, example, request, tmp)
    if file.input.startswith("text_encoder") and "fp8" in file.name:
        out = tmp / f"{example.tiny}-fp8-{source.name}"
        spiece = tiny_t5_spiece() if "umt5" in file.name else None
        return comfy_files.write_fp8_text_encoder(source, out, scaled="scaled" in file.name, spiece=spiece)
    return source


def _stand_in(file: Any, example: ex.Example, request: pytest.FixtureRequest, tmp: Path) -> Path:
    if example.tiny == "ltx2_checkpointable":  # the all-in-one checkpoint; Gemma with NVFP4 layers, as fp4_mixed
        return _ltx2_stand_in(file, request.getfixturevalue("tiny_ltx2_checkpointable_dir"), tmp)
    if example.tiny == "flux":  # BFL's layouts: the denoiser's keys, ae.safetensors' LDM VAE
        folder = request.getfixturevalue("tiny_flux_dir")
        if file.input == "denoiser":
            request.getfixturevalue("flux_tiny_width")
            return request.getfixturevalue("bfl_flux")(file.tiny)
        if file.input == "vae":
            save_file(flux_files.ldm_vae_state_dict(folder), str(tmp / "flux-ae.safetensors"))
            return tmp / "flux-ae.safetensors"
        return comfy_files.write_component_file(folder, file.tiny, tmp / f"flux-{file.tiny}.safetensors")
    if example.tiny == "z_image":  # Comfy-Org's files: ComfyUI's names, the Qwen3 file, ae.safetensors
        return z_image_files.comfy_z_image_files(request.getfixturevalue("tiny_z_image_dir"), tmp / "z-image")[file.input]
    if example.tiny in FILE_FAMILIES:  # the transformer in its file's names, the family's text-encoder and VAE files
        fixture, transformer_state, parts = FILE_FAMILIES[example.tiny]
        folder = request.getfixturevalue(fixture)
        if file.input == "denoiser":
            out = tmp / f"{example.tiny}-{file.tiny}.safetensors"
            save_file(comfy_files.comfy_tensors(transformer_state(folder), file.tiny), str(out))
            return out
        return parts(folder, tmp / example.tiny)[file.input]
    if example.tiny != "wan":
        folder = request.getfixturevalue("tiny_wan_family")(example.tiny)
        if file.input in ("text_encoder", "vae"):
            return comfy_files.write_component_file(folder, file.tiny, tmp / f"{example.tiny}-{file.tiny}.safetensors")
        component = {"denoiser": "transformer", "denoiser_2": "transformer_2"}[file.input]
        return comfy_files.write_comfy_wan(folder, tmp / f"{example.tiny}-{component}-{file.tiny}.safetensors",
                                           file.tiny, component=component)
    if file.input != "denoiser":
        return request.getfixturevalue("wan_component_files")[file.tiny]
    if file.name.endswith(".gguf"):
        return request.getfixturevalue("wan_gguf")(file.tiny).file
    return request.getfixturevalue("comfy_wan")(file.tiny)


def _ltx2_stand_in(file: Any, folder: Path, tmp: Path) -> Path:
    from diffusers import LTX2Pipeline
    from fixtures.ltx2_files import comfy_gemma3_text_state, write_ltx2_checkpoint
    from fixtures.nvfp4_files import nvfp4_layers

    pipe = LTX2Pipeline.from_pretrained(str(folder), dtype=torch.float32)
    if file.input == "denoiser":
        return write_ltx2_checkpoint(pipe, tmp / "ltx2-checkpoint.safetensors")
    state = comfy_gemma3_text_state(pipe.text_encoder.state_dict(), tiny_gemma_spiece())
    save_file(nvfp4_layers(state, ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]),
              str(tmp / "ltx2-gemma-fp4.safetensors"))
    return tmp / "ltx2-gemma-fp4.safetensors"


FILE_FAMILIES = {  # tiny family -> (its folder's fixture, its transformer in its files' names, its other files)
    "qwen_image": ("tiny_qwen_image_dir", qwen_image_files.transformer_state, qwen_image_files.comfy_qwen_image_files),
    "qwen_image_edit": ("tiny_qwen_image_edit_dir", qwen_image_files.transformer_state,
                        qwen_image_files.comfy_qwen_image_files),
    "flux2_klein": ("tiny_flux2_klein_dir", flux2_klein_files.transformer_state,
                    flux2_klein_files.comfy_flux2_klein_files),
    "flux2_dev": ("tiny_flux2_dev_dir", flux2_klein_files.transformer_state, flux2_dev_files.comfy_flux2_dev_files),
}
SHIPPED = {"flux": "FLUX.1-schnell", "z_image": "Z-Image-Turbo", "qwen_image": "Qwen-Image",
           "qwen_image_edit": "Qwen-Image-Edit-2509", "flux2_klein": "FLUX.2-klein-4B"}  # tiny family -> carried folder naming ComfyUI's tokenizers


def carried_in_place(example: ex.Example, comfy: harness.ComfyHost, request: pytest.FixtureRequest, tmp: Path) -> str:
    """The template's config ('auto': the configs the pack carries): the example's tiny folder less
    its weights and tokenizers (as the pack's carried folders are) in their place, so that auto picks
    it for the tiny files; for Flux, FLUX.2 [klein], Z-Image and Qwen-Image, the tiny tokenizers where ComfyUI keeps its own, and
    the node pointed at that folder instead of the running ComfyUI's."""
    assert example.model == ex.sf.AUTO_CONFIG
    families = {"wan": "tiny_wan_dir", "flux": "tiny_flux_dir", "ltx2_checkpointable": "tiny_ltx2_checkpointable_dir",
                "z_image": "tiny_z_image_dir", "qwen_image": "tiny_qwen_image_dir", "flux2_klein": "tiny_flux2_klein_dir",
                "flux2_dev": "tiny_flux2_dev_dir", "qwen_image_edit": "tiny_qwen_image_edit_dir"}
    source = request.getfixturevalue(families.get(example.tiny, "tiny_wan_family"))
    folder = source if example.tiny in families else source(example.tiny)
    pack = comfy.pack_submodule("offload_core.formats.carried")
    carried = comfy_files.carried_like_copy(folder, tmp / "carried" / folder.name)
    monkeypatch = request.getfixturevalue("monkeypatch")
    if example.tiny in SHIPPED:  # tokenizers from ComfyUI's folders: the tiny ones where the carried file says
        entries = pack.by_name(SHIPPED[example.tiny]) / pack.SHIPPED
        shutil.copyfile(entries, carried / pack.SHIPPED)
        shipped = tmp / "ComfyUI" / "comfy"
        for name, entry in json.loads(entries.read_text()).items():
            shutil.copytree(folder / name, shipped / entry["comfyui"])
        monkeypatch.setattr(comfy.pack_submodule("nodes.single_file"), "comfy_package", lambda: shipped)
    monkeypatch.setattr(pack, "ROOT", carried.parent)
    return example.model


@pytest.fixture
def gguf_listed(comfy: harness.ComfyHost) -> Any:
    """.gguf denoisers listed as ComfyUI-GGUF lists them (its ``unet_gguf``: the diffusion_models
    folders, extension .gguf); ComfyUI alone lists no .gguf file. Removed afterwards."""
    table = comfy.folder_paths.folder_names_and_paths
    had = table.get("unet_gguf")
    if had is None:
        table["unet_gguf"] = (table["diffusion_models"][0], {".gguf"})
    yield
    if had is None:
        table.pop("unet_gguf", None)


def place_single_files(example: ex.Example, comfy: harness.ComfyHost, request: pytest.FixtureRequest, tmp: Path
                       ) -> tuple[str, dict[str, dict[str, Any]]]:
    """A single-file template on tiny files: the tiny configs in the place of the pack's carried ones,
    and for each file the template picks, its tiny stand-in copied into the ComfyUI folder the Note
    names; returns the config's name and the loader inputs that pick the stand-ins."""
    fp = comfy.folder_paths
    config = carried_in_place(example, comfy, request, tmp)
    if any(file.name.endswith(".gguf") for file in example.files):
        request.getfixturevalue("gguf_listed")
    picks = {}
    for file in example.files:
        source = tiny_stand_in(file, example, request, tmp)
        folder = Path(fp.models_dir) / file.folder  # ComfyUI/models/<folder>, as the Note says
        assert str(folder) in fp.get_folder_paths(file.folder), f"ComfyUI does not list {folder}"
        target = folder / f"tiny-template-{source.name}"
        shutil.copyfile(source, target)
        picks[file.input] = target.name
    return config, {ex.sf.SINGLE_FILE_LOADER: picks}


@pytest.mark.parametrize("name", NAMES)
def test_api_twin_runs_on_the_tiny_model(name: str, comfy: harness.ComfyHost, request: pytest.FixtureRequest,
                                         tmp_path: Path) -> None:
    example = ex.example(name)
    overrides = example.tiny_overrides()
    if example.files:  # single-file templates: the configs-only folder, the files in ComfyUI's folders
        model, picks = place_single_files(example, comfy, request, tmp_path)
        overrides |= picks
    else:
        folder = request.getfixturevalue(f"tiny_{example.tiny}_dir")
        model = ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), folder)
    prompt = ex.api_prompt(name, model, overrides)
    input_dir = Path(comfy.folder_paths.get_input_directory())
    for node in prompt.values():  # the keyframes an example loads: flat 64x64 pictures (FLUX.2's least)
        if node["class_type"] == "LoadImage":
            Image.new("RGB", (64, 64), (200, 30, 30)).save(input_dir / node["inputs"]["image"])

    result = comfy.run_prompt(prompt).raise_for_error()

    kinds = {node_id: node["class_type"] for node_id, node in prompt.items()}
    texts = {kinds[n]: "\n".join(out["text"]) for n, out in result.outputs.items() if "text" in out}
    assert texts["PreviewAny"] == ""  # the tiny sizes sit on every grid: nothing to note
    assert texts["DiffusersOffloadReport"].startswith(f"{example.pipeline} on cpu")
    (path,) = comfy.output_files(result, next(n for n, k in kinds.items() if k.startswith("Save")))
    if path.suffix == ".png":
        with Image.open(path) as image:
            assert image.size == (32, 32)
        return
    with av.open(str(path)) as container:
        streams = sorted(s.type for s in container.streams)
        assert streams == (["audio", "video"] if example.tiny.startswith("ltx2") else ["video"])
        frames = next(o["frames"] for node, o in overrides.items() if node in kinds.values() and "frames" in o)
        assert sum(1 for _ in container.decode(video=0)) == frames
