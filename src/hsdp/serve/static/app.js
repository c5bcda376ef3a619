// The hsdp serve playground: a form built from GET /v1/models (the fields, defaults and limits of the served
// model), jobs through /v1/jobs (queue, poll, download, cancel). Public API calls only; no library, no build step.
"use strict";

const KEY_STORE = "hsdp-api-key";
const POLL_MS = 250;
const LIST_MS = 1000;
const FINISHED = ["completed", "failed", "cancelled"];
const state = { key: sessionStorage.getItem(KEY_STORE), model: null, route: null, fields: [], current: null, shown: null };

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...children);
  return node;
}

class ApiError extends Error {
  constructor(status, body) {
    const message = (body && body.error && body.error.message) || `HTTP ${status}`;
    super(message);
    this.status = status;
    this.param = body && body.error && body.error.param;
  }
}

// Every request of the page goes through here: the API key (when the server has one) as a bearer token.
async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    askKey();
    throw new ApiError(401, await response.json().catch(() => null));
  }
  if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
  return response;
}

function askKey() {
  $("key-section").hidden = false;
  $("api-key").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("key-section").hidden = true;
  start();
});

// -- the form ------------------------------------------------------------------------------------------------
function hint(field) {
  const parts = [];
  if (field.default !== null && field.default !== undefined) parts.push(`default ${field.default}`);
  if (field.type === "size") parts.push(`sides multiples of ${field.multiple_of}, at most ${field.maximum}`);
  else if (field.type === "text" && field.maximum) parts.push(`up to ${field.maximum} characters`);
  else if (field.maximum !== null && field.maximum !== undefined) parts.push(`${field.minimum} to ${field.maximum}`);
  return [field.description, parts.join(", ")].filter(Boolean).join("; ");
}

function fieldInput(field) {
  const id = `f-${field.name}`;
  const common = { id, name: field.name, "aria-describedby": `${id}-hint`, required: field.required };
  if (field.type === "text") {
    return el("textarea", { ...common, rows: field.name === "prompt" ? 3 : 2, maxlength: field.maximum });
  }
  if (field.type === "size") {
    return el("input", { ...common, type: "text", pattern: "\\d+x\\d+", placeholder: field.default || "WIDTHxHEIGHT" });
  }
  if (field.type === "image") return el("input", { ...common, type: "file", accept: "image/png,image/jpeg,image/webp" });
  const step = field.type === "integer" ? 1 : "any";
  return el("input", {
    ...common, type: "number", step, min: field.minimum, max: field.maximum,
    placeholder: field.name === "seed" ? "random" : field.default,
  });
}

function buildForm(fields) {
  const box = $("fields");
  box.replaceChildren();
  for (const field of fields) {
    if (field.type === "adapters") continue;
    const id = `f-${field.name}`;
    const wrap = el("div", { class: field.type === "text" ? "wide" : null });
    wrap.append(el("label", { for: id, text: field.name }), fieldInput(field), el("span", { id: `${id}-hint`, class: "hint", text: hint(field) }));
    box.append(wrap);
  }
}

function buildAdapters(cards) {
  const list = $("adapter-list");
  list.replaceChildren();
  $("adapters").hidden = cards.length === 0;
  for (const card of cards) {
    const id = `a-${card.id}`;
    const row = el("div", { class: "adapter" });
    row.append(
      el("input", { type: "checkbox", id, "data-adapter": card.id }),
      el("label", { for: id, text: card.id }),
      el("label", { for: `${id}-scale`, text: "scale", class: "muted" }),
      el("input", { type: "number", id: `${id}-scale`, step: "any", value: "1", min: -100, max: 100, size: 5 }),
    );
    list.append(row);
  }
}

function chosenAdapters() {
  const chosen = [];
  for (const box of document.querySelectorAll("[data-adapter]:checked")) {
    const scale = Number($(`${box.id}-scale`).value || 1);
    chosen.push(scale === 1 ? { name: box.dataset.adapter } : { name: box.dataset.adapter, scale });
  }
  return chosen;
}

