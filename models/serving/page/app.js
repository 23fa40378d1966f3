// The chat page of `python -m examples.serve`: streams answers from this server's own
// /v1/chat/completions. Model output is hostile input: it only ever reaches the page as
// textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "gemma-zoo-api-key";  // sessionStorage: the key lives as long as the tab
const AUDIO_FORMATS = ["wav", "mp3", "flac", "ogg", "opus", "m4a", "aac", "webm"];
const history = [];  // the conversation, as the API's messages
let props = null;    // GET /props: model, context_length, modalities, thinking
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || response.statusText;
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

async function connect() {
  const response = await fetch("/props", { headers: headers() });
  if (response.status === 401) {
    $("key-form").hidden = false;
    $("model-name").textContent = "API key needed";
    if (sessionStorage.getItem(KEY)) showError("the server refused this key");
    return;
  }
  if (!response.ok) { showError(await errorText(response)); return; }
  props = await response.json();
  $("key-form").hidden = true;
  showError("");
  $("model-name").textContent = props.model;
  showContext(0);
  $("thinking-label").hidden = !props.thinking;
  $("thinking").disabled = !props.thinking;
  const accept = [];
  if (props.modalities.vision) accept.push("image/*");
  if (props.modalities.audio) accept.push("audio/*");
  $("attach-label").hidden = accept.length === 0;
  $("attach").disabled = accept.length === 0;
  $("attach").accept = accept.join(",");
}

function showContext(used) {
  const limit = props && props.context_length ? props.context_length : "?";
  $("context-use").textContent = used + " / " + limit + " tokens";
}

function readFile(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function mediaPart(file) {
  const url = await readFile(file);
  if (file.type.startsWith("image/")) return { type: "image_url", image_url: { url } };
  const format = file.name.split(".").pop().toLowerCase();
  if (file.type.startsWith("audio/") && AUDIO_FORMATS.includes(format)) {
    return { type: "input_audio", input_audio: { data: url.slice(url.indexOf(",") + 1), format } };
  }
  throw new Error(file.name + ": attach an image or audio (" + AUDIO_FORMATS.join(", ") + ")");
}

function addTurn(role, text, mediaNames) {
  const turn = document.createElement("div");
  turn.className = "turn " + role;
  if (mediaNames && mediaNames.length) {
    const media = document.createElement("div");
    media.className = "media";
    media.textContent = "attached: " + mediaNames.join(", ");
    turn.append(media);
  }
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  turn.append(reasoning, content);
  $("log").append(turn);
  return { turn, reasoning, content };
}

function busy(running) {
  $("send").disabled = running;
  $("stop").disabled = !running;
}

// The server-sent events of one streamed answer, as parsed JSON payloads.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(event) {
  event.preventDefault();
  if (controller || !props) return;
  const text = $("prompt").value;
  const files = Array.from($("attach").files || []);
  if (!text.trim() && !files.length) return;
  showError("");
  let content = text;
  try {
    if (files.length) content = [...(await Promise.all(files.map(mediaPart))), { type: "text", text }];
  } catch (err) {
    showError(err.message);
    return;
  }
  const message = { role: "user", content };
  addTurn("user", text, files.map((f) => f.name));
  const answer = addTurn("assistant", "");
  answer.turn.classList.add("streaming");
  const body = {
    model: props.model, messages: [...history, message], stream: true,
    stream_options: { include_usage: true }, max_tokens: Number($("max-tokens").value) || undefined,
  };
  if (props.thinking) body.chat_template_kwargs = { enable_thinking: $("thinking").checked };
  controller = new AbortController();
  busy(true);
  let reply = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (response.status === 401) { await connect(); throw new Error(await errorText(response)); }
    if (!response.ok) throw new Error(await errorText(response));
    history.push(message);
    $("prompt").value = "";
    $("attach").value = "";
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) showContext(chunk.usage.total_tokens);
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.reasoning_content) answer.reasoning.textContent += delta.reasoning_content;
        if (delta.content) { reply += delta.content; answer.content.textContent = reply; }
        if (choice.finish_reason) answer.turn.dataset.finish = choice.finish_reason;
      }
    }
  } catch (err) {
    if (err.name === "AbortError") answer.turn.dataset.finish = "stopped";
    else showError(err.message);
  } finally {
    if (history[history.length - 1] === message) history.push({ role: "assistant", content: reply });
    answer.turn.classList.remove("streaming");
    controller = null;
    busy(false);
  }
}

$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
});
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key-input").value);
  $("key-input").value = "";
  connect();
});
connect().catch((err) => showError(err.message));
