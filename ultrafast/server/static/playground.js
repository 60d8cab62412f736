// The playground's chat: the transcript, one streamed chat completion per turn (only the new
// message plus `session_id`), Stop, Copy and Regenerate. Needs conversations.js and markdown.js.
"use strict";
let controller = null;      // aborts the answer now streaming (the Stop button)
let conversationId = null;  // created on the first turn; the server keeps the history
let stoppedTurn = false;    // a stopped answer the server may not have stored yet

// ---- the transcript ----
function followTranscript(change) {  // stay at the bottom if the reader was there
  const out = $("output");
  const atBottom = out.scrollHeight - out.scrollTop - out.clientHeight < 40;
  change();
  if (atBottom) out.scrollTop = out.scrollHeight;
}

function addTurn(role, text = "") {
  const turn = document.createElement("div");
  turn.className = "turn " + role;
  turn.textContent = text;
  followTranscript(() => $("output").appendChild(turn));
  return turn;
}

function addAnswer(initial = "", state = "waiting") {
  for (const old of document.querySelectorAll(".regenerate")) old.remove();  // last one only
  const turn = addTurn("assistant");
  turn.innerHTML = '<div class="body"></div><div class="stats">' +
    '<span>TTFT <b class="ttft">-</b> ms</span><span>tokens/s <b class="tps">-</b></span>' +
    '<span>tokens <b class="ntokens">0</b></span><span>model <b class="served_model">-</b>' +
    '</span><span>tier <b class="served_tier">-</b></span>' +
    '<span class="state"></span><button class="copy" title="copy the answer">Copy</button>' +
    '<button class="regenerate" title="answer the last message again">Regenerate</button></div>';
  const field = (name) => turn.querySelector("." + name);
  let text = initial, pending = false;
  const answer = {
    field,
    text: () => text,
    append(piece) {  // re-render at most once a frame: the whole answer, so fences close right
      text += piece;
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => { pending = false; answer.render(); });
    },
    render() { followTranscript(() => { field("body").innerHTML = renderMarkdown(text); }); },
    error(message) {
      const line = document.createElement("div");
      line.className = "error";
      line.textContent = message;
      turn.appendChild(line);
    },
  };
  field("state").textContent = state;
  field("copy").addEventListener("click", () => copyText(text, field("copy")));
  field("regenerate").addEventListener("click", regenerate);
  answer.render();
  return answer;
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (e) {  // no clipboard API (plain http off loopback): the old way
    const area = document.createElement("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

function setState(answer, state) {
  $("status").textContent = state;
  if (answer) answer.field("state").textContent = state;
}

// how an answer ended, in words: "length" when max_tokens (or the context) cut it
const endState = (finish) => (!finish || finish === "stop" || finish === "tool_calls")
  ? "done" : finish;

function showItems(items) {
  $("output").textContent = "";
  for (const item of items) {
    if (item.type !== "message") continue;
    if (item.role === "assistant") {
      addAnswer(itemText(item), item.status === "incomplete" ? "stopped" : "stored");
    } else {
      addTurn(item.role === "user" ? "user" : "system", itemText(item));
    }
  }
}

function showConversation(id) {
  conversationId = id;
  $("conversation").textContent = id || "new";
  if (id) writeStore(STORE.current, id); else localStorage.removeItem(STORE.current);
  renderList(id);
}

async function openConversation(id) {
  if (controller) controller.abort();
  document.body.classList.remove("show-chats");
  showConversation(id);
  stoppedTurn = false;
  try {
    showItems(await conversationItems(id));
    setState(null, "idle");
  } catch (e) {
    addTurn("system", e.message || String(e)).classList.add("error");
  }
}

function newChat() {
  if (controller) controller.abort();
  stoppedTurn = false;
  showConversation(null);
  $("output").textContent = "";
  setState(null, "idle");
}

async function ensureConversation(firstMessage) {
  if (conversationId) return conversationId;
  const system = $("system_prompt").value.trim();
  const items = system ? [{type: "message", role: "system", content: system}] : [];
  if (system) addTurn("system", system);  // shown above the first turn, as stored
  const id = await createConversation(firstMessage.trim().split("\n")[0], items);
  remember(id, firstMessage.trim().split("\n")[0].slice(0, 80));
  showConversation(id);
  return id;
}

// After a stop the server stores the partial answer as soon as it sees the disconnect; the
// next turn waits for that (a few polls at most), so the history keeps its order.
async function awaitStoredAnswer(sessionId) {
  const url = `/v1/conversations/${encodeURIComponent(sessionId)}/items?order=desc&limit=1`;
  for (let tries = 0; tries < 30; tries++) {
    const r = await fetch(url, {headers: headers()});
    if (!r.ok) return;
    const newest = (await r.json()).data[0];
    if (!newest || newest.role === "assistant") return;
    await new Promise((done) => setTimeout(done, 100));
  }
}

function requestBody(content, sessionId) {
  const body = {
    model: $("model").value || undefined, messages: [{role: "user", content}],  // the new turn
    session_id: sessionId, service_tier: $("tier").value,
    max_tokens: Number($("max_tokens").value), stream: true,
    stream_options: {include_usage: true},
  };
  for (const name of ["temperature", "top_p"]) {  // empty: the model's own defaults
    if ($(name).value !== "") body[name] = Number($(name).value);
  }
  return body;
}

// one SSE stream into `answer`; returns {finish, failed, count, exact, first, last}
async function readStream(r, answer, seen) {
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return seen;
    buffer += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {  // one SSE event per blank line
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;  // ": ping" keep-alives and the like
        const data = line.slice(6);
        if (data !== "[DONE]") onChunk(JSON.parse(data), answer, seen);
      }
    }
  }
}

