"""Headless demo: a shipped example workflow through a real ComfyUI, in this process.

Why: shows the pack end to end on any machine, without a GPU, a browser or a download. Without
``--model`` it builds a tiny random-weight model; it then runs the example's API twin through
ComfyUI's own validation and executor (the in-process host the tests use), copies what the output
nodes saved to ``out/`` and prints the notes and the placement report.

    make demo                                  # tiny LTX-2: video with audio, a few seconds
    make demo MODEL=/models/Wan2.1-T2V-1.3B-Diffusers ARGS="--set steps=4 --set frames=17"
    .venv/bin/python tools/demo.py --example flux_text_to_image
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import offload_examples as ex
from PIL import Image

OUT = ex.ROOT / "out"
BASE = ex.ROOT / ".comfy_base"
TINY_DIR = ex.ROOT / ".tiny_models"
DEFAULT_EXAMPLE = "ltx2_text_to_video"
TITLES = {"PreviewAny": "notes (what the Generate node snapped or ignored)", "DiffusersOffloadReport": "placement report"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run an example workflow through an in-process ComfyUI.")
    parser.add_argument("--model", type=Path, help="a diffusers pipeline folder; default: build a tiny one")
    parser.add_argument(
        "--example", choices=[e.name for e in ex.EXAMPLES],
        help=f"example workflow; default: the one for --model's pipeline class, else {DEFAULT_EXAMPLE}",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="INPUT=VALUE",
        help="override an input of the Generate node, e.g. --set steps=4 (JSON values)",
    )
    return parser.parse_args(argv)


def overrides(example: ex.Example, pairs: list[str], tiny: bool) -> dict[str, dict[str, Any]]:
    """Inputs to change per node class: the tiny-model ones, then ``--set`` (Generate nodes)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set wants INPUT=VALUE, got {pair!r}")
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError:
            values[key] = raw
    return example.tiny_overrides(**values) if tiny else dict.fromkeys(ex.GENERATE, values)


def model_folder(args: argparse.Namespace) -> tuple[ex.Example, Path]:
    """The example to run and its model folder (a tiny one is built when none was given)."""
    if args.model is not None:
        folder = args.model.expanduser().resolve()
        indexes = ("model_index.json", "modular_model_index.json")
        if not folder.is_dir() or not any((folder / i).is_file() for i in indexes):  # before anything is linked
            what = "does not exist" if not folder.exists() else "is not a diffusers pipeline folder"
            raise SystemExit(f"--model {args.model}: {folder} {what}; give the path of a diffusers pipeline "
                             f"folder (the one holding {' or '.join(indexes)})")
        try:
            return (ex.example(args.example) if args.example else ex.example_for_model(folder)), folder
        except ValueError as exc:
            raise SystemExit(f"--model {args.model}: {exc}") from None
    from fixtures.tiny_h3_ref import build_tiny_h3_ref
    from fixtures.tiny_models import BUILDERS, FOLDER_NAMES

    example = ex.example(args.example or DEFAULT_EXAMPLE)
    if example.files:
        raise SystemExit(f"--example {example.name}: the demo builds diffusers folders only; open this template "
                         "in ComfyUI (its Note lists the single files and where they go)")
    builders = {**BUILDERS, "h3_ref": build_tiny_h3_ref}
    names = {**FOLDER_NAMES, "h3_ref": "tiny-minimax-h3-ref"}
    folder = builders[example.tiny](TINY_DIR / names[example.tiny])
    print(f"built tiny {example.pipeline} in {folder.relative_to(ex.ROOT)}")
    return example, folder


def drop_dangling_links(models: Path) -> None:
    """Links in the demo's own models/diffusers whose folder is gone (an earlier run's model)."""
    for link in models.iterdir():
        if link.is_symlink() and not link.exists():
            target = link.readlink()
            link.unlink()
            print(f"removed {link}: it pointed at {target}, which does not exist")


def placeholder_keyframes(host: Any, prompt: dict[str, Any]) -> None:
    """Flat pictures for LoadImage nodes whose file is missing (first/last-frame examples)."""
    folder = Path(host.folder_paths.get_input_directory())
    for node in prompt.values():
        path = folder / node["inputs"]["image"] if node["class_type"] == "LoadImage" else None
        if path is not None and not path.is_file():
            Image.new("RGB", (64, 64), (200, 30, 30) if "first" in path.name else (30, 30, 200)).save(path)
            print(f"made a placeholder keyframe {path} (put your own picture there)")


def collect(host: Any, result: Any) -> list[Path]:
    """Copy the files the output nodes saved into ``out/``."""
    OUT.mkdir(exist_ok=True)
    copied = []
    for path in host.output_files(result):
        target = OUT / path.name
        shutil.copyfile(path, target)
        copied.append(target)
    return copied


def show(host: Any, result: Any, prompt: dict[str, Any]) -> None:
    """Print what the output nodes show as text (notes, placement report) and the files written."""
    for node_id, ui in sorted(result.outputs.items()):
        if "text" in ui:
            title = TITLES.get(prompt[node_id]["class_type"], prompt[node_id]["class_type"])
            print(f"\n--- {title} ---\n{chr(10).join(ui['text']) or '(none)'}")
    print()
    for path in collect(host, result):
        print(f"wrote {path.relative_to(ex.ROOT)} ({path.stat().st_size} bytes)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.path.append(str(ex.ROOT / "tests"))  # appended: ComfyUI's own folder must lead sys.path
    from comfyhost import harness

    example, folder = model_folder(args)
    if args.model is None:
        import torch

        torch.set_num_threads(1)  # tiny ops gain nothing from threads
    host = harness.setup(BASE)
    models = Path(host.folder_paths.get_folder_paths("diffusers")[0])
    drop_dangling_links(models)
    model = ex.link_model(models, folder)
    prompt = ex.api_prompt(example.name, model, overrides(example, args.set, tiny=args.model is None))
    placeholder_keyframes(host, prompt)
    print(f"running {example.name} on {model} (ComfyUI {host.version}, {host.model_management.get_torch_device()})")
    try:
        result = host.run_prompt(prompt).raise_for_error()
    except (harness.PromptValidationError, harness.PromptExecutionError) as exc:
        print(f"the workflow failed: {exc}", file=sys.stderr)
        return 1
    show(host, result, prompt)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
