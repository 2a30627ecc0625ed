// The panel: every pipeline the pack holds (whatever workflow loaded it), its components, where
// their bytes are and its preload plan. A sidebar tab, or a floating box on older frontends.

import { app } from "../../../scripts/app.js";
import { KINDS, componentBar, el, formatBytes, pipelineName, stageLine } from "./dom.js";
import { state } from "./state.js";

const panel = { root: null };

export function renderPanel() {
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
  card.append(el("div", "dofl-plan", p.plan ? `preload: ${p.plan}` : "preload: no streamed denoiser"));
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

export function installPanel() {
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