function onChunk(chunk, answer, seen) {
  if (chunk.error) { answer.error(chunk.error.message); seen.failed = true; return; }
  if (chunk.model) answer.field("served_model").textContent = chunk.model;
  if (chunk.service_tier) answer.field("served_tier").textContent = chunk.service_tier;
  if (chunk.usage) { seen.count = chunk.usage.completion_tokens; seen.exact = true; }
  for (const choice of chunk.choices || []) {
    if (choice.finish_reason) seen.finish = choice.finish_reason;
    const piece = (choice.delta || {}).content;
    if (!piece) continue;
    seen.last = performance.now();
    if (seen.first === null) {
      seen.first = seen.last;
      answer.field("ttft").textContent = (seen.first - seen.started).toFixed(1);
    }
    seen.count += 1;  // about one token a chunk while streaming; usage corrects it at the end
    answer.append(piece);
    answer.field("ntokens").textContent = String(seen.count);
    showRate(answer, seen);
  }
}

function showRate(answer, seen) {
  if (seen.last > seen.first && seen.count > 1) {
    const rate = (seen.count - 1) / ((seen.last - seen.first) / 1000);
    answer.field("tps").textContent = rate.toFixed(1);
  }
}

async function send(text) {
  const content = typeof text === "string" ? text : $("prompt").value;
  if (!content.trim() || controller) return;
  $("prompt").value = "";
  $("send").disabled = true;
  $("stop").disabled = false;
  controller = new AbortController();
  let answer = null;
  const seen = {started: null, first: null, last: null, count: 0, exact: false,
                finish: null, failed: false};
  try {
    const sessionId = await ensureConversation(content);
    addTurn("user", content);
    answer = addAnswer();
    setState(answer, "waiting");
    if (stoppedTurn) { await awaitStoredAnswer(sessionId); stoppedTurn = false; }
    seen.started = performance.now();  // TTFT counts from the turn, not the set-up
    const r = await fetch("/v1/chat/completions", {method: "POST", signal: controller.signal,
      headers: headers(), body: JSON.stringify(requestBody(content, sessionId))});
    if (r.status === 401) askForKey("This server needs an API key.");
    if (!r.ok) throw new Error(await apiError(r));
    answer.field("served_tier").textContent = r.headers.get("x-service-tier") || "-";
    setState(answer, "streaming");
    await readStream(r, answer, seen);
    answer.render();
    answer.field("ntokens").textContent = String(seen.count);
    if (seen.exact) showRate(answer, seen);
    else answer.field("tps").title = "estimated: one token per streamed chunk";
    setState(answer, seen.failed ? "error" : endState(seen.finish));
  } catch (e) {
    if (!answer) answer = addAnswer();
    answer.render();
    if (e.name === "AbortError") { stoppedTurn = true; setState(answer, "stopped"); }
    else { answer.error(e.message || String(e)); setState(answer, "error"); }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    $("prompt").focus();
  }
}

// Answer the last user message again. Conversations cannot drop items, so the conversation is
// copied without its last exchange (same title), the old one deleted, and the message re-sent.
async function regenerate() {
  if (controller || !conversationId) return;
  const oldId = conversationId;
  try {
    if (stoppedTurn) { await awaitStoredAnswer(oldId); stoppedTurn = false; }
    const items = (await conversationItems(oldId)).filter((i) => i.type === "message");
    const last = items.map((i) => i.role).lastIndexOf("user");
    if (last < 0) return;
    const kept = items.slice(0, last);
    const title = (conversations.find((c) => c.id === oldId) || {}).title || "";
    const id = await createConversation(title, kept.map((i) => (
      {type: "message", role: i.role, content: itemText(i)})));
    remember(id, title, oldId);
    await fetch(`/v1/conversations/${encodeURIComponent(oldId)}`, {method: "DELETE",
                                                                   headers: headers()});
    showConversation(id);
    showItems(kept);
    await send(itemText(items[last]));
  } catch (e) {
    addTurn("system", e.message || String(e)).classList.add("error");
  }
}

async function start() {
  try {
    await loadModels();
  } catch (e) {
    setState(null, "no models: " + e.message);
    return;  // a 401 opened the key panel; "Use key" starts again
  }
  $("key_panel").hidden = true;
  await refreshList();
  const current = readStore(STORE.current, null);
  if (conversations.some((c) => c.id === current)) await openConversation(current);
  else renderList(null);
}

$("send").addEventListener("click", () => send());
$("stop").addEventListener("click", () => controller && controller.abort());
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
$("new_chat").addEventListener("click", () => {
  newChat();
  document.body.classList.remove("show-chats");
});
$("chats_toggle").addEventListener("click", () => document.body.classList.toggle("show-chats"));
$("main").addEventListener("click", (e) => {  // a tap beside the open drawer closes it
  if (!e.target.closest("#chats_toggle")) document.body.classList.remove("show-chats");
});
$("model").addEventListener("change", () => writeStore(STORE.model, $("model").value));
$("change_key").addEventListener("click", () => askForKey("API key for this server:"));
$("save_key").addEventListener("click", () => {
  writeStore(STORE.key, $("api_key").value.trim());
  $("api_key").value = "";
  start();
});
$("api_key").addEventListener("keydown", (e) => { if (e.key === "Enter") $("save_key").click(); });
if (window.matchMedia("(max-width: 700px)").matches) $("settings").open = false;
start();
