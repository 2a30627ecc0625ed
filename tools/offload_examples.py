"""The shipped example workflows: their API twins, the UI JSON made from them, and model folders.

Why one module: the demo, the workflow generator and the tests must agree on what an example
is (which twin, which model placeholder, which tiny-model overrides) and on how ComfyUI describes
a node (``/object_info``). It imports nothing from ComfyUI; callers hand it a running host.

An example is authored once, as its API twin (``example_workflows/api/<name>.json``, what
``POST /prompt`` takes, with :data:`MODEL_PLACEHOLDER` for the model folder); the UI JSON users
drag in (``example_workflows/<name>.json``) is generated from it and the live node schemas, with a
Note naming the model to download. ComfyUI offers every ``example_workflows/*.json`` as a template
titled by its file stem, with ``<stem>.jpg`` beside it as the thumbnail; the files a template loads
(keyframes) are shipped in ``example_workflows/input/``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import single_file_examples as sf
from example_catalog import (  # noqa: F401  (re-exported: the examples and their sizes)
    EXAMPLES,
    GENERATE,
    MODELS_DIR,
    SETTINGS,
    TINY_OVERRIDES,
    TINY_SIZES,
    Example,
    example,
    example_for_model,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = ROOT / "example_workflows"
API_DIR = EXAMPLES_DIR / "api"
MODEL_PLACEHOLDER = "${MODEL}"
LOADER = "DiffusersOffloadLoadPipeline"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COMFY_DYNAMICCOMBO_V3"}
CONTROL_VALUES = ("fixed", "increment", "decrement", "randomize")
PACK_ID = "diffusers-offload"  # pyproject [project].name: the registry id a workflow's cnr_id names
INPUT_DIR = EXAMPLES_DIR / "input"  # what the templates load; the pack copies it into ComfyUI's input folder
UI_ONLY = ("Note", "MarkdownNote")  # frontend-only nodes: never queued, no backend schema


# ------------------------------------------------------------------------------------ API twins


def api_prompt(
    name: str, model: str, overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """The API twin of ``name`` for the model folder ``model``; ``overrides`` maps a node class to
    input values (only inputs the twin's node has are changed), e.g. ``Example.tiny_overrides()``."""
    flat = [key for key, value in (overrides or {}).items() if not isinstance(value, Mapping)]
    if flat:
        raise TypeError(f"overrides map a node class to its inputs ({{class: {{input: value}}}}); got {flat}")
    prompt = json.loads((API_DIR / f"{name}.json").read_text(encoding="utf-8"))
    for node in prompt.values():
        inputs = node["inputs"]
        for key, value in inputs.items():
            if value == MODEL_PLACEHOLDER:
                inputs[key] = model
        changes = (overrides or {}).get(node["class_type"], {})
        inputs.update({k: v for k, v in changes.items() if k in inputs})
    return prompt


def link_model(models_dir: Path, folder: Path) -> str:
    """Make ``folder`` listed by the loader: a link named after it in ``models/diffusers``."""
    folder = Path(folder).resolve()
    link = Path(models_dir) / folder.name
    if link.is_symlink() and link.resolve() != folder:
        link.unlink()  # a stale link from an earlier run with another folder of that name
    if not link.exists():
        link.symlink_to(folder, target_is_directory=True)
    elif link.resolve() != folder:
        raise FileExistsError(f"{link} exists and is not a link to {folder}")
    return folder.name


# ---------------------------------------------------------------------------------- node schemas


def object_info(host: Any, node_type: str) -> dict[str, Any]:
    """What ``GET /object_info/<node_type>`` answers, from the host's own route (no socket)."""
    handler = next(
        r.handler for r in host.server.routes
        if getattr(r, "method", "") == "GET" and getattr(r, "path", "") == "/object_info/{node_class}"
    )
    request = SimpleNamespace(match_info={"node_class": node_type})
    response = host.loop.run_until_complete(handler(request))
    info = json.loads(response.body)
    if node_type not in info:
        raise KeyError(f"ComfyUI has no node {node_type!r}")
    return info[node_type]


def schema_inputs(info: dict[str, Any]) -> Iterator[tuple[str, Any, dict[str, Any], bool]]:
    """(name, type, options, optional) of every visible input, in the order the UI shows them."""
    for section in ("required", "optional"):
        specs = info["input"].get(section, {})
        for name in info.get("input_order", {}).get(section, list(specs)):
            spec = specs[name]
            yield name, spec[0], (spec[1] if len(spec) > 1 else {}), section == "optional"


def is_widget(kind: Any, options: dict[str, Any]) -> bool:
    return (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput")


# ----------------------------------------------------------------------------------- UI JSON


def ui_workflow(api: dict[str, Any], schemas: dict[str, dict[str, Any]], shown: Example) -> dict[str, Any]:
    """The UI workflow (nodes, links, widgets_values) a frontend would save for ``api``, with a
    Note on top naming the model (the lowest id the twin leaves free, so ids stay dense)."""
    depth = _depths(api)
    links: list[list[Any]] = []
    nodes = {
        node_id: _ui_node(node_id, node, schemas[node["class_type"]], shown.model) for node_id, node in api.items()
    }
    for node_id, node in api.items():
        for slot, entry in enumerate(nodes[node_id]["inputs"]):
            source = node["inputs"].get(entry["name"])
            if _is_link(source):
                origin = nodes[source[0]]["outputs"][source[1]]
                link_id = len(links) + 1
                links.append([link_id, int(source[0]), source[1], int(node_id), slot, origin["type"]])
                entry["link"] = link_id
                origin["links"].append(link_id)
    free_id = min(set(range(1, len(api) + 2)) - {int(n) for n in api})
    note = _note_node(free_id, note_text(shown, api), order=len(api))
    _layout(nodes, depth, top=note["pos"][1] + note["size"][1] + 60)
    nodes[str(note["id"])] = note
    return {
        "last_node_id": max(int(n) for n in nodes),
        "last_link_id": len(links),
        "nodes": [nodes[n] for n in sorted(nodes, key=int)],
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 1.0, "offset": [0, 0]}},
        "version": 0.4,
    }


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _ui_node(node_id: str, node: dict[str, Any], info: dict[str, Any], model: str) -> dict[str, Any]:
    sockets, widgets, values = [], [], []
    for name, kind, options, optional in schema_inputs(info):
        value = node["inputs"].get(name, options.get("default"))
        entry = {"localized_name": name, "name": name, "type": "COMBO" if isinstance(kind, list) else kind, "link": None}
        if optional:
            entry["shape"] = 7
        if not is_widget(kind, options):
            sockets.append(entry)
            continue
        widgets.append({**entry, "widget": {"name": name}})
        values.append(model if value == MODEL_PLACEHOLDER else value)
        if options.get("control_after_generate"):
            values.append("fixed")  # examples reproduce; users switch to randomize
    outputs = [
        {"localized_name": name, "name": name, "type": kind, "links": [], "slot_index": slot}
        for slot, (name, kind) in enumerate(zip(info["output_name"], info["output"], strict=True))
    ]
    core = info.get("python_module", "").startswith(("nodes", "comfy_extras"))
    return {
        "id": int(node_id),
        "type": node["class_type"],
        "pos": [0, 0],
        "size": [380, _height(info, len(values), max(len(sockets), len(outputs)))],
        "flags": {},
        "order": 0,
        "mode": 0,
        "inputs": sockets + widgets,
        "outputs": outputs,
        "properties": {"Node name for S&R": node["class_type"], "cnr_id": "comfy-core" if core else PACK_ID},
        "widgets_values": values,
    }


