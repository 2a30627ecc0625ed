"""Regenerate the UI workflows in ``example_workflows/`` from their API twins and the live schemas.

Why: the API twin is the one authored file per example (the tests and the demo run it); the UI
JSON users drag in must show the same nodes, links and values, in the widget order that the
node schemas of a real ComfyUI give. Run after changing a twin or a node's inputs:

    .venv/bin/python tools/make_workflows.py

``tests/comfy/test_workflows.py`` fails when a UI file and its twin have drifted apart.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import offload_examples as ex


def main() -> int:
    sys.path.append(str(ex.ROOT / "tests"))  # appended: ComfyUI's own folder must lead sys.path
    from comfyhost import harness

    with tempfile.TemporaryDirectory() as base:
        host = harness.setup(Path(base))
        for example in ex.EXAMPLES:
            api = ex.api_prompt(example.name, ex.MODEL_PLACEHOLDER)
            schemas = {node["class_type"]: ex.object_info(host, node["class_type"]) for node in api.values()}
            path = ex.write_ui(example.name, ex.ui_workflow(api, schemas, example.model))
            print(f"wrote {path.relative_to(ex.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
