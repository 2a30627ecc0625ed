// The view's style sheet, added once to the page.

export const ROW_HEIGHT = 17;
export const STAGE_HEIGHT = 22;

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

export function installStyle() {
  document.head.append(Object.assign(document.createElement("style"), { textContent: CSS }));
}
