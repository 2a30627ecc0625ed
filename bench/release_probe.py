"""What a release leaves allocated on the device before any garbage collection, and who holds it.

Why: in the ComfyUI row (single_file_node.py) a native model loaded after ours found ~10 GiB still
allocated after our release (ComfyUI's unload passes collect off; a later gc freed it). This places
the Wan-14B geometry (4 blocks) with every block kept, runs a forward, releases without collecting,
and names the referrers of every CUDA tensor still alive.

    python3 bench/release_probe.py          # GPU, ~1 min
"""

from __future__ import annotations

import gc
import inspect

import torch
from benchkit import pack
from benchkit.models import build_wan, wan_forward, wan_inputs

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402


def holders(obj: object, skip: list) -> list[str]:
    """Who refers to ``obj``: each referrer's type; a dict also by its keys and the object whose
    ``__dict__`` it is; a tuple or list by the types that hold it (one level further)."""
    out = []
    for r in gc.get_referrers(obj):
        if r is skip or inspect.isframe(r):
            continue
        if isinstance(r, dict):
            owners = [type(x).__name__ for x in gc.get_referrers(r) if getattr(x, "__dict__", None) is r]
            keys = [str(k) for k, v in r.items() if v is obj][:3]
            out.append(f"dict{keys} of {owners or '?'}")
        elif isinstance(r, (tuple, list)):
            up = [type(x).__name__ for x in gc.get_referrers(r) if x is not skip and not inspect.isframe(x)][:4]
            out.append(f"{type(r).__name__} held by {up}")
        else:
            out.append(type(r).__name__)
    return out[:8]


def main() -> None:
    for kind, store in (("bf16", None), ("fp8", torch.float8_e4m3fn)):
        m = build_wan(4, device="cpu")
        if store is not None:
            for layer in m.blocks.modules():
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.data = layer.weight.data.to(store)
        feeds = wan_inputs("small", 1, device="cuda")
        eng, bag = Engine(), Components(transformer=m)
        base = torch.cuda.memory_allocated()
        eng.place(bag, OffloadConfig(preload="100"))
        try:
            wan_forward(m, *feeds)
        except Exception as exc:  # the probe is about the release
            print(f"   forward failed: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        eng.release(bag, collect=False)
        left = torch.cuda.memory_allocated() - base
        print(f"== {kind}: placed {held / 2**30:.2f} GiB, left after release without gc {left / 2**30:.2f} GiB",
              flush=True)
        alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda and o.numel() > 2**20]
        print(f"   {len(alive)} large CUDA tensors alive", flush=True)
        for t in alive[:3]:
            print("  ", tuple(t.shape), t.dtype, *holders(t, alive), sep="\n     ", flush=True)
        gc.collect()
        print(f"   after gc.collect: {(torch.cuda.memory_allocated() - base) / 2**30:.2f} GiB", flush=True)
        del m, eng, bag, alive
        gc.collect()


if __name__ == "__main__":
    main()
