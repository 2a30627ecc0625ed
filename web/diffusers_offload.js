// Live placement and stage view of the Diffusers Offload pack.
//
// Shows, on each of the pack's nodes, the current stage ("denoise 12/30") and per component a
// bar of where its weights are; a sidebar tab (or a floating panel on frontends without one)
// lists every pipeline the pack holds. Everything shown comes from the pack's state route and
// its websocket events: the page computes nothing but widths and labels. Without the route (an
// older pack or server: 404) the view stays hidden and the page is untouched.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const ROUTE = "/diffusers_offload/state";
const EVENTS = {
  placement: "diffusers_offload.placement",
  stage: "diffusers_offload.stage",
  removed: "diffusers_offload.removed",
};
const NODE_PREFIX = "DiffusersOffload";
const PIPE_TYPE = "DIFFUSERS_PIPE";
const KINDS = [
  ["device", "on device"],
  ["pinned", "pinned RAM, streamed"],
  ["ram", "RAM"],
  ["on_demand", "on demand"],
];
const ROW_HEIGHT = 17;
const STAGE_HEIGHT = 22;
const WIDGET_MARGIN = 20; // the frontend draws a DOM widget this much shorter than its slot

// ------------------------------------------------------------------------------------ state

const state = {
  available: null, // null: not asked yet, false: no route (hide everything), true: live
  pipelines: new Map(), // id -> pipeline snapshot (the route's / event's JSON)
  stages: new Map(), // node id -> stage payload
  executing: null, // node id ComfyUI is executing, from the core "executing" event
  fromRoute: null, // the route's last answer (tests read it through window.DiffusersOffloadView)
};

async function fetchState() {
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

function onPlacement({ detail }) {
  if (!detail?.id) return;
  state.available = true;
  state.pipelines.set(detail.id, detail);
  refresh();
}

function onStage({ detail }) {
  if (!detail?.node) return;
  if (detail.stage) state.stages.set(String(detail.node), detail);
  else state.stages.delete(String(detail.node));
  refresh();
}

function onRemoved({ detail }) {
  state.pipelines.delete(detail?.id);
  refresh();
}

function onExecuting({ detail }) {
  const node = detail && typeof detail === "object" ? detail.node : detail;
  state.executing = node == null ? null : String(node);
  refresh();
}

function onRunEnded() {
  state.executing = null;
  state.stages.clear();
  refresh();
}

// ---------------------------------------------------------------------------------- helpers

function formatBytes(n) {
  const GiB = 1024 ** 3;
  if (n >= GiB / 100 || n === 0) return `${(n / GiB).toFixed(2)} GiB`;
  return `${(n / 1024 ** 2).toFixed(2)} MiB`;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text != null) node.textContent = text;
  return node;
}

function pipelineName(p) {
  const folder = (p.path || "").split(/[\\/]/).filter(Boolean).pop();
  return folder ? `${p.pipeline} · ${folder}` : p.pipeline;
}

/** A bar of the component's bytes by where they are, with a tooltip of exact sizes. */
function componentBar(c) {
  const bar = el("div", "dofl-bar");
  const total = c.nbytes || 1;
  for (const [kind, label] of KINDS) {
    const bytes = c.segments?.[kind] ?? 0;
    if (!bytes) continue;
    const seg = el("div", `dofl-seg dofl-${kind}`);
    seg.style.width = `${(100 * bytes) / total}%`;
    seg.title = `${label}: ${formatBytes(bytes)}`;
    bar.append(seg);
  }
  bar.title = KINDS.filter(([k]) => c.segments?.[k])
    .map(([k, label]) => `${label} ${formatBytes(c.segments[k])}`)
    .join(" · ");
  return bar;
}

function stageLine(stage) {
  const line = el("div", "dofl-stage");
  line.dataset.stage = stage.stage;
  line.append(el("span", "dofl-stage-text", stage.text ?? stage.stage));
  if (stage.total) {
    const track = el("div", "dofl-track");
    const fill = el("div", "dofl-fill");
    fill.style.width = `${(100 * (stage.step ?? 0)) / stage.total}%`;
    track.append(fill);
    line.append(track);
  }
  return line;
}

// ---------------------------------------------------------------------------- node views

const views = new Set();

