// czyx playground: plain JavaScript, no framework, no build step, nothing fetched from elsewhere.
// It talks to the server's own API: /v1/czyx/* (whoami, layout, render, store) and
// /v1/chat/completions streamed with "X-Czyx-Watch: routes" (each decode token's routing
// arrives as an "event: czyx.routes" server-sent event beside the text chunks).
"use strict";

const TOKEN_KEY = "czyx.token";
const STATE_CLASS = ["hit", "pref", "miss"]; // route frame states 0, 1, 2
const STATE_WORD = ["hit", "prefetched", "read (miss)"];
const REPLAY_MS = 120;
const CHART_POINTS = 120;

const $ = (id) => document.getElementById(id);
const app = {
  token: null,
  me: null,
  layout: null, // the selected version's layout
  cells: [], // cells[layer][expert] -> element
  history: [], // chat messages sent so far (no session) or nothing (session: the server keeps it)
  frames: [], // route frames of the last generation
  shown: -1, // the frame the grid shows
  live: true, // the grid follows new frames (false while replaying or scrubbed)
  abort: null,
  replayTimer: null,
  series: { bytes: [], hit: [], tps: [] },
};

// ------------------------------------------------------------------ requests

class ApiFailure extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = Object.assign({ Authorization: "Bearer " + app.token }, options.headers || {});
  const resp = await fetch(path, Object.assign({}, options, { headers }));
  if (!resp.ok) {
    let message = resp.status + " " + resp.statusText;
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON */ }
    const err = new ApiFailure(resp.status, message);
    if (resp.status === 401 || resp.status === 403) await checkSignedIn(err);
    throw err;
  }
  return resp;
}

// A 401/403: if the token itself is now refused (revoked, expired), sign out.
async function checkSignedIn(err) {
  if (!app.token) return;
  const resp = await fetch("/v1/czyx/whoami", { headers: { Authorization: "Bearer " + app.token } });
  if (resp.status === 401 || resp.status === 403) {
    signOut("Signed out: " + err.message);
  }
}

async function* serverEvents(resp) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const raw = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of raw.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// ------------------------------------------------------------------ sign in / out

async function signIn(token) {
  app.token = token;
  let me;
  try {
    const r = await fetch("/v1/czyx/whoami", { headers: { Authorization: "Bearer " + token } });
    if (!r.ok) {
      let m = r.status + " " + r.statusText;
      try { m = (await r.json()).error.message; } catch (_) { /* not JSON */ }
      throw new ApiFailure(r.status, m);
    }
    me = await r.json();
  } catch (err) {
    app.token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    $("signin-error").textContent = "Sign-in refused: " + err.message;
    document.body.dataset.signedIn = "false";
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, token);
  app.me = me;
  $("token").value = "";
  $("signin-error").textContent = "";
  $("signin").hidden = true;
  $("app").hidden = false;
  $("who").hidden = false;
  $("who-text").textContent = me.tenant + " \u00b7 portal " + me.portal.slice(0, 8) +
    " \u00b7 " + me.rights.join(", ");
  const sel = $("model");
  sel.replaceChildren();
  for (const m of me.models) {
    const opt = document.createElement("option");
    opt.value = m.id;
    opt.textContent = m.id + (m.chat_template ? "" : " (no chat template)");
    sel.append(opt);
  }
  $("tab-store").hidden = !me.store_view;
  selectTab("play");
  if (me.models.length) await loadLayout(me.models[0].id);
  else setStatus("This portal may run no version served here.");
  document.body.dataset.signedIn = "true";
}

function signOut(message) {
  stopGeneration();
  app.token = null;
  app.me = null;
  sessionStorage.removeItem(TOKEN_KEY);
  $("app").hidden = true;
  $("who").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = message || "";
  document.body.dataset.signedIn = "false";
  $("token").focus();
}

function selectTab(which) {
  for (const [name, tab, view] of [["play", "tab-play", "view-play"], ["store", "tab-store", "view-store"]]) {
    const on = name === which;
    $(tab).setAttribute("aria-selected", String(on));
    $(view).hidden = !on;
  }
  if (which === "store") loadStore();
}

// ------------------------------------------------------------------ the expert grid

