"""The other engines wan_bench.py times beside ours, in the same process: diffusers' group
offloading (block_level and leaf_level, with streams) and mmgp 3.8.2 (WanGP's engine).

``run(m, feeds, warmup, repeats)`` is the bench's timed forward and ``row`` its JSON rows.
"""

from __future__ import annotations

import gc
import time

import psutil
import torch

from . import GiB
from .measure import Ballast, cuda_used, peak_alloc_gib, rel_err
from .models import blocks_of, nbytes

DIFFUSERS_GROUP_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def strip_group_offloading(m: torch.nn.Module) -> None:
    """Remove diffusers' group-offloading hooks (diffusers 0.42.1 has no public remove)."""
    for module in m.modules():
        registry = module.__dict__.get("_diffusers_hook")
        if registry is None:
            continue
        for name in DIFFUSERS_GROUP_HOOKS:
            registry.remove_hook(name, recurse=False)
        if not registry.hooks:
            del module._diffusers_hook
            module.__dict__.pop("forward", None)


def section_anchors(m, refs, feeds, args, run, row, device: str) -> None:
    from diffusers.hooks import apply_group_offloading

    for kind in ("block_level", "leaf_level"):
        kw = {"num_blocks_per_group": 1} if kind == "block_level" else {}
        t0 = time.perf_counter()
        apply_group_offloading(m, onload_device=torch.device(device), offload_device=torch.device("cpu"),
                               offload_type=kind, use_stream=device == "cuda", **kw)
        apply_s = time.perf_counter() - t0
        for w in feeds:
            med, runs, out = run(m, feeds[w], args.warmup, args.repeats)
            row(section="anchor", mode=f"diffusers {kind}+stream", workload=w, median_s=med, runs=runs,
                rel_err=rel_err(out, refs[w]), peak_alloc_gib=peak_alloc_gib(),
                rss_gib=psutil.Process().memory_info().rss / GiB, place_s=apply_s)
        strip_group_offloading(m)
        gc.collect()
        if cuda_used():
            torch._C._host_emptyCache()
            torch.cuda.empty_cache()


def section_mmgp(m, refs, feeds, args, cap: float | None, run, row) -> None:
    """mmgp 3.8.2 as WanGP runs it: pinned, async transfers, no quantization, fp32 modules kept
    fp32 (as ours), ``--mmgp-kept`` blocks preloaded. Its budget (MiB) buys blocks as
    ``int((budget - non-block - 2 * block) / block)`` (``offload.tune_preloading``), so the budget
    for K blocks is asked with one MiB to spare, and the row reports the count mmgp actually kept.
    Last in the process: mmgp moves the weights into its own pinned chunks and leaves them there."""
    from mmgp import offload

    # As WanGP declares mixed precision to mmgp (which asserts one dtype otherwise): the model's
    # dtype, and the modules kept in fp32 locked to it.
    m._model_dtype = torch.bfloat16
    for sub in m.modules():
        if any(p.dtype == torch.float32 for p in sub.parameters(recurse=False)):
            sub._lock_dtype = torch.float32
    blocks = blocks_of(m)
    block = max(nbytes(b) for b in blocks)
    budget_mib = (nbytes(m) - sum(nbytes(b) for b in blocks) + (args.mmgp_kept + 2) * block) / 2**20 + 1
    ballast = Ballast(cap)
    try:
        t0 = time.perf_counter()
        mm = offload.all({"transformer": m}, pinnedMemory=True, quantizeTransformer=False, asyncTransfers=True,
                         budgets={"transformer": budget_mib}, convertWeightsFloatTo=None, verboseLevel=1)
        place_s = time.perf_counter() - t0
        kept = len(mm.preloaded_blocks_per_model["transformer"])
        for w in feeds:
            try:
                med, runs, out = run(m, feeds[w], args.warmup, args.repeats)
                row(section="mmgp", cap_gib=cap, workload=w, median_s=med, runs=runs, rel_err=rel_err(out, refs[w]),
                    kept=kept, asked=args.mmgp_kept, budget_mib=budget_mib, place_s=place_s,
                    peak_alloc_gib=torch.cuda.max_memory_allocated() / GiB,
                    peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
                    rss_gib=psutil.Process().memory_info().rss / GiB)
                del out
            except torch.OutOfMemoryError as e:
                row(section="mmgp", cap_gib=cap, workload=w, kept=kept, error=f"OOM: {str(e)[:100]}")
                gc.collect()
                torch.cuda.empty_cache()
        mm.release()
    finally:
        ballast.close()
