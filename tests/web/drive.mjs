// Drives headless Chromium through one browser session against a running ComfyUI and writes
// what the page showed to a JSON file; tests/web/test_browser.py makes the assertions.
//
//   node drive.mjs config.json
//
// config: { url, result, chromium, profile, workflow (UI JSON), short, long (API prompts),
//           nodes: { loader, generate, report, settings } (ids in the workflow), previews (the server sends them),
//           shots: { node, panel, preview, canvas } }
//
// Every request the browser makes to a host other than the loopback server is aborted.

import { readFileSync, writeFileSync } from "node:fs";
import { chromium } from "playwright-core";
import { readHelp, readLayout, readPanel, readPreview, readView, recordStages } from "./page_reads.mjs";

const config = JSON.parse(readFileSync(process.argv[2], "utf8"));
const OURS = /diffusers_offload|dofl|DiffusersOffload/i;
const LOOPBACK = new Set(["127.0.0.1", "localhost", "[::1]"]);
const result = { console: [], pageErrors: [], steps: {}, network: { blocked: [], outside: [] } };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const { loader, generate, report, settings } = config.nodes;

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
async function openApp(page, { ours = true, reload = false } = {}) {
  const t = Date.now();
  if (reload) await page.reload({ waitUntil: "domcontentloaded" });
  else await page.goto(config.url, { waitUntil: "domcontentloaded" });
  const loaded = Date.now();
  await page.waitForFunction(() => window.app?.graph && window.LiteGraph && window.comfyAPI?.api?.api, null, {
    timeout: 90000,
  });
  const app = Date.now();
  if (ours) await page.waitForFunction(() => window.DiffusersOffloadView, null, { timeout: 30000 });
  (result.openings ??= []).push({ page: (Date.now() - t) / 1000, loaded: (loaded - t) / 1000, app: (app - t) / 1000 });
}

/** Show the example's UI workflow, its widgets set to what the long run queues (same ids). */
async function loadWorkflow(page) {
  await page.evaluate(async ([wf, prompt]) => {
    await window.app.loadGraphData(structuredClone(wf));
    for (const [id, { inputs }] of Object.entries(prompt)) {
      for (const widget of window.app.graph.getNodeById(id)?.widgets ?? []) {
        const value = inputs[widget.name];
        if (value !== undefined && !Array.isArray(value)) widget.value = value;
      }
    }
    window.app.canvas.ds.offset = [0, 0];
    window.app.canvas.ds.scale = 0.8;
    window.app.graph.setDirtyCanvas(true, true);
  }, [config.workflow, config.long]);
  return shownWorkflow(page);
}

/** The Offload settings node of the saved UI workflow, as the frontend rebuilt it from the schema:
 *  each widget's name, value and advanced flag (read before loadWorkflow sets values by name). */
async function readSettings(page, workflow = config.workflow) {
  return page.evaluate(async (wf) => {
    await window.app.loadGraphData(structuredClone(wf));
    const node = window.app.graph.nodes.find((n) => n.type === "DiffusersOffloadSettings");
    if (!node) return null;
    return {
      id: String(node.id),
      knowsAdvanced: typeof node.hasAdvancedWidgets === "function",
      widgets: node.widgets.map((w) => ({ name: w.name, value: w.value, advanced: Boolean(w.options?.advanced ?? w.advanced) })),
    };
  }, workflow);
}

/** Queue an API prompt as the frontend does: with the workflow on the canvas in extra_pnginfo. */
async function queue(page, prompt) {
  return page.evaluate(async (p) => {
    const { workflow } = await window.app.graphToPrompt();
    const res = await fetch("/api/prompt", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt: p, client_id: window.comfyAPI.api.api.clientId, extra_data: { extra_pnginfo: { workflow } } }),
    });
    const body = await res.json();
    if (!res.ok) throw new Error(JSON.stringify(body));
    return body.prompt_id;
  }, prompt);
}

async function finished(promptId, timeoutMs = 240000) {
  return until(`prompt ${promptId}`, async () => (await getJson(`/api/history/${promptId}`)).body?.[promptId], timeoutMs, 250);
}

