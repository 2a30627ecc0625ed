// Live placement and stage view of the Diffusers Offload pack: the one file that registers the
// extension. The work is in dofl/ (ComfyUI serves every .js under web/ and the page imports each
// of them too; the modules there only define things, so importing them twice does nothing more):
//   dofl/state.js       what the route and the events say, and which workflow it belongs to
//   dofl/node_view.js   placement on loaders and the report, the stage on every node, node sizes
//   dofl/stage_text.js  the stage text under a node cleared when its stage ends
//   dofl/panel.js       the sidebar tab (or floating panel) of every pipeline the pack holds
//   dofl/dom.js, dofl/style.js   shared DOM pieces and the style sheet
// Everything shown comes from the pack's state route and its websocket events: the page computes
// nothing but widths and labels. Without the route (an older pack or server: 404) the view stays
// hidden and the page is untouched.

import { app } from "../../scripts/app.js";
import { attachView, isOurs, renderViews } from "./dofl/node_view.js";
import { installPanel, renderPanel } from "./dofl/panel.js";
import { installStageTextCleanup } from "./dofl/stage_text.js";
import { fetchState, listen, onRedraw, refresh, start, state } from "./dofl/state.js";
import { installStyle } from "./dofl/style.js";

listen(); // now, while the app loads its extensions: before it opens the websocket

app.registerExtension({
  name: "diffusers_offload.view",

  nodeCreated(node) {
    if (isOurs(node)) attachView(node);
  },

  afterConfigureGraph() {
    refresh(); // another workflow (a tab switch) or the same one reloaded: redraw for its id
  },

  async setup() {
    installStyle();
    onRedraw(renderViews);
    onRedraw(renderPanel);
    installStageTextCleanup();
    await start();
    if (state.available) installPanel();
    window.DiffusersOffloadView = { state, fetchState };
  },
});
