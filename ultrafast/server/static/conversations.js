// The playground's talk with the server besides the chat stream: the API key (asked for when
// the server answers 401, kept in localStorage), the model list, and the conversations. The
// server keeps each conversation (Conversations API); this browser keeps only the list of their
// ids, so a reload reads their titles (metadata.title) and turns back from the server.
"use strict";
const $ = (id) => document.getElementById(id);
const STORE = {key: "ultrafast.apiKey", list: "ultrafast.conversations",
               current: "ultrafast.currentConversation", model: "ultrafast.model"};

function readStore(name, fallback) {
  try { return JSON.parse(localStorage.getItem(name)) ?? fallback; } catch (e) { return fallback; }
}
function writeStore(name, value) { localStorage.setItem(name, JSON.stringify(value)); }

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = readStore(STORE.key, "");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function askForKey(message) {
  $("key_message").textContent = message;
  $("key_panel").hidden = false;
  $("api_key").focus();
}

async function apiError(r) {
  const body = await r.json().catch(() => null);
  const message = body && body.error ? body.error.message : r.statusText;
  const hint = body && body.error && body.error.code === "context_length_exceeded"
    ? " (start a new chat)" : "";
  return `${r.status}: ${message}${hint}`;
}

// fetch with the key; a 401 asks for one (and still throws, so the caller stops)
async function api(path, options = {}) {
  const r = await fetch(path, {...options, headers: headers()});
  if (r.status === 401) {
    askForKey(readStore(STORE.key, "") ? "That API key was refused; enter another."
                                       : "This server needs an API key.");
  }
  if (!r.ok) throw new Error(await apiError(r));
  return r.status === 204 ? null : r.json();
}

async function loadModels() {
  const models = (await api("/v1/models")).data;
  const select = $("model"), wanted = readStore(STORE.model, null);
  select.textContent = "";
  for (const m of models) {
    const option = document.createElement("option");
    option.value = option.textContent = m.id;
    select.appendChild(option);
  }
  if (models.some((m) => m.id === wanted)) select.value = wanted;
  const chosen = models.find((m) => m.id === select.value);
  if (chosen && chosen.max_model_len) $("max_tokens").max = chosen.max_model_len;
}

// ---- the conversation list ----
let conversations = readStore(STORE.list, []);  // [{id, title}], newest first

function saveList() { writeStore(STORE.list, conversations); }

function renderList(currentId) {
  const list = $("conversations");
  list.textContent = "";
  for (const c of conversations) {
    const item = document.createElement("li");
    item.dataset.id = c.id;
    if (c.id === currentId) item.className = "current";
    const open = document.createElement("button");
    open.className = "open";
    open.textContent = c.title || "(untitled)";
    open.title = c.title || c.id;
    open.addEventListener("click", () => openConversation(c.id));
    const forget = document.createElement("button");
    forget.className = "forget";
    forget.textContent = "×";
    forget.title = "delete this conversation on the server";
    forget.addEventListener("click", () => deleteConversation(c.id));
    item.append(open, forget);
    list.appendChild(item);
  }
}

// titles from the server; conversations it no longer has (expired, deleted) leave the list
async function refreshList() {
  const kept = [];
  for (const c of conversations) {
    const r = await fetch(`/v1/conversations/${encodeURIComponent(c.id)}`, {headers: headers()});
    if (r.status === 404) continue;
    if (r.ok) c.title = ((await r.json()).metadata || {}).title || c.title;
    kept.push(c);
  }
  conversations = kept;
  saveList();
}

async function createConversation(title, items) {
  const body = {metadata: {title: title.slice(0, 80)}, items};
  const created = await api("/v1/conversations", {method: "POST", body: JSON.stringify(body)});
  return created.id;
}

const MAX_LISTED = 50;  // older ones stay on the server (until their TTL), off the list

function remember(id, title, replacing = null) {
  const at = conversations.findIndex((c) => c.id === replacing);
  if (at >= 0) conversations[at] = {id, title};
  else conversations.unshift({id, title});
  conversations = conversations.slice(0, MAX_LISTED);
  saveList();
}

async function deleteConversation(id) {
  await fetch(`/v1/conversations/${encodeURIComponent(id)}`, {method: "DELETE",
                                                              headers: headers()});
  conversations = conversations.filter((c) => c.id !== id);
  saveList();
  if (id === conversationId) newChat();
  else renderList(conversationId);
}

// every item of a conversation, oldest first (the API pages by 100)
async function conversationItems(id) {
  const items = [];
  for (let after = null; ;) {
    const query = "order=asc&limit=100" + (after ? "&after=" + encodeURIComponent(after) : "");
    const page = await api(`/v1/conversations/${encodeURIComponent(id)}/items?${query}`);
    items.push(...page.data);
    if (!page.has_more || !page.data.length) return items;
    after = page.last_id;
  }
}

const itemText = (item) => (item.content || []).map((part) => part.text || "").join("");
