// The task console: an MCP 2026-07-28 client of this proxy's /mcp (the wire: mcp.js; forms: forms.js), with the
// tasks extension declared. It lists the tools, calls one, follows its task through subscriptions/listen (tasks/get
// when listening fails), answers the task's input requests with tasks/update and cancels it with tasks/cancel.
// Everything a server or a policy says is shown as text (textContent), never as markup.
"use strict";

const TERMINAL = new Set(["completed", "failed", "cancelled", "expired"]); // expired: the page's, not the wire's
const MAX_TOOL_PAGES = 50;
const KEPT_TASKS = 50; // the tasks this tab remembers across a reload
const MAX_ROUNDS = 10; // MRTR rounds of one call, as the official SDKs cap them

const RULES = JSON.parse(document.getElementById("rules").textContent);
const state = {
  tools: new Map(),
  entries: new Map(), // task id (or a local id for a call answered directly) -> entry
  nextCall: 1,
  nextEntry: 1,
  follow: { controller: null, ids: "", polling: false, timer: null, retryMs: 0, retryAt: 0 },
};


function askForCredentials(status) {
  const auth = document.getElementById("auth");
  auth.open = true;
  auth.classList.add("asked");
  auth.querySelector("summary").textContent =
    status === 401 ? "Credentials: the proxy asks for a token" : "Credentials: this token may not do that";
}


// --- the tools ----------------------------------------------------------------------------------------------------

async function loadTools() {
  const list = document.getElementById("tools");
  const tools = [];
  let cursor;
  try {
    for (let page = 0; page < MAX_TOOL_PAGES; page++) {
      const result = await rpc("tools/list", cursor ? { cursor } : {});
      if (Array.isArray(result.tools)) tools.push(...result.tools.filter((tool) => tool && typeof tool.name === "string"));
      cursor = result.nextCursor;
      if (!cursor) break;
    }
  } catch (error) {
    list.replaceChildren(el("li", { class: "error" }, `tools/list failed: ${describeError(error)}`));
    return;
  }
  list.replaceChildren();
  state.tools.clear();
  for (const tool of tools) {
    state.tools.set(tool.name, tool);
    const [badge, explanation] = describeRule(ruleFor(tool.name));
    const button = el("button", { type: "button", class: "tool", title: explanation, onclick: () => chooseTool(tool) },
      el("span", { class: "name" }, tool.name),
      el("span", { class: `badge ${badge === "passes through" ? "plain" : "task"}` }, badge));
    list.append(el("li", { "data-tool": tool.name }, button));
  }
  if (!tools.length) list.append(el("li", { class: "quiet" }, "The server lists no tools."));
}

function chooseTool(tool) {
  const form = document.getElementById("call");
  form.hidden = false;
  form.dataset.tool = tool.name;
  document.getElementById("call-title").textContent = tool.title || tool.name;
  document.getElementById("call-rule").textContent = describeRule(ruleFor(tool.name))[1];
  document.getElementById("call-description").textContent = tool.description ?? "";
  document.getElementById("call-error").textContent = "";
  const schema = tool.inputSchema ?? {};
  const area = document.getElementById("call-arguments");
  area.value = json(skeleton(schema));
  const fields = document.getElementById("call-fields");
  fields.replaceChildren();
  area.oninput = null;
  const properties = Object.entries(schema.properties ?? {});
  if (properties.length && properties.every(([, sub]) => isSimple(sub))) {
    const required = new Set(Array.isArray(schema.required) ? schema.required : []);
    const built = [];
    const sync = () => {
      let value = {};
      try {
        value = JSON.parse(area.value);
      } catch {}
      for (const field of built) {
        const read = field.read();
        if (read === undefined) delete value[field.key];
        else value[field.key] = read;
      }
      area.value = json(value);
    };
    for (const [key, sub] of properties) built.push(fieldFor(key, sub, required.has(key), sync));
    fields.append(...built.map((field) => field.row));
    // And the other way: JSON typed in the box shows in the fields.
    const show = () => {
      let value;
      try {
        value = JSON.parse(area.value);
      } catch {
        return;
      }
      if (value && typeof value === "object") for (const field of built) field.write(value[field.key]);
    };
    area.oninput = show;
    show();
  }
  document.querySelectorAll("#tools li").forEach((item) => item.classList.toggle("chosen", item.dataset.tool === tool.name));
}

