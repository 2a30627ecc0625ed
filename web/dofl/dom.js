// Small DOM pieces the node view and the panel share: sizes, the placement bar, the stage line.

export const KINDS = [
  ["device", "on device"],
  ["pinned", "pinned RAM, streamed"],
  ["ram", "RAM"],
  ["on_demand", "on demand"],
];

export function formatBytes(n) {
  const GiB = 1024 ** 3;
  if (n >= GiB / 100 || n === 0) return `${(n / GiB).toFixed(2)} GiB`;
  return `${(n / 1024 ** 2).toFixed(2)} MiB`;
}

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text != null) node.textContent = text;
  return node;
}

export function pipelineName(p) {
  const folder = (p.path || "").split(/[\\/]/).filter(Boolean).pop();
  return folder ? `${p.pipeline} · ${folder}` : p.pipeline;
}

/** A bar of the component's bytes by where they are, with a tooltip of exact sizes. */
export function componentBar(c) {
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

/** "denoise 12/30" with a progress track when the stage has a total. */
export function stageLine(stage) {
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

/** One line for an idle pipeline: where its weights are, in total. */
export function summaryLine(p) {
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
