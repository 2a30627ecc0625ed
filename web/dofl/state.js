// What the view knows: the pack's pipelines and the stage of each node, from its state route and
// its websocket events, and which of them belong to the workflow on the canvas.
//
// Events are listened to from the moment the extension's file is imported, before the app opens
// its websocket: an event that arrives before `start()` (a page reloaded in the middle of a run)
// is buffered, then applied after the route's picture if it is newer, never "unknown" to the app.

import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

export const ROUTE = "/diffusers_offload/state";
export const EVENTS = {
  placement: "diffusers_offload.placement",
  stage: "diffusers_offload.stage",
  removed: "diffusers_offload.removed",
};
export const RUN_ENDED = ["execution_success", "execution_error", "execution_interrupted"];

export const state = {
  available: null, // null: not asked yet, false: no route (hide everything), true: live
  pipelines: new Map(), // id -> pipeline snapshot (the route's / event's JSON)
  stages: new Map(), // node id -> stage payload (with the prompt and workflow it belongs to)
  fromRoute: null, // the route's last answer (tests read it through window.DiffusersOffloadView)
  early: 0, // events that arrived before start(), buffered
};

// ------------------------------------------------------------------------- the workflow shown

/** The id of the workflow on the canvas: the root graph's, which the frontend sends with every
 *  prompt it queues (extra_pnginfo.workflow.id) and keeps when it restores a tab. */
export function currentWorkflow() {
  try {
    const graph = app.rootGraph ?? app.graph;
    return graph?.id ? String(graph.id) : null;
  } catch {
    return null; // the app has no graph yet
  }
}

/** Whether a stage or a pipeline's use came from the workflow on the canvas. A prompt queued
 *  without a workflow (a script) shows in the panel only. */
export function fromThisWorkflow(item) {
  return item?.workflow != null && item.workflow === currentWorkflow();
}

/** The stage of a node of the workflow shown, or null. */
export function stageOf(nodeId) {
  const stage = state.stages.get(String(nodeId));
  return stage && fromThisWorkflow(stage) ? stage : null;
}

/** The pipeline tied to this node of the workflow shown (the newest prompt wins on the server). */
export function pipelineBoundTo(nodeId) {
  const id = String(nodeId);
  for (const p of state.pipelines.values()) {
    if (p.uses?.some((u) => u.node === id && fromThisWorkflow(u))) return p;
  }
  return null;
}

// ------------------------------------------------------------------------------- the updates

function apply(kind, detail) {
  if (kind === "placement" && detail?.id) {
    state.available = true;
    state.pipelines.set(detail.id, detail);
  } else if (kind === "stage" && detail?.node != null) {
    const node = String(detail.node);
    if (detail.stage) state.stages.set(node, detail);
    else if (state.stages.get(node)?.prompt === detail.prompt) state.stages.delete(node);
  } else if (kind === "removed") {
    state.pipelines.delete(detail?.id);
  }
}

/** The run a core event names ended: its stages are over (all of them when it names none). */
function runEnded({ detail }) {
  const prompt = detail?.prompt_id;
  for (const [node, stage] of state.stages) {
    if (!prompt || stage.prompt === prompt) state.stages.delete(node);
  }
  refresh();
}

let started = false;
const buffered = [];

/** Listen to the pack's events; call once, when the extension's file is imported. */
export function listen() {
  for (const [kind, event] of Object.entries(EVENTS)) {
    api.addEventListener(event, ({ detail }) => {
      if (!started) {
        state.early += 1;
        buffered.push([kind, detail]);
        return;
      }
      apply(kind, detail);
      refresh();
    });
  }
}

/** Read the route, then apply what was buffered and is newer than its answer; live from here. */
export async function start() {
  await fetchState();
  const since = state.fromRoute?.time ?? 0;
  for (const [kind, detail] of buffered.splice(0)) {
    const at = detail?.at ?? detail?.updated;
    if (at == null || at >= since) apply(kind, detail);
  }
  started = true;
  for (const event of RUN_ENDED) api.addEventListener(event, runEnded);
  api.addEventListener("reconnected", fetchState);
  refresh();
}

export async function fetchState() {
  try {
    const res = await api.fetchApi(ROUTE, { cache: "no-store" });
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const data = await res.json();
    state.available = true;
    state.fromRoute = data;
    state.pipelines = new Map(data.pipelines.map((p) => [p.id, p]));
    state.stages = new Map(Object.entries(data.stages ?? {}).filter(([, s]) => s?.stage));
  } catch {
    state.available = false; // 404 on an older server, or the server went away: stay quiet
  }
  refresh();
}

// --------------------------------------------------------------------------------- redrawing

const redraws = new Set();

/** Call `fn` on every redraw (at most once per frame). */
export function onRedraw(fn) {
  redraws.add(fn);
}

let pending = false;
export function refresh() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    for (const fn of redraws) fn();
  });
}