/** The pipeline a node shows: one the server ties to it, else the nearest along pipe links. */
function pipelineFor(node) {
  const direct = (id) => [...state.pipelines.values()].find((p) => p.nodes?.includes(String(id)));
  const seen = new Set([node.id]);
  let frontier = [node];
  while (frontier.length) {
    const next = [];
    for (const n of frontier) {
      const found = direct(n.id);
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

  height() {
    if (!this.root.childElementCount) return 0;
    return STAGE_HEIGHT + this.rows * ROW_HEIGHT + 6 + WIDGET_MARGIN;
  }

  render() {
    const id = String(this.node.id);
    const pipeline = state.available ? pipelineFor(this.node) : null;
    let stage = state.available ? state.stages.get(id) : null;
    if (!stage && state.available && state.executing === id) stage = { stage: "running", text: "running" };
    this.root.replaceChildren();
    this.rows = 0;
    this.root.dataset.node = id;
    if (!pipeline && !stage) return this.resize();
    this.root.append(stage ? stageLine(stage) : this.summary(pipeline));
    for (const c of pipeline?.components ?? []) {
      const row = el("div", "dofl-row");
      row.dataset.component = c.name;
      row.dataset.nbytes = c.nbytes;
      row.append(el("span", "dofl-name", c.name), componentBar(c), el("span", "dofl-size", formatBytes(c.nbytes)));
      row.title = `${c.name} (${c.cls}): ${c.role}, ${c.reason}`;
      this.root.append(row);
      this.rows += 1;
    }
    this.resize();
  }

  summary(p) {
    const line = el("div", "dofl-stage dofl-idle");
    line.dataset.stage = "idle";
    if (p.device === "unplaced") {
      line.append(el("span", "dofl-stage-text", `not placed yet, ${formatBytes(p.total_bytes)}`));
      return line;
    }
    line.append(el("span", "dofl-stage-text", `${p.device}: ${formatBytes(p.device_bytes)} on device`));
    if (p.pinned_bytes) line.append(el("span", "dofl-muted", `, ${formatBytes(p.pinned_bytes)} pinned`));
    return line;
  }

  resize() {
    const wanted = this.node.computeSize?.();
    if (wanted && this.node.size[1] < wanted[1]) this.node.setSize([this.node.size[0], wanted[1]]);
    this.node.setDirtyCanvas?.(true, true);
  }
}

function attachView(node) {
  if (node.__doflView) return;
  const view = new NodeView(node);
  node.__doflView = view;
  views.add(view);
  const onRemoved = node.onRemoved;
  node.onRemoved = function (...args) {
    views.delete(view);
    return onRemoved?.apply(this, args);
  };
  refresh(); // next frame: a node being configured gets its id only after nodeCreated
}

// -------------------------------------------------------------------------------- the panel

const panel = { root: null };

function renderPanel() {
  const root = panel.root;
  if (!root) return;
  root.replaceChildren();
  root.classList.add("dofl-panel");
  root.append(el("h3", "dofl-title", "Diffusers offload"));
  if (state.available === false) {
    root.append(el("p", "dofl-muted", "This server has no placement route (older pack or ComfyUI)."));
    return;
  }
  if (!state.pipelines.size) {
    root.append(el("p", "dofl-muted", "No pipeline loaded."));
    return;
  }
  const legend = el("div", "dofl-legend");
  for (const [kind, label] of KINDS) {
    const item = el("span", "dofl-legend-item");
    item.append(el("i", `dofl-swatch dofl-${kind}`), document.createTextNode(label));
    legend.append(item);
  }
  root.append(legend);
  for (const p of state.pipelines.values()) root.append(pipelineCard(p));
}

function pipelineCard(p) {
  const card = el("section", "dofl-card");
  card.dataset.pipeline = p.id;
  card.append(el("div", "dofl-card-title", pipelineName(p)));
  card.append(
    el(
      "div",
      "dofl-muted",
      `${p.device} · mode ${p.mode} · ${p.dtype} · ${formatBytes(p.total_bytes)}: ` +
        `${formatBytes(p.device_bytes)} on device, ${formatBytes(p.pinned_bytes)} pinned`,
    ),
  );
  const running = [...state.stages.values()].filter((s) => s.pipeline === p.id);
  for (const s of running) card.append(stageLine({ ...s, text: `node ${s.node}: ${s.text}` }));
  for (const c of p.components) card.append(componentBlock(c));
  const plan = el("div", "dofl-plan", p.plan ? `preload: ${p.plan}` : "preload: no streamed denoiser");
  card.append(plan);
  if (p.plan_change) {
    const at = new Date(p.plan_change.at * 1000).toLocaleTimeString();
    const was = p.plan_change.previous ? ` (was: ${p.plan_change.previous})` : "";
    card.append(el("div", "dofl-muted dofl-plan-change", `last plan change ${at}${was}`));
  }
  return card;
}

/** One component in the panel: name, role and size; where its bytes are; exact figures. */
function componentBlock(c) {
  const block = el("div", "dofl-comp");
  Object.assign(block.dataset, {
    component: c.name, nbytes: c.nbytes, deviceBytes: c.device_bytes, pinnedBytes: c.pinned_bytes,
  });
  block.title = `${c.cls} (${c.dtypes.join("/")}${c.quantization ? `, ${c.quantization}` : ""})`;
  const head = el("div", "dofl-comp-head");
  head.append(el("span", "dofl-name", c.name), el("span", "dofl-role", c.role), el("span", "dofl-num", formatBytes(c.nbytes)));
  const figures = `device ${formatBytes(c.device_bytes)} · pinned ${formatBytes(c.pinned_bytes)} · ${c.reason}`;
  block.append(head, componentBar(c), el("div", "dofl-muted dofl-figures", figures));
  return block;
}

/** Frontends without sidebar tabs: a small floating panel behind a toggle button. */
function floatingPanel() {
  const box = el("div", "dofl-floating");
  box.hidden = true;
  const button = el("button", "dofl-toggle", "Offload");
  button.addEventListener("click", () => {
    box.hidden = !box.hidden;
    renderPanel();
  });
  document.body.append(button, box);
  return box;
}

function installPanel() {
  const manager = app.extensionManager;
  if (typeof manager?.registerSidebarTab === "function") {
    manager.registerSidebarTab({
      id: "diffusers-offload",
      icon: "pi pi-server",
      title: "Offload",
      tooltip: "Diffusers offload: pipelines and where their weights are",
      type: "custom",
      render: (root) => {
        panel.root = root;
        renderPanel();
      },
      destroy: () => {
        panel.root = null;
      },
    });
  } else {
    panel.root = floatingPanel();
  }
}

// --------------------------------------------------------------------------------- wiring

let pending = false;
function refresh() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    for (const view of views) view.render();
    renderPanel();
  });
}

