// The chat page: a conversation over this server's /v1/chat/completions (streamed), the model from
// /v1/models, and a live panel from /metrics. Same origin only; model text reaches the DOM as text.
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "wallbreaker.apiKey";
const SETTINGS_STORE = "wallbreaker.settings";
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed", "ignore_eos"];
const METRICS_EVERY_MS = 1000;

const state = {
  model: null,
  apiKey: localStorage.getItem(KEY_STORE) || "",
  keyRequired: false,
  history: [], // {role, content} of the conversation, the system prompt aside
  images: [], // data URLs of the images attached to the message being written
  controller: null, // the AbortController of the reply streaming now
  lastGenerated: null, // [tokens generated, time] of the previous scrape, for the live rate
};

function authHeaders() {
  return state.apiKey ? { Authorization: `Bearer ${state.apiKey}` } : {};
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// Settings ------------------------------------------------------------------------------------

function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}") || {}; } catch { saved = {}; }
  for (const name of SETTINGS) {
    if (!(name in saved)) continue;
    const input = $(name);
    if (input.type === "checkbox") input.checked = Boolean(saved[name]);
    else input.value = String(saved[name]);
  }
}

function saveSettings() {
  const saved = {};
  for (const name of SETTINGS) {
    const input = $(name);
    saved[name] = input.type === "checkbox" ? input.checked : input.value;
  }
  localStorage.setItem(SETTINGS_STORE, JSON.stringify(saved));
}

function numberField(id, parse) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = parse(raw);
  return Number.isFinite(value) ? value : undefined;
}

function samplingFields() {
  const fields = {
    temperature: numberField("temperature", parseFloat),
    top_p: numberField("top_p", parseFloat),
    max_tokens: numberField("max_tokens", (s) => parseInt(s, 10)),
    seed: numberField("seed", (s) => parseInt(s, 10)),
  };
  if ($("ignore_eos").checked) fields.ignore_eos = true;
  for (const k of Object.keys(fields)) if (fields[k] === undefined) delete fields[k];
  return fields;
}

// The model and the API key -------------------------------------------------------------------

async function connect() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: authHeaders(), cache: "no-store" });
  } catch {
    $("model-info").textContent = "server unreachable, retrying…";
    setTimeout(connect, 2000);
    return;
  }
  if (response.status === 401) {
    state.keyRequired = true;
    $("change-key").hidden = false;
    $("model-info").textContent = "needs an API key";
    askKey(state.apiKey ? "The server refused this key." : "");
    return;
  }
  if (!response.ok) {
    $("model-info").textContent = `/v1/models answered ${response.status}; retrying…`;
    setTimeout(connect, 2000);
    return;
  }
  const card = ((await response.json()).data || [])[0];
  if (!card) {
    $("model-info").textContent = "no model served";
    return;
  }
  state.model = card.id;
  const info = $("model-info");
  info.textContent = "";
  info.append(el("span", "model-name", card.id));
  if (card.max_model_len) info.append(el("span", "model-ctx", `context ${card.max_model_len.toLocaleString("en-US")} tokens`));
  info.title = card.id;
  updateButtons();
}

function askKey(error) {
  const dialog = $("api-key-dialog");
  const message = $("api-key-error");
  message.hidden = !error;
  message.textContent = error || "";
  dialog.hidden = false;
  $("api-key").value = "";
  $("api-key").focus();
}

function saveKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  state.apiKey = key;
  localStorage.setItem(KEY_STORE, key);
  $("api-key-dialog").hidden = true;
  connect();
}

// Messages ------------------------------------------------------------------------------------

function hideEmpty() {
  const empty = $("empty");
  if (empty) empty.hidden = true;
}

