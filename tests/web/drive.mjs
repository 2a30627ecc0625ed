// Drives headless Chromium through one browser session against a running ComfyUI and writes
// what the page showed to a JSON file; tests/web/test_browser.py makes the assertions.
//
//   node drive.mjs config.json
//
// config: { url, result, chromium, profile, workflow (UI JSON), short, long (API prompts),
//           viewNode, loaderNode, shots: { node, panel } }

import { readFileSync, writeFileSync } from "node:fs";
import { chromium } from "playwright-core";

const config = JSON.parse(readFileSync(process.argv[2], "utf8"));
const OURS = /diffusers_offload|dofl/i;
const result = { console: [], pageErrors: [], steps: {} };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function until(what, fn, timeoutMs = 60000, everyMs = 100) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await fn();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(everyMs);
  }
}

async function getJson(path) {
  const res = await fetch(config.url + path);
  return { status: res.status, body: res.ok ? await res.json() : null };
}

function watch(page, label) {
  page.on("console", (msg) => {
    if (msg.type() !== "error" && msg.type() !== "warning") return;
    const url = msg.location()?.url ?? "";
    result.console.push({ page: label, type: msg.type(), text: msg.text(), url, ours: OURS.test(url + msg.text()) });
  });
  page.on("pageerror", (err) => {
    const text = `${err.message}\n${err.stack ?? ""}`;
    result.pageErrors.push({ page: label, text, ours: OURS.test(text) });
  });
}

/** Open the page and wait for the app, the graph and our extension's setup. */
async function openApp(page, { ours = true } = {}) {
  await page.goto(config.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app?.graph && window.LiteGraph && window.comfyAPI?.api?.api, null, {
    timeout: 90000,
  });
  if (ours) await page.waitForFunction(() => window.DiffusersOffloadView, null, { timeout: 30000 });
}

/** Show the example's UI workflow, its widgets set to what the long run queues (same ids). */
async function loadWorkflow(page) {
  await page.evaluate(async ([wf, prompt]) => {
    await window.app.loadGraphData(structuredClone(wf));
    for (const [id, { inputs }] of Object.entries(prompt)) {
      for (const widget of window.app.graph.getNodeById(Number(id))?.widgets ?? []) {
        const value = inputs[widget.name];
        if (value !== undefined && !Array.isArray(value)) widget.value = value;
      }
    }
    window.app.canvas.ds.offset = [0, 0];
    window.app.canvas.ds.scale = 1;
    window.app.graph.setDirtyCanvas(true, true);
  }, [config.workflow, config.long]);
}

/** The Offload settings node of the saved UI workflow, as the frontend rebuilt it from the schema:
 *  each widget's name, value and advanced flag (read before loadWorkflow sets values by name). */
async function readSettings(page) {
  return page.evaluate(async (wf) => {
    await window.app.loadGraphData(structuredClone(wf));
    const node = window.app.graph.nodes.find((n) => n.type === "DiffusersOffloadSettings");
    if (!node) return null;
    return {
      id: String(node.id),
      knowsAdvanced: typeof node.hasAdvancedWidgets === "function",
      widgets: node.widgets.map((w) => ({
        name: w.name,
        value: w.value,
        advanced: Boolean(w.options?.advanced ?? w.advanced),
      })),
    };
  }, config.workflow);
}

async function queue(page, prompt) {
  const id = await page.evaluate(async (p) => {
    const clientId = window.comfyAPI.api.api.clientId;
    const res = await fetch("/api/prompt", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt: p, client_id: clientId }),
    });
    const body = await res.json();
    if (!res.ok) throw new Error(JSON.stringify(body));
    return body.prompt_id;
  }, prompt);
  return id;
}

async function finished(promptId, timeoutMs = 240000) {
  return until(
    `prompt ${promptId}`,
    async () => (await getJson(`/api/history/${promptId}`)).body?.[promptId],
    timeoutMs,
    250,
  );
}

