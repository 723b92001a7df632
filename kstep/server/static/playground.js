// kstep playground: one pane per served model, each streaming the same prompt from this server's
// OpenAI endpoints with kstep's canvas view (stream_options.include_canvas). Every chunk is recorded
// as a state; panes draw states live or paced (the speed control), and Replay redraws a finished run.
"use strict";

const MASK = "\u2591";
const $ = (selector) => document.querySelector(selector);
const runs = {};            // model id -> {states, text, usage, error, done, firstText}
window.kstepRuns = runs;    // for tests and the curious

let apiKey = sessionStorage.getItem("kstep-api-key");
let models = [];
const panes = {};

function headers() {
  const h = {"Content-Type": "application/json"};
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body?.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function showPageError(message) {
  const p = $("#page-error");
  p.textContent = message || "";
  p.hidden = !message;
}

async function loadModels() {
  const response = await fetch("/v1/models", {headers: headers()});
  if (response.status === 401) {
    $("#key-form").hidden = false;
    $("#api-key").focus();
    showPageError(apiKey ? "the API key was refused" : "this server needs an API key");
    return;
  }
  if (!response.ok) {
    showPageError(await errorMessage(response));
    return;
  }
  $("#key-form").hidden = true;
  showPageError("");
  models = (await response.json()).data;
  buildPanes();
}

function stat(dl, key, label) {
  const div = document.createElement("div");
  const dt = document.createElement("dt");
  const dd = document.createElement("dd");
  dt.textContent = label;
  dd.dataset.stat = key;
  dd.textContent = "–";
  div.append(dt, dd);
  dl.append(div);
}

function buildPanes() {
  const main = $("#panes");
  main.replaceChildren();
  for (const model of models) {
    const section = document.createElement("section");
    section.className = "pane";
    section.dataset.model = model.id;
    section.dataset.kind = model.kind;
    const title = document.createElement("h2");
    title.textContent = model.id + " ";
    const kind = document.createElement("small");
    kind.textContent = `${model.kind}, ${model.family}`;
    title.append(kind);
    const pre = document.createElement("pre");
    pre.tabIndex = 0;
    pre.setAttribute("aria-label", `${model.id} output`);
    const prompt = document.createElement("span");
    prompt.className = "prompt";
    const completion = document.createElement("code");
    completion.className = "completion";
    pre.append(prompt, completion);
    const error = document.createElement("p");
    error.className = "error";
    error.setAttribute("role", "alert");
    error.hidden = true;
    const dl = document.createElement("dl");
    dl.className = "stats";
    dl.setAttribute("role", "status");
    stat(dl, "passes", "forward passes");
    stat(dl, "tokens", "tokens");
    stat(dl, "per-pass", "tokens per pass");
    stat(dl, "elapsed", "elapsed");
    stat(dl, "first", "first committed text");
    stat(dl, "rate", "tokens/s");
    section.append(title, pre, error, dl);
    main.append(section);
    panes[model.id] = {model, section, prompt, completion, error, dl, timer: null, queue: []};
  }
}

function settings() {
  const number = (id) => $(id).value === "" ? null : Number($(id).value);
  return {
    prompt: $("#prompt").value,
    maxTokens: number("#max-tokens"),
    decoding: $("#decoding").value,
    threshold: number("#threshold"),
    steps: number("#steps"),
    blockLength: number("#block-length"),
    temperature: number("#temperature"),
    seed: number("#seed"),
    speed: Number($("#speed").value),
  };
}

function requestBody(model, s) {
  const body = {model: model.id, prompt: s.prompt, max_tokens: s.maxTokens, temperature: s.temperature,
                stream: true, stream_options: {include_canvas: true, include_usage: true}};
  if (s.seed !== null) body.seed = s.seed;  // a random-start model's canvases are random without one
  if (model.kind === "uniform-diffusion") {  // random-start refinement (DiffusionGemma): its own knobs
    if (s.decoding === "steps") {  // that many passes per canvas, never stopping early
      body.max_denoising_steps = s.steps;
      body.confidence_threshold = 0;
    }
  } else if (model.kind !== "autoregressive") {  // masked-diffusion knobs; an AR model would refuse them
    if (s.decoding === "exact") body.exact = true;
    if (s.decoding === "threshold") body.threshold = s.threshold;
    if (s.decoding === "steps") body.steps = s.steps;
    if (s.blockLength !== null) body.block_length = s.blockLength;
  }
  return body;
}

function setStat(pane, key, value) {
  pane.dl.querySelector(`[data-stat="${key}"]`).textContent = value;
}

function seconds(ms) {
  return ms === null || ms === undefined ? "–" : `${(ms / 1000).toFixed(2)} s`;
}

function span(text, className) {
  const s = document.createElement("span");
  if (className) s.className = className;
  s.textContent = text;
  return s;
}

// Draw one recorded state: the canvas position by position (diffusion) or the text so far (AR).
function draw(pane, run, index) {
  const state = run.states[index];
  const previous = index > 0 ? run.states[index - 1] : null;
  const pieces = state.pieces;
  const edited = new Set(state.edits);  // positions whose token changed into another since the last state
  const nodes = [];
  const committed = pieces ? pieces.slice(0, state.tokens).join("") : null;
  if (pieces && committed === state.text) {
    pieces.forEach((piece, i) => {
      if (piece === null) {
        nodes.push(span(MASK, "mask"));
        return;
      }
      const isNew = !previous || !previous.pieces || previous.pieces[i] == null;  // unmasked, or a new canvas
      const classes = [isNew ? "new" : "", edited.has(i) ? "edit" : "", i >= state.tokens ? "pending" : ""]
        .filter(Boolean).join(" ");
      nodes.push(classes ? span(piece, classes) : document.createTextNode(piece));
    });
  } else {  // an AR stream, or committed text that per-token pieces cannot spell exactly (a split character)
    nodes.push(document.createTextNode(state.text));
    if (pieces) {
      pieces.slice(state.tokens).forEach((piece) => nodes.push(piece === null ? span(MASK, "mask") : span(piece, "pending")));
    } else if (previous && state.text.startsWith(previous.text) && state.text.length > previous.text.length) {
      nodes[0] = document.createTextNode(previous.text);
      nodes.push(span(state.text.slice(previous.text.length), "new"));
    }
  }
  pane.completion.replaceChildren(...nodes);
  setStat(pane, "passes", state.step ?? "–");
  setStat(pane, "tokens", state.tokens ?? "–");
  setStat(pane, "per-pass", state.step ? (state.tokens / state.step).toFixed(2) : "–");
  setStat(pane, "elapsed", seconds(state.t));
  setStat(pane, "first", run.firstText !== null && state.t >= run.firstText ? seconds(run.firstText) : "–");
  const last = run.done && index === run.states.length - 1;
  setStat(pane, "rate", last && run.usage ? (run.usage.completion_tokens / (state.t / 1000)).toFixed(1) : "–");
  pane.section.dataset.state = last ? "done" : "running";
}

// Paced drawing: live draws every state as it arrives; otherwise one state per `speed` ms.
function schedule(pane, run, index, speed) {
  if (!speed) {
    draw(pane, run, index);
    return;
  }
  pane.queue.push(index);
  if (pane.timer !== null) return;
  const tick = () => {
    if (!pane.queue.length) {
      pane.timer = null;
      return;
    }
    draw(pane, run, pane.queue.shift());
    pane.timer = setTimeout(tick, speed);
  };
  tick();
}

function absorb(pane, run, chunk, speed) {
  if (chunk.usage) run.usage = chunk.usage;  // include_usage: the last chunk, which has no choices
  const choice = chunk.choices?.[0];
  if (!choice) return;
  const t = performance.now() - run.start;
  run.text += choice.text || "";
  if (choice.text && run.firstText === null) run.firstText = t;
  run.states.push({t, step: choice.step, tokens: choice.tokens, text: run.text, pieces: choice.canvas_pieces ?? null,
                   edits: choice.canvas_edits ?? []});
  schedule(pane, run, run.states.length - 1, speed);
}

async function runModel(pane, s) {
  const run = {model: pane.model.id, states: [], text: "", usage: null, error: null, done: false, firstText: null,
               start: performance.now()};
  runs[pane.model.id] = run;
  pane.queue = [];
  clearTimeout(pane.timer);
  pane.timer = null;
  pane.error.hidden = true;
  pane.prompt.textContent = s.prompt;
  pane.completion.replaceChildren();
  pane.section.dataset.state = "running";
  pane.section.setAttribute("aria-busy", "true");
  try {
    const response = await fetch("/v1/completions", {method: "POST", headers: headers(),
                                                     body: JSON.stringify(requestBody(pane.model, s))});
    if (!response.ok) throw new Error(await errorMessage(response));
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const chunk = JSON.parse(event.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        absorb(pane, run, chunk, s.speed);
      }
    }
    run.done = true;
    if (run.states.length) schedule(pane, run, run.states.length - 1, s.speed);  // the stats' final figures
  } catch (e) {
    run.error = e.message;
    run.done = true;
    pane.error.textContent = e.message;
    pane.error.hidden = false;
    pane.section.dataset.state = "error";
  } finally {
    pane.section.removeAttribute("aria-busy");
  }
}

