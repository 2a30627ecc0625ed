// The stage text ComfyUI shows under a node ("decoding", "video decode chunk 3/8": the pack sends
// it as progress text) is cleared when the node's stage ends or the run ends: the node shows the
// notes its run sent before the stages (snapped sizes), or no text at all, at its own height.

import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";
import { isOurs } from "./node_view.js";
import { EVENTS, RUN_ENDED, fromThisWorkflow } from "./state.js";

const PREVIEW = "$$node-text-preview"; // the frontend's progress-text widget (1.32 to 1.49 at least)
// what nodes/running.py and offload_core/run/stages.py send as progress text during a run
export const STAGE_TEXT = /^(decoding|denoise|text encode|image encode|video decode|audio decode)\b/;

const notes = new Map(); // node id -> the last text of this run that is not a stage

function clearStageText(node) {
  const widgets = node?.widgets ?? [];
  const index = widgets.findIndex((w) => w.name === PREVIEW);
  if (index < 0 || !STAGE_TEXT.test(String(widgets[index].value ?? ""))) return;
  const note = notes.get(String(node.id));
  if (note) {
    widgets[index].value = note;
    node.setDirtyCanvas?.(true, true);
    return;
  }
  widgets[index].onRemove?.(); // as the frontend's own removeTextPreview does
  widgets.splice(index, 1);
  node.__doflView?.fit(); // back to the node's own height if the text had made it grow
}

function ourNodes() {
  return (app.rootGraph ?? app.graph)?.nodes?.filter(isOurs) ?? [];
}

export function installStageTextCleanup() {
  api.addEventListener("execution_start", () => notes.clear());
  api.addEventListener("progress_text", ({ detail }) => {
    if (detail?.text && !STAGE_TEXT.test(detail.text)) notes.set(String(detail.nodeId), detail.text);
  });
  api.addEventListener(EVENTS.stage, ({ detail }) => {
    if (detail && !detail.stage && fromThisWorkflow(detail)) {
      clearStageText(ourNodes().find((n) => String(n.id) === String(detail.node)));
    }
  });
  for (const event of RUN_ENDED) {
    api.addEventListener(event, () => ourNodes().forEach(clearStageText));
  }
}
