"""ComfyUI's native path on an image transformer (Qwen-Image, FLUX.2 [dev]), the anchor beside
``wan_bench.py --model qwenimage | flux2``: the team's ``native_bench.py`` (``../shared/reference/native_anchor``,
carried in ``.gpu/native_anchor``) run as it is on a random file of the model, its Wan-only model summary
fields (width, feed-forward, heads, text width) left empty, and a 2-D model's latent given without its
frame axis (native_bench.py makes 5-D ones).

    python bench/native_image_anchor.py --write /tmp/qwen_image.safetensors          # the file (fp8 blocks)
    python bench/native_image_anchor.py --run /tmp/qwen_image.safetensors -- --comfy-dir .gpu/comfyui \\
        --cap-gb 12 --workloads image=1x16x1x128x128 --text-len 128 --text-dim 3584 --json-out $OUT/native.jsonl

``--write`` builds the carried config's transformer with random weights (seed 0) and saves it in the
key names ComfyUI's files hold (Qwen-Image: diffusers'; FLUX.2: BFL's, as the test fixtures write
them), the blocks' matrices as plain fp8 (what ComfyUI's ``weight_dtype`` fp8_e4m3fn holds them as),
the rest bf16; ``--layers`` fewer blocks for a CPU check (with ``--cpu`` after ``--``). FLUX.2 [dev]:
``--workloads image=1x128x1x64x64 --text-len 512 --text-dim 15360``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WAN_ONLY = ("dim", "ffn_dim", "num_heads", "num_layers", "text_dim", "model_type")


def write(path: Path, model_name: str, layers: int | None, device: str) -> None:
    import torch
    from benchkit import fixtures, pack
    from benchkit.image_models import build_flux2, build_qwenimage
    from safetensors.torch import save_file

    pack()
    if model_name == "flux2":
        fixtures()
        from fixtures.family_files import bfl_flux2_state

        model, blocks = build_flux2(device, layers=layers), ("transformer_blocks.", "single_transformer_blocks.")
    else:
        model, blocks = build_qwenimage(device, layers=layers), ("transformer_blocks.",)
    with torch.no_grad():  # cast in place, one tensor at a time: [dev] in bf16 and fp8 at once fits no card
        for name, p in model.named_parameters():
            fp8 = name.startswith(blocks) and name.endswith(".weight") and p.ndim == 2
            p.data = p.data.to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    state = {name: t.cpu().contiguous() for name, t in model.state_dict().items()}
    del model
    if model_name == "flux2":
        state = bfl_flux2_state(state)  # (renames and concatenations: contiguous)
    save_file(state, str(path))
    print(f"wrote {path}: {len(state)} tensors, {sum(t.nbytes for t in state.values()) / 2**30:.2f} GiB")


def run(path: Path, argv: list[str], anchor: Path) -> None:
    """native_bench.py's main on ``path``, the Wan-only fields given None once ComfyUI is up."""
    sys.path.insert(0, str(anchor))
    import native_bench

    startup = native_bench.comfy_startup

    def comfy_startup(args):
        out = startup(args)
        import comfy.sample
        import comfy.sd

        load = comfy.sd.load_diffusion_model

        def load_diffusion_model(*a, **kw):
            patcher = load(*a, **kw)
            model = patcher.model.diffusion_model
            for name in WAN_ONLY:
                if not hasattr(model, name):
                    setattr(model, name, None)
            return patcher

        comfy.sd.load_diffusion_model = load_diffusion_model
        fix = comfy.sample.fix_empty_latent_channels

        def fix_empty_latent_channels(model, latent, *a, **kw):
            out = fix(model, latent, *a, **kw)
            flat = model.get_model_object("latent_format").latent_dimensions == 2 and out.ndim == 5
            return out.squeeze(2) if flat else out

        comfy.sample.fix_empty_latent_channels = fix_empty_latent_channels
        return out

    native_bench.comfy_startup = comfy_startup
    sys.argv = ["native_bench.py", "--model", str(path), *argv]
    sys.exit(native_bench.main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", type=Path, help="write the random model file here")
    ap.add_argument("--model", choices=("qwenimage", "flux2"), default="qwenimage", help="for --write")
    ap.add_argument("--run", type=Path, help="run native_bench.py on this file (its flags after --)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first blocks (a CPU check)")
    ap.add_argument("--device", default="cuda", help="where the model is built for --write")
    ap.add_argument("--anchor", type=Path, default=HERE.parent / ".gpu" / "native_anchor")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # native_bench.py's own flags after "--"
    args = ap.parse_args(argv[:cut])
    if args.write:
        write(args.write, args.model, args.layers, args.device)
    if args.run:
        run(args.run, argv[cut + 1:], args.anchor)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