def _height(info: dict[str, Any], widgets: int, sockets: int) -> int:
    """Room for every widget (multiline text boxes are taller) and for the picture an output node or
    an image loader shows under them."""
    multiline = sum(1 for _, _, options, _ in schema_inputs(info) if options.get("multiline"))
    shows_image = info.get("output_node") or any(o.get("image_upload") for _, _, o, _ in schema_inputs(info))
    preview = 240 if shows_image else 0
    return 46 + 22 * sockets + 26 * widgets + 70 * multiline + preview


def _depths(api: dict[str, Any]) -> dict[str, int]:
    """Column of each node: one right of its deepest source; a node with no source sits just left
    of its first consumer (keyframe loaders beside the loader, next to what they feed)."""
    depth: dict[str, int] = {}

    def visit(node_id: str) -> int:
        if node_id not in depth:
            sources = [v[0] for v in api[node_id]["inputs"].values() if _is_link(v)]
            depth[node_id] = 1 + max((visit(s) for s in sources), default=-1)
        return depth[node_id]

    for node_id in api:
        visit(node_id)
    for node_id, node in api.items():
        if not any(_is_link(v) for v in node["inputs"].values()):
            consumers = [depth[c] for c, n in api.items() if any(_is_link(v) and v[0] == node_id for v in n["inputs"].values())]
            depth[node_id] = min(consumers, default=1) - 1
    return depth