// The request body: only what the user set; the form shows the model's defaults as placeholders and the server
// applies them to what is left empty, so the page's request is the one a client leaving them out sends.
function requestBody() {
  const body = {};
  const uploads = {};  // file parts by field name: input_reference, and mask for an inpainting pipeline
  for (const field of state.fields) {
    if (field.type === "adapters") continue;
    const input = $(`f-${field.name}`);
    if (field.type === "image") { if (input.files[0]) uploads[field.name] = input.files[0]; continue; }
    const raw = input.value.trim();
    if (raw === "" && field.name !== "prompt") continue;
    body[field.name] = field.type === "integer" || field.type === "number" ? Number(raw) : raw;
  }
  const adapters = chosenAdapters();
  if (adapters.length) body.lora = adapters.length === 1 ? adapters[0] : adapters;
  return { body, uploads };
}

async function submitJob(event) {
  event.preventDefault();
  $("form-error").textContent = "";
  const { body, uploads } = requestBody();
  let options;
  if (Object.keys(uploads).length) {
    const form = new FormData();
    for (const [name, value] of Object.entries(body)) form.append(name, typeof value === "object" ? JSON.stringify(value) : value);
    for (const [name, file] of Object.entries(uploads)) form.append(name, file);
    options = { method: "POST", body: form };
  } else {
    options = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  }
  try {
    const job = await (await api(state.route, options)).json();
    follow(job);
    refreshJobs();
  } catch (error) {
    $("form-error").textContent = error.message;
    if (error.param && $(`f-${error.param}`)) $(`f-${error.param}`).focus();
  }
}

// -- the current job -----------------------------------------------------------------------------------------
function describe(job) {
  if (job.status === "in_progress") {
    const steps = job.steps ? `step ${job.step} of ${job.steps}` : "starting";
    const eta = job.eta_seconds !== null && job.eta_seconds !== undefined ? `, about ${job.eta_seconds.toFixed(1)} s left` : "";
    return `Running: ${steps}${eta}`;
  }
  if (job.status === "queued") return "Queued";
  if (job.status === "completed") return `Completed: seed ${job.seed}${job.size ? `, ${job.size}` : ""}`;
  return `${job.status[0].toUpperCase()}${job.status.slice(1)}${job.error ? `: ${job.error.message}` : ""}`;
}

function showStatus(job) {
  const status = $("current-status");
  status.textContent = describe(job);
  status.dataset.status = job.status;
  status.dataset.step = job.step;
  status.dataset.jobId = job.id;
  $("current-progress").value = job.progress;
}

function follow(job) {
  state.current = job.id;
  $("current-section").hidden = false;
  $("result").replaceChildren();
  showStatus(job);
  poll(job.id);
}