const CSS = `
.dofl-node { font: 11px/1.3 sans-serif; color: var(--input-text, #ddd); padding: 2px 4px;
  box-sizing: border-box; overflow: hidden; pointer-events: none; }
.dofl-stage { display: flex; align-items: center; gap: 6px; height: ${STAGE_HEIGHT - 4}px; }
.dofl-stage-text { font-weight: 600; white-space: nowrap; }
.dofl-track { flex: 1; height: 4px; background: #0004; border-radius: 2px; overflow: hidden; }
.dofl-fill { height: 100%; background: #4caf50; }
.dofl-row { display: grid; grid-template-columns: 86px 1fr 64px; align-items: center; gap: 6px;
  height: ${ROW_HEIGHT}px; }
.dofl-name { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.dofl-size, .dofl-num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
.dofl-bar { display: flex; height: 9px; background: #0003; border-radius: 2px; overflow: hidden;
  min-width: 60px; }
.dofl-seg { height: 100%; }
.dofl-device { background: #4caf50; } .dofl-pinned { background: #2196f3; }
.dofl-ram { background: #9e9e9e; } .dofl-on_demand { background: #ff9800; }
.dofl-muted { opacity: 0.7; font-size: 11px; }
.dofl-panel { padding: 8px; font: 12px/1.4 sans-serif; overflow: auto; height: 100%; box-sizing: border-box; }
.dofl-title { margin: 0 0 6px; font-size: 14px; }
.dofl-card { border: 1px solid #8884; border-radius: 6px; padding: 6px; margin: 6px 0; }
.dofl-card-title { font-weight: 600; }
.dofl-comp { margin: 6px 0; }
.dofl-comp-head { display: grid; grid-template-columns: 1fr auto 72px; gap: 8px; }
.dofl-comp-head .dofl-name { font-weight: 500; }
.dofl-role { opacity: 0.8; }
.dofl-figures { margin-top: 1px; }
.dofl-plan { font-family: monospace; font-size: 11px; }
.dofl-legend { display: flex; flex-wrap: wrap; gap: 8px; font-size: 11px; }
.dofl-legend-item { display: inline-flex; align-items: center; gap: 3px; }
.dofl-swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; }
.dofl-toggle { position: fixed; right: 12px; bottom: 12px; z-index: 1000; }
.dofl-floating { position: fixed; right: 12px; bottom: 44px; width: 440px; max-height: 60vh;
  z-index: 1000; background: var(--comfy-menu-bg, #222); border: 1px solid #8886; border-radius: 6px; }
`;

app.registerExtension({
  name: "diffusers_offload.view",

  nodeCreated(node) {
    if (String(node.comfyClass ?? node.type ?? "").startsWith(NODE_PREFIX)) attachView(node);
  },

  afterConfigureGraph() {
    refresh();
  },

  async setup() {
    document.head.append(Object.assign(document.createElement("style"), { textContent: CSS }));
    api.addEventListener(EVENTS.placement, onPlacement);
    api.addEventListener(EVENTS.stage, onStage);
    api.addEventListener(EVENTS.removed, onRemoved);
    api.addEventListener("executing", onExecuting);
    for (const ended of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(ended, onRunEnded);
    }
    api.addEventListener("reconnected", fetchState);
    await fetchState();
    if (state.available) installPanel();
    window.DiffusersOffloadView = { state, fetchState };
  },
});
