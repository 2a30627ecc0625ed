"""Named subscriptions to a transport's events, as diffusers' ``HookRegistry`` names its hooks.

A streamer emits ``forward`` (the model is entered), ``cycle`` (its first block is entered),
``forward_end`` (the model's forward returned), ``oom`` (an allocation failed; a listener returning True freed something, so retry),
``capturing`` and ``captured`` (around a block's or unit's capture as a CUDA graph: its allocations
are not the forward's) and
``end`` (the pipeline call is over). Each listener is registered under a name and removed by that name
only, so the preload driver, a benchmark's clock and a test's probe never remove each other.
"""

from __future__ import annotations

from collections.abc import Callable

Listener = Callable[..., object]  # listener(event, source, **info) -> truthy when it acted


class Events:
    def __init__(self) -> None:
        self._listeners: dict[str, Listener] = {}

    def subscribe(self, name: str, listener: Listener, *, first: bool = False) -> None:
        """Add ``listener`` under ``name`` (after the others, or before them with ``first``)."""
        if name in self._listeners:
            raise ValueError(f"a listener named {name!r} is already subscribed")
        if first:
            self._listeners = {name: listener, **self._listeners}
        else:
            self._listeners[name] = listener

    def unsubscribe(self, name: str) -> Listener | None:
        """Remove the listener named ``name``; returns it (None when there was none)."""
        return self._listeners.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._listeners)

    def emit(self, event: str, source: object, **info) -> bool:
        """Call every listener (all of them, even after one acted); True when any acted."""
        return any([bool(listener(event, source, **info)) for listener in list(self._listeners.values())])