/** Records every stage text the node view shows (a MutationObserver in the page). */
async function recordStages(page, nodeId) {
  await page.evaluate((id) => {
    window.__seen = [];
    window.__events = { placement: 0, stage: 0, stages: [] };
    const api = window.comfyAPI.api.api;
    api.addEventListener("diffusers_offload.placement", () => window.__events.placement++);
    api.addEventListener("diffusers_offload.stage", ({ detail }) => {
      window.__events.stage++;
      if (String(detail?.node) === String(id)) window.__events.stages.push(detail.stage ?? "");
    });
    const note = () => {
      const text = document.querySelector(`.dofl-node[data-node="${id}"] .dofl-stage-text`)?.textContent;
      if (text && window.__seen.at(-1) !== text) window.__seen.push(text);
    };
    new MutationObserver(note).observe(document.body, { subtree: true, childList: true, characterData: true });
  }, nodeId);
}

/** What a node's view shows: the stage line and one row per component. */
async function readView(page, nodeId) {
  return page.evaluate((id) => {
    const root = document.querySelector(`.dofl-node[data-node="${id}"]`);
    if (!root) return null;
    const box = root.getBoundingClientRect();
    return {
      stage: root.querySelector(".dofl-stage")?.dataset.stage ?? null,
      text: root.querySelector(".dofl-stage-text")?.textContent ?? null,
      visible: box.width > 0 && box.height > 0 && root.childElementCount > 0,
      rows: [...root.querySelectorAll(".dofl-row")].map((row) => ({
        name: row.dataset.component,
        nbytes: Number(row.dataset.nbytes),
        size: row.querySelector(".dofl-size").textContent,
        segments: Object.fromEntries(
          [...row.querySelectorAll(".dofl-seg")].map((s) => [
            [...s.classList].find((c) => c.startsWith("dofl-") && c !== "dofl-seg").slice(5),
            parseFloat(s.style.width),
          ]),
        ),
      })),
    };
  }, nodeId);
}

async function readPanel(page) {
  return page.evaluate(() => {
    const root = document.querySelector(".dofl-panel");
    if (!root) return null;
    return {
      text: root.textContent,
      cards: [...root.querySelectorAll(".dofl-card")].map((card) => ({
        id: card.dataset.pipeline,
        title: card.querySelector(".dofl-card-title").textContent,
        plan: card.querySelector(".dofl-plan")?.textContent ?? null,
        planChange: card.querySelector(".dofl-plan-change")?.textContent ?? null,
        rows: [...card.querySelectorAll(".dofl-comp[data-component]")].map((block) => ({
          name: block.dataset.component,
          nbytes: Number(block.dataset.nbytes),
          deviceBytes: Number(block.dataset.deviceBytes),
          pinnedBytes: Number(block.dataset.pinnedBytes),
          cells: [...block.querySelector(".dofl-comp-head").children].map((span) => span.textContent),
          figures: block.querySelector(".dofl-figures").textContent,
        })),
      })),
    };
  });
}

/** A screenshot of one node (title, widgets and our view) as the canvas draws it. */
async function shootNode(page, nodeId, path) {
  const clip = await page.evaluate((id) => {
    const app = window.app;
    const node = app.graph.getNodeById(Number(id));
    app.canvas.ds.offset = [360 - node.pos[0], 240 - node.pos[1]]; // clear of the top bars
    app.canvas.setDirty(true, true);
    const { offset, scale } = app.canvas.ds;
    const rect = app.canvas.canvas.getBoundingClientRect();
    const title = window.LiteGraph.NODE_TITLE_HEIGHT;
    const pad = 12;
    return {
      x: Math.max(rect.left + (node.pos[0] + offset[0]) * scale - pad, 0),
      y: Math.max(rect.top + (node.pos[1] - title + offset[1]) * scale - pad, 0),
      width: node.size[0] * scale + 2 * pad,
      height: (node.size[1] + title) * scale + 2 * pad,
    };
  }, nodeId);
  await sleep(300); // a frame for the canvas and the DOM widgets to follow the pan
  await page.screenshot({ path, clip });
}