async function loadLayout(model) {
  const lay = await (await api("/v1/czyx/models/" + encodeURIComponent(model) + "/layout")).json();
  app.layout = lay;
  const grid = $("grid");
  grid.replaceChildren();
  app.cells = [];
  const cols = Math.ceil(Math.sqrt(lay.n_experts));
  // Few experts: bigger cells; many (DeepSeek's 256 a layer): small ones.
  const px = lay.n_experts <= 64 ? 22 : lay.n_experts <= 128 ? 14 : 10;
  grid.style.setProperty("--cell", px + "px");
  for (let l = 0; l < lay.n_layers; l++) {
    app.cells.push([]);
    if (!lay.sparse_layers[l]) continue;
    const box = document.createElement("div");
    box.className = "layer";
    const name = document.createElement("span");
    name.className = "lname";
    name.textContent = "L" + l;
    const cells = document.createElement("div");
    cells.className = "cells";
    cells.style.gridTemplateColumns = "repeat(" + cols + ", " + px + "px)";
    for (const e of lay.order[l]) {
      const c = document.createElement("div");
      c.className = "cell";
      c.dataset.layer = l;
      c.dataset.expert = e;
      c.title = "layer " + l + ", expert " + e + ", class 0x" +
        lay.classes[l][e].toString(16).padStart(2, "0");
      cells.append(c);
      app.cells[l][e] = c;
    }
    box.append(name, cells);
    grid.append(box);
  }
  grid.setAttribute("aria-label", "Experts of " + model + " per layer (" + lay.n_experts +
    " each, top-" + lay.top_k + "), in the " + (lay.curve || "router's") + " curve order");
}

function residentBits(hex, n) {
  const out = new Array(n).fill(false);
  for (let e = 0; e < n; e++) {
    const byte = parseInt(hex.substr(2 * (e >> 3), 2), 16);
    out[e] = ((byte >> (e & 7)) & 1) === 1;
  }
  return out;
}

function showFrame(i) {
  const f = app.frames[i];
  if (!f || !app.layout) return;
  const n = app.layout.n_experts;
  f.layers.forEach((layer, row) => {
    const cells = app.cells[layer];
    if (!cells) return;
    const held = residentBits(f.resident[row], n);
    for (let e = 0; e < n; e++) {
      if (cells[e]) {
        cells[e].className = held[e] ? "cell held" : "cell";
        cells[e].removeAttribute("aria-label");
      }
    }
    f.experts[row].forEach((e, j) => {
      const c = cells[e];
      if (!c) return;
      const s = f.state[row][j];
      c.className = "cell " + STATE_CLASS[s];
      c.setAttribute("aria-label", "layer " + layer + " expert " + e + ": " + STATE_WORD[s] +
        ", weight " + f.weights[row][j].toFixed(3));
    });
  });
  app.shown = i;
  $("grid").dataset.frame = String(i);
  $("frame-label").textContent = "token " + (i + 1) + " of " + app.frames.length + ": " +
    JSON.stringify(f.text);
  $("scrub").value = String(i);
  $("scrub-out").textContent = String(i + 1);
  for (const b of $("tokens").children) {
    b.setAttribute("aria-current", String(Number(b.dataset.index) === i));
  }
}

function addFrame(f) {
  const i = app.frames.length;
  app.frames.push(f);
  const b = document.createElement("button");
  b.type = "button";
  b.dataset.index = String(i);
  b.textContent = f.text.replace(/\n/g, "\u21b5") || "\u2400";
  b.title = "token " + (i + 1) + " (id " + f.token + ")";
  b.addEventListener("click", () => { stopReplay(); app.live = false; showFrame(i); });
  $("tokens").append(b);
  const scrub = $("scrub");
  scrub.max = String(i);
  scrub.disabled = false;
  // Charts: this token's step.
  const st = f.step;
  app.series.bytes.push(st.tokens ? st.bytes_read / st.tokens : 0);
  const hits = app.frames.reduce((a, g) => a + g.step.hits, 0);
  const looks = app.frames.reduce((a, g) => a + g.step.hits + g.step.misses, 0);
  app.series.hit.push(looks ? hits / looks : 1);
  app.series.tps.push(st.seconds > 0 ? 1 / st.seconds : 0);
  drawCharts();
  if (app.live) showFrame(i);
}

function resetFrames() {
  stopReplay();
  app.frames = [];
  app.shown = -1;
  app.live = true;
  app.series = { bytes: [], hit: [], tps: [] };
  $("tokens").replaceChildren();
  $("scrub").max = "0";
  $("scrub").value = "0";
  $("scrub").disabled = true;
  $("replay").disabled = true;
  $("scrub-out").textContent = "";
  $("frame-label").textContent = "";
  drawCharts();
}

function fmtBytes(n) {
  if (n >= 1 << 20) return (n / (1 << 20)).toFixed(1) + " MiB";
  if (n >= 1 << 10) return (n / (1 << 10)).toFixed(1) + " KiB";
  return Math.round(n) + " B";
}

