// What drive.mjs reads from the page: each function runs in the browser and returns plain JSON.

/** A node's view (our DOM widget) and where it and the node are on screen. */
export async function readView(page, nodeId) {
  return page.evaluate((id) => {
    const root = document.querySelector(`.dofl-node[data-node="${id}"]`);
    if (!root) return null;
    const box = root.getBoundingClientRect();
    const app = window.app;
    const node = app.graph.getNodeById(id);
    const canvas = app.canvas.canvas.getBoundingClientRect();
    const { offset, scale } = app.canvas.ds;
    const preview = node?.widgets?.find((w) => w.name === "$$node-text-preview");
    return {
      stage: root.querySelector(".dofl-stage")?.dataset.stage ?? null,
      text: root.querySelector(".dofl-stage-text")?.textContent ?? null,
      shows: root.dataset.shows ?? null,
      visible: box.width > 0 && box.height > 0 && root.childElementCount > 0,
      box: { top: box.top, bottom: box.bottom, left: box.left, right: box.right },
      nodeBox: node && {
        top: canvas.top + (node.pos[1] + offset[1]) * scale,
        bottom: canvas.top + (node.pos[1] + node.size[1] + offset[1]) * scale,
      },
      size: node ? [node.size[0], node.size[1]] : null,
      least: node?.computeSize?.()[1] ?? null,
      progressText: preview ? String(preview.value ?? "") : null,
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

/** Every node's box in graph units, title bar included. */
export async function readLayout(page) {
  return page.evaluate(() => {
    const title = window.LiteGraph.NODE_TITLE_HEIGHT;
    return window.app.graph.nodes.map((n) => ({
      id: String(n.id), type: n.type, ours: String(n.type).startsWith("DiffusersOffload"),
      x: n.pos[0], y: n.pos[1] - title, w: n.size[0], h: n.size[1] + title,
    }));
  });
}

export async function readPanel(page) {
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

/** Records, during a run, every stage text the node view shows, the most component rows the
 *  generate node ever showed, our events, ComfyUI's progress text for that node and its preview
 *  images (how many, and the node each was for where the server says). */
export async function recordStages(page, nodeId) {
  await page.evaluate((id) => {
    window.__seen = [];
    window.__generateRows = 0;
    window.__events = { placement: 0, stage: 0, stages: [], stagePayloads: [], progressText: [], previews: 0, previewNodes: [] };
    const api = window.comfyAPI.api.api;
    api.addEventListener("b_preview", () => window.__events.previews++); // ComfyUI's preview images
    api.addEventListener("b_preview_with_metadata", ({ detail }) => window.__events.previewNodes.push(String(detail?.displayNodeId)));
    api.addEventListener("diffusers_offload.placement", () => window.__events.placement++);
    api.addEventListener("diffusers_offload.stage", ({ detail }) => {
      window.__events.stage++;
      if (String(detail?.node) !== String(id)) return;
      window.__events.stages.push(detail.stage ?? "");
      window.__events.stagePayloads.push({ prompt: detail.prompt, workflow: detail.workflow });
    });
    api.addEventListener("progress_text", ({ detail }) => {
      if (String(detail?.nodeId) === String(id)) window.__events.progressText.push(detail.text);
    });
    const note = () => {
      const view = document.querySelector(`.dofl-node[data-node="${id}"]`);
      window.__generateRows = Math.max(window.__generateRows, view?.querySelectorAll(".dofl-row").length ?? 0);
      const text = view?.querySelector(".dofl-stage-text")?.textContent;
      if (text && window.__seen.at(-1) !== text) window.__seen.push(text);
    };
    new MutationObserver(note).observe(document.body, { subtree: true, childList: true, characterData: true });
  }, nodeId);
}

/** The help page the frontend shows for each node ({type, title}), opened as a user does: select
 *  the node, then the selection toolbox's info button; waits for the page whose heading is `title`. */
export async function readHelp(page, nodes, sleep) {
  const ids = await page.evaluate((types) => {
    const graph = window.app.graph;
    return types.map((type, i) => {
      const node = window.LiteGraph.createNode(type);
      node.pos = [40 + 420 * (i % 3), 80 + 420 * Math.floor(i / 3)];
      graph.add(node);
      return node.id;
    });
  }, nodes.map((n) => n.type));
  const shown = () =>
    page.evaluate(() => {
      const root = document.querySelector(".node-help-content .markdown-content");
      return root ? { title: root.querySelector("h1")?.textContent ?? null, text: root.textContent } : null;
    });
  const help = {};
  for (const [i, { type, title }] of nodes.entries()) {
    let seen = null;
    for (let attempt = 0; attempt < 3 && seen?.title !== title; attempt++) {
      await page.evaluate((id) => {
        const canvas = window.app.canvas;
        const node = window.app.graph.getNodeById(id);
        canvas.deselectAll?.();
        canvas.ds.scale = 1;
        canvas.ds.offset = [1000 - node.pos[0], 400 - node.pos[1]]; // clear of the help panel
        canvas.selectNode(node);
        canvas.setDirty(true, true);
      }, ids[i]);
      await sleep(300);
      await page.locator('[data-testid="info-button"]').first().click();
      for (let t = 0; t < 30 && seen?.title !== title; t++) {
        await sleep(100);
        seen = await shown();
      }
    }
    help[type] = seen;
  }
  return help;
}

/** The preview images the frontend holds and draws for a node (ComfyUI's b_preview messages). */
export async function readPreview(page, nodeId) {
  return page.evaluate((id) => {
    const node = window.app.graph.getNodeById(id);
    const held = window.app.nodePreviewImages?.[String(id)];
    return { held: held ? [...held].length : 0, imgs: node?.imgs?.length ?? 0, size: node ? [node.size[0], node.size[1]] : null };
  }, nodeId);
}