function nearBottom() {
  const box = $("messages");
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function addUserMessage(text, images = []) {
  hideEmpty();
  const turn = el("div", "turn user");
  const msg = el("div", "msg", text);
  msg.dataset.role = "user";
  for (const url of images) msg.prepend(thumbnail(url));
  turn.append(msg);
  $("messages").append(turn);
  scrollDown();
}

// An assistant reply: its element, re-rendered (at most once a frame) as text streams in.
function addAssistantMessage() {
  hideEmpty();
  const turn = el("div", "turn assistant");
  const msg = el("div", "msg markdown");
  msg.dataset.role = "assistant";
  msg.dataset.state = "waiting";
  const typing = el("span", "typing");
  typing.append(el("i"), el("i"), el("i"));
  msg.append(typing);
  const stats = el("div", "stats");
  turn.append(msg, stats);
  $("messages").append(turn);
  scrollDown();

  let text = "";
  let scheduled = false;
  const render = () => {
    scheduled = false;
    const follow = nearBottom();
    msg.replaceChildren(renderMarkdown(text));
    if (follow) scrollDown();
  };
  return {
    msg,
    stats,
    update(newText) {
      text = newText;
      msg.dataset.state = "streaming";
      if (!scheduled) {
        scheduled = true;
        requestAnimationFrame(render);
      }
    },
    finish(finalText, status) {
      text = finalText;
      render();
      msg.dataset.state = status;
    },
  };
}

function formatStats({ ttftMs, tokens, exact, tokensPerS, promptTokens, finish }) {
  const parts = [];
  if (ttftMs !== null) {
    parts.push(["TTFT", ttftMs < 1000 ? `${ttftMs.toFixed(0)} ms` : `${(ttftMs / 1000).toFixed(2)} s`,
      "time to first token, measured here: from sending the request to its first text"]);
  }
  if (tokensPerS !== null) parts.push(["", `${tokensPerS.toFixed(1)} tok/s`, "decode speed: the tokens after the first, over the time they took"]);
  if (tokens) {
    parts.push(["", `${exact ? "" : "~"}${tokens} tokens`,
      exact ? "tokens generated (the server's usage)" : "text chunks received (a stopped reply has no usage)"]);
  }
  if (promptTokens) parts.push(["prompt", `${promptTokens}`, "prompt tokens, chat template and history included"]);
  parts.push(["", finish, "finish reason"]);
  return parts;
}

function showStats(view, stats) {
  view.stats.replaceChildren();
  for (const [label, value, title] of formatStats(stats)) {
    const item = el("span", "stat");
    item.title = title;
    if (label) item.append(el("span", "stat-label", label + " "));
    item.append(el("span", value === stats.finish ? `stat-finish finish-${stats.finish}` : "stat-value", value));
    view.stats.append(item);
  }
  view.msg.dataset.finishReason = stats.finish;
}

// Streaming -----------------------------------------------------------------------------------

// The `data:` payloads of a server-sent event stream.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) !== -1) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch { /* not JSON */ }
  return `the server answered ${response.status}`;
}

// Images: attached from a file or pasted, sent as OpenAI image_url parts (data URLs) before the text.
function thumbnail(url) {
  const img = el("img", "thumb");
  img.src = url; // a data: URL of the user's own file (the page's CSP allows data: images only)
  img.alt = "attached image";
  return img;
}

function showAttachments() {
  const box = $("attachments");
  box.replaceChildren(...state.images.map(thumbnail));
  box.hidden = state.images.length === 0;
}

function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => { state.images.push(reader.result); showAttachments(); };
    reader.readAsDataURL(file);
  }
}

async function send() {
  const prompt = $("prompt");
  const text = prompt.value;
  if ((!text.trim() && !state.images.length) || state.controller || !state.model) return;
  prompt.value = "";
  autosize();
  const images = state.images;
  state.images = [];
  showAttachments();
  const parts = images.length
    ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), ...(text ? [{ type: "text", text }] : [])]
    : text;
  state.history.push({ role: "user", content: parts });
  addUserMessage(text, images);
  const view = addAssistantMessage();

  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true }, ...samplingFields() };

  const controller = new AbortController();
  state.controller = controller;
  updateButtons();
  const start = performance.now();
  let first = null;
  let last = null;
  let content = "";
  let chunks = 0;
  let finish = null;
  let usage = null;
  let error = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
      body: JSON.stringify(body),
      signal: controller.signal,
      cache: "no-store",
    });
    if (!response.ok) {
      error = await errorText(response);
      if (response.status === 401) askKey("The server refused this key.");
    } else {
      for await (const data of sseData(response.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) { error = chunk.error.message || "the server reported an error"; break; }
        const choice = (chunk.choices || [])[0];
        if (choice) {
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            last = performance.now();
            if (first === null) first = last;
            content += piece;
            chunks += 1;
            view.update(content);
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (chunk.usage) usage = chunk.usage;
      }
    }
  } catch (e) {
    if (controller.signal.aborted) finish = "stopped";
    else error = e && e.message ? e.message : String(e);
  } finally {
    state.controller = null;
    updateButtons();
  }

  if (content) state.history.push({ role: "assistant", content });
  else if (error) state.history.pop(); // nothing came back: the question can be asked again
  if (error && !content) {
    view.finish("", "error");
    view.msg.replaceChildren(el("div", "error", error));
  } else {
    view.finish(content, finish === "stopped" ? "stopped" : error ? "error" : "done");
    if (error) view.msg.append(el("div", "error", error));
  }
  const tokens = usage ? usage.completion_tokens : chunks;
  const seconds = first !== null && last > first ? (last - first) / 1000 : 0;
  showStats(view, {
    ttftMs: first === null ? null : first - start,
    tokens,
    exact: Boolean(usage),
    tokensPerS: tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null,
    promptTokens: usage ? usage.prompt_tokens : 0,
    finish: error ? "error" : finish || "stopped",
  });
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  stop();
  state.history = [];
  state.images = [];
  showAttachments();
  for (const turn of document.querySelectorAll("#messages .turn")) turn.remove();
  $("empty").hidden = false;
  $("prompt").focus();
}

