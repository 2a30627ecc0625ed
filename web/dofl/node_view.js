// The view drawn on the pack's nodes. A loader (a node that makes a pipeline from nothing) and the
// placement report show where every component's weights are, one bar per component; every node
// shows its current stage ("denoise 12/30") while it has one, and nothing else. A node is sized
// to what it shows: it keeps its own height (the workflow's, or the user's) while its content fits,
// grows just enough when rows appear, and goes back to its own height when they go; the height
// the view added is never saved in the workflow.

import { ROW_HEIGHT, STAGE_HEIGHT } from "./style.js";
import { componentBar, el, formatBytes, stageLine, summaryLine } from "./dom.js";
import { pipelineBoundTo, refresh, stageOf, state } from "./state.js";

export const NODE_PREFIX = "DiffusersOffload";
const REPORT = "DiffusersOffloadReport";
const PIPE_TYPE = "DIFFUSERS_PIPE";
const WIDGET_MARGIN = 20; // the frontend draws a DOM widget this much shorter than its slot

const views = new Set();

export function isOurs(node) {
  return String(node.comfyClass ?? node.type ?? "").startsWith(NODE_PREFIX);
}

/** A loader (a pipeline out, none in) or the placement report. */
function showsPlacement(node) {
  if (String(node.comfyClass ?? node.type) === REPORT) return true;
  const pipeIn = (node.inputs ?? []).some((slot) => slot.type === PIPE_TYPE);
  const pipeOut = (node.outputs ?? []).some((slot) => slot.type === PIPE_TYPE);
  return pipeOut && !pipeIn;
}

/** The pipeline a node shows: the one the server ties to it in this workflow, else the nearest
 *  one along pipe links (a loader ComfyUI answered from its cache, the report downstream). */
function pipelineFor(node) {
  const seen = new Set([node.id]);
  let frontier = [node];
  while (frontier.length) {
    const next = [];
    for (const n of frontier) {
      const found = pipelineBoundTo(n.id);
      if (found) return found;
      for (const [i, input] of (n.inputs ?? []).entries()) {
        if (input.type !== PIPE_TYPE || input.link == null) continue;
        const up = n.getInputNode?.(i);
        if (up && !seen.has(up.id)) seen.add(up.id), next.push(up);
      }
      for (const [i, output] of (n.outputs ?? []).entries()) {
        if (output.type !== PIPE_TYPE) continue;
        for (const down of n.getOutputNodes?.(i) ?? []) {
          if (!seen.has(down.id)) seen.add(down.id), next.push(down);
        }
      }
    }
    frontier = next;
  }
  return null;
}

class NodeView {
  constructor(node) {
    this.node = node;
    this.root = el("div", "dofl-node");
    this.rows = 0;
    this.widget = node.addDOMWidget("offload_view", "diffusers_offload_view", this.root, {
      serialize: false, // never part of the saved workflow nor of the queued prompt
      hideOnZoom: false,
      getValue: () => undefined,
      setValue: () => {},
      getMinHeight: () => this.height(),
      getMaxHeight: () => this.height(),
    });
    this.widget.serialize = false;
  }

  /** The node's height without what the view (or a stage text) made it grow: the height it had
   *  when first drawn, moved by whatever resized it since (the user dragging its corner). */
  ownHeight() {
    if (this.own == null) this.own = this.node.size[1];
    else if (Math.abs(this.node.size[1] - this.set) > 0.5) this.own += this.node.size[1] - this.set;
    this.set = this.node.size[1];
    return this.own;
  }

  /** Its own height, or what its content needs when that is more. */
  fit() {
    const node = this.node;
    const want = Math.max(this.ownHeight(), node.computeSize?.()[1] ?? 0);
    if (Math.abs(want - node.size[1]) > 0.5) node.setSize([node.size[0], want]);
    this.set = node.size[1];
    node.setDirtyCanvas?.(true, true);
  }

  height() {
    if (!this.root.childElementCount) return 0;
    return STAGE_HEIGHT + this.rows * ROW_HEIGHT + 6 + WIDGET_MARGIN;
  }

  render() {
    const id = String(this.node.id);
    this.ownHeight(); // before the content changes
    const stage = state.available ? stageOf(id) : null;
    const pipeline = state.available && showsPlacement(this.node) ? pipelineFor(this.node) : null;
    this.root.replaceChildren();
    this.rows = 0;
    this.root.dataset.node = id;
    this.root.dataset.shows = pipeline ? "placement" : stage ? "stage" : "nothing";
    if (stage || pipeline) this.root.append(stage ? stageLine(stage) : summaryLine(pipeline));
    for (const c of pipeline?.components ?? []) {
      const row = el("div", "dofl-row");
      row.dataset.component = c.name;
      row.dataset.nbytes = c.nbytes;
      row.append(el("span", "dofl-name", c.name), componentBar(c), el("span", "dofl-size", formatBytes(c.nbytes)));
      row.title = `${c.name} (${c.cls}): ${c.role}, ${c.reason}`;
      this.root.append(row);
      this.rows += 1;
    }
    this.fit();
  }
}

export function attachView(node) {
  if (node.__doflView) return;
  const view = new NodeView(node);
  node.__doflView = view;
  views.add(view);
  const { onRemoved, onSerialize } = node;
  node.onRemoved = function (...args) {
    views.delete(view);
    return onRemoved?.apply(this, args);
  };
  node.onSerialize = function (data, ...rest) {
    const result = onSerialize?.call(this, data, ...rest);
    if (data?.size) data.size = [data.size[0], view.ownHeight()]; // the rows come and go
    return result;
  };
  refresh(); // next frame: a node being configured gets its id only after nodeCreated
}

export function renderViews() {
  for (const view of views) view.render();
}
