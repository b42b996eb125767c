/* rocs report viewer: draws the graphs embedded in #rocs-data as SVG, with a layered layout,
 * module groups that collapse and expand, zoom and pan, search and a detail panel per node.
 *
 * Layout: every node sits on the layer of its longest path from an input; an edge that spans
 * several layers passes through one reserved slot per layer it crosses (shared by all edges of
 * one source), so edges run between nodes, never through them. Layers are ordered by role
 * (REQUEST, CONST, CANDIDATE, so the regions form columns), then by the barycentre of their
 * neighbours; x positions are the least-squares fit to the neighbours' positions that keeps
 * the order and the gaps (isotonic regression by pool-adjacent-violators).
 *
 * With "?selftest" in the address the page checks itself and writes the result as JSON into
 * #rocs-selftest (used by the browser test).
 */
(function () {
  "use strict";
  var errors = [];
  window.addEventListener("error", function (e) { errors.push(String(e.message)); });
  var consoleError = console.error;
  console.error = function () {
    errors.push(Array.prototype.join.call(arguments, " "));
    consoleError.apply(console, arguments);
  };

  var DATA = JSON.parse(document.getElementById("rocs-data").textContent);
  var SVGNS = "http://www.w3.org/2000/svg";
  var ROLE_ORDER = { REQUEST: 0, CONST: 1, CANDIDATE: 2 };
  var UNIT = { REQUEST: "/req", CANDIDATE: "/cand", CONST: "" };
  var CHAR_W = 6.3, LINE_H = 13, PAD = 6, GAP_X = 16, GAP_Y = 40, SLOT_W = 6, MAX_W = 240;
  var canvas = document.getElementById("rocs-canvas");
  var svg = document.getElementById("rocs-svg");
  var viewport = document.getElementById("rocs-viewport");
  var details = document.getElementById("rocs-details");
  var searchBox = document.getElementById("rocs-search");
  var searchInfo = document.getElementById("rocs-search-info");
  var moduleTree = document.getElementById("rocs-modules");
  var state = { view: null, collapsed: {}, showShape: false, scale: 1, tx: 0, ty: 0 };
  var current = null; // { view, graph, boxes, width, height }
  var search = { query: "", hits: [], at: -1 };

  function el(tag, attrs, parent) {
    var node = document.createElementNS(SVGNS, tag);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function html(tag, text, parent, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = text;
    if (cls) node.className = cls;
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmtFlops(f) {
    var units = [["G", 1e9], ["M", 1e6], ["K", 1e3]];
    for (var i = 0; i < units.length; i++)
      if (Math.abs(f) >= units[i][1]) return (f / units[i][1]).toFixed(2) + units[i][0];
    return String(Math.round(f));
  }
  function viewByName(name) {
    for (var i = 0; i < DATA.views.length; i++) if (DATA.views[i].name === name) return DATA.views[i];
    return null;
  }
  function prefixes(module) {
    if (!module) return [];
    var parts = module.split("."), out = [];
    for (var i = 0; i < parts.length; i++) out.push(parts.slice(0, i + 1).join("."));
    return out;
  }
  function collapsedSet(view) {
    if (!state.collapsed[view.name]) {
      var set = {};
      if (view.nodes.length > DATA.collapse_above) {
        var counts = {};
        view.nodes.forEach(function (n) {
          var top = prefixes(n.module)[0];
          if (top && n.op !== "input") counts[top] = (counts[top] || 0) + 1;
        });
        for (var m in counts) if (counts[m] >= 3) set[m] = true;
      }
      state.collapsed[view.name] = set;
    }
    return state.collapsed[view.name];
  }
  function groupOf(node, collapsed) {
    if (node.op === "input" || node.op === "output") return null;
    var ps = prefixes(node.module);
    for (var i = 0; i < ps.length; i++) if (collapsed[ps[i]]) return ps[i];
    return null;
  }

  // -- the visible graph: nodes, or one box per (collapsed module, role) -------------------------
  function visibleGraph(view) {
    var collapsed = collapsedSet(view);
    var items = [], byKey = {}, itemOf = [];
    view.nodes.forEach(function (n, i) {
      var g = groupOf(n, collapsed);
      var key = g === null ? "n" + i : "g:" + g + ":" + n.role;
      var item = byKey[key];
      if (!item) {
        item = byKey[key] = { key: key, group: g, role: n.role, members: [], index: items.length,
                              flops: 0, fused: false, broadcast: false };
        items.push(item);
      }
      item.members.push(i);
      item.flops += n.flops || 0;
      if (n.fused) item.fused = true;
      itemOf.push(item);
    });
    var edges = [], seen = {};
    view.edges.forEach(function (e) {
      var a = itemOf[e[0]], b = itemOf[e[1]], kind = e[2]; // 0 data, 1 broadcast, 2 shape only
      if (a === b) return;
      var key = a.key + ">" + b.key, prev = seen[key];
      if (prev) {
        if (kind === 1 || (kind === 0 && prev.kind === 2)) prev.kind = kind;
        return;
      }
      edges.push(seen[key] = { a: a, b: b, kind: kind });
    });
    edges.forEach(function (e) { if (e.kind === 1) e.a.broadcast = true; });
    return { items: items, edges: edges, itemOf: itemOf };
  }

  function labelLines(view, item) {
    if (item.group !== null) {
      var lines = ["\u25b8 " + item.group, item.members.length + " nodes"];
      if (item.flops) lines.push(fmtFlops(item.flops) + " FLOPs" + UNIT[item.role]);
      return lines;
    }
    var n = view.nodes[item.members[0]];
    var out = [n.op === "input" ? "input " + n.name : n.short];
    if (n.module) out.push(n.module);
    if (n.flops) out.push(fmtFlops(n.flops) + " FLOPs" + UNIT[n.role]);
    return out;
  }

  // -- layout ---------------------------------------------------------------------------------
  function layout(view, graph) {
    var items = graph.items;
    items.forEach(function (it) {
      var lines = labelLines(view, it), longest = 0;
      lines.forEach(function (l) { longest = Math.max(longest, l.length); });
      it.lines = lines;
      it.w = Math.min(MAX_W, longest * CHAR_W + 2 * PAD);
      it.h = lines.length * LINE_H + 2 * PAD;
      it.preds = []; it.succs = [];
    });
    var forward = graph.edges.filter(function (e) { return e.kind !== 2 && e.a.index < e.b.index; });
    forward.forEach(function (e) { e.b.preds.push(e.a); e.a.succs.push(e.b); });
    items.forEach(function (it) {
      var r = 0;
      it.preds.forEach(function (p) { r = Math.max(r, p.rank + 1); });
      it.rank = r;
    });
    for (var i = items.length - 1; i >= 0; i--) {
      // A weight-only source sits just above its first consumer, not next to the inputs.
      var it = items[i], n = view.nodes[it.members[0]];
      if (n.op !== "input" && !it.preds.length && it.succs.length) {
        var lowest = Infinity;
        it.succs.forEach(function (s) { lowest = Math.min(lowest, s.rank); });
        it.rank = Math.max(0, lowest - 1);
      }
    }
    var depth = 0;
    items.forEach(function (it) { depth = Math.max(depth, it.rank + 1); });
    var layers = [];
    for (var r = 0; r < depth; r++) layers.push([]);
    items.forEach(function (it) {
      it.up = []; it.down = []; it.dummy = false;
      layers[it.rank].push(it);
    });
    // One chain of slots per source, down to its lowest target.
    items.forEach(function (s) {
      var last = s.rank;
      s.succs.forEach(function (t) { last = Math.max(last, t.rank); });
      s.chain = {};
      var prev = s;
      for (var r = s.rank + 1; r < last; r++) {
        var d = { dummy: true, role: s.role, rank: r, w: SLOT_W, h: 0, up: [prev], down: [] };
        prev.down.push(d);
        layers[r].push(d);
        s.chain[r] = d;
        prev = d;
      }
      s.succs.forEach(function (t) {
        var above = t.rank - 1 > s.rank ? s.chain[t.rank - 1] : s;
        above.down.push(t);
        t.up.push(above);
      });
    });
    orderLayers(layers);
    placeX(layers);
    var y = 56, heights = [];
    layers.forEach(function (layer, r) {
      var h = 0;
      layer.forEach(function (v) { h = Math.max(h, v.h); });
      heights.push(h);
      layer.forEach(function (v) { v.y = y + (h - v.h) / 2; v.top = y; v.bottom = y + h; });
      y += h + GAP_Y;
    });
    var minX = Infinity, maxX = -Infinity;
    layers.forEach(function (layer) {
      layer.forEach(function (v) { minX = Math.min(minX, v.x - v.w / 2); maxX = Math.max(maxX, v.x + v.w / 2); });
    });
    if (minX === Infinity) { minX = 0; maxX = 200; }
    var shift = 20 - minX;
    layers.forEach(function (layer) { layer.forEach(function (v) { v.x += shift; }); });
    return { width: Math.max(maxX - minX + 40, 760), height: y, layers: layers };
  }

  function roleKey(v) { return ROLE_ORDER[v.role] === undefined ? 2 : ROLE_ORDER[v.role]; }

  function orderLayers(layers) {
    layers.forEach(function (layer) {
      layer.sort(function (a, b) { return roleKey(a) - roleKey(b) || (a.index || 0) - (b.index || 0); });
      layer.forEach(function (v, i) { v.pos = i; });
    });
    for (var iter = 0; iter < 6; iter++) {
      var down = iter % 2 === 0;
      for (var k = 0; k < layers.length; k++) {
        var layer = layers[down ? k : layers.length - 1 - k];
        layer.forEach(function (v) {
          var ns = down ? v.up : v.down, sum = 0;
          ns.forEach(function (u) { sum += u.pos; });
          v.bc = ns.length ? sum / ns.length : v.pos;
        });
        layer.sort(function (a, b) { return roleKey(a) - roleKey(b) || a.bc - b.bc; });
        layer.forEach(function (v, i) { v.pos = i; });
      }
    }
  }

  // Least-squares positions x_i close to want_i with x_{i+1} - x_i >= gap_i (order kept).
  function fit(layer, want) {
    var offsets = [0];
    for (var i = 1; i < layer.length; i++)
      offsets.push(offsets[i - 1] + layer[i - 1].w / 2 + GAP_X + layer[i].w / 2);
    var blocks = [];
    for (i = 0; i < layer.length; i++) {
      var b = { sum: want[i] - offsets[i], n: 1 };
      while (blocks.length && blocks[blocks.length - 1].sum / blocks[blocks.length - 1].n > b.sum / b.n) {
        var top = blocks.pop();
        b = { sum: b.sum + top.sum, n: b.n + top.n };
      }
      blocks.push(b);
    }
    var k = 0;
    blocks.forEach(function (blk) {
      for (var j = 0; j < blk.n; j++, k++) layer[k].x = blk.sum / blk.n + offsets[k];
    });
  }

  function placeX(layers) {
    layers.forEach(function (layer) {
      var x = 0;
      layer.forEach(function (v) { v.x = x + v.w / 2; x += v.w + GAP_X; });
      var half = x / 2;
      layer.forEach(function (v) { v.x -= half; });
    });
    for (var iter = 0; iter < 8; iter++) {
      var down = iter % 2 === 0;
      for (var k = 0; k < layers.length; k++) {
        var layer = layers[down ? k : layers.length - 1 - k];
        var want = layer.map(function (v) {
          var ns = down ? v.up : v.down;
          if (!ns.length) ns = down ? v.down : v.up;
          if (!ns.length) return v.x;
          var sum = 0;
          ns.forEach(function (u) { sum += u.x; });
          return sum / ns.length;
        });
        fit(layer, want);
      }
    }
  }

  // -- drawing ---------------------------------------------------------------------------------
  function curve(x1, y1, x2, y2) {
    var h = (y2 - y1) / 2;
    return "C " + x1 + " " + (y1 + h) + " " + x2 + " " + (y2 - h) + " " + x2 + " " + y2;
  }

  function edgePath(e) {
    var s = e.a, t = e.b;
    if (e.kind === 2 || s.index > t.index) {
      // Shape-only (an overlay) or backward (after grouping): one curve on the right.
      var x1 = s.x + s.w / 2, y1 = s.y + s.h / 2, x2 = t.x + t.w / 2, y2 = t.y + t.h / 2;
      var bulge = Math.max(x1, x2) + 40;
      return "M " + x1 + " " + y1 + " C " + bulge + " " + y1 + " " + bulge + " " + y2 + " " + x2 + " " + y2;
    }
    var d = "M " + s.x + " " + (s.y + s.h), x = s.x, y = s.y + s.h;
    for (var r = s.rank + 1; r < t.rank; r++) {
      var slot = s.chain[r];
      d += " " + curve(x, y, slot.x, slot.top) + " L " + slot.x + " " + slot.bottom;
      x = slot.x; y = slot.bottom;
    }
    return d + " " + curve(x, y, t.x, t.y);
  }

  function render() {
    var view = viewByName(state.view);
    var graph = visibleGraph(view);
    var box = layout(view, graph);
    while (viewport.firstChild) viewport.removeChild(viewport.firstChild);
    var edgeLayer = el("g", { "class": "edges" }, viewport);
    var nodeLayer = el("g", { "class": "nodes" }, viewport);
    graph.edges.forEach(function (e) {
      if (e.kind === 2 && !state.showShape) return;
      var cls = "edge" + (e.kind === 1 ? " broadcast" : e.kind === 2 ? " shape" : "");
      var marker = e.kind === 1 ? "url(#rocs-arrow-bc)" : "url(#rocs-arrow)";
      el("path", { d: edgePath(e), "class": cls, "marker-end": marker }, edgeLayer);
    });
    graph.items.forEach(function (it) {
      var cls = "node role-" + it.role + (it.fused ? " fused" : "") + (it.group !== null ? " group" : "") +
        (it.broadcast ? " broadcast-source" : "");
      var g = el("g", { "class": cls, "data-key": it.key, transform: "translate(" + (it.x - it.w / 2) + "," + it.y + ")" }, nodeLayer);
      el("rect", { width: it.w, height: it.h, rx: it.group !== null ? 9 : 5 }, g);
      if (it.fused && it.group === null) el("rect", { "class": "inner", x: 3, y: 3, width: it.w - 6, height: it.h - 6, rx: 3 }, g);
      it.lines.forEach(function (line, i) {
        var t = el("text", { x: it.w / 2, y: PAD + LINE_H * (i + 0.8), "class": i === 0 ? "head" : "" }, g);
        t.textContent = line.length > 38 ? line.slice(0, 37) + "\u2026" : line;
      });
      g.addEventListener("click", function (ev) { ev.stopPropagation(); select(it); });
      g.addEventListener("dblclick", function (ev) {
        ev.stopPropagation();
        if (it.group !== null) setCollapsed(it.group, false);
      });
      it.element = g;
    });
    current = { view: view, graph: graph, width: box.width, height: box.height };
    svg.setAttribute("data-nodes", String(graph.items.length));
    renderTabs();
    renderModules(view);
    highlightHits();
  }

  // -- zoom and pan ------------------------------------------------------------------------------
  function applyTransform() {
    viewport.setAttribute("transform", "translate(" + state.tx + "," + state.ty + ") scale(" + state.scale + ")");
  }
  function fitWidth() {
    var w = canvas.clientWidth || 800;
    state.scale = Math.min(1, w / current.width);
    state.tx = (w - current.width * state.scale) / 2;
    state.ty = 0;
    applyTransform();
  }
  function fitAll() {
    var w = canvas.clientWidth || 800, h = canvas.clientHeight || 600;
    state.scale = Math.min(1, w / current.width, h / current.height);
    state.tx = (w - current.width * state.scale) / 2;
    state.ty = 0;
    applyTransform();
  }
  function zoom(factor, cx, cy) {
    var s = Math.max(0.05, Math.min(4, state.scale * factor));
    if (cx === undefined) { cx = canvas.clientWidth / 2; cy = canvas.clientHeight / 2; }
    state.tx = cx - (cx - state.tx) * (s / state.scale);
    state.ty = cy - (cy - state.ty) * (s / state.scale);
    state.scale = s;
    applyTransform();
  }
  function centerOn(it) {
    state.scale = Math.max(state.scale, 0.8);
    state.tx = canvas.clientWidth / 2 - it.x * state.scale;
    state.ty = canvas.clientHeight / 2 - (it.y + it.h / 2) * state.scale;
    applyTransform();
  }
  canvas.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    var r = canvas.getBoundingClientRect();
    zoom(Math.exp(-ev.deltaY * 0.0015), ev.clientX - r.left, ev.clientY - r.top);
  }, { passive: false });
  var drag = null;
  canvas.addEventListener("mousedown", function (ev) { drag = { x: ev.clientX - state.tx, y: ev.clientY - state.ty }; });
  window.addEventListener("mousemove", function (ev) {
    if (!drag) return;
    state.tx = ev.clientX - drag.x; state.ty = ev.clientY - drag.y;
    applyTransform();
  });
  window.addEventListener("mouseup", function () { drag = null; });

  // -- collapse and expand -----------------------------------------------------------------------
  function setCollapsed(module, collapsed) {
    var set = collapsedSet(current.view);
    if (collapsed) {
      set[module] = true;
    } else {
      delete set[module];
      for (var m in set) if (m.indexOf(module + ".") === 0) delete set[m];
    }
    render();
  }
  function setAll(collapsed) {
    var set = {};
    if (collapsed) current.view.nodes.forEach(function (n) {
      var top = prefixes(n.module)[0];
      if (top && n.op !== "input") set[top] = true;
    });
    state.collapsed[current.view.name] = set;
    render();
    fitWidth();
  }
  function renderModules(view) {
    while (moduleTree.firstChild) moduleTree.removeChild(moduleTree.firstChild);
    var counts = {}, order = [];
    view.nodes.forEach(function (n) {
      if (n.op === "input" || n.op === "output") return;
      prefixes(n.module).forEach(function (p) {
        if (!(p in counts)) { counts[p] = 0; order.push(p); }
        counts[p] += 1;
      });
    });
    order.sort();
    var set = collapsedSet(view);
    order.forEach(function (m) {
      var depth = m.split(".").length - 1;
      var row = html("div", null, moduleTree, "module-row");
      row.style.paddingLeft = (depth * 12) + "px";
      var hidden = prefixes(m).slice(0, -1).some(function (p) { return set[p]; });
      if (hidden) row.className += " hidden-by-parent";
      var button = html("button", set[m] ? "+" : "\u2212", row, "toggle");
      button.title = set[m] ? "expand" : "collapse";
      button.setAttribute("data-module", m);
      button.addEventListener("click", function () { setCollapsed(m, !set[m]); });
      html("span", m + " (" + counts[m] + ")", row);
    });
  }

  // -- selection and details -------------------------------------------------------------------
  function row(table, key, value) {
    if (value === undefined || value === null || value === "") return;
    var tr = html("tr", null, table);
    html("th", key, tr);
    html("td", value, tr);
  }
  function select(it) {
    Array.prototype.forEach.call(viewport.querySelectorAll(".selected"), function (e) {
      e.classList.remove("selected");
    });
    if (it.element) it.element.classList.add("selected");
    var view = current.view;
    while (details.firstChild) details.removeChild(details.firstChild);
    html("h3", it.group !== null ? "module " + it.group : view.nodes[it.members[0]].name, details);
    var table = html("table", null, details);
    if (it.group !== null) {
      row(table, "role", it.role);
      row(table, "nodes", String(it.members.length));
      row(table, "FLOPs", it.flops ? fmtFlops(it.flops) + UNIT[it.role] : "-");
      var ops = {};
      it.members.forEach(function (i) { var s = view.nodes[i].short; ops[s] = (ops[s] || 0) + 1; });
      row(table, "ops", Object.keys(ops).map(function (k) {
        return k + (ops[k] > 1 ? " \u00d7" + ops[k] : "");
      }).join(", "));
      var b = html("button", "expand " + it.group, details, "action");
      b.addEventListener("click", function () { setCollapsed(it.group, false); });
      return;
    }
    var n = view.nodes[it.members[0]];
    row(table, "op", n.op);
    row(table, "role", n.role + " \u2014 " + DATA.role_titles[n.role]);
    row(table, "module", n.module || (n.op === "input" || n.op === "output" ? "" : "(top level)"));
    row(table, "shape", n.shape);
    row(table, "batch axis", n.axis);
    row(table, "FLOPs", n.flops ? fmtFlops(n.flops) + " " + { REQUEST: "per request", CANDIDATE: "per candidate", CONST: "once" }[n.role] : "-");
    if (n.broadcast) row(table, "broadcast", "read by candidate computation: gathered per candidate");
    if (n.fused) row(table, "fused", "a rocs:: kernel that reads request rows through candidate_to_request");
    row(table, "reason", n.reason);
    var index = it.members[0], ins = [], outs = [];
    view.edges.forEach(function (e) {
      var label = e[2] === 2 ? " (shape only)" : e[2] === 1 ? " (broadcast)" : "";
      if (e[1] === index) ins.push([e[0], label]);
      if (e[0] === index) outs.push([e[1], label]);
    });
    [["inputs", ins], ["users", outs]].forEach(function (pair) {
      if (!pair[1].length) return;
      var tr = html("tr", null, table);
      html("th", pair[0], tr);
      var td = html("td", null, tr);
      pair[1].forEach(function (p, k) {
        if (k) td.appendChild(document.createTextNode(", "));
        var a = html("a", view.nodes[p[0]].name + p[1], td);
        a.href = "#";
        a.addEventListener("click", function (ev) { ev.preventDefault(); reveal(p[0]); });
      });
    });
    prefixes(n.module).forEach(function (m) {
      if (n.op === "input") return;
      var b = html("button", "collapse " + m, details, "action");
      b.addEventListener("click", function () { setCollapsed(m, true); });
    });
  }

  function reveal(index) {
    var view = current.view, set = collapsedSet(view), changed = false;
    prefixes(view.nodes[index].module).forEach(function (p) { if (set[p]) { delete set[p]; changed = true; } });
    if (changed) render();
    var it = current.graph.itemOf[index];
    select(it);
    centerOn(it);
    return it;
  }

  // -- search ----------------------------------------------------------------------------------
  function runSearch(query) {
    search.query = query.trim().toLowerCase();
    search.hits = [];
    search.at = -1;
    if (search.query) current.view.nodes.forEach(function (n, i) {
      var text = (n.name + " " + n.op + " " + n.module).toLowerCase();
      if (text.indexOf(search.query) >= 0) search.hits.push(i);
    });
    searchInfo.textContent = search.query ? search.hits.length + " match" + (search.hits.length === 1 ? "" : "es") : "";
    highlightHits();
    return nextHit();
  }
  function nextHit() {
    if (!search.hits.length) return null;
    search.at = (search.at + 1) % search.hits.length;
    var it = reveal(search.hits[search.at]);
    highlightHits();
    searchInfo.textContent = (search.at + 1) + " of " + search.hits.length;
    return it;
  }
  function highlightHits() {
    Array.prototype.forEach.call(viewport.querySelectorAll(".match"), function (e) { e.classList.remove("match"); });
    if (!current) return;
    search.hits.forEach(function (i) {
      var it = current.graph.itemOf[i];
      if (it && it.element) it.element.classList.add("match");
    });
  }
  searchBox.addEventListener("keydown", function (ev) {
    if (ev.key !== "Enter") return;
    if (searchBox.value.trim().toLowerCase() === search.query && search.hits.length) nextHit();
    else runSearch(searchBox.value);
  });

  // -- toolbar ---------------------------------------------------------------------------------
  function renderTabs() {
    Array.prototype.forEach.call(document.querySelectorAll("#rocs-tabs button"), function (b) {
      b.classList.toggle("active", b.getAttribute("data-view") === state.view);
    });
  }
  function showView(name) {
    state.view = name;
    search.hits = [];
    searchInfo.textContent = "";
    render();
    fitWidth();
  }
  DATA.views.forEach(function (v) {
    var b = html("button", v.title, document.getElementById("rocs-tabs"));
    b.setAttribute("data-view", v.name);
    b.addEventListener("click", function () { showView(v.name); });
  });
  function on(id, fn) { document.getElementById(id).addEventListener("click", fn); }
  on("rocs-zoom-in", function () { zoom(1.25); });
  on("rocs-zoom-out", function () { zoom(0.8); });
  on("rocs-fit", fitAll);
  on("rocs-collapse-all", function () { setAll(true); });
  on("rocs-expand-all", function () { setAll(false); });
  document.getElementById("rocs-shape-edges").addEventListener("change", function (ev) {
    state.showShape = ev.target.checked;
    render();
  });

  if (!DATA.views.length) {
    document.getElementById("graph").style.display = "none";
    return;
  }
  showView(DATA.default_view || DATA.views[0].name);

  // -- self test -------------------------------------------------------------------------------
  if (location.search.indexOf("selftest") < 0) return;
  var result = { checks: {}, errors: errors };
  function check(name, fn) {
    try { result.checks[name] = fn(); } catch (e) { result.checks[name] = { ok: false, error: String(e) }; }
  }
  function drawnBox() {
    var b = viewport.getBBox();
    return { width: b.width, height: b.height, nodes: viewport.querySelectorAll("g.node").length };
  }
  DATA.views.forEach(function (v) {
    check("render " + v.name, function () {
      showView(v.name);
      var b = drawnBox(), r = viewport.getBoundingClientRect(), c = canvas.getBoundingClientRect();
      return { ok: b.width > 0 && b.height > 0 && b.nodes > 0 && r.right <= c.right + 1 && r.left >= c.left - 1,
               width: b.width, height: b.height, nodes: b.nodes };
    });
  });
  showView(DATA.views[DATA.views.length - 1].name);
  check("search", function () {
    var view = current.view, target = null;
    view.nodes.forEach(function (n) { if (!target && n.module && n.op !== "input") target = n; });
    var it = runSearch(target.name);
    var selected = viewport.querySelector("g.node.selected");
    return { ok: !!it && !!selected && it.members.indexOf(view.nodes.indexOf(target)) >= 0 &&
                 details.textContent.indexOf(target.name) >= 0, query: target.name, hits: search.hits.length };
  });
  check("collapse", function () {
    setAll(false);
    var before = viewport.querySelectorAll("g.node").length;
    var view = current.view, counts = {};
    view.nodes.forEach(function (n) { var t = prefixes(n.module)[0]; if (t && n.op !== "input") counts[t] = (counts[t] || 0) + 1; });
    var module = Object.keys(counts).sort(function (a, b) { return counts[b] - counts[a]; })[0];
    setCollapsed(module, true);
    var collapsed = viewport.querySelectorAll("g.node").length, groups = viewport.querySelectorAll("g.node.group").length;
    setCollapsed(module, false);
    var after = viewport.querySelectorAll("g.node").length;
    return { ok: collapsed < before && groups > 0 && after === before, module: module,
             before: before, collapsed: collapsed, after: after };
  });
  result.ok = errors.length === 0 && Object.keys(result.checks).every(function (k) { return result.checks[k].ok; });
  document.getElementById("rocs-selftest").textContent = JSON.stringify(result);
})();