function updateButtons() {
  const busy = state.controller !== null;
  $("send").disabled = busy || !state.model;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

function autosize() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight, 240)}px`;
}

// The live panel ------------------------------------------------------------------------------

function parseMetrics(text) {
  const samples = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)/);
    if (m) samples[m[1] + (m[2] || "")] = Number(m[3]);
  }
  return samples;
}

function showMetrics(samples) {
  const get = (name) => samples[name];
  const show = (id, value) => { $(id).textContent = value === undefined || Number.isNaN(value) ? "–" : value; };
  show("m-running", get("wallbreaker_requests_running"));
  show("m-waiting", get("wallbreaker_requests_waiting"));
  const used = get("wallbreaker_kv_blocks_used");
  const total = get("wallbreaker_kv_blocks_total");
  show("m-kv", used === undefined ? undefined : `${used} / ${total}`);
  $("m-kv-bar").style.width = total ? `${Math.min(100, (100 * used) / total).toFixed(1)}%` : "0%";
  const rate = get("wallbreaker_spec_acceptance_rate");
  show("m-spec", rate ? `${(100 * rate).toFixed(1)}%` : rate === 0 ? "–" : undefined);
  const generated = get("wallbreaker_generation_tokens_total");
  const now = performance.now();
  let perS;
  if (generated !== undefined && state.lastGenerated) {
    const [before, then] = state.lastGenerated;
    perS = Math.max(0, ((generated - before) * 1000) / (now - then));
  }
  state.lastGenerated = generated === undefined ? null : [generated, now];
  show("m-rate", perS === undefined ? undefined : `${perS.toFixed(0)} tok/s`);
  show("m-gen", generated === undefined ? undefined : generated.toLocaleString("en-US"));
  const diskHits = get("wallbreaker_kv_disk_hits_total");
  const diskBad = get("wallbreaker_kv_disk_bad_entries_total");
  show("m-disk", diskHits === undefined ? undefined
    : `${diskHits.toLocaleString("en-US")} blocks` + (diskBad ? ` (${diskBad} bad)` : ""));
}

async function pollMetrics() {
  const dot = $("live-dot");
  try {
    const response = await fetch("/metrics", { headers: authHeaders(), cache: "no-store" });
    if (response.ok) {
      showMetrics(parseMetrics(await response.text()));
      dot.className = "dot on";
      $("live-note").textContent = "from /metrics, every second";
    } else {
      dot.className = "dot off";
      $("live-note").textContent = response.status === 401 ? "/metrics needs the API key" : `/metrics answered ${response.status}`;
    }
  } catch {
    dot.className = "dot off";
    $("live-note").textContent = "/metrics unreachable";
  }
  setTimeout(pollMetrics, METRICS_EVERY_MS);
}

// Wiring --------------------------------------------------------------------------------------

function copyCode(event) {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const code = button.closest(".code").querySelector("code");
  const done = (label) => {
    button.textContent = label;
    setTimeout(() => { button.textContent = "copy"; }, 1200);
  };
  if (navigator.clipboard) navigator.clipboard.writeText(code.textContent).then(() => done("copied"), () => done("failed"));
}

function init() {
  loadSettings();
  for (const name of SETTINGS) $(name).addEventListener("change", saveSettings);
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("change-key").addEventListener("click", () => askKey(""));
  $("api-key-form").addEventListener("submit", saveKey);
  $("messages").addEventListener("click", copyCode);
  const prompt = $("prompt");
  $("attach").addEventListener("click", () => $("image").click());
  $("image").addEventListener("change", (e) => { attachFiles(e.target.files); e.target.value = ""; });
  prompt.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
    if (files.length) { e.preventDefault(); attachFiles(files); }
  });
  prompt.addEventListener("input", autosize);
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") {
      if (state.controller) { e.preventDefault(); stop(); }
      else if (!$("api-key-dialog").hidden && state.model) $("api-key-dialog").hidden = true;
    }
  });
  updateButtons();
  connect();
  pollMetrics();
  prompt.focus();
}

init();