async function poll(id) {
  while (state.current === id) {
    let job;
    try {
      job = await (await api(`${state.route}/${id}`)).json();
    } catch (error) {
      $("current-status").textContent = `Lost the job: ${error.message}`;
      return;
    }
    if (state.current !== id) return;
    showStatus(job);
    if (FINISHED.includes(job.status)) {
      if (job.status === "completed") await showResult(job);
      return;
    }
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}

async function content(job) {
  return (await api(`${state.route}/${job.id}/content`)).blob();
}

async function showResult(job) {
  const blob = await content(job);
  if (state.shown) URL.revokeObjectURL(state.shown);
  const url = URL.createObjectURL(blob);
  state.shown = url;
  const alt = `${job.output} for "${job.prompt}" (seed ${job.seed})`;
  let player;
  if (job.output === "image") player = el("img", { src: url, alt, id: "result-media" });
  else player = el(job.output, { src: url, controls: true, id: "result-media", "aria-label": alt, preload: "metadata" });
  const link = el("a", { href: url, download: fileName(job), text: `Download ${fileName(job)}` });
  $("result").replaceChildren(player, el("p", {}, link));
}

function fileName(job) {
  const suffix = { "video/mp4": "mp4", "image/png": "png", "image/jpeg": "jpg", "image/webp": "webp", "audio/wav": "wav", "audio/flac": "flac", "audio/mpeg": "mp3" };
  return `${job.id}.${suffix[job.content_type] || "bin"}`;
}

// -- the job list --------------------------------------------------------------------------------------------
async function download(job) {
  const url = URL.createObjectURL(await content(job));
  const link = el("a", { href: url, download: fileName(job) });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function jobRow(job) {
  const actions = el("td");
  if (!FINISHED.includes(job.status)) {
    const cancel = el("button", { type: "button", class: "secondary", "aria-label": `Cancel ${job.id}`, text: "Cancel" });
    cancel.addEventListener("click", async () => { await api(`${state.route}/${job.id}`, { method: "DELETE" }).catch(() => null); refreshJobs(); });
    actions.append(cancel);
  }
  if (job.status === "completed") {
    const show = el("button", { type: "button", class: "secondary", "aria-label": `Show ${job.id}`, text: "Show" });
    show.addEventListener("click", () => { follow(job); });
    const save = el("button", { type: "button", class: "secondary", "aria-label": `Download ${job.id}`, text: "Download" });
    save.addEventListener("click", () => download(job));
    actions.append(show, save);
  }
  const progress = job.status === "in_progress" && job.steps ? `step ${job.step} of ${job.steps}` : `${job.progress}%`;
  return el("tr", { "data-job-id": job.id, "data-status": job.status },
    el("td", {}, el("code", { text: job.id.slice(0, 14) })),
    el("td", { class: "prompt", text: job.prompt }),
    el("td", { class: "status", text: job.status }),
    el("td", { text: progress }),
    actions);
}

async function refreshJobs() {
  try {
    const jobs = (await (await api(`${state.route}?limit=50`)).json()).data;
    $("job-rows").replaceChildren(...jobs.map(jobRow));
  } catch (error) {
    // The next refresh tries again; a 401 has already asked for the key.
  }
}

// -- text models ---------------------------------------------------------------------------------------------
async function complete(event) {
  event.preventDefault();
  const body = { prompt: $("text-prompt").value };
  for (const [name, id] of [["max_tokens", "text-max-tokens"], ["temperature", "text-temperature"]]) {
    if ($(id).value.trim() !== "") body[name] = Number($(id).value);
  }
  const result = $("text-result");
  result.dataset.done = "false";
  try {
    const answer = await (await api("/v1/completions", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) })).json();
    result.textContent = answer.choices[0].text;
  } catch (error) {
    result.textContent = error.message;
  }
  result.dataset.done = "true";
}

// -- start ---------------------------------------------------------------------------------------------------
async function start() {
  let cards;
  try {
    cards = (await (await api("/v1/models")).json()).data;
  } catch (error) {
    $("model-info").textContent = error.status === 401 ? "This server needs its API key." : `Could not read /v1/models: ${error.message}`;
    return;
  }
  const base = cards.find((card) => !card.parent);
  state.model = base;
  $("model-name").textContent = base.id;
  $("model-info").textContent = `${base.kind.replace("_", " ")} model making ${base.outputs.join(", ")}`;
  const parameters = base.parameters || { fields: [] };
  if (base.kind !== "diffusion" || !parameters.job_route) {
    $("text-section").hidden = false;
    document.body.dataset.ready = "true";
    return;
  }
  state.route = parameters.job_route;
  state.fields = parameters.fields;
  buildForm(state.fields);
  buildAdapters(cards.filter((card) => card.parent));
  $("run-section").hidden = false;
  $("jobs-section").hidden = false;
  refreshJobs();
  if (!state.timer) state.timer = setInterval(refreshJobs, LIST_MS);
  document.body.dataset.ready = "true";
}

$("job-form").addEventListener("submit", submitJob);
$("text-form").addEventListener("submit", complete);
start();