def _layout(nodes: dict[str, dict[str, Any]], depth: dict[str, int], top: int) -> None:
    """Columns by depth from ``top`` down; ``order`` topological (what the frontend would save)."""
    tops: dict[int, int] = {}
    for order, node_id in enumerate(sorted(nodes, key=lambda n: (depth[n], int(n)))):
        node = nodes[node_id]
        column = depth[node_id]
        y = tops.get(column, top)
        node.update(pos=[100 + 440 * column, y], order=order)
        tops[column] = y + node["size"][1] + 60


# ------------------------------------------------------------------------------- the model Note


def note_text(shown: Example, api: dict[str, Any]) -> str:
    """What the template's Note says: the model it needs, the command that fetches it, where it goes."""
    if shown.files:
        return sf.note_text(shown)
    lines = [
        shown.title,
        "",
        f"Needs the diffusers-format model {shown.repo}",
        f"(https://huggingface.co/{shown.repo}) in a folder named {shown.model} under {MODELS_DIR}/.",
    ]
    if shown.gated:
        lines.append("The repository is gated: accept its licence on that page and run `hf auth login` first.")
    lines += ["", "Download it, from the folder that holds ComfyUI/:", shown.download_command()]
    if shown.skip:
        lines.append(f"(--exclude leaves out {shown.skip_what}, which this template does not load.)")
    lines += [
        "With huggingface_hub older than 1.0 the command is `huggingface-cli download`, same arguments.",
        "",
        "A folder elsewhere works too when extra_model_paths.yaml adds it under `diffusers`. Refresh the",
        f"page (R) and pick {shown.model} in the loader's model list.",
    ]
    images = [node["inputs"]["image"] for node in api.values() if node["class_type"] == "LoadImage"]
    if images:
        lines += ["", "The Load Image nodes start on sample keyframes that the pack copies into ComfyUI/input:",
                  *images, "Load your own first and last frames there."]
    return "\n".join(lines)


def _note_node(node_id: int, text: str, order: int) -> dict[str, Any]:
    width, height = 860, 40 + 14 * (text.count("\n") + 1)
    return {
        "id": node_id,
        "type": "Note",
        "pos": [100, 40],
        "size": [width, height],
        "flags": {},
        "order": order,  # a virtual node: never executed, placed after the graph
        "mode": 0,
        "inputs": [],
        "outputs": [],
        "properties": {},
        "widgets_values": [text],
        "color": "#432",
        "bgcolor": "#653",
    }


# ----------------------------------------------------------------------------- shipped inputs

from keyframes import KEYFRAME_SIZE, KEYFRAMES, keyframe  # noqa: E402, F401  (re-exported: the tests read them here)


def write_keyframes() -> list[Path]:
    INPUT_DIR.mkdir(exist_ok=True)
    paths = []
    for name, kind in KEYFRAMES.items():
        keyframe(kind).save(INPUT_DIR / name, optimize=True)
        paths.append(INPUT_DIR / name)
    return paths


def write_ui(name: str, workflow: dict[str, Any]) -> Path:
    path = EXAMPLES_DIR / f"{name}.json"
    path.write_text(json.dumps(workflow, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
