"""GPU check of the staging path (issue 21.2, 24.7): on CUDA, a streamed Wan transformer placed
pinned, partly pinned (50 %), staged (pin_memory off) and with no side stream gives mode none's
output bit for bit, and the step time of each; a released leaf placement with streams leaves no
pinned memory in PyTorch's host cache.

    python3 bench/staging_check.py [--width 1536 --layers 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("diffusers_offload", ROOT / "__init__.py",
                                              submodule_search_locations=[str(ROOT)])
pack = importlib.util.module_from_spec(spec)
sys.modules["diffusers_offload"] = pack
spec.loader.exec_module(pack)

from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.memory import MemoryReader  # noqa: E402


class Free(MemoryReader):
    def __init__(self, available: int) -> None:
        self.available = available

    def host_available(self) -> int:
        return self.available


def build(width: int, layers: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    heads = width // 128
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128,
                                  in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=width * 4,
                                  num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads")
    model = model.to(torch.bfloat16).eval()
    feeds = {"hidden_states": torch.randn(1, 16, 5, 60, 104, dtype=torch.bfloat16, device="cuda"),
             "encoder_hidden_states": torch.randn(1, 512, 4096, dtype=torch.bfloat16, device="cuda"),
             "timestep": torch.full((1,), 500.0, device="cuda"), "return_dict": False}
    return model, feeds


def timed(model, feeds, steps: int = 3):
    with torch.inference_mode():
        out = model(**feeds)[0]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            model(**feeds)
        torch.cuda.synchronize()
    return out, (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    model, feeds = build(args.width, args.layers)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model {nbytes / 2**30:.2f} GiB, {args.layers} blocks")
    bag = Components(transformer=model)
    base = OffloadConfig(preload="off", resident_floor_mb=0, device="cuda")
    engine = Engine()
    engine.place(bag, base.replace(mode="none"))
    ref, t_none = timed(model, feeds)
    engine.release(bag)
    rows = [("none (resident)", t_none, True, "-")]
    cases = [("pinned", base, None), ("partly pinned 50%", base, 0.5), ("staged (pin_memory off)",
             base.replace(pin_memory=False), None), ("no side stream", base.replace(use_stream=False), None)]
    for name, config, share in cases:
        engine = Engine(memory=Free(int(nbytes * share) + config.pin_reserve_bytes)) if share else Engine()
        engine.place(bag, config)
        streamer = engine.states(bag)["transformer"].transport
        out, step = timed(model, feeds)
        details = streamer.details()
        rows.append((name, step, torch.equal(out, ref),
                     f"pinned blocks {details['pinned_blocks']}/{details['blocks']}, staged {details.get('staged', 0)}, "
                     f"sync loads {details['sync_loads']}"))
        engine.release(bag)
    for name, step, same, note in rows:
        print(f"{name:<26} step {step * 1000:8.1f} ms  bit-exact {same}  {note}")
    leaf_release(model)


def leaf_release(model) -> None:
    """A leaf placement with streams, released: the module back in pageable memory, the host cache empty."""
    bag = Components(text_encoder=model)
    rss = psutil.Process().memory_info().rss
    engine = Engine()
    engine.place(bag, OffloadConfig(mode="leaf", resident_floor_mb=0, device="cuda"))
    streams = engine.states(bag)["text_encoder"].transport.ctx.streams
    pinned_during = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_pinned())
    engine.release(bag)
    pinned_after = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_pinned())
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    held = stats.get("reserved_bytes.current", stats.get("segment.current", "n/a"))
    print(f"leaf with streams={streams}: pinned params during {pinned_during / 2**30:.2f} GiB, after release "
          f"{pinned_after / 2**30:.2f} GiB; host cache reserved after release: {held}; "
          f"RSS change {(psutil.Process().memory_info().rss - rss) / 2**30:+.2f} GiB")


if __name__ == "__main__":
    main()
