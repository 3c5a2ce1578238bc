// The status page: polls the gateway's admin API and draws the fleet. The admin key lives in
// sessionStorage (this tab only) and travels in the Authorization header, never in a URL. Every
// value from the gateway is put in the page as text (textContent), never as markup.
"use strict";

const KEY_STORE = "modelyard-admin-key";
const POLL_MS = 1500;
const LOG_LINES = 40;
const ACTIONS = ["load", "park", "unload"];

const $ = (id) => document.getElementById(id);
const pending = new Map(); // model name -> the action sent for it, until it answers
let active = false; // polling (not waiting for a key)
let inFlight = false; // a poll is under way: one at a time
let soon = false; // poll again as soon as the one under way ends
let pollTimer = null;

class Refused extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function storedKey() {
  return sessionStorage.getItem(KEY_STORE);
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  const key = storedKey();
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch(path, {
    ...options, headers, cache: "no-store", credentials: "omit", redirect: "error",
  });
  if (response.status === 401 || response.status === 403) {
    throw new Refused(response.status, await errorMessage(response));
  }
  return response;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// ---- the key ----

function askForKey(message) {
  stopPolling();
  $("fleet").hidden = true;
  $("forget").hidden = true;
  $("login").hidden = false;
  $("refusal").textContent = message;
  $("key").value = "";
  $("key").focus();
}

function onKeySubmitted(event) {
  event.preventDefault();
  const key = $("key").value.trim();
  $("key").value = "";
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  $("refusal").textContent = "";
  startPolling();
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORE);
  askForKey("Key forgotten.");
}

// ---- polling ----

function startPolling() {
  active = true;
  pollNow();
}

function stopPolling() {
  active = false;
  clearTimeout(pollTimer);
  pollTimer = null;
}

function pollNow() {
  if (inFlight) {
    soon = true;
    return;
  }
  clearTimeout(pollTimer);
  pollTimer = null;
  poll();
}

async function poll() {
  inFlight = true;
  try {
    const listing = await (await api("/admin/models")).json();
    $("login").hidden = true;
    $("fleet").hidden = false;
    $("forget").hidden = !storedKey();
    render(listing);
    await showLog(listing);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    $("updated").classList.remove("stale");
  } catch (error) {
    if (error instanceof Refused) {
      // no key sent yet: ask for one; a key refused, or admin endpoints off (403): say so
      const ask = !storedKey() && error.status === 401;
      askForKey(ask ? "This gateway needs its admin key." : "Refused: " + error.message);
      return;
    }
    $("updated").textContent = "the gateway does not answer (" + error.message + ")";
    $("updated").classList.add("stale");
  } finally {
    inFlight = false;
  }
  if (!active) return;
  pollTimer = setTimeout(poll, soon ? 0 : POLL_MS);
  soon = false;
}