async function main() {
  const context = await chromium.launchPersistentContext(config.profile, {
    executablePath: config.chromium,
    headless: true,
    serviceWorkers: "block",
    viewport: { width: 1700, height: 1000 },
    args: [
      "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
    ],
  });
  const t0 = Date.now();
  const lap = (name) => (result.steps[name] = (Date.now() - t0) / 1000);
  try {
    const page = context.pages()[0] ?? (await context.newPage());
    watch(page, "main");

    // 1. the extension loads
    await openApp(page);
    lap("loaded");
    result.extensions = (await getJson("/api/extensions")).body;
    result.nodeTypes = await page.evaluate(() =>
      Object.keys(window.LiteGraph.registered_node_types).filter((t) => t.startsWith("DiffusersOffload")),
    );
    result.tabButton = await page.locator(".diffusers-offload-tab-button").count();
    result.settings = await readSettings(page);
    result.settingsSchema = (await getJson("/api/object_info/DiffusersOffloadSettings")).body;
    await loadWorkflow(page);
    result.idleView = await readView(page, config.viewNode);

    // 2. a short run: stages, then the final placement
    await recordStages(page, config.viewNode);
    const shortId = await queue(page, config.short);
    result.shortHistory = (await finished(shortId)).status;
    await until("the stage to clear", async () => (await readView(page, config.viewNode))?.stage === "idle", 20000);
    lap("short run");
    result.seen = await page.evaluate(() => window.__seen);
    result.events = await page.evaluate(() => window.__events);
    result.finalView = await readView(page, config.viewNode);
    result.loaderView = await readView(page, config.loaderNode);
    result.route = await page.evaluate(async () => (await fetch("/api/diffusers_offload/state")).json());

    // 3. the panel lists the pipelines with the route's sizes
    await page.locator(".diffusers-offload-tab-button").first().click();
    await page.waitForSelector(".dofl-panel .dofl-card", { timeout: 15000 });
    result.panel = await readPanel(page);
    const panelClip = await page.evaluate(() => {
      const root = document.querySelector(".dofl-panel").getBoundingClientRect();
      const last = document.querySelector(".dofl-panel > :last-child").getBoundingClientRect();
      return { x: root.left, y: root.top, width: root.width, height: last.bottom - root.top + 12 };
    });
    await page.screenshot({ path: config.shots.panel, clip: panelClip });
    await page.locator(".diffusers-offload-tab-button").first().click(); // close it again
    lap("panel");

    // 4. a long run: reload in the middle, the view comes back from the route
    const longId = await queue(page, config.long);
    const midText = await until(
      "a denoise step on the node view",
      async () => {
        const view = await readView(page, config.viewNode);
        return view?.stage === "denoise" && view.rows.length && /denoise [1-9]/.test(view.text) ? view.text : null;
      },
      120000,
    );
    result.midText = midText;
    await shootNode(page, config.viewNode, config.shots.node);
    lap("mid run");
    await page.reload({ waitUntil: "domcontentloaded" });
    await openApp(page);
    const restored = await page.evaluate(() => window.app.graph.getNodeById(4) != null);
    if (!restored) await loadWorkflow(page);
    result.reload = {
      workflowRestoredByFrontend: restored,
      routeStages: await page.evaluate(() => window.DiffusersOffloadView.state.fromRoute?.stages ?? null),
      view: await until("the restored view", async () => {
        const view = await readView(page, config.viewNode);
        return view?.visible && view.stage && view.stage !== "idle" && view.rows.length ? view : null;
      }, 20000),
      historyDoneAtReload: Boolean((await getJson(`/api/history/${longId}`)).body?.[longId]),
    };
    lap("reloaded");
    await fetch(`${config.url}/api/interrupt`, { method: "POST" });
    result.longHistory = (await finished(longId)).status;
    result.afterLong = await until("the stage to clear after the run", async () => {
      const view = await readView(page, config.viewNode);
      return view?.stage === "idle" ? view : null;
    }, 20000);
    lap("long run");

    // 5. a server without the route (404): nothing of ours shows, nothing breaks
    const bare = await context.newPage();
    watch(bare, "no-route");
    await bare.route("**/diffusers_offload/state", (route) => route.fulfill({ status: 404, body: "404: Not Found" }));
    await openApp(bare);
    await bare.evaluate(async (wf) => window.app.loadGraphData(structuredClone(wf)), config.workflow);
    await sleep(500);
    result.noRoute = {
      available: await bare.evaluate(() => window.DiffusersOffloadView.state.available),
      tabButton: await bare.locator(".diffusers-offload-tab-button").count(),
      visibleViews: await bare.evaluate(
        () => [...document.querySelectorAll(".dofl-node")].filter((n) => n.childElementCount).length,
      ),
      nodes: await bare.evaluate(() => window.app.graph.nodes.length),
    };
    await bare.close();
    lap("no route");
  } catch (err) {
    result.error = `${err.message}\n${err.stack ?? ""}`;
  } finally {
    writeFileSync(config.result, JSON.stringify(result, null, 1));
    await context.close();
  }
}

await main();