async function submitCall(event) {
  event.preventDefault();
  const form = event.currentTarget;
  const tool = state.tools.get(form.dataset.tool);
  const error = document.getElementById("call-error");
  error.textContent = "";
  let args;
  try {
    args = JSON.parse(document.getElementById("call-arguments").value || "{}");
    if (!args || typeof args !== "object" || Array.isArray(args)) throw new Error("the arguments are a JSON object");
  } catch (problem) {
    error.textContent = `Arguments: ${problem.message}`;
    return;
  }
  const button = document.getElementById("call-button");
  button.disabled = true;
  try {
    await call(tool, args, {});
  } catch (problem) {
    error.textContent = `${tool.name}: ${describeError(problem)}`;
  } finally {
    button.disabled = false;
  }
}

// tools/call, and what its answer is: a task to follow, a result, or questions first (MRTR) then the call again.
async function call(tool, args, retry, entry = null) {
  const params = { name: tool.name, arguments: args, ...retry };
  const headers = paramHeaders(tool.inputSchema, args);
  const progress = (update) => {
    if (entry && typeof update?.message === "string") setEntry(entry, { statusMessage: update.message });
  };
  if (!entry) {
    entry = addEntry({ kind: "call", id: `call-${state.nextCall++}`, tool: tool.name, status: "working",
      createdAt: new Date().toISOString(), rounds: 0 });
  }
  entry.call = { tool, args };
  entry.rounds = (entry.rounds ?? 0) + 1;
  if (entry.rounds > MAX_ROUNDS) {
    setEntry(entry, { status: "failed", error: { message: `still asking after ${MAX_ROUNDS} rounds` } });
    return;
  }
  let result;
  try {
    result = await rpc("tools/call", params, { name: tool.name, headers, onProgress: progress });
  } catch (problem) {
    setEntry(entry, { status: "failed", error: { message: describeError(problem) }, lastUpdatedAt: new Date().toISOString() });
    return;
  }
  if (result.resultType === "task" && typeof result.taskId === "string") {
    promote(entry, result);
  } else if (result.resultType === "input_required") {
    entry.requestState = result.requestState;
    entry.collected = {};
    setEntry(entry, { status: "input_required", inputRequests: result.inputRequests ?? {},
      statusMessage: "The server asks before it answers" });
    if (!Object.keys(result.inputRequests ?? {}).length) {
      if (typeof result.requestState !== "string") {
        setEntry(entry, { status: "failed", error: { message: "the server asked for input but sent no question" } });
        return;
      }
      // Only state to echo (a server shedding load): again after a short pause, as the SDKs do.
      await new Promise((resolve) => setTimeout(resolve, 50 + Math.random() * 200));
      await call(tool, args, stateOnly(entry), entry);
    }
  } else {
    setEntry(entry, { status: "completed", result, statusMessage: undefined, inputRequests: undefined,
      lastUpdatedAt: new Date().toISOString() });
  }
}

function stateOnly(entry) {
  return entry.requestState !== undefined ? { requestState: entry.requestState } : {};
}

// --- calls and tasks ----------------------------------------------------------------------------------------------

function addEntry(fields) {
  const entry = { answered: new Set(), ...fields };
  entry.node = el("li", { class: "entry", "data-entry": String(state.nextEntry++) });
  state.entries.set(entry.id, entry);
  document.getElementById("tasks").prepend(entry.node);
  render(entry);
  return entry;
}

// A call whose answer was a task becomes that task's entry.
function promote(entry, task) {
  state.entries.delete(entry.id);
  entry.kind = "task";
  entry.id = task.taskId;
  state.entries.set(entry.id, entry);
  applyTask(entry, task);
  remember();
  refollow();
}

// A task's state as the proxy sends it (a DetailedTask): what it leaves out is no longer so.
function applyTask(entry, task) {
  for (const key of ["statusMessage", "inputRequests", "result", "error"]) if (!(key in task)) entry[key] = undefined;
  setEntry(entry, task);
}