function drawChart(id, values, fixedMax) {
  const cv = $(id);
  const ctx = cv.getContext("2d");
  const w = cv.width, h = cv.height;
  ctx.clearRect(0, 0, w, h);
  const vals = values.slice(-CHART_POINTS);
  if (!vals.length) return;
  const max = fixedMax || Math.max(...vals) || 1;
  ctx.strokeStyle = "#2557a7";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  vals.forEach((v, i) => {
    const x = vals.length === 1 ? w / 2 : (i / (vals.length - 1)) * (w - 4) + 2;
    const y = h - 3 - (v / max) * (h - 6);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

function drawCharts() {
  const s = app.series;
  drawChart("c-bytes", s.bytes);
  drawChart("c-hit", s.hit, 1);
  drawChart("c-tps", s.tps);
  const last = (a) => a[a.length - 1];
  $("v-bytes").textContent = s.bytes.length ? fmtBytes(last(s.bytes)) : "";
  $("v-hit").textContent = s.hit.length ? (100 * last(s.hit)).toFixed(1) + "%" : "";
  $("v-tps").textContent = s.tps.length ? last(s.tps).toFixed(1) : "";
}

function startReplay() {
  stopReplay();
  if (!app.frames.length) return;
  app.live = false;
  let i = 0;
  $("replay").textContent = "Stop replay";
  showFrame(0);
  app.replayTimer = setInterval(() => {
    i += 1;
    if (i >= app.frames.length) { stopReplay(); return; }
    showFrame(i);
  }, REPLAY_MS);
}

function stopReplay() {
  if (app.replayTimer !== null) clearInterval(app.replayTimer);
  app.replayTimer = null;
  $("replay").textContent = "Replay";
}

// ------------------------------------------------------------------ chat

function setStatus(text) { $("status").textContent = text; }

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(who, body);
  $("log").append(div);
  $("log").scrollTop = $("log").scrollHeight;
  return body;
}

function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function samplingBody() {
  const body = {};
  for (const key of ["temperature", "top_p", "top_k", "max_tokens", "seed"]) {
    const v = numberField(key);
    if (v !== null) body[key] = v;
  }
  return body;
}

function turnMessages(text) {
  const msg = { role: "user", content: text };
  // With a session the server holds the conversation: only the new turn is sent.
  return $("session").value.trim() ? [msg] : [...app.history, msg];
}

async function send(text) {
  const model = $("model").value;
  if (!model || app.abort) return;
  const messages = turnMessages(text);
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.parentElement.setAttribute("aria-busy", "true");
  resetFrames();
  const headers = { "Content-Type": "application/json" };
  const info = app.me.models.find((m) => m.id === model);
  if (info && info.watch) headers["X-Czyx-Watch"] = "routes";
  else $("frame-label").textContent = "(this version's scheduler reports no routing)";
  const session = $("session").value.trim();
  if (session) headers["X-Czyx-Session"] = session;
  const body = Object.assign({
    model, messages, stream: true, stream_options: { include_usage: true },
  }, samplingBody());
  app.abort = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("generating\u2026");
  let text_out = "", finish = null, usage = null, version = null, error = null;
  const t0 = performance.now();
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST", headers, body: JSON.stringify(body), signal: app.abort.signal,
    });
    for await (const ev of serverEvents(resp)) {
      if (ev.event === "czyx.routes") { addFrame(JSON.parse(ev.data)); continue; }
      if (ev.data === "[DONE]") break;
      const obj = JSON.parse(ev.data);
      if (obj.error) { error = obj.error.message; continue; }
      if (obj.usage) usage = obj.usage;
      if (obj.czyx_session_version !== undefined) version = obj.czyx_session_version;
      const ch = obj.choices && obj.choices[0];
      if (!ch) continue;
      if (ch.delta && ch.delta.content) {
        text_out += ch.delta.content;
        out.textContent = text_out;
        $("log").scrollTop = $("log").scrollHeight;
      }
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else error = err.message;
  } finally {
    app.abort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    out.parentElement.removeAttribute("aria-busy");
    $("replay").disabled = app.frames.length === 0;
  }
  if (!app.token) return; // signed out meanwhile
  if (error) {
    out.parentElement.classList.add("error");
    out.textContent = text_out + (text_out ? "\n" : "") + "error: " + error;
    setStatus("failed: " + error);
    return;
  }
  if (!session) app.history = [...messages, { role: "assistant", content: text_out }];
  const secs = (performance.now() - t0) / 1000;
  const parts = [];
  if (usage) parts.push(usage.prompt_tokens + " prompt + " + usage.completion_tokens + " tokens");
  if (usage && usage.prompt_tokens_details) parts.push(usage.prompt_tokens_details.cached_tokens + " cached");
  parts.push(secs.toFixed(2) + " s");
  if (finish) parts.push("finish: " + finish);
  if (version !== null) parts.push("session " + session + " v" + version);
  setStatus(parts.join(" \u00b7 "));
}