async function runAll(event) {
  event.preventDefault();
  const s = settings();
  $("#run").disabled = true;
  $("#replay").disabled = true;
  try {
    await Promise.all(Object.values(panes).map((pane) => runModel(pane, s)));
    await drained();
  } finally {
    $("#run").disabled = false;
    $("#replay").disabled = !Object.values(runs).some((r) => r.states.length);
  }
}

// Resolves once every pane has drawn its last queued state (paced drawing outlives the stream).
function drained() {
  return new Promise((resolve) => {
    const check = () => Object.values(panes).every((p) => p.timer === null) ? resolve() : setTimeout(check, 50);
    check();
  });
}

function replay() {
  const speed = Number($("#speed").value) || 100;
  for (const pane of Object.values(panes)) {
    const run = runs[pane.model.id];
    if (!run || !run.states.length) continue;
    pane.queue = [];
    clearTimeout(pane.timer);
    pane.timer = null;
    run.states.forEach((_, i) => schedule(pane, run, i, speed));
  }
}

$("#run-form").addEventListener("submit", runAll);
$("#replay").addEventListener("click", replay);
$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("#api-key").value;
  sessionStorage.setItem("kstep-api-key", apiKey);
  loadModels();
});
$("#prompt").addEventListener("keydown", (event) => {  // Ctrl/Cmd+Enter runs, as in most playgrounds
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("#run-form").requestSubmit();
});
loadModels();
