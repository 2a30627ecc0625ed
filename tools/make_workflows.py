"""Regenerate ``example_workflows/``: the UI workflows from their API twins and the live schemas,
the keyframes the templates load, and the thumbnails ComfyUI's template browser shows.

Why: the API twin is the one authored file per example (the tests and the demo run it); the UI
JSON users drag in must show the same nodes, links and values, in the widget order that the
node schemas of a real ComfyUI give, plus a Note naming the model to download. ComfyUI lists
every ``example_workflows/*.json`` as a template titled by its file stem and shows
``<stem>.jpg`` beside it. Run after changing a twin, a node's inputs or an example's model:

    .venv/bin/python tools/make_workflows.py [NAME ...]   # NAME: only those examples (no keyframes)

``tests/comfy/test_workflows.py`` fails when a UI file and its twin have drifted apart, and
``tests/comfy/test_templates.py`` when a template lacks its Note, thumbnail or inputs.
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import offload_examples as ex

THUMB_SIZE = (512, 512)
BACKGROUND, PANEL, TEXT, MUTED, ACCENT = "#17191f", "#262a33", "#f2f2f2", "#a7adba", "#6fa8dc"
CHAIN = (ex.SETTINGS, "DiffusersOffloadLoadPipeline", "DiffusersOffloadLoadModularPipeline", ex.sf.SINGLE_FILE_LOADER,
         *ex.GENERATE, "SaveImage", "SaveVideo")


def thumbnail(example: ex.Example, api: dict[str, Any], schemas: dict[str, dict[str, Any]]) -> Any:
    """The card the template browser shows: title, model, the template's chain, its keyframes."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", THUMB_SIZE, BACKGROUND)
    draw = ImageDraw.Draw(image)
    big, small = ImageFont.load_default(size=32), ImageFont.load_default(size=20)
    y = 28
    for line in textwrap.wrap(example.title, 27):
        draw.text((28, y), line, font=big, fill=TEXT)
        y += 38
    draw.text((28, y + 2), example.files[0].name if example.files else example.repo, font=small, fill=MUTED)
    y += 42

    keyframes = [node["inputs"]["image"] for node in api.values() if node["class_type"] == "LoadImage"]
    if keyframes:  # the two shipped frames, first then last
        for i, name in enumerate(keyframes):
            frame = Image.open(ex.INPUT_DIR / name).convert("RGB").resize((210, 120))
            image.paste(frame, (28 + i * 246, y))
        y += 136

    kinds = [node["class_type"] for node in api.values()]
    chain = [schemas[kind]["display_name"] for kind in CHAIN if kind in kinds]
    box_h = min(52, (THUMB_SIZE[1] - 56 - y) // len(chain) - 12)
    for i, name in enumerate(chain):
        top = y + i * (box_h + 12)
        draw.rounded_rectangle((28, top, THUMB_SIZE[0] - 28, top + box_h), radius=10, fill=PANEL)
        draw.text((46, top + box_h / 2), name, font=small, fill=TEXT, anchor="lm")
        if i:
            draw.polygon([(250, top - 10), (262, top - 10), (256, top - 2)], fill=ACCENT)
    draw.text((28, THUMB_SIZE[1] - 36), "Diffusers Offload", font=small, fill=ACCENT)
    return image


def main(names: list[str]) -> int:
    sys.path.append(str(ex.ROOT / "tests"))  # appended: ComfyUI's own folder must lead sys.path
    from comfyhost import harness

    examples = [ex.example(name) for name in names] or list(ex.EXAMPLES)
    if not names:
        for path in ex.write_keyframes():
            print(f"wrote {path.relative_to(ex.ROOT)}")
    with tempfile.TemporaryDirectory() as base:
        host = harness.setup(Path(base))
        for example in examples:
            api = ex.api_prompt(example.name, ex.MODEL_PLACEHOLDER)
            schemas = {node["class_type"]: ex.object_info(host, node["class_type"]) for node in api.values()}
            path = ex.write_ui(example.name, ex.ui_workflow(api, schemas, example))
            print(f"wrote {path.relative_to(ex.ROOT)}")
            thumb = ex.EXAMPLES_DIR / f"{example.name}.jpg"
            thumbnail(example, api, schemas).save(thumb, quality=88, optimize=True)
            print(f"wrote {thumb.relative_to(ex.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