function setEntry(entry, task) {
  for (const key of ["status", "statusMessage", "createdAt", "lastUpdatedAt", "inputRequests", "result", "error",
    "pollIntervalMs"]) {
    if (key in task) entry[key] = task[key];
  }
  if (entry.status !== "input_required") entry.inputRequests = undefined;
  render(entry);
}

function render(entry) {
  const node = entry.node;
  node.dataset.taskId = entry.kind === "task" ? entry.id : "";
  node.dataset.status = entry.status;
  node.dataset.tool = entry.tool;
  const live = !TERMINAL.has(entry.status);
  const head = el("div", { class: "head" },
    el("span", { class: "name" }, entry.tool),
    el("span", { class: `status ${entry.status}` }, entry.status.replace("_", " ")),
    el("span", { class: "quiet timing" }, timing(entry)));
  const id = entry.kind === "task"
    ? el("div", { class: "quiet id" }, "task ", el("code", {}, entry.id))
    : el("div", { class: "quiet id" }, "answered directly (no task)");
  // While it asks, the page says so in its own words (the proxy's statusMessage speaks of "the client").
  const said = entry.status === "input_required" && entry.kind === "task" ? "Waiting for your answer below."
    : entry.statusMessage;
  const message = said ? el("p", { class: "message" }, said) : null;
  const parts = [];
  if (entry.status === "completed" && entry.result) parts.push(resultView(entry.result));
  if (entry.status === "failed" && entry.error) {
    parts.push(el("p", { class: "error" }, `${entry.error.message ?? "failed"}${entry.error.code != null ? ` (${entry.error.code})` : ""}`));
  }
  if (entry.kind === "task" && live) {
    const cancel = el("button", { type: "button", class: "cancel", onclick: () => cancelTask(entry, cancel) },
      "Cancel task");
    if (entry.cancelling) {
      cancel.disabled = true;
      cancel.textContent = "Cancelling…";
    }
    parts.push(el("div", { class: "actions" }, cancel));
  }
  if (!entry.slots) {
    entry.slots = { top: el("div"), inputs: el("div"), bottom: el("div") };
    node.replaceChildren(entry.slots.top, entry.slots.inputs, entry.slots.bottom);
  }
  entry.slots.top.replaceChildren(...[head, id, message].filter(Boolean));
  entry.slots.bottom.replaceChildren(...parts);
  // The input forms are rebuilt only when the questions change: a form being typed in is never taken out of the
  // page (which would lose its focus) by an update of the task's other fields.
  const asking = entry.status === "input_required" && entry.inputRequests;
  const keys = asking ? Object.keys(entry.inputRequests).filter((key) => !entry.answered.has(key)).join("\n") : null;
  if (keys !== entry.slots.inputs.dataset.keys) {
    entry.slots.inputs.dataset.keys = keys ?? "";
    entry.slots.inputs.replaceChildren(...(asking ? [inputForms(entry)] : []));
    if (keys === null) delete entry.slots.inputs.dataset.keys;
  }
}

function timing(entry) {
  if (!entry.createdAt) return "";
  const start = Date.parse(entry.createdAt);
  const end = TERMINAL.has(entry.status) ? Date.parse(entry.lastUpdatedAt ?? entry.createdAt) : Date.now();
  const took = Number.isNaN(start) || Number.isNaN(end) ? "" : ` · ${seconds(Math.max(0, end - start))}`;
  return `${TERMINAL.has(entry.status) ? "ran from" : "since"} ${clock(entry.createdAt)}${took}`;
}

function resultView(result) {
  const view = el("div", { class: `result${result.isError ? " is-error" : ""}` });
  if (result.isError) view.append(el("p", { class: "error" }, "The tool reports an error:"));
  for (const item of Array.isArray(result.content) ? result.content : []) {
    if (item && item.type === "text" && typeof item.text === "string") view.append(el("pre", { class: "text" }, item.text));
    else view.append(el("pre", { class: "json" }, json(item)));
  }
  if (result.structuredContent !== undefined) {
    view.append(el("details", {}, el("summary", {}, "structured content"), el("pre", { class: "json" }, json(result.structuredContent))));
  }
  return view;
}

