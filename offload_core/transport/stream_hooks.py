"""The block streamer's hooks: on the denoiser, on each block, on each part of a block streamed
in parts. Each calls back into the streamer; an allocation that fails inside a forward is
retried while the streamer's listeners (the planner) can give something up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from diffusers.hooks import ModelHook

from .base import MarkerHook
from .blocks import StreamBlock, StreamUnit
from .graphs import CallGraph


class Streamer(Protocol):
    """What the hooks call: the block streamer's per-forward path."""

    device: torch.device

    def begin_forward(self, args: tuple, kwargs: dict) -> None: ...

    def end_forward(self) -> None: ...

    def enter_block(self, block: StreamBlock, args: tuple, kwargs: dict) -> CallGraph | None: ...

    def forward_of(self, block: StreamBlock, original: Callable[..., object]) -> Callable[..., object]: ...

    def exit_block(self, block: StreamBlock, output: object, forward: Callable[..., object] | None) -> None: ...

    def enter(self, unit: StreamUnit, args: tuple | None = None, kwargs: dict | None = None) -> CallGraph | None: ...

    def exit(self, unit: StreamUnit, output: object = None, forward: Callable[..., object] | None = None) -> None: ...

    def borrow(self, unit: StreamUnit) -> bool: ...

    def relieve_in(self, block: StreamBlock) -> bool: ...

    def relieve_outside_blocks(self, first: bool) -> bool: ...


T = TypeVar("T")


def retry_on_oom(run: Callable[[], T], relieve: Callable[[int], bool]) -> T:
    """``run()``; on an allocator out-of-memory error, ``relieve(attempt)`` and run again while
    it freed something (attempt counts from 0); the error goes up when nothing more can go."""
    attempt = 0
    while True:
        try:
            return run()
        except torch.OutOfMemoryError:
            if not relieve(attempt):
                raise
            attempt += 1


class BlockHook(ModelHook):
    """On each block: its units made ready and released; its CUDA graph, if it has one for this
    call, replayed in place of its forward, else its compiled forward where the streamer chose it."""

    def __init__(self, streamer: Streamer, block: StreamBlock) -> None:
        super().__init__()
        self.streamer, self.block = streamer, block
        self.graph: CallGraph | None = None
        self.forward: Callable[..., object] | None = None

    def pre_forward(self, module, *args, **kwargs):
        self.graph = self.streamer.enter_block(self.block, args, kwargs)
        self.forward = self.streamer.forward_of(self.block, self.fn_ref.original_forward)
        return args, kwargs

    def new_forward(self, module, *args, **kwargs):
        """On an OOM inside the block the planner gives kept blocks up and the block runs again:
        the step continues while there is anything left to give up."""
        if self.graph is not None:
            return self.graph.replay()
        forward = self.forward
        return retry_on_oom(lambda: forward(*args, **kwargs), lambda _attempt: self.streamer.relieve_in(self.block))

    def post_forward(self, module, output):
        graph, self.graph = self.graph, None
        forward, self.forward = self.forward, None
        self.streamer.exit_block(self.block, output, None if graph is not None else forward)
        return output


class PartHook(ModelHook):
    """On a large child of a block streamed in parts: its weights are bound for its forward
    only, which may be its CUDA graph (an OOM inside goes up to the block's retry)."""

    def __init__(self, streamer: Streamer, unit: StreamUnit) -> None:
        super().__init__()
        self.streamer, self.unit = streamer, unit
        self.graph: CallGraph | None = None

    def pre_forward(self, module, *args, **kwargs):
        self.graph = self.streamer.enter(self.unit, args, kwargs)
        return args, kwargs

    def new_forward(self, module, *args, **kwargs):
        if self.graph is not None:
            return self.graph.replay()
        return self.fn_ref.original_forward(*args, **kwargs)

    def post_forward(self, module, output):
        graph, self.graph = self.graph, None
        self.streamer.exit(self.unit, output, None if graph is not None else self.fn_ref.original_forward)
        return output


class OutsideHook(ModelHook):
    """On a direct child of a block streamed whole: when a pipeline calls it outside the block's
    forward, the block's weights are bound for that call."""

    def __init__(self, streamer: Streamer, unit: StreamUnit) -> None:
        super().__init__()
        self.streamer, self.unit, self.borrowed = streamer, unit, False

    def pre_forward(self, module, *args, **kwargs):
        self.borrowed = self.streamer.borrow(self.unit)
        return args, kwargs

    def post_forward(self, module, output):
        if self.borrowed:
            self.borrowed = False
            self.streamer.exit(self.unit)
        return output


class ModelEntryHook(MarkerHook):
    """The marker on the denoiser: announces each forward, and retries one that ran out of memory
    outside the blocks (the first forward of a larger workload allocates its inputs before the
    first block, where the plan for it is made): first without the blocks copied ahead, then with
    kept blocks given up."""

    def __init__(self, streamer: Streamer) -> None:
        super().__init__(streamer.device)
        self.streamer = streamer

    def pre_forward(self, module, *args, **kwargs):
        self.streamer.begin_forward(args, kwargs)
        return args, kwargs

    def new_forward(self, module, *args, **kwargs):
        return retry_on_oom(lambda: self.fn_ref.original_forward(*args, **kwargs),
                            lambda attempt: self.streamer.relieve_outside_blocks(first=attempt == 0))

    def post_forward(self, module, output):
        self.streamer.end_forward()
        return output
