// The Astraeus console: every run, and why it waits. It reads the HTTP API's JSON routes with the bearer token kept
// in this tab's sessionStorage, and polls them every POLL_MS, so that the page follows the cluster without reload.
"use strict";

const POLL_MS = 2000;
const RUN_STATES = ["Pending", "Starting", "Running", "Completed", "Failed", "Cancelled", "Terminated"];
const ENDED = new Set(["Completed", "Failed", "Cancelled", "Terminated", "Deleted"]);
const WORKER_ENDED = new Set(["Completed", "Failed", "Cancelled", "Down"]);
const ui = { state: "", workspace: "", search: "", sort: "age", desc: false, includeDeleted: false };
let advice = { reasons: {}, restarting: null, failures: {} };
let config = { temporal_ui: null, temporal_namespace: "default" };
let me = null; // the token's own view (GET /whoami): whether to show admin forms; forgotten when the token changes
let following = null; // the AbortController of a log being followed: aborted when the page changes
let timer = null;
let shown = "";
const described = new Map(); // "ns/name" -> describe of an ended run (it changes no more)

// ---- small helpers ------------------------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function stateBadge(state) {
  return h("span", { class: `state s-${state}`, "data-state": state }, state);
}

// A time in UTC, as the hover of each time shows it: 2026-12-01 16:12:02 UTC.
function utc(iso) { return new Date(iso).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC"); }

// A time in the viewer's zone, and in UTC on hover.
function when(iso) {
  if (!iso) return h("span", { class: "muted" }, "—");
  const d = new Date(iso);
  return h("time", { datetime: d.toISOString(), title: utc(iso) }, d.toLocaleString());
}

function age(iso) {
  const s = Math.max(0, Math.round((Date.now() - new Date(iso).getTime()) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

function token() { return sessionStorage.getItem("astraeus.token"); }

// Who the token is (`GET /whoami`: its workspace, whether it is an admin's), asked once per token.
async function whoami() {
  if (!me) me = await api("/whoami");
  return me;
}

// A workflow in the Temporal UI (its list, filtered to the workflow's id: that page exists in every UI version).
function temporalLink(workflowId, label) {
  if (!config.temporal_ui) return null;
  const query = encodeURIComponent(`WorkflowId="${workflowId}"`);
  return h("a", { class: "temporal", href: `${config.temporal_ui}/namespaces/${encodeURIComponent(config.temporal_namespace)}/workflows?query=${query}`,
    target: "_blank", rel: "noopener" }, label);
}

async function api(path, options = {}) {
  const headers = { authorization: `Bearer ${token()}`, ...(options.headers || {}) };
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) { me = null; sessionStorage.removeItem("astraeus.token"); showLogin("That token is not valid (any more)."); throw new Error("401"); }
  const text = await response.text();
  if (!response.ok) {
    let message = text;
    try { message = JSON.parse(text).error; } catch (e) { /* plain text */ }
    throw new Error(message || `HTTP ${response.status}`);
  }
  return (response.headers.get("content-type") || "").includes("json") ? JSON.parse(text) : text;
}

function say(message, isError) {
  const status = document.getElementById("status");
  status.textContent = message;
  status.classList.toggle("error", !!isError);
}

// A confirmation (and optionally a reason) in a modal dialog: resolves to the reason given, or null.
function confirmDialog(title, body, withReason) {
  return new Promise((resolve) => {
    const input = withReason ? h("input", { id: "dialog-reason", type: "text", placeholder: "empty: the default reason" }) : null;
    const dialog = h("dialog", { "aria-labelledby": "dialog-title" },
      h("form", { method: "dialog" },
        h("h2", { id: "dialog-title" }, title), h("p", {}, body),
        input && h("label", { for: "dialog-reason" }, "Reason "), input,
        h("div", { class: "actions" },
          h("button", { value: "yes", class: "danger", id: "dialog-yes" }, "Confirm"),
          h("button", { value: "no", id: "dialog-no" }, "Keep it"))));
    dialog.addEventListener("close", () => {
      resolve(dialog.returnValue === "yes" ? (input ? input.value : "") : null);
      dialog.remove();
    });
    document.body.append(dialog);
    dialog.showModal();
  });
}

// ---- login and routing --------------------------------------------------------------------------------------

function showLogin(error) {
  clearInterval(timer);
  document.getElementById("page").replaceChildren();
  document.getElementById("login").hidden = false;
  document.getElementById("logout").hidden = true;
  document.getElementById("login-error").textContent = error || "";
  document.getElementById("token").focus();
}

document.getElementById("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  const given = document.getElementById("token").value.trim();
  const answer = await fetch("/jobs?limit=1", { headers: { authorization: `Bearer ${given}` } });
  if (answer.status === 401) { showLogin("That token is not valid."); return; }
  sessionStorage.setItem("astraeus.token", given);
  me = null;
  document.getElementById("token").value = "";
  route();
});

document.getElementById("logout").addEventListener("click", () => {
  sessionStorage.removeItem("astraeus.token");
  me = null;
  showLogin();
});

window.addEventListener("hashchange", route);

function route() {
  if (!token()) { showLogin(); return; }
  document.getElementById("login").hidden = true;
  document.getElementById("logout").hidden = false;
  clearInterval(timer);
  if (following) { following.abort(); following = null; }
  const hash = location.hash || "#/runs";
  const parts = hash.slice(2).split("/").map(decodeURIComponent);
  const page = document.getElementById("page");
  let refresh;
  if (parts[0] === "runs" && parts.length === 3) refresh = runPage(page, parts[1], parts[2]);
  else if (parts[0] === "machines" && parts.length === 2) refresh = machinePage(page, parts[1]);
  else if (parts[0] === "machines") refresh = machinesPage(page);
  else if (parts[0] === "quotas") refresh = quotasPage(page);
  else if (parts[0] === "drives") refresh = drivesPage(page);
  else refresh = runsPage(page);
  shown = hash;
  const tick = async () => {
    try { await refresh(); say(`Updated ${new Date().toLocaleTimeString()}`); }
    catch (e) { if (e.message !== "401") say(e.message, true); }
  };
  tick();
  timer = setInterval(() => { if (!document.querySelector("dialog[open]")) tick(); }, POLL_MS);
}

// Countdowns ("Restarting in 7s") tick every second between polls.
setInterval(() => {
  for (const el of document.querySelectorAll("[data-until]")) {
    const left = Math.max(0, Math.ceil((new Date(el.dataset.until).getTime() - Date.now()) / 1000));
    el.textContent = left > 0 ? `Restarting in ${left}s` : "Restarting now";
  }
}, 1000);

// ---- the runs list ------------------------------------------------------------------------------------------

function runsPage(page) {
  const stateSelect = h("select", { id: "filter-state", onchange: (e) => { ui.state = e.target.value; refresh(); } },
    h("option", { value: "" }, "All states"), [...RUN_STATES, "Deleted"].map((s) => h("option", { value: s }, s)));
  stateSelect.value = ui.state;
  const wsSelect = h("select", { id: "filter-workspace", onchange: (e) => { ui.workspace = e.target.value; draw(); } },
    h("option", { value: "" }, "All workspaces"));
  const search = h("input", { id: "search", type: "search", value: ui.search, placeholder: "name contains…",
    oninput: (e) => { ui.search = e.target.value; draw(); } });
  const deleted = h("input", { id: "include-deleted", type: "checkbox", checked: ui.includeDeleted,
    onchange: (e) => { ui.includeDeleted = e.target.checked; refresh(); } });
  const body = h("div", { id: "runs" });
  page.replaceChildren(h("h1", {}, "Runs"),
    h("div", { class: "filters", role: "search" },
      h("label", { for: "filter-state" }, "State", stateSelect),
      h("label", { for: "filter-workspace" }, "Workspace", wsSelect),
      h("label", { for: "search" }, "Search by name", search),
      h("label", { class: "inline", for: "include-deleted" }, deleted, "Include deleted")),
    body);
  let rows = [];

  async function refresh() {
    const query = new URLSearchParams({ limit: "1000" });
    if (ui.includeDeleted) query.set("include_deleted", "true");
    if (ui.state && !(ui.state === "Deleted" && !ui.includeDeleted)) query.set("state", ui.state);
    if (ui.state === "Deleted" && !ui.includeDeleted) { ui.includeDeleted = true; deleted.checked = true; query.set("include_deleted", "true"); query.set("state", "Deleted"); }
    const listed = (await api(`/jobs?${query}`)).runs;
    rows = await Promise.all(listed.map(async (run) => {
      const key = `${run.namespace}/${run.name}`;
      if (run.state === "Deleted") return { run };
      let d = described.get(key);
      if (!d) {
        try { d = await api(`/jobs/${key}?limit=1`); } catch (e) { return { run }; }
        if (ENDED.has(d.status.state)) described.set(key, d);
      }
      return { run, d };
    }));
    const spaces = [...new Set(rows.map((r) => r.run.namespace))].sort();
    const chosen = ui.workspace;
    wsSelect.replaceChildren(h("option", { value: "" }, "All workspaces"), spaces.map((s) => h("option", { value: s }, s)));
    wsSelect.value = spaces.includes(chosen) ? chosen : "";
    draw();
  }

  const columns = [
    ["name", "Name", (r) => r.run.name], ["workspace", "Workspace", (r) => r.run.namespace],
    ["state", "State", (r) => r.run.state], ["reason", "Reason", (r) => reasonOf(r)],
    ["workers", "Workers running / total", (r) => running(r)], ["gpus", "GPUs", (r) => r.run.gpus ?? -1],
    ["priority", "Priority", (r) => r.run.priority ?? 0], ["age", "Age", (r) => -new Date(r.run.created_at).getTime()],
  ];

  function reasonOf(r) {
    if (r.run.state === "Deleted") return `Deleted by ${r.run.deleted_by} (was ${r.run.last_state})`;
    return r.d ? r.d.status.reason : "";
  }
  function running(r) { return r.d ? r.d.tasks.filter((t) => t.status.state === "Running").length : -1; }

  function draw() {
    const needle = ui.search.toLowerCase();
    const shownRows = rows.filter((r) => (!ui.workspace || r.run.namespace === ui.workspace)
      && (!needle || r.run.name.toLowerCase().includes(needle)));
    const key = columns.find((c) => c[0] === ui.sort)[2];
    shownRows.sort((a, b) => { const x = key(a), y = key(b); return (x < y ? -1 : x > y ? 1 : 0) * (ui.desc ? -1 : 1); });
    if (!shownRows.length) {
      body.replaceChildren(h("p", { class: "empty" }, rows.length
        ? "No run matches these filters: clear the search or choose another state or workspace."
        : "No runs yet. Submit one: astraeus submit examples/hello.yaml, or POST a spec to /jobs."));
      return;
    }
    const head = h("tr", {}, columns.map(([id, label]) => h("th", { scope: "col",
      "aria-sort": ui.sort === id ? (ui.desc ? "descending" : "ascending") : null },
      h("button", { type: "button", onclick: () => { ui.desc = ui.sort === id ? !ui.desc : false; ui.sort = id; draw(); } },
        label, ui.sort === id ? (ui.desc ? " ▼" : " ▲") : ""))));
    const lines = shownRows.map((r) => {
      const key = `${r.run.namespace}/${r.run.name}`;
      const total = r.d ? r.d.tasks.length : r.run.workers;
      return h("tr", { "data-run": key },
        h("td", {}, r.run.state === "Deleted" ? r.run.name
          : h("a", { href: `#/runs/${encodeURIComponent(r.run.namespace)}/${encodeURIComponent(r.run.name)}` }, r.run.name)),
        h("td", {}, r.run.namespace), h("td", {}, stateBadge(r.run.state)),
        h("td", { class: "reason" }, reasonOf(r)),
        h("td", { class: "workers" }, r.d ? `${running(r)} / ${total}` : `— / ${total ?? "—"}`),
        h("td", {}, r.run.gpus ?? "—"), h("td", {}, r.run.priority ?? 0),
        h("td", {}, h("time", { datetime: r.run.created_at, title: `created ${new Date(r.run.created_at).toLocaleString()}, ${utc(r.run.created_at)}` }, age(r.run.created_at))));
    });
    body.replaceChildren(h("table", { id: "runs-table" }, h("caption", { class: "muted" },
      `${shownRows.length} of ${rows.length} runs`), h("thead", {}, head), h("tbody", {}, lines)));
  }
  return refresh;
}

// ---- a run's page -------------------------------------------------------------------------------------------

function runPage(page, ns, name) {
  const path = `/jobs/${encodeURIComponent(ns)}/${encodeURIComponent(name)}`;
  const body = h("div", { id: "run" });
  const logs = h("section", { id: "logs", "aria-live": "polite" });
  const act = async (what, call) => {
    try { await call(); say(what); } catch (e) { say(e.message, true); }
    refresh();
  };
  const cancel = h("button", { type: "button", id: "cancel", class: "danger", onclick: async () => {
    if (await confirmDialog(`Cancel ${ns}/${name}?`, "Every worker is stopped and the run ends Cancelled.") !== null)
      act("Cancelled", () => api(`${path}/cancel`, { method: "POST" }));
  } }, "Cancel run");
  const del = h("button", { type: "button", id: "delete", class: "danger", onclick: async () => {
    if (await confirmDialog(`Delete ${ns}/${name}?`, "An active run is cancelled first; its files and logs are removed on its machines.") !== null) {
      try { await api(path, { method: "DELETE" }); location.hash = "#/runs"; } catch (e) { say(e.message, true); }
    }
  } }, "Delete run");
  page.replaceChildren(h("p", {}, h("a", { href: "#/runs" }, "← All runs")),
    h("h1", {}, `${ns}/${name}`), h("div", { class: "actions" }, cancel, del,
      temporalLink(`job/${ns}/${name}`, "Its workflow in the Temporal UI")), body, logs);

  // The worker's output: its last 200 lines, or (follow) all of it as it comes, until it ends for good.
  async function showLogs(task, follow) {
    if (following) { following.abort(); following = null; }
    const pre = h("pre", { id: "log-text", tabindex: "0", "aria-label": `Output of ${task}` });
    const head = h("h2", { id: "logs-title" }, follow ? `Logs of ${task}, following` : `Logs of ${task} (last 200 lines)`);
    const stop = follow ? h("button", { type: "button", id: "stop-following", onclick: () => { if (following) following.abort(); } }, "Stop following") : null;
    logs.replaceChildren(head, stop || "", pre);
    head.scrollIntoView();
    const url = `${path}/tasks/${encodeURIComponent(task)}/logs`;
    if (!follow) {
      const text = await api(`${url}?tail=200`);
      if (text) pre.textContent = text; else pre.replaceWith(h("p", { class: "empty" }, "No output yet."));
      return;
    }
    const controller = new AbortController();
    following = controller;
    try {
      const response = await fetch(`${url}?follow=true`, { headers: { authorization: `Bearer ${token()}` }, signal: controller.signal });
      if (!response.ok) throw new Error((await response.json().catch(() => ({}))).error || `HTTP ${response.status}`);
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        pre.textContent += decoder.decode(value, { stream: true });
        pre.scrollTop = pre.scrollHeight;
      }
      head.textContent = `Logs of ${task} (it ended)`;
    } catch (e) {
      if (e.name !== "AbortError") throw e;
      head.textContent = `Logs of ${task} (no longer following)`;
    } finally {
      if (following === controller) following = null;
      if (stop) stop.remove();
    }
  }

  async function stopTask(task) {
    const reason = await confirmDialog(`Stop worker ${task}?`, "Its machine stops it; say why (it is kept in its history).", true);
    if (reason !== null) act(`Stopped ${task}`, () => api(`${path}/tasks/${encodeURIComponent(task)}/stop`, {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ reason: reason || null }) }));
  }

  async function refresh() {
    let d;
    try { d = await api(path); } catch (e) {
      body.replaceChildren(h("p", { class: "empty" }, `${e.message}. It may have been deleted: see the runs list with Include deleted.`));
      return;
    }
    const s = d.status;
    cancel.disabled = ENDED.has(s.state);
    const waitingTask = d.tasks.find((t) => t.status.state === "Pending");
    const restarting = d.tasks.some((t) => isRestarting(t, d));
    const help = s.state !== "Pending" ? null : advice.reasons[s.code]
      || (waitingTask && advice.reasons[waitingTask.status.code]) || (restarting ? advice.restarting : null);
    const parts = [
      h("p", {}, stateBadge(s.state), " ", h("span", { class: "exact", id: "run-reason" }, s.reason)),
      help && h("div", { class: "headline", id: "advice" }, h("h2", { id: "headline" }, help.headline),
        h("p", { id: "advice-text" }, help.advice), dataLocationLink(s, waitingTask),
        h("p", { class: "muted" }, "Exact reason: ", h("span", { class: "exact" }, s.reason))),
      h("p", { class: "muted" }, "Created ", when(s.created_at), s.started_at ? [" · started ", when(s.started_at)] : "",
        s.finished_at ? [" · finished ", when(s.finished_at)] : ""),
      h("h2", {}, "Workers"), workersTable(d),
    ];
    if (d.placement && d.placement.nodes && d.placement.nodes.length) parts.push(keepsOut(d.placement));
    parts.push(h("h2", {}, "History"), timeline(d));
    body.replaceChildren(...parts.filter(Boolean));
  }

  // "Choose where to keep data on <machine>" (the run's reason, or its waiting worker's): a link to that machine's
  // page, where an admin chooses one.
  function dataLocationLink(s, waitingTask) {
    const said = s.code === "ChooseDataLocation" ? s.reason
      : waitingTask && waitingTask.status.code === "ChooseDataLocation" ? waitingTask.status.reason : null;
    const machine = said && /^Choose where to keep data on (.+)$/.exec(said);
    if (!machine) return null;
    return h("p", {}, h("a", { id: "advice-machine", href: `#/machines/${encodeURIComponent(machine[1])}` },
      `Choose the data location on ${machine[1]}'s page`));
  }

  // A worker waiting out its back-off: it shows when it restarts (restart_at), and the console counts down to it.
  function isRestarting(t, d) {
    return !!t.restart_at && new Date(t.restart_at).getTime() > Date.now() - 1000 && !ENDED.has(d.status.state);
  }

  function workersTable(d) {
    if (!d.tasks.length) return h("p", { class: "empty" }, "No workers yet: the scheduler is creating them.");
    const rows = d.tasks.map((t) => {
      const restarting = isRestarting(t, d);
      const f = t.last_failure;
      return h("tr", { "data-task": t.id },
        h("th", { scope: "row" }, t.id),
        h("td", {}, stateBadge(t.status.state), restarting ? [" ", h("span", { class: "state s-Restarting restarting",
          "data-until": t.restart_at }, "Restarting")] : ""),
        h("td", { class: "exact" }, t.status.reason), h("td", {}, t.node || "—"), h("td", {}, t.restarts),
        h("td", {}, when(t.restart_at)), h("td", {}, t.healthy === null || t.healthy === undefined ? "—" : t.healthy ? "yes" : "no"),
        h("td", { class: "failure" }, f ? h("details", {}, h("summary", {},
          `${f.exit_code === null ? "" : `exit ${f.exit_code}: `}${f.reason}`),
          (advice.failures || {})[f.reason] ? h("p", { class: "failure-advice" }, advice.failures[f.reason].advice) : "",
          h("pre", { class: "log-tail" }, f.log_tail || "(no output)")) : "—"),
        h("td", {}, h("div", { class: "actions" },
          t.node ? h("button", { type: "button", class: "logs", "aria-label": `Logs of ${t.id}`, onclick: () => showLogs(t.id, false).catch((e) => say(e.message, true)) }, "Logs") : "",
          t.node && !WORKER_ENDED.has(t.status.state) ? h("button", { type: "button", class: "follow", "aria-label": `Follow the logs of ${t.id}`,
            onclick: () => showLogs(t.id, true).catch((e) => say(e.message, true)) }, "Follow") : "",
          !WORKER_ENDED.has(t.status.state) && t.status.state !== "Stopping"
            ? h("button", { type: "button", class: "stop danger", "aria-label": `Stop ${t.id}`, onclick: () => stopTask(t.id) }, "Stop") : "")));
    });
    return h("table", { id: "workers" }, h("thead", {}, h("tr", {}, ["Worker", "State", "Reason", "Machine", "Restarts",
      "Restarts at", "Healthy", "Last failure", "Actions"].map((c) => h("th", { scope: "col" }, c)))), h("tbody", {}, rows));
  }

  // What keeps it out: each machine's reasons, grouped by reason, with how many machines say it.
  function keepsOut(placement) {
    const groups = new Map();
    for (const node of placement.nodes) for (const reason of node.reasons) {
      if (!groups.has(reason)) groups.set(reason, []);
      groups.get(reason).push(node.name);
    }
    const rows = [...groups.entries()].sort((a, b) => b[1].length - a[1].length || (a[0] < b[0] ? -1 : 1))
      .map(([reason, machines]) => h("tr", {}, h("td", { class: "exact" }, reason), h("td", {}, machines.length),
        h("td", {}, machines.length > 10 ? `${machines.slice(0, 10).join(", ")} and ${machines.length - 10} more` : machines.join(", "))));
    return h("section", { id: "keeps-out" }, h("h2", {}, "What keeps it out"),
      h("div", { class: "muted" }, `Why each of ${placement.nodes.length} machine(s) does not take its first waiting worker. `,
        h("details", { class: "how", id: "how" }, h("summary", {}, "(how)"),
          h("p", {}, "The scheduler checks every machine in a fixed order, cheap checks first: is it ready, under ",
            "pressure, cordoned; does the worker select it (labels, names, pools); has it the network asked for; then ",
            "room: CPU, memory, GPUs (free and usable, healthy ones if asked), GPU model; then topology and drives. ",
            "A machine is listed with each check it fails, in that order, in the words of the spec's per-machine ",
            "reasons. Machines that say the same are grouped: the count says how many. Fix the most common reason ",
            "first (ask for less, or choose other machines), or wait for room to free up."))),
      h("table", {}, h("thead", {}, h("tr", {}, ["Reason", "Machines", "Which"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, rows)));
  }

  function timeline(d) {
    const entries = [...d.history.map((e) => ({ ...e, who: "run" })),
      ...d.tasks.flatMap((t) => t.history.map((e) => ({ ...e, who: t.id })))];
    entries.sort((a, b) => new Date(a.at) - new Date(b.at));
    return h("ol", { class: "timeline", id: "history" }, entries.map((e) => h("li", {}, when(e.at), " ",
      h("strong", {}, e.who), " ", stateBadge(e.state), " ", h("span", { class: "exact" }, e.reason))));
  }
  return refresh;
}

// ---- machines and quotas ------------------------------------------------------------------------------------

function gib(bytes) { return `${(bytes / 2 ** 30).toFixed(1)} GiB`; }

// Bytes as people read a drive's size, as the CLI writes them: 512 B, 1.5 KiB, 200 GiB.
function size(bytes) {
  if (bytes < 1024) return `${bytes} B`;
  let value = bytes;
  for (const unit of ["KiB", "MiB", "GiB", "TiB"]) {
    value /= 1024;
    if (value < 1024 || unit === "TiB") return `${+value.toFixed(1)} ${unit}`;
  }
}

const RACK = "topology.astraeus.io/rack";

function room(r) {
  return r ? `${r.gpus} GPU${r.gpus === 1 ? "" : "s"} · ${+r.cpu.toFixed(2)} CPUs · ${gib(r.memory_bytes)}` : "—";
}

function gpuText(gpus) {
  if (!gpus.length) return "none";
  const models = new Map();
  for (const g of gpus) { const k = `${g.model} (${gib(g.memory_bytes)})`; models.set(k, (models.get(k) || 0) + 1); }
  return [...models].map(([k, n]) => `${n} × ${k}`).join(", ");
}

function gpuHealth(gpus) {
  const notes = gpus.filter((g) => g.fault || g.at_risk)
    .map((g) => g.fault ? `GPU ${g.index}: ${g.fault}` : `GPU ${g.index} at risk: ${g.at_risk}`);
  return notes.length ? h("span", { class: "error" }, notes.join("; ")) : "";
}

// Cordon, uncordon or remove a machine (admin tokens); cordon and remove are confirmed first, each with a reason
// (a removal's is kept in the machine's history, before "Machine removed from the cluster").
async function machineVerb(node, v, after) {
  let reason = "";
  if (v === "cordon") reason = await confirmDialog(`Cordon ${node}?`, "No new work is placed there; running work stays.", true);
  if (v === "remove") reason = await confirmDialog(`Remove ${node}?`, "It leaves the cluster: its workers go Down and restart elsewhere by their policy; its agent brings it back when it registers again.", true);
  if (reason === null) return;
  try {
    await api(`/nodes/${encodeURIComponent(node)}/${v}`, { method: "POST", headers: { "content-type": "application/json" },
      body: JSON.stringify({ reason }) });
    say(`${v} ${node}`);
  } catch (e) { say(e.message, true); }
  after();
}

// Only an admin's token may change a machine: a workspace token is shown no buttons.
function machineActions(n, after, admin) {
  if (n.state === "Removed" || !admin) return "—";
  return h("div", { class: "actions" },
    n.cordon === null ? h("button", { type: "button", class: "cordon", "aria-label": `Cordon ${n.name}`, onclick: () => machineVerb(n.name, "cordon", after) }, "Cordon")
      : h("button", { type: "button", class: "uncordon", "aria-label": `Uncordon ${n.name}`, onclick: () => machineVerb(n.name, "uncordon", after) }, "Uncordon"),
    h("button", { type: "button", class: "remove danger", "aria-label": `Remove ${n.name}`, onclick: () => machineVerb(n.name, "remove", after) }, "Remove"));
}

function lastReason(n) { return n.history.length ? n.history[n.history.length - 1].reason : "—"; }

function machinesPage(page) {
  const body = h("div", { id: "machines" });
  page.replaceChildren(h("h1", {}, "Machines"), body);
  async function refresh() {
    const [nodes, use, who] = await Promise.all([api("/nodes"), api("/usage"), whoami()]);
    if (!nodes.length) { body.replaceChildren(h("p", { class: "empty" }, "No machines yet. Start an agent on each: astraeus agent --name NAME (astraeus dev starts local ones).")); return; }
    const free = new Map(use.machines.map((m) => [m.name, m]));
    body.replaceChildren(h("table", {}, h("thead", {}, h("tr", {}, ["Machine", "State", "Reason", "GPUs", "Free room",
      "CPUs / memory", "Labels", "Pools", "Rack", "Pressure", "Cordon", "Admin"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, nodes.map((n) => {
        const inv = n.inventory || {};
        const labels = Object.entries(inv.labels || {}).filter(([k]) => k !== RACK);
        return h("tr", { "data-node": n.name },
          h("th", { scope: "row" }, h("a", { href: `#/machines/${encodeURIComponent(n.name)}` }, n.name)), h("td", {}, stateBadge(n.state)),
          h("td", { class: "exact" }, lastReason(n)),
          h("td", {}, gpuText(inv.gpus || []), " ", gpuHealth(inv.gpus || [])),
          h("td", { class: "free" }, n.inventory ? room(free.get(n.name)) : "—"),
          h("td", {}, inv.cpus !== undefined ? `${inv.cpus} / ${gib(inv.memory_bytes)}` : "—"),
          h("td", {}, labels.map(([k, v]) => `${k}=${v}`).join(", ") || "—"),
          h("td", {}, (inv.pools || []).join(", ") || "—"), h("td", {}, (inv.labels || {})[RACK] || "—"),
          h("td", {}, (inv.pressure || []).join(", ") || "—"),
          h("td", {}, n.cordon === null ? "—" : n.cordon || "(cordoned)"),
          h("td", {}, machineActions(n, refresh, who.admin)));
      }))));
  }
  return refresh;
}

// A machine's page: what it has and what is free, where it keeps data and its copies of drives, the workers on it,
// its own history. The data location's form (admins) is drawn once, outside what each poll redraws, so that what an
// admin types stays.
function machinePage(page, name) {
  const top = h("div", {});
  const data = h("div", { id: "data" });
  const form = h("div", {});
  const rest = h("div", {});
  page.replaceChildren(h("p", {}, h("a", { href: "#/machines" }, "← All machines")), h("h1", {}, name),
    h("div", { id: "machine" }, top,
      h("section", { "aria-labelledby": "data-title" }, h("h2", { id: "data-title" }, "Data location and drives"), data, form),
      rest));
  let formShown = false;
  async function refresh() {
    const [n, use, who] = await Promise.all([api(`/nodes/${encodeURIComponent(name)}`), api("/usage"), whoami()]);
    const inv = n.inventory || {};
    const free = use.machines.find((m) => m.name === name);
    const facts = [
      ["State", h("span", {}, stateBadge(n.state), " ", h("span", { class: "exact", id: "machine-reason" }, lastReason(n)))],
      ["Since", when(n.since)], ["Free room", h("span", { id: "machine-free" }, n.inventory ? room(free) : "—")],
      ["CPUs / memory", inv.cpus !== undefined ? `${inv.cpus} / ${gib(inv.memory_bytes)}` : "—"],
      ["Cordon", n.cordon === null ? "—" : n.cordon || "(cordoned)"], ["Pressure", (inv.pressure || []).join(", ") || "—"],
      ["Rack", (inv.labels || {})[RACK] || "—"], ["Site", inv.site || "—"], ["Pools", (inv.pools || []).join(", ") || "—"],
      ["Labels", Object.entries(inv.labels || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "—"],
      ["Agent", n.holder || "—"],
    ];
    const gpus = inv.gpus || [];
    const placed = free ? free.placed : [];
    const others = free ? free.workers - placed.length : 0;
    top.replaceChildren(
      h("div", { class: "actions" }, machineActions(n, refresh, who.admin), temporalLink(`node/${name}`, "Its workflow in the Temporal UI")),
      h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
      h("h2", {}, "GPUs"),
      gpus.length ? h("table", { id: "gpus" }, h("thead", {}, h("tr", {}, ["GPU", "Model", "Memory", "Health"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, gpus.map((g) => h("tr", {}, h("th", { scope: "row" }, g.index), h("td", {}, g.model), h("td", {}, gib(g.memory_bytes)),
          h("td", {}, g.fault ? h("span", { class: "error" }, `fault: ${g.fault}`) : g.at_risk ? `at risk: ${g.at_risk}` : "healthy")))))
        : h("p", { class: "empty" }, "No GPUs on this machine."));
    data.replaceChildren(...dataLocation(n, who.admin));
    if (who.admin && n.state !== "Removed" && !formShown) { form.replaceChildren(dataLocationForm(name, refresh)); formShown = true; }
    rest.replaceChildren(
      h("h2", {}, "Workers on it"),
      placed.length ? h("table", { id: "placed" }, h("thead", {}, h("tr", {}, ["Run", "Worker", "GPUs", "CPUs", "Memory"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, placed.map((p) => h("tr", {}, h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(p.namespace)}/${encodeURIComponent(p.run)}` }, `${p.namespace}/${p.run}`)),
          h("th", { scope: "row" }, p.task), h("td", {}, p.gpus), h("td", {}, +p.cpu.toFixed(2)), h("td", {}, gib(p.memory_bytes))))))
        : h("p", { class: "empty" }, others ? "" : "No workers on it: it takes work when a run fits here."),
      others ? h("p", { class: "muted" }, `${others} worker(s) of other workspaces.`) : "",
      h("h2", {}, "History"),
      h("ol", { class: "timeline", id: "machine-history" }, n.history.map((e) => h("li", {}, when(e.at), " ", stateBadge(e.state), " ",
        h("span", { class: "exact" }, e.reason)))));
  }
  return refresh;
}

// Where a machine keeps copies of drives (the place its agent reports, else the one an admin chose) and its room,
// and the copies it holds.
function dataLocation(n, admin) {
  const inv = n.inventory || {};
  const place = inv.data_location || n.data_location;
  const how = admin ? "Choose one below." : `An admin chooses one here, or with astraeus nodes data-location ${n.name} PATH.`;
  const copies = inv.drive_copies || [];
  return [
    h("p", { id: "data-location" }, place
      ? ["Copies of drives are kept at ", h("span", { class: "exact", id: "data-location-path-shown" }, place),
        inv.data_free_bytes === null || inv.data_free_bytes === undefined ? "" : `, ${size(inv.data_free_bytes)} free`, "."]
      : `No data location: workers that need a copy of a drive cannot be placed here. ${how}`),
    copies.length ? h("table", { id: "drive-copies" }, h("caption", { class: "muted" }, "Copies of drives it holds"),
      h("thead", {}, h("tr", {}, ["Drive", "Size", "Filled", "Path"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, copies.map((c) => h("tr", { "data-drive": c.drive }, h("th", { scope: "row" }, c.drive), h("td", {}, size(c.size_bytes)),
        h("td", {}, when(c.filled_at)), h("td", { class: "exact" }, c.path)))))
      : h("p", { class: "empty", id: "drive-copies-none" }, "No copies of drives here yet: a worker that mounts a drive held elsewhere fills one."),
  ];
}

// An admin chooses (or changes) where a machine keeps copies of drives, once confirmed; its agent must find the
// directory there, and the server's refusal is shown as it says it.
function dataLocationForm(node, after) {
  const input = h("input", { id: "data-location-input", name: "path", type: "text", required: true, autocomplete: "off",
    placeholder: "/srv/astraeus-data", "aria-describedby": "data-location-help" });
  const error = h("p", { id: "data-location-error", class: "error", role: "alert" });
  const submit = async (event) => {
    event.preventDefault();
    const path = input.value.trim();
    if (!path) return;
    const ok = await confirmDialog(`Keep data on ${node} at ${path}?`,
      `Workers placed on ${node} that mount a drive held elsewhere get their copy filled and kept there. Its agent must find the directory on ${node}.`);
    if (ok === null) return;
    error.textContent = "";
    try {
      await api(`/nodes/${encodeURIComponent(node)}/data-location`, { method: "PUT",
        headers: { "content-type": "application/json" }, body: JSON.stringify({ path }) });
      input.value = "";
      say(`Data location of ${node}: ${path}`);
    } catch (e) { error.textContent = e.message; say(e.message, true); }
    after();
  };
  return h("form", { id: "data-location-form", class: "inline-form", onsubmit: submit },
    h("label", { for: "data-location-input" }, "Data location"), input,
    h("button", { type: "submit", id: "data-location-choose" }, "Choose"),
    h("p", { id: "data-location-help", class: "muted" }, `An absolute path to a directory on ${node}, which its agent must find (admins only). Copies at a former data location stay on its disk, unused.`),
    error);
}

// The cluster's catalogue of drives (read-only; admins change it with astraeus drive create|rm).
function drivesPage(page) {
  const body = h("div", { id: "drives" });
  page.replaceChildren(h("h1", {}, "Drives"), body);
  async function refresh() {
    const drives = await api("/drives");
    if (!drives.length) { body.replaceChildren(h("p", { class: "empty" }, "No drives. An admin adds one: astraeus drive create NAME --machine MACHINE --size SIZE --source DIR [--site SITE].")); return; }
    body.replaceChildren(h("p", { class: "muted" }, "Each drive is held on one machine; machines of its site copy it to their data location for the workers that mount it."),
      h("table", { id: "drives-table" }, h("thead", {}, h("tr", {}, ["Drive", "Site", "Machine", "Size", "Source", "Problem"].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, drives.map((d) => h("tr", { "data-drive": d.name }, h("th", { scope: "row" }, d.name), h("td", {}, d.site || "any"),
          h("td", {}, d.node ? h("a", { href: `#/machines/${encodeURIComponent(d.node)}` }, d.node) : "—"), h("td", {}, size(d.size_bytes)),
          h("td", { class: "exact" }, d.source), h("td", {}, d.problem ? h("span", { class: "error" }, d.problem) : "—"))))));
  }
  return refresh;
}

function quotasPage(page) {
  const body = h("div", { id: "quotas" });
  page.replaceChildren(h("h1", {}, "Quotas"), body);
  const of = (used, limit, show) => limit === null ? `${show(used)} (no limit)` : `${show(used)} of ${show(limit)}`;
  async function refresh() {
    const [quotas, use] = await Promise.all([api("/quotas"), api("/usage")]);
    const used = new Map(use.workspaces.map((w) => [w.namespace, w]));
    const none = { gpus: 0, cpu: 0, memory_bytes: 0, workers: 0 };
    const spaces = [...new Set([...quotas.map((q) => q.namespace), ...used.keys()])].sort();
    if (!spaces.length) { body.replaceChildren(h("p", { class: "empty" }, "No quotas, and nothing running: every workspace may use the whole cluster. An admin sets a quota with astraeus quota set WORKSPACE --gpus N.")); return; }
    const limits = new Map(quotas.map((q) => [q.namespace, q]));
    const free = { gpus: null, cpu: null, memory_bytes: null, pools: [] };
    body.replaceChildren(h("p", { class: "muted" }, "Use is what each workspace's placed workers hold now; a quota caps it."),
      h("table", {}, h("thead", {}, h("tr", {}, ["Workspace", "GPUs used", "CPUs used", "Memory used", "Workers", "Pools"]
      .map((c) => h("th", { scope: "col" }, c)))), h("tbody", {}, spaces.map((ns) => {
        const q = limits.get(ns) || free; const u = used.get(ns) || none;
        return h("tr", { "data-workspace": ns }, h("th", { scope: "row" }, ns), h("td", {}, of(u.gpus, q.gpus, (x) => x)),
          h("td", {}, of(u.cpu, q.cpu, (x) => +x.toFixed(2))), h("td", {}, of(u.memory_bytes, q.memory_bytes, gib)),
          h("td", {}, u.workers), h("td", {}, q.pools.join(", ") || "all"));
      }))));
  }
  return refresh;
}

// A one-time sign-in link of `astraeus dev` (#sign-in=CODE): the code leaves the address at once (so that neither
// the history nor a copied address keeps it), and is traded, once, for the token it stands for.
async function signInFromLink() {
  const match = /^#sign-in=([A-Za-z0-9_-]+)$/.exec(location.hash);
  if (!match) return null;
  history.replaceState(null, "", `${location.pathname}#/runs`);
  const answer = await fetch("/console/sign-in", { method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ code: match[1] }) });
  const body = await answer.json().catch(() => ({}));
  if (!answer.ok) return body.error || `HTTP ${answer.status}`;
  sessionStorage.setItem("astraeus.token", body.token);
  return null;
}

Promise.all([
  fetch("/console/advice.json").then((r) => r.json()).then((table) => { advice = table; }),
  fetch("/console/config.json").then((r) => r.json()).then((c) => { config = c; }),
]).catch(() => null).then(signInFromLink).then((error) => { if (error) showLogin(error); else route(); });