function inputForms(entry) {
  const keys = Object.keys(entry.inputRequests).filter((key) => !entry.answered.has(key));
  const box = el("div", { class: "inputs" });
  box.dataset.keys = keys.join("\n");
  for (const key of keys) box.append(inputForm(entry, key, entry.inputRequests[key]));
  if (!keys.length) box.append(el("p", { class: "quiet" }, "Answered; waiting for the server."));
  return box;
}

function inputForm(entry, key, request) {
  const params = request && typeof request.params === "object" && request.params ? request.params : {};
  const form = el("form", { class: "input", "data-key": key });
  const problem = el("p", { class: "error", role: "alert" });
  const send = async (answer) => {
    problem.textContent = "";
    form.querySelectorAll("button").forEach((button) => (button.disabled = true));
    try {
      await answerInput(entry, key, answer);
    } catch (error) {
      problem.textContent = describeError(error);
      form.querySelectorAll("button").forEach((button) => (button.disabled = false));
    }
  };
  if (request?.method === "elicitation/create" && params.mode === "url") {
    form.append(el("p", { class: "question" }, String(params.message ?? "The server asks you to visit a page.")));
    const url = String(params.url ?? "");
    if (/^https?:\/\//i.test(url)) form.append(el("p", {}, el("a", { href: url, target: "_blank", rel: "noopener noreferrer" }, url)));
    else form.append(el("p", { class: "quiet" }, url));
    form.append(buttons(send, () => ({ action: "accept" }), "I have done it"));
  } else if (request?.method === "elicitation/create") {
    form.append(el("p", { class: "question" }, String(params.message ?? "The server asks:")));
    const schema = params.requestedSchema && typeof params.requestedSchema === "object" ? params.requestedSchema : {};
    const required = new Set(Array.isArray(schema.required) ? schema.required : []);
    const fields = Object.entries(schema.properties ?? {}).filter(([, sub]) => sub && typeof sub === "object")
      .map(([name, sub]) => fieldFor(name, sub, required.has(name)));
    form.append(...fields.map((field) => field.row));
    form.append(buttons(send, () => {
      const content = {};
      for (const field of fields) {
        const value = field.read();
        if (value === undefined && field.required) throw new Error(`${field.key} is required`);
        if (value !== undefined) content[field.key] = value;
      }
      return { action: "accept", content };
    }, "Send"));
  } else if (request?.method === "sampling/createMessage") {
    form.append(el("p", { class: "question" }, "The server asks the client's model; answer as the model:"));
    for (const message of Array.isArray(params.messages) ? params.messages : []) {
      const content = message?.content;
      const text = content && content.type === "text" ? content.text : json(content);
      form.append(el("blockquote", {}, el("span", { class: "quiet" }, `${message?.role ?? "?"}: `), String(text)));
    }
    const reply = el("textarea", { rows: "3", "aria-label": "the model's answer" });
    form.append(reply);
    form.append(buttons(send, () => ({ role: "assistant", content: { type: "text", text: reply.value },
      model: CLIENT.name, stopReason: "endTurn" }), "Send", false));
  } else {
    form.append(el("p", { class: "question" }, `The server asks ${String(request?.method ?? "something")}:`),
      el("pre", { class: "json" }, json(params)));
    const reply = el("textarea", { rows: "3", "aria-label": "the answer, as JSON" },
      request?.method === "roots/list" ? '{"roots": []}' : "{}");
    form.append(buttons(send, () => JSON.parse(reply.value), "Send", false));
  }
  form.append(problem);
  form.addEventListener("submit", (event) => event.preventDefault());
  return form;
}

// Send, and for an elicitation also Decline and Cancel (the user's other two answers).
function buttons(send, accept, label, refusable = true) {
  const row = el("div", { class: "actions" });
  const problem = (error) => row.parentElement.querySelector(".error").textContent = error.message;
  row.append(el("button", { type: "submit", onclick: () => {
    try {
      send(accept());
    } catch (error) {
      problem(error);
    }
  } }, label));
  if (refusable) {
    row.append(el("button", { type: "button", onclick: () => send({ action: "decline" }) }, "Decline"));
    row.append(el("button", { type: "button", title: "Answer nothing (the action \"cancel\")",
      onclick: () => send({ action: "cancel" }) }, "Dismiss"));
  }
  return row;
}

async function answerInput(entry, key, answer) {
  if (entry.kind === "task") {
    await rpc("tasks/update", { taskId: entry.id, inputResponses: { [key]: answer } }, { name: entry.id });
    entry.answered.add(key);
    render(entry);
    if (state.follow.polling) pollSoon(0);
    return;
  }
  // A question before the call was answered (MRTR): the call again, with every answer and the server's state.
  entry.collected[key] = answer;
  entry.answered.add(key);
  const outstanding = Object.keys(entry.inputRequests).filter((name) => !(name in entry.collected));
  render(entry);
  if (outstanding.length) return;
  const { tool, args } = entry.call;
  const retry = { inputResponses: entry.collected, ...stateOnly(entry) };
  entry.answered = new Set();
  setEntry(entry, { status: "working", statusMessage: "Answered; calling again", inputRequests: undefined });
  await call(tool, args, retry, entry);
}

async function cancelTask(entry, button) {
  entry.cancelling = true;
  button.disabled = true;
  button.textContent = "Cancelling…";
  try {
    await rpc("tasks/cancel", { taskId: entry.id }, { name: entry.id });
    if (state.follow.polling) pollSoon(0);
  } catch (error) {
    entry.cancelling = false;
    setEntry(entry, { statusMessage: `Cancel failed: ${describeError(error)}` });
  }
}

// --- following tasks: one subscriptions/listen stream for every live task, tasks/get if that fails ----------------

function liveTasks() {
  return [...state.entries.values()].filter((entry) => entry.kind === "task" && !TERMINAL.has(entry.status));
}

function setFollowing(text) {
  document.getElementById("following").textContent = text;
}

function refollow() {
  const live = liveTasks();
  if (state.follow.polling) {
    pollSoon(0);
    return;
  }
  const ids = live.map((entry) => entry.id).sort().join(",");
  if (!live.length) setFollowing("No task running.");
  if (ids === state.follow.ids) return;
  state.follow.controller?.abort();
  state.follow.controller = null;
  state.follow.ids = ids;
  if (!live.length) {
    setFollowing("No task running.");
    return;
  }
  listen(live.map((entry) => entry.id));
}

async function listen(ids) {
  const controller = new AbortController();
  state.follow.controller = controller;
  let failure = null;
  try {
    const { id, response } = await post("subscriptions/listen", { notifications: { taskIds: ids } },
      { signal: controller.signal });
    const type = (response.headers.get("Content-Type") || "").toLowerCase();
    if (!response.ok || !type.startsWith("text/event-stream")) throw new RpcError(`HTTP ${response.status}`);
    setFollowing(`Following ${ids.length} task${ids.length === 1 ? "" : "s"} live (subscriptions/listen).`);
    state.follow.retryMs = 0;
    for await (const data of sseEvents(response)) {
      const message = JSON.parse(data);
      if (message.method === "notifications/tasks" && message.params) {
        const entry = state.entries.get(message.params.taskId);
        if (entry) applyTask(entry, message.params);
      } else if (message.method === "notifications/subscriptions/acknowledged") {
        const granted = new Set(message.params?.notifications?.taskIds ?? []);
        for (const taskId of ids) if (!granted.has(taskId)) getTask(state.entries.get(taskId));
      } else if (message.id === id) {
        if (message.error) throw new RpcError(String(message.error.message), message.error.code);
        break; // the server ended the subscription: every task it granted has ended
      }
    }
  } catch (error) {
    if (controller.signal.aborted) return;
    failure = error;
  }
  if (state.follow.controller !== controller) return;
  state.follow.controller = null;
  state.follow.ids = "";
  if (failure) {
    // tasks/get meanwhile, and the stream tried again after a back-off (2 s, doubling to a minute).
    state.follow.polling = true;
    state.follow.retryMs = Math.min(60_000, Math.max(2_000, state.follow.retryMs * 2));
    state.follow.retryAt = Date.now() + state.follow.retryMs;
    setFollowing(`Polling with tasks/get (subscriptions/listen failed: ${describeError(failure)}; `
      + `trying it again in ${Math.round(state.follow.retryMs / 1000)} s).`);
    pollSoon(0);
  } else {
    setTimeout(refollow, 1000); // what is still live gets a new stream
  }
}

async function getTask(entry) {
  if (!entry) return;
  try {
    applyTask(entry, await rpc("tasks/get", { taskId: entry.id }, { name: entry.id }));
  } catch (error) {
    if (error instanceof RpcError && error.code === -32602) {
      setEntry(entry, { status: "expired", statusMessage: "The proxy no longer knows this task: it expired (its "
        + "ttlMs), or it is another caller's (a different token)." });
      remember();
    } else {
      setEntry(entry, { statusMessage: `tasks/get failed: ${describeError(error)}` });
    }
  }
}

function pollSoon(delay) {
  clearTimeout(state.follow.timer);
  state.follow.timer = setTimeout(poll, delay);
}

async function poll() {
  if (Date.now() >= state.follow.retryAt) {
    state.follow.polling = false;
    clearTimeout(state.follow.timer);
    refollow();
    return;
  }
  const live = liveTasks();
  if (!live.length) {
    setFollowing("No task running (polling with tasks/get).");
    return;
  }
  await Promise.all(live.map(getTask));
  const interval = Math.max(250, Math.min(...live.map((entry) => entry.pollIntervalMs ?? 1000)));
  pollSoon(interval);
}

// --- this tab's tasks across a reload ----------------------------------------------------------------------------

function remember() {
  const tasks = [...state.entries.values()].filter((entry) => entry.kind === "task" && entry.status !== "expired")
    .map((entry) => ({ id: entry.id, tool: entry.tool })).slice(-KEPT_TASKS);
  sessionStorage.setItem("console-tasks", JSON.stringify(tasks));
}

function recall() {
  let tasks = [];
  try {
    tasks = JSON.parse(sessionStorage.getItem("console-tasks") || "[]");
  } catch {}
  for (const task of Array.isArray(tasks) ? tasks : []) {
    if (task && typeof task.id === "string" && typeof task.tool === "string") {
      addEntry({ kind: "task", id: task.id, tool: task.tool, status: "working" });
    }
  }
}

// --- start --------------------------------------------------------------------------------------------------------

async function describeServer() {
  const line = document.getElementById("server");
  try {
    const result = await rpc("server/discover", {});
    const info = result._meta?.["io.modelcontextprotocol/serverInfo"] ?? result.serverInfo ?? {};
    const tasks = result.capabilities?.extensions?.[TASKS] !== undefined;
    const name = [info.name ?? "unnamed", info.version].filter(Boolean).join(" ");
    line.textContent = `Server: ${name} · protocol ${PROTOCOL} · tasks ${tasks ? "offered" : "not offered"}`;
  } catch (error) {
    line.textContent = `server/discover failed: ${describeError(error)}`;
  }
}

// A task this tab did not start (another tab's, a curl's): followed by its id, as the caller that created it.
function followById(event) {
  event.preventDefault();
  const field = document.getElementById("follow-id");
  const taskId = field.value.trim();
  if (!taskId || state.entries.has(taskId)) return;
  field.value = "";
  addEntry({ kind: "task", id: taskId, tool: "task", status: "working" });
  remember();
  getTask(state.entries.get(taskId)).then(refollow);
}

function start() {
  wire.token = sessionStorage.getItem("console-token") || "";
  wire.refused = askForCredentials;
  document.getElementById("token").value = wire.token;
  document.getElementById("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    wire.token = document.getElementById("token").value.trim();
    sessionStorage.setItem("console-token", wire.token);
    describeServer();
    loadTools();
  });
  document.getElementById("call").addEventListener("submit", submitCall);
  document.getElementById("follow").addEventListener("submit", followById);
  setInterval(() => {
    for (const entry of state.entries.values()) {
      if (!TERMINAL.has(entry.status)) entry.node.querySelector(".timing").textContent = timing(entry);
    }
  }, 1000);
  recall();
  describeServer();
  loadTools();
  refollow();
}

start();