function stopGeneration() {
  if (app.abort) app.abort.abort();
  stopReplay();
}

async function showPrompt() {
  const pre = $("rendered");
  const btn = $("show-prompt");
  if (!pre.hidden) {
    pre.hidden = true;
    btn.setAttribute("aria-expanded", "false");
    return;
  }
  const text = $("prompt").value;
  const messages = turnMessages(text || "\u2026");
  try {
    const r = await (await api("/v1/czyx/render", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: $("model").value, messages }),
    })).json();
    pre.textContent = r.prompt + "\n\u2014 " + r.tokens + " tokens";
  } catch (err) {
    pre.textContent = "cannot render: " + err.message;
  }
  pre.hidden = false;
  btn.setAttribute("aria-expanded", "true");
}

// ------------------------------------------------------------------ the store view

function table(id, head, rows) {
  const t = $(id);
  t.replaceChildren();
  const thead = document.createElement("thead");
  const tr = document.createElement("tr");
  for (const h of head) {
    const th = document.createElement("th");
    th.scope = "col";
    th.textContent = h;
    tr.append(th);
  }
  thead.append(tr);
  const tbody = document.createElement("tbody");
  for (const row of rows) {
    const r = document.createElement("tr");
    for (const cell of row) {
      const td = document.createElement("td");
      if (cell && typeof cell === "object") {
        td.textContent = cell.text;
        if (cell.cls) td.className = cell.cls;
      } else {
        td.textContent = cell === null || cell === undefined ? "" : String(cell);
      }
      r.append(td);
    }
    tbody.append(r);
  }
  t.append(thead, tbody);
}

function when(t) {
  return t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : "";
}

async function loadStore() {
  let v;
  try {
    v = await (await api("/v1/czyx/store")).json();
  } catch (err) {
    table("t-versions", ["error"], [[err.message]]);
    return;
  }
  table("t-versions", ["tag", "kind", "arch", "extents", "own bytes", "shared with", "served"],
    v.versions.map((x) => [
      x.tag, x.kind, x.arch, x.extents, fmtBytes(x.own_bytes),
      x.shared.map((s) => (s.tags[0] || s.space.slice(0, 12)) + ": " + fmtBytes(s.bytes)).join(", ") || "\u2014",
      x.served ? "yes" : "",
    ]));
  table("t-spaces", ["selector", "kind", "arch", "tags"],
    v.spaces.map((s) => [
      { text: s.selector.slice(0, 16) + "\u2026", cls: "mono" }, s.kind, s.arch,
      s.tags.join(", ") || (s.trunk_of.length ? "trunk of " + s.trunk_of.join(", ") : ""),
    ]));
  table("t-portals", ["id", "status", "tenant", "parent", "created", "expires", "caveats"],
    v.portals.map((p) => [
      { text: p.id.slice(0, 12), cls: "mono" }, { text: p.status, cls: "status-" + p.status },
      p.tenant, p.parent ? p.parent.slice(0, 8) : "", when(p.created), when(p.expires), p.caveats,
    ]));
  table("t-audit", ["seq", "time", "event", "details"],
    v.audit.map((a) => {
      const rest = Object.entries(a).filter(([k]) => !["seq", "time", "event"].includes(k))
        .map(([k, x]) => k + "=" + (typeof x === "string" ? x : JSON.stringify(x))).join(" ");
      return [a.seq, when(a.time), a.event, rest];
    }));
}

// ------------------------------------------------------------------ wiring

document.addEventListener("DOMContentLoaded", () => {
  $("signin-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const t = $("token").value.trim();
    if (t) signIn(t);
  });
  $("signout").addEventListener("click", () => signOut("Signed out."));
  $("tab-play").addEventListener("click", () => selectTab("play"));
  $("tab-store").addEventListener("click", () => selectTab("store"));
  $("store-refresh").addEventListener("click", loadStore);
  $("model").addEventListener("change", () => { resetFrames(); loadLayout($("model").value).catch((e) => setStatus(e.message)); });
  $("chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim()) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stopGeneration);
  $("clear").addEventListener("click", () => {
    app.history = [];
    $("log").replaceChildren();
    resetFrames();
    setStatus("");
  });
  $("show-prompt").addEventListener("click", showPrompt);
  $("replay").addEventListener("click", () => (app.replayTimer === null ? startReplay() : stopReplay()));
  $("scrub").addEventListener("input", () => { stopReplay(); app.live = false; showFrame(Number($("scrub").value)); });
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved) signIn(saved);
  else document.body.dataset.signedIn = "false";
});