// ---- drawing ----

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) if (child !== null) node.append(child);
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function seconds(s) {
  return s < 60 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

function render(listing) {
  const memory = listing.memory;
  $("memory").max = Math.max(memory.cpu_bytes, 1);
  $("memory").value = memory.cpu_resident_bytes;
  $("memory-text").textContent =
    `${bytes(memory.cpu_resident_bytes)} resident of ${bytes(memory.cpu_bytes)} budget`;

  const rows = listing.models.map(modelRow);
  $("models").tBodies[0].replaceChildren(...rows);

  const errors = (listing.recent_errors || []).slice().reverse();
  $("errors").replaceChildren(...errors.map(errorItem));
  $("no-errors").hidden = errors.length > 0;
}

function modelRow(model) {
  // completion tokens of the answers that ended in the last minute, over a minute
  const rate = model.completion_tokens_per_s.toFixed(1);
  const footprint = model.footprint
    ? `${bytes(model.footprint.awake_bytes)} awake, ${bytes(model.footprint.parked_bytes)} ` +
      `parked (${model.footprint.source})`
    : "—";
  return el("tr", { "data-model": model.name },
    el("th", { scope: "row", text: model.name }),
    el("td", {}, el("span", { class: `model-state state-${model.state}`, text: model.state })),
    el("td", { text: model.local ? model.residency || "" : "external" }),
    el("td", { class: "queued", text: String(model.queued_requests) }),
    el("td", { text: footprint }),
    el("td", { class: "tokens", text: rate }),
    el("td", {}, ...(model.replicas || []).map((r) => replicaBox(model.name, r))),
    el("td", { class: "actions" }, ...(model.local ? actionButtons(model) : [])),
  );
}

function replicaBox(modelName, replica) {
  const box = el("div", { class: "replica", "data-replica": `${modelName}#${replica.index}` },
    el("span", { class: `replica-state state-${replica.state}`, text: replica.state }),
    el("span", { class: "quiet", text: ` #${replica.index} · ${seconds(replica.for_s)}` +
      (replica.pid ? ` · pid ${replica.pid}` : "") +
      (replica.restarts ? ` · ${replica.restarts} restarts` : "") }),
  );
  if (replica.draining) box.append(el("span", { class: "tag", text: "draining" }));
  const progress = replica.progress;
  if (progress) {
    const bar = el("progress", { max: 100 });
    if (progress.percent !== null) bar.value = progress.percent;
    const percent = progress.percent !== null ? ` ${Math.round(progress.percent)}%` : "";
    box.append(el("div", { class: "progress" }, bar,
      el("span", { class: "stage", text: `${progress.stage}${percent}` }),
      el("span", { class: "quiet", text: ` · ${seconds(progress.stage_s)} in stage` })));
  }
  if (replica.state === "ready" && replica.url) {
    const drain = !replica.draining;
    box.append(el("button", {
      type: "button", class: "small", text: drain ? "drain" : "undrain",
      onclick: () => setDrain(modelName, replica.url, drain),
    }));
  }
  return box;
}

function actionButtons(model) {
  const busy = pending.get(model.name);
  const allowed = {
    load: model.state !== "ready",
    park: model.state === "ready",
    unload: model.state !== "stopped",
  };
  return ACTIONS.map((action) => el("button", {
    type: "button",
    text: busy === action ? action + "…" : action,
    disabled: busy !== undefined || !allowed[action],
    "data-action": action,
    "data-model": model.name,
    onclick: () => act(model.name, action),
  }));
}

function errorItem(error) {
  const when = new Date(error.time * 1000).toLocaleTimeString();
  return el("li", {},
    el("span", { class: "quiet", text: when + " " }),
    el("strong", { text: `${error.model}#${error.replica}` }),
    ` ${error.from} → ${error.to}` + (error.reason ? `: ${error.reason}` : ""));
}

// ---- actions ----

async function act(name, action) {
  pending.set(name, action);
  pollNow(); // show it as under way at once
  try {
    const response = await api(`/admin/models/${encodeURIComponent(name)}/${action}`,
      { method: "POST" });
    $("notice").textContent = response.ok
      ? `${name}: ${action} done.`
      : `${name}: ${action} failed: ${await errorMessage(response)}`;
  } catch (error) {
    if (error instanceof Refused) {
      askForKey("Refused: " + error.message);
      return;
    }
    $("notice").textContent = `${name}: ${action} failed: ${error.message}`;
  } finally {
    pending.delete(name);
  }
  if (active) pollNow();
}

async function setDrain(model, backend, drain) {
  try {
    const response = await api("/admin/drain", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ backend, model, drain }),
    });
    $("notice").textContent = response.ok
      ? `${backend}: ${drain ? "draining" : "back in rotation"}.`
      : `${backend}: ${await errorMessage(response)}`;
  } catch (error) {
    if (error instanceof Refused) {
      askForKey("Refused: " + error.message);
      return;
    }
    $("notice").textContent = `${backend}: ${error.message}`;
  }
  if (active) pollNow();
}

// ---- the engine log ----

async function showLog(listing) {
  const select = $("log-replica");
  const chosen = select.value;
  const replicas = [];
  for (const model of listing.models) {
    for (const replica of model.replicas || []) replicas.push([model.name, replica]);
  }
  const values = replicas.map(([name, r]) => `${name}#${r.index}`);
  if (values.join("\n") !== Array.from(select.options, (o) => o.value).join("\n")) {
    select.replaceChildren(...values.map((v) => el("option", { value: v, text: v })));
    if (values.includes(chosen)) select.value = chosen;
  }
  if (!select.value) {
    $("log-path").textContent = "";
    $("log-lines").textContent = "No engine has run yet.";
    return;
  }
  const at = select.value.lastIndexOf("#");
  const [name, index] = [select.value.slice(0, at), select.value.slice(at + 1)];
  const replica = replicas.find(([n, r]) => n === name && String(r.index) === index)[1];
  $("log-path").textContent = replica.log || "";
  const query = new URLSearchParams({ model: name, replica: index, tail: String(LOG_LINES) });
  const response = await api("/admin/logs?" + query);
  $("log-lines").textContent = response.ok ? await response.text() : await errorMessage(response);
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", onKeySubmitted);
  $("forget").addEventListener("click", forgetKey);
  $("log-replica").addEventListener("change", () => pollNow());
  startPolling(); // open mode needs no key; otherwise the first answer asks for it
});