const command = (page, id) => page.evaluate((c) => window.app.extensionManager.command.execute(c), id);
const shownWorkflow = (page) => page.evaluate(() => String(window.app.rootGraph?.id ?? window.app.graph.id));

/** Go back through the open workflow tabs to the one whose graph is `workflowId`. */
async function backToTab(page, workflowId) {
  for (let i = 0; i < 12 && (await shownWorkflow(page)) !== workflowId; i++) {
    const before = await shownWorkflow(page);
    await command(page, "Workspace.PreviousOpenedWorkflow");
    await until("the previous tab", async () => (await shownWorkflow(page)) !== before, 10000, 50);
  }
  if ((await shownWorkflow(page)) !== workflowId) throw new Error(`no open tab shows workflow ${workflowId}`);
  await sleep(300);
}
const views = async (page) => ({
  loader: await readView(page, loader), generate: await readView(page, generate),
  report: await readView(page, report), settings: await readView(page, settings),
});

/** A screenshot of one node (title, widgets and our view) as the canvas draws it. */
async function shootNode(page, nodeId, path) {
  const clip = await page.evaluate((id) => {
    const app = window.app;
    const node = app.graph.getNodeById(id);
    app.canvas.bringToFront(node); // drawn over a neighbour it may touch
    app.canvas.ds.scale = 1;
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
  await context.route("**/*", (route) => {
    const url = route.request().url();
    if (LOOPBACK.has(new URL(url).hostname)) return route.continue();
    result.network.blocked.push(url);
    return route.abort("blockedbyclient");
  });
  context.on("response", (res) => {
    const url = res.url();
    if (/^https?:/.test(url) && !LOOPBACK.has(new URL(url).hostname)) result.network.outside.push(url);
  });
  const t0 = Date.now();
  const lap = (name) => (result.steps[name] = (Date.now() - t0) / 1000);
  try {
    const page = context.pages()[0] ?? (await context.newPage());
    watch(page, "main");

    // 1. the extension loads, once; the server's node info (search aliases, module)
    await openApp(page);
    lap("loaded");
    result.extensions = (await getJson("/api/extensions")).body;
    result.registered = await page.evaluate(() =>
      (window.app.extensions ?? []).map((e) => e.name).filter((n) => /diffusers.?offload/i.test(n)),
    );
    const info = (await getJson("/api/object_info")).body;
    result.nodeInfo = Object.fromEntries(
      Object.entries(info).filter(([k]) => k.startsWith("DiffusersOffload")).map(([k, v]) => [
        k, { display_name: v.display_name, python_module: v.python_module, search_aliases: v.search_aliases ?? null },
      ]),
    );
    result.nodeTypes = Object.keys(result.nodeInfo);
    result.tabButton = await page.locator(".diffusers-offload-tab-button").count();
    result.settings = await readSettings(page);
    result.olderSettings = {}; // the same workflow as saved before the later (optional) options existed
    for (const [last, wf] of Object.entries(config.olderWorkflows)) result.olderSettings[last] = await readSettings(page, wf);
    result.settingsSchema = { DiffusersOffloadSettings: info.DiffusersOffloadSettings };
    result.workflowId = await loadWorkflow(page);
    result.idle = { views: await views(page), layout: await readLayout(page) };

    // 2. a short run: stages on the generate node, then the final placement on the loader and report
    await recordStages(page, generate);
    const shortId = await queue(page, config.short);
    result.shortId = shortId;
    result.shortHistory = (await finished(shortId)).status;
    await until("the stage to clear", async () => (await readView(page, generate))?.shows === "nothing", 20000);
    await sleep(300); // a frame for the sizes
    lap("short run");
    result.seen = await page.evaluate(() => window.__seen);
    result.generateRows = await page.evaluate(() => window.__generateRows);
    result.events = await page.evaluate(() => window.__events);
    result.after = { views: await views(page), layout: await readLayout(page) };
    result.route = await page.evaluate(async () => (await fetch("/api/diffusers_offload/state")).json());
    if (config.shots.canvas) await page.screenshot({ path: config.shots.canvas });
    // the last preview image ComfyUI drew on the generate node stays there after the run
    result.preview = await readPreview(page, generate);
    if (config.previews && config.shots.preview) {
      // the frontend grows the node for the image, over the report node under it: that one (its
      // view is DOM, above the canvas) steps aside for the picture
      const moveReport = (dx) => page.evaluate(([id, d]) => {
        window.app.graph.getNodeById(id).pos[0] += d;
        window.app.canvas.setDirty(true, true);
      }, [report, dx]);
      await moveReport(5000);
      await shootNode(page, generate, config.shots.preview);
      await moveReport(-5000);
    }

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

    // 4. a new workflow tab with the same node ids shows nothing of the first tab's run; back on
    //    the first tab, its placement is there again
    await command(page, "Comfy.NewBlankWorkflow");
    const otherId = await loadWorkflow(page);
    await sleep(300);
    result.otherTab = { workflowId: otherId, views: await views(page) };
    await backToTab(page, result.workflowId);
    result.backTab = {
      workflowId: await shownWorkflow(page),
      views: await until("the first tab's placement", async () => {
        const v = await views(page);
        return v.loader?.shows === "placement" ? v : null;
      }, 10000).catch(() => views(page)),
    };
    lap("tabs");

    // 5. help pages (every node of the pack, in a tab of its own) and the node search
    await command(page, "Comfy.NewBlankWorkflow");
    result.help = await readHelp(page, result.nodeTypes.map((type) => ({ type, title: result.nodeInfo[type].display_name })), sleep);
    await page.evaluate(() => { // close the node library the help opened in
      const workspace = window.app.extensionManager;
      const tab = workspace.activeSidebarTabId;
      if (tab) return workspace.command.execute(`Workspace.ToggleSidebarTab.${tab}`);
    });
    if (Object.values(result.nodeInfo).some((n) => n.search_aliases)) {
      await command(page, "Workspace.SearchBox.Toggle");
      const input = page.locator("input[role=combobox]:visible").first();
      result.search = {};
      for (const words of ["block swap", "wan", "h3"]) {
        await input.fill(words);
        await sleep(700);
        result.search[words] = await page.evaluate(() => [...document.querySelectorAll("[role=option]")].map((o) => o.textContent));
      }
      await page.keyboard.press("Escape");
    }
    await backToTab(page, result.workflowId);
    lap("help");

    // 6. a long run: reload in the middle; events that come before the extension's setup are
    //    buffered, and the view comes back from the route
    const longId = await queue(page, config.long);
    result.longId = longId;
    result.midText = await until(
      "a denoise step on the generate node",
      async () => {
        const view = await readView(page, generate);
        return view?.stage === "denoise" && /denoise [1-9]/.test(view.text) ? view.text : null;
      },
      120000,
    );
    await until("the loader's rows", async () => (await readView(page, loader))?.rows.length, 10000);
    await shootNode(page, loader, config.shots.node);
    lap("mid run");
    // the route answers late, so the run's events surely reach the page before the view is live
    const slowRoute = async (route) => { await sleep(1500); await route.continue(); };
    await page.route("**/diffusers_offload/state", slowRoute);
    await openApp(page, { reload: true });
    await page.unroute("**/diffusers_offload/state", slowRoute);
    lap("reopened");
    // the frontend restores the open tab (the same workflow id) a little after its setup
    const restored = await until("the restored tab", async () => (await shownWorkflow(page)) === result.workflowId, 15000)
      .catch(() => false);
    result.reload = {
      workflowRestoredByFrontend: restored,
      early: await page.evaluate(() => window.DiffusersOffloadView.state.early),
      routeStages: await page.evaluate(() => window.DiffusersOffloadView.state.fromRoute?.stages ?? null),
      view: await until("the restored view", async () => {
        const view = await readView(page, generate);
        return view?.visible && view.stage && view.stage !== "idle" ? view : null;
      }, 20000),
      loader: await readView(page, loader),
      historyDoneAtReload: Boolean((await getJson(`/api/history/${longId}`)).body?.[longId]),
    };
    lap("reloaded");
    await fetch(`${config.url}/api/interrupt`, { method: "POST" });
    result.longHistory = (await finished(longId)).status;
    result.afterLong = await until("the stage to clear after the run", async () => {
      const view = await readView(page, generate);
      return view?.shows === "nothing" ? view : null;
    }, 20000);
    lap("long run");

    // 7. a server without the route (404): nothing of ours shows, nothing breaks
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
