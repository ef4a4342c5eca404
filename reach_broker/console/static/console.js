// reach console: plain JavaScript, no libraries. The broker pushes the fleet, the events and
// the compensation queue over one EventSource (/events); the page updates in place. Every
// text from the broker goes in through textContent, never as HTML.
"use strict";

const STATES = ["healthy", "suspect", "offline", "recovering", "draining"];
const TERMS = ["liveness", "latency", "load", "success", "stuck"];
const SVG = "http://www.w3.org/2000/svg";

const view = {
  hello: null, fleet: null, events: [], comp: null, selected: null, detail: null,
  detailTimer: null, chartCap: null, owners: null, pageCursor: null,
};
const STATE_COLORS = { healthy: "#1a7f37", suspect: "#b35900", offline: "#c8202d",
  recovering: "#0969da", draining: "#7a4fd0", registered: "#8c959f" };

function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false) continue;
    node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return node;
}

function fix(x, digits = 2) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }

function ago(ms) {
  if (!ms) return "–";
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${Math.floor(s % 60)}s ago`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m ago`;
}

function clock(ms) {
  const d = new Date(ms);
  return d.toLocaleTimeString([], { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0").slice(0, 1);
}

function bar(value, max, extra) {
  const share = Math.max(0, Math.min(1, value / max));
  const cls = extra === undefined ? "bar" : `bar ${extra}`;
  const fill = el("i");
  fill.style.width = `${(share * 100).toFixed(1)}%`; // CSSOM, allowed by the page's CSP
  return el("span", { class: cls }, fill);
}

function scoreClass(score) { return score < 60 ? "low" : score < 80 ? "mid" : ""; }

function termsTitle(explain) {
  const t = explain.terms;
  const parts = TERMS.map((k) => `${k} ${fix(t[k])}`);
  const weak = explain.weakest ? `\nweakest: ${explain.weakest}` : "\nevery term at 1";
  return `score = 100 × liveness × latency × load^w × success^w × stuck\n${parts.join(" · ")}${weak}`;
}

function stateBadge(state) { return el("span", { class: `state ${state}`, text: state }); }

// --- the stream ---------------------------------------------------------------------------

function connect() {
  const link = document.getElementById("link");
  const linkText = document.getElementById("link-text");
  const es = new EventSource("/events");
  es.onopen = () => { link.className = "link live"; linkText.textContent = "live"; };
  es.onerror = () => { link.className = "link down"; linkText.textContent = "reconnecting…"; };
  es.addEventListener("hello", (e) => { view.hello = JSON.parse(e.data); renderWho(); });
  es.addEventListener("fleet", (e) => { view.fleet = JSON.parse(e.data); renderFleet(); renderCaps(); });
  es.addEventListener("events", (e) => { view.events = JSON.parse(e.data).reverse(); renderEvents(false); });
  es.addEventListener("event", (e) => {
    view.events.unshift(JSON.parse(e.data));
    view.events.length = Math.min(view.events.length, 300);
    renderEvents(true);
    if (view.selected) loadDetail();
  });
  es.addEventListener("compensation", (e) => { view.comp = JSON.parse(e.data); renderQueue(); });
  es.addEventListener("owners", (e) => { view.owners = JSON.parse(e.data); renderOwners(); });
}

function renderWho() {
  const h = view.hello;
  document.getElementById("who").textContent =
    `broker ${h.broker_id} · v${h.version} · prefix ${h.prefix}`;
}

// --- the fleet ----------------------------------------------------------------------------

function renderFleet() {
  const f = view.fleet;
  const chips = document.getElementById("chips");
  chips.replaceChildren(...STATES.map((s) => el("span", { class: `chip ${s}${f.by_state[s] ? "" : " zero"}` },
    el("b", { text: f.by_state[s] || 0 }), s)));
  const shown = f.agents.length < f.total ? `, the first ${f.agents.length} shown` : "";
  document.getElementById("fleet-count").textContent = `${f.total} agent${f.total === 1 ? "" : "s"}${shown}`;
  const body = document.querySelector("#fleet tbody");
  const rows = new Map([...body.children].map((tr) => [tr.dataset.agent, tr]));
  const order = [];
  // The broker sends the least healthy first (so its cap keeps them); rows stay in id order,
  // so a row changes its state in place instead of jumping during a failover.
  const agents = [...f.agents].sort((x, y) => (x.agent_id < y.agent_id ? -1 : 1));
  for (const a of agents) {
    let tr = rows.get(a.agent_id);
    if (!tr) {
      tr = el("tr", { "data-agent": a.agent_id, onclick: () => select(a.agent_id) });
      for (const cls of ["id", "st", "num sc", "ld", "cp", "rg", "vr", "num seen"]) tr.append(el("td", { class: cls }));
    }
    rows.delete(a.agent_id);
    fillRow(tr, a);
    order.push(tr);
  }
  for (const tr of rows.values()) tr.remove();
  order.forEach((tr, i) => { if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null); });
}

function fillRow(tr, a) {
  const c = tr.children;
  tr.classList.toggle("selected", view.selected === a.agent_id);
  c[7].dataset.ms = a.last_seen_ms;
  c[7].textContent = ago(a.last_seen_ms);
  // Cells are rebuilt only when they change, so a tooltip being read stays where it is.
  const sig = JSON.stringify([a.state, a.score, a.active, a.max_concurrency, a.capabilities,
    a.region, a.version, a.explain.terms, a.explain.weakest]);
  if (tr.dataset.sig === sig) return;
  tr.dataset.sig = sig;
  tr.dataset.state = a.state;
  c[0].textContent = a.agent_id;
  c[1].replaceChildren(stateBadge(a.state));
  c[1].dataset.state = a.state;
  c[2].replaceChildren(el("span", { class: "score", title: termsTitle(a.explain) },
    bar(a.score, 100, scoreClass(a.score)), el("span", { text: fix(a.score, 1) })));
  c[3].replaceChildren(el("span", { class: "load" }, bar(a.active, a.max_concurrency),
    `${a.active}/${a.max_concurrency}`));
  c[4].replaceChildren(el("span", { class: "caps" }, a.capabilities.map((x) => el("span", { class: "cap", text: x }))));
  c[5].textContent = a.region || "–";
  c[6].textContent = a.version || "–";
}

// --- capabilities ---------------------------------------------------------------------------

function renderCaps() {
  const box = document.getElementById("caps");
  const caps = view.fleet.capabilities;
  if (!caps.length) { box.replaceChildren(el("p", { class: "dim", text: "no capability yet" })); return; }
  // A card is rebuilt only when what it shows changed (its tooltips stay put otherwise).
  const old = new Map([...box.querySelectorAll(".capcard")].map((n) => [n.dataset.capability, n]));
  const kids = caps.map((c) => {
    const sig = JSON.stringify(c);
    const node = old.get(c.name);
    if (node && node.dataset.sig === sig) return node;
    const card = capCard(c);
    card.dataset.sig = sig;
    return card;
  });
  const more = view.fleet.capability_total - caps.length;
  if (more > 0) kids.push(el("p", { class: "hint", text: `${more} more capabilities (all with a healthy agent) not shown` }));
  box.replaceChildren(...kids);
}

function capCard(c) {
  const rows = [];
  for (const r of c.routable) {
    const e = r.explain;
    rows.push(el("tr", { "data-agent": r.agent_id },
      el("td", { class: "num", text: e.rank || "–" }),
      el("td", { class: "mono", text: r.agent_id }),
      el("td", { class: "num", title: termsTitle(e), text: fix(r.score, 1) }),
      el("td", { class: "share", title: `weight ${fix(e.weight, 1)}${e.slow_start < 1 ? `, slow start ×${fix(e.slow_start)}` : ""}` },
        bar(r.share, 1), ` ${Math.round(r.share * 100)}%`),
      el("td", {}, e.kept ? el("span", { class: "reason kept", title: "routed although below the minimum", text: e.kept })
        : el("span", { class: "detailtext", text: e.weakest ? `weakest: ${e.weakest} ${fix(e.terms[e.weakest])}` : "all terms 1" }))));
  }
  for (const x of c.excluded) {
    rows.push(el("tr", { class: "out", "data-agent": x.agent_id },
      el("td", { class: "num", text: x.explain && x.explain.rank ? x.explain.rank : "–" }),
      el("td", { class: "mono", text: x.agent_id }),
      el("td", { class: "num", title: x.explain ? termsTitle(x.explain) : null, text: fix(x.score, 1) }),
      el("td", {}, el("span", { class: `reason ${x.reason}`, text: x.reason })),
      el("td", { class: "detailtext", text: x.detail })));
  }
  const shown = c.routable.length + c.excluded.length;
  const hidden = c.members - shown;
  return el("div", { class: `capcard${c.reachable ? "" : " none"}`, "data-capability": c.name },
    el("header", {},
      el("span", { class: "name", text: c.name }),
      c.panic ? el("span", { class: "badge", title: "fewer than half of its agents are healthy: nothing is ejected for its score", text: "PANIC" }) : null,
      el("span", { class: "reach" }, el("b", { text: c.reachable }), ` of ${c.members} reachable`,
        c.ejected ? ` · ${c.ejected} ejected` : "")),
    el("table", {}, el("tbody", {}, rows)),
    hidden > 0 ? el("p", { class: "hint", text: `${hidden} more not shown` }) : null);
}

// --- events -----------------------------------------------------------------------------------

function renderEvents(fresh) {
  const list = document.getElementById("events");
  const items = view.events.slice(0, 200).map((v, i) => eventItem(v, fresh && i === 0));
  list.replaceChildren(...items);
  document.getElementById("events-count").textContent = view.events.length ? `${view.events.length} recent` : "none yet";
}

function eventItem(v, fresh) {
  const e = v.event;
  // A move between states; an eviction; or another kind without a state (a released claim).
  const move = e.to ? [e.from ? stateBadge(e.from) : null, e.from ? el("span", { class: "move", text: "→" }) : null, stateBadge(e.to)]
    : [el("span", { class: "state gone", text: e.kind })];
  const brokers = v.brokers.length > 1 ? ` · ${v.brokers.length} brokers` : ` · ${v.brokers[0]}`;
  return el("li", { class: `event${fresh ? " fresh" : ""}`, "data-agent": e.agent_id, "data-to": e.to || "" },
    el("span", { class: "at", text: clock(e.at_ms) }),
    el("span", { class: "what" }, el("span", { class: "agent", text: e.agent_id }), move,
      e.kind === "state" || !e.to ? null : el("span", { class: "move", text: e.kind })),
    el("span", { class: "why", text: `${e.request_id ? `request ${e.request_id}: ` : ""}${e.reason}${brokers}` }));
}

// --- the compensation queue --------------------------------------------------------------------

function renderQueue() {
  const box = document.getElementById("queue");
  const q = view.comp;
  if (!q.available) {
    box.replaceChildren(el("p", { class: "dim", text: q.at_ms ? `not available: ${q.error || "no JetStream"}` : "…" }));
    return;
  }
  if (!q.total) { box.replaceChildren(el("p", { class: "dim", text: "empty: no task waits for an agent" })); return; }
  box.replaceChildren(el("table", { class: "queue" },
    el("thead", {}, el("tr", {}, el("th", { text: "Capability" }), el("th", { class: "num", text: "Waiting" }), el("th", { class: "num", text: "Oldest" }))),
    el("tbody", {}, q.capabilities.map((r) => el("tr", { "data-capability": r.capability },
      el("td", { class: "mono", text: r.capability }),
      el("td", { class: "num", text: r.depth }),
      el("td", { class: "num", "data-ms": r.oldest_ms || "", text: r.oldest_ms ? ago(r.oldest_ms).replace(" ago", "") : "–" }))))));
}

// --- who owns what ----------------------------------------------------------------------------

function renderOwners() {
  const o = view.owners;
  const box = document.getElementById("owners");
  if (!o.partitions) { box.replaceChildren(el("p", { class: "dim", text: o.at_ms ? "no partition owner answered" : "…" })); return; }
  const brokers = Object.entries(o.brokers).map(([b, n]) => `${b}: ${n}`).join(" · ");
  document.getElementById("owners-count").textContent = `${o.partitions} partitions · ${brokers || "no owner"}`;
  box.replaceChildren(el("table", { class: "queue owners" },
    el("thead", {}, el("tr", {}, el("th", { class: "num", text: "Partition" }), el("th", { text: "Owner" }), el("th", { class: "num", text: "Agents" }))),
    el("tbody", {}, o.rows.map((r) => el("tr", { "data-partition": r.partition },
      el("td", { class: "num", text: r.partition }),
      el("td", { class: "mono", text: r.owner || "none answered" }),
      el("td", { class: "num", text: r.agents === null ? "–" : r.agents }))))));
}

// --- every agent, page by page -------------------------------------------------------------------

async function loadPage(cursor) {
  const q = cursor ? `?limit=100&cursor=${encodeURIComponent(cursor)}` : "?limit=100";
  const r = await fetch(`/api/agents${q}`, { cache: "no-store" });
  const page = await r.json();
  const where = document.getElementById("pages-where");
  const next = document.getElementById("pages-next");
  if (page.error) { where.textContent = page.error; next.disabled = true; return; }
  where.textContent = `partition ${page.partition} of ${page.partitions} (${page.count} agents) from ${page.broker_id || "?"}`;
  view.pageCursor = page.cursor || null;
  next.disabled = !view.pageCursor;
  document.querySelector("#pages tbody").replaceChildren(...page.agents.map((a) => el("tr", { "data-agent": a.agent_id, onclick: () => select(a.agent_id) },
    el("td", { class: "id", text: a.agent_id }), el("td", { class: "st" }, stateBadge(a.state)),
    el("td", { class: "num sc", text: fix(a.score, 1) }), el("td", { class: "ld" }, bar(a.load, 1)),
    el("td", { class: "cp", text: a.capabilities.join(", ") }), el("td", { class: "rg", text: a.region || "–" }),
    el("td", { class: "vr", text: a.version || "–" }))));
}

document.getElementById("pages-first").addEventListener("click", () => loadPage(null));
document.getElementById("pages-next").addEventListener("click", () => { if (view.pageCursor) loadPage(view.pageCursor); });

// --- one agent ----------------------------------------------------------------------------------

function select(agentId) {
  view.selected = view.selected === agentId ? null : agentId;
  document.querySelectorAll("#fleet tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.agent === view.selected));
  clearInterval(view.detailTimer);
  if (!view.selected) { document.getElementById("detail").hidden = true; return; }
  loadDetail();
  view.detailTimer = setInterval(loadDetail, 2000);
}

async function loadDetail() {
  const id = view.selected;
  if (!id) return;
  try {
    const r = await fetch(`/api/agents/${encodeURIComponent(id)}`, { cache: "no-store" });
    if (id !== view.selected) return;
    if (!r.ok) { renderDetailGone(id); return; }
    view.detail = await r.json();
    renderDetail();
  } catch (err) { /* the stream's status shows the broker is away */ }
}

function renderDetailGone(id) {
  const box = document.getElementById("detail");
  box.hidden = false;
  box.replaceChildren(el("h2", {}, id, el("button", { class: "close", title: "close", onclick: () => select(id), text: "×" })),
    el("p", { class: "dim", text: "no longer known to the broker (evicted)" }));
}

function renderDetail() {
  const d = view.detail;
  const a = d.agent;
  const e = a.explain;
  const box = document.getElementById("detail");
  box.hidden = false;
  const terms = TERMS.map((k) => [
    el("span", { class: e.weakest === k ? "weak" : "", text: k }), bar(e.terms[k], 1, e.terms[k] < 0.6 ? "low" : e.terms[k] < 0.9 ? "mid" : ""),
    el("span", { class: "num", text: fix(e.terms[k]) })]);
  const figures = [
    ["task time", e.task_ms !== undefined && e.task_ms !== null ? `${fix(e.task_ms, 0)} ms` : "–"],
    ["probe RTT", e.rtt_ms !== undefined && e.rtt_ms !== null ? `${fix(e.rtt_ms, 1)} ms` : "–"],
    ["success", `${fix((e.success_rate ?? 1) * 100, 1)}%`],
    ["results", `${e.ok_total || 0} ok / ${e.fail_total || 0} failed`],
    ["weight", `${fix(e.weight, 1)}${(e.slow_start ?? 1) < 1 ? ` (slow start ×${fix(e.slow_start)})` : ""}`],
    ["in state", ago(a.state_since_ms).replace(" ago", "")],
  ];
  box.replaceChildren(
    el("h2", {}, el("span", { class: "mono", text: a.agent_id }), stateBadge(a.state),
      el("span", { class: "dim", text: `score ${fix(a.score, 1)}` }),
      el("button", { class: "close", title: "close", onclick: () => select(a.agent_id), text: "×" })),
    el("div", { class: "terms" }, terms),
    el("div", { class: "figures" }, figures.map(([k, v]) => el("div", {}, el("b", { text: v }), k))),
    timeline(d.transitions, a.state),
    chart("score", d.samples, d.samples.score, a.score, 100, "#0b5cad", ""),
    chart("load", d.samples, d.samples.load, a.load ?? null, 1, "#8250df", ""),
    chart("task time", d.samples, d.samples.task_ms, e.task_ms ?? null, null, "#c26a00", " ms"),
    el("h2", { class: "sub" }, "Transitions"),
    d.transitions.length ? el("ul", { class: "transitions" }, d.transitions.slice().reverse().map((v) => el("li", {},
      el("b", { text: clock(v.event.at_ms) }), ` ${transition(v.event)}: ${v.event.reason}`)))
      : el("p", { class: "dim", text: "none since the broker started" }));
}

function transition(e) {
  if (!e.to) return e.request_id ? `${e.kind} ${e.request_id}` : e.kind;
  return `${e.from || e.kind} → ${e.to}`;
}

function chart(label, samples, values, current, fixedMax, color, unit) {
  const W = 320, H = 64, pad = 4;
  // The broker's samples (every sample_s), then the value as of now at the right edge.
  const pts = values.map((v, i) => [samples.at_ms[i], v]).filter(([, v]) => v !== null);
  if (current !== null && current !== undefined) pts.push([Date.now(), current]);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const last = pts.length ? pts[pts.length - 1][1] : null;
  const max = fixedMax || Math.max(1, ...pts.map(([, v]) => v)) * 1.15;
  // The window: what the broker keeps (history_s), or less while the agent is young (at
  // least a minute), so a new agent's first samples are not a dot at the right edge.
  const now = Date.now();
  const kept = (view.hello ? view.hello.history_s : 300) * 1000;
  const first = pts.length ? pts[0][0] : now;
  const span = Math.min(kept, Math.max(60000, now - first));
  const x = (t) => pad + (W - 2 * pad) * (1 - (now - t) / span);
  const y = (v) => H - pad - (H - 2 * pad) * Math.min(1, v / max);
  if (fixedMax === 100) {
    const line = document.createElementNS(SVG, "line");
    for (const [k, v] of Object.entries({ x1: 0, x2: W, y1: y(60), y2: y(60), stroke: "#f3b4b8", "stroke-dasharray": "3 3" })) line.setAttribute(k, v);
    svg.append(line);
  }
  if (pts.length) {
    const poly = document.createElementNS(SVG, "polyline");
    poly.setAttribute("points", pts.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "));
    for (const [k, v] of Object.entries({ fill: "none", stroke: color, "stroke-width": 2, "vector-effect": "non-scaling-stroke", "stroke-linejoin": "round" })) poly.setAttribute(k, v);
    svg.append(poly);
  }
  const window = span >= 90000 ? `${Math.round(span / 60000)} min` : `${Math.round(span / 1000)} s`;
  return el("div", { class: "chart" },
    el("div", { class: "label" }, el("span", { text: `${label} · last ${window}` }),
      el("span", { text: last === null ? "no samples yet" : `now ${fix(last, unit ? 0 : 1)}${unit}` })),
    svg);
}

// The agent's states over the kept window, from its transitions (the broker keeps the last
// 16): one coloured stretch per state, the current one up to now.
function timeline(transitions, current) {
  const W = 320, H = 18;
  const now = Date.now();
  const span = (view.hello ? view.hello.history_s : 300) * 1000;
  const moves = transitions.map((v) => v.event).filter((e) => e.to).sort((p, q) => p.at_ms - q.at_ms);
  const stretches = [];
  // Before its first kept transition the agent was in that one's "from" state; before its
  // registration (no "from") it was not there at all.
  let state = moves.length ? moves[0].from : current;
  let since = now - span;
  for (const m of moves) {
    if (state && m.at_ms > since) stretches.push([state, since, m.at_ms]);
    state = m.to;
    since = Math.max(since, m.at_ms);
  }
  stretches.push([current || state, since, now]);
  const x = (t) => W * Math.max(0, (t - (now - span)) / span);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  for (const [s, t0, t1] of stretches) {
    const r = document.createElementNS(SVG, "rect");
    const attrs = { x: x(t0).toFixed(1), y: 0, width: Math.max(1, x(t1) - x(t0)).toFixed(1), height: H,
      fill: STATE_COLORS[s] || "#8c959f", class: "seg", "data-state": s };
    for (const [k, v] of Object.entries(attrs)) r.setAttribute(k, v);
    const title = document.createElementNS(SVG, "title");
    title.textContent = `${s} from ${clock(t0)}`;
    r.append(title);
    svg.append(r);
  }
  return el("div", { class: "chart timeline" },
    el("div", { class: "label" }, el("span", { text: `states · last ${Math.round(span / 60000)} min` }),
      el("span", { text: `now ${current}` })),
    svg);
}

// --- calls by capability: routes/s and latency p50/p99, 15 minutes ----------------------------

async function loadCharts() {
  let idx;
  try {
    const r = await fetch("/api/charts", { cache: "no-store" });
    if (!r.ok) return;
    idx = await r.json();
  } catch (err) { return; }
  const sel = document.getElementById("chart-cap");
  const caps = idx.capabilities;
  if (!caps.length) {
    sel.replaceChildren();
    document.getElementById("calls").replaceChildren(el("p", { class: "dim", text: "no route request yet" }));
    return;
  }
  if (!view.chartCap || !caps.some(([c]) => c === view.chartCap)) view.chartCap = caps[0][0];
  sel.replaceChildren(...caps.map(([c, n]) => el("option", { value: c, selected: c === view.chartCap, text: `${c} (${n} routes)` })));
  sel.onchange = () => { view.chartCap = sel.value; loadCharts(); };
  try {
    const r = await fetch(`/api/charts/${encodeURIComponent(view.chartCap)}`, { cache: "no-store" });
    if (!r.ok) return;
    renderCharts(await r.json());
  } catch (err) { /* the stream's status shows the broker is away */ }
}

function renderCharts(c) {
  const box = document.getElementById("calls");
  box.dataset.capability = c.capability;
  const untimed = c.calls.every((n) => n === 0);
  box.replaceChildren(
    series("routes/s", c.at_ms, c.bucket_s, [{ name: "routes/s", values: c.routes_per_s, color: "#0b5cad" }], "", "routes"),
    series("call latency", c.at_ms, c.bucket_s, [
      { name: "p50", values: c.p50_ms, color: "#1a7f37" },
      { name: "p99", values: c.p99_ms, color: "#c8202d" }], " ms", "latency"),
    el("p", { class: "hint", text: untimed ? "latency: from agents' ack records (received → completed); none yet"
      : "latency: from agents' ack records (received → completed), per 15 s" }));
}

function swatch(color) {
  const i = el("i");
  i.style.background = color; // CSSOM, allowed by the page's CSP
  return i;
}

// A chart of bucketed values: one polyline per series, a point per bucket that has a value.
function series(label, atMs, bucketS, lines, unit, kind) {
  const W = 320, H = 64, pad = 4;
  const step = bucketS * 1000;
  const t0 = atMs[0], t1 = atMs[atMs.length - 1] + step;
  const all = lines.flatMap((l) => l.values.filter((v) => v !== null));
  const max = Math.max(1e-9, ...all) * 1.15;
  const x = (t) => pad + (W - 2 * pad) * ((t + step / 2 - t0) / (t1 - t0));
  const y = (v) => H - pad - (H - 2 * pad) * Math.min(1, v / max);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.dataset.kind = kind;
  for (const l of lines) {
    const pts = l.values.map((v, i) => [atMs[i], v]).filter(([, v]) => v !== null);
    if (!pts.length) continue;
    const poly = document.createElementNS(SVG, "polyline");
    poly.setAttribute("points", pts.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "));
    for (const [k, v] of Object.entries({ fill: "none", stroke: l.color, "stroke-width": 1.5, "vector-effect": "non-scaling-stroke", "data-series": l.name })) poly.setAttribute(k, v);
    svg.append(poly);
    for (const [t, v] of pts) {
      if (v === 0) continue;
      const dot = document.createElementNS(SVG, "circle");
      for (const [k, a] of Object.entries({ cx: x(t).toFixed(1), cy: y(v).toFixed(1), r: 1.6, fill: l.color, class: "pt", "data-series": l.name, "data-v": v })) dot.setAttribute(k, a);
      svg.append(dot);
    }
  }
  const now = lines.map((l) => { const v = [...l.values].reverse().find((z) => z !== null); return `${l.name} ${v === undefined ? "–" : fix(v, unit ? 0 : 2)}${unit}`; });
  return el("div", { class: "chart" },
    el("div", { class: "label" }, el("span", {}, label, lines.length > 1 ? lines.map((l) => el("span", { class: "legend" }, swatch(l.color), l.name)) : null),
      el("span", { text: now.join(" · ") })),
    svg);
}

// --- time goes by ---------------------------------------------------------------------------------

setInterval(() => {
  document.querySelectorAll("#fleet td.seen").forEach((td) => { td.textContent = ago(Number(td.dataset.ms)); });
  document.querySelectorAll("#queue td[data-ms]").forEach((td) => {
    if (td.dataset.ms) td.textContent = ago(Number(td.dataset.ms)).replace(" ago", "");
  });
}, 1000);

connect();
loadCharts();
loadPage(null);
setInterval(loadCharts, 5000);
