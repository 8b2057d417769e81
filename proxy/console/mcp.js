// The wire of the task console: an MCP 2026-07-28 client of this proxy's /mcp (the envelope, the SEP-2243 headers,
// a request and its JSON or event-stream answer). Loaded before console.js, which sets `wire.token` and
// `wire.refused`.
"use strict";

const MCP = "/mcp";
const PROTOCOL = "2026-07-28";
const TASKS = "io.modelcontextprotocol/tasks";
const CAPABILITIES = { extensions: { [TASKS]: {} }, elicitation: { form: {}, url: {} }, sampling: {} };
const CLIENT = { name: "mcp-tasks-proxy-console", version: "1" };
const MAX_EVENT_CHARS = 32 * 1024 * 1024; // one SSE event larger than this ends the stream (a hostile server)

const wire = {
  token: "", // the tab's bearer token, when the proxy asks for one
  nextId: 1,
  refused: (status) => {}, // told of a 401, or of a 403 for a token's scope
};

class RpcError extends Error {
  constructor(message, code, status) {
    super(message);
    this.code = code;
    this.status = status;
  }
}

function meta() {
  return {
    "io.modelcontextprotocol/protocolVersion": PROTOCOL,
    "io.modelcontextprotocol/clientCapabilities": CAPABILITIES,
    "io.modelcontextprotocol/clientInfo": CLIENT,
  };
}

// A header value as SEP-2243 sends it: as is when it is plain visible ASCII, else base64 of its UTF-8 in a sentinel.
function headerValue(text) {
  if (/^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?$/.test(text) && !text.startsWith("=?base64?")) return text;
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return `=?base64?${btoa(binary)}?=`;
}

// Mcp-Param-* headers for the arguments at a tool's x-mcp-header properties (SEP-2243).
function paramHeaders(schema, value, headers = {}) {
  const properties = schema && typeof schema === "object" ? schema.properties : null;
  if (!properties || typeof properties !== "object" || !value || typeof value !== "object") return headers;
  for (const [key, sub] of Object.entries(properties)) {
    if (!sub || typeof sub !== "object") continue;
    const argument = value[key];
    if (typeof sub["x-mcp-header"] === "string" && argument !== undefined && argument !== null
        && typeof argument !== "object") {
      headers[`Mcp-Param-${sub["x-mcp-header"]}`] = headerValue(String(argument));
    }
    paramHeaders(sub, argument, headers);
  }
  return headers;
}

async function post(method, params, { name, headers = {}, signal } = {}) {
  const id = wire.nextId++;
  const message = { jsonrpc: "2.0", id, method, params: { ...params, _meta: meta() } };
  const sent = {
    "Content-Type": "application/json",
    Accept: "application/json, text/event-stream",
    "MCP-Protocol-Version": PROTOCOL,
    "Mcp-Method": method,
    ...headers,
  };
  if (name !== undefined) sent["Mcp-Name"] = headerValue(name);
  if (wire.token) sent.Authorization = `Bearer ${wire.token}`;
  const response = await fetch(MCP, { method: "POST", headers: sent, body: JSON.stringify(message), signal });
  const challenge = response.headers.get("WWW-Authenticate") || "";
  if (response.status === 401 || (response.status === 403 && challenge.includes("insufficient_scope"))) {
    wire.refused(response.status);
  }
  return { id, response };
}

// The data of each server-sent event (the WHATWG event-stream format: lines, `data:` fields, a blank line ends one).
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  let size = 0;
  let searched = 0; // where the search for the next line's end goes on: a long line is not scanned again per chunk
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        if (buffer !== "") buffer += "\n"; // the stream's last line, ended by its end
        if (data.length || buffer !== "") buffer += "\n";
      } else {
        buffer += value;
      }
      for (;;) {
        const found = buffer.slice(searched).search(/[\r\n]/);
        const end = found < 0 ? -1 : searched + found;
        if (end < 0 || (!done && buffer[end] === "\r" && end === buffer.length - 1)) { // a \r\n may be split
          searched = end < 0 ? buffer.length : end;
          break;
        }
        searched = 0;
        const line = buffer.slice(0, end);
        buffer = buffer.slice(end + (buffer.startsWith("\r\n", end) ? 2 : 1));
        if (line === "") {
          if (data.length && data.join("") !== "") yield data.join("\n");
          data = [];
          size = 0;
        } else if (line.startsWith("data")) {
          const colon = line.indexOf(":");
          if (colon < 0 && line !== "data") continue;
          const field = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (line.slice(0, colon < 0 ? line.length : colon) !== "data") continue;
          size += field.length;
          if (size > MAX_EVENT_CHARS) throw new RpcError("an event of the server's stream is too large");
          data.push(field);
        }
      }
      if (buffer.length > MAX_EVENT_CHARS) throw new RpcError("a line of the server's stream is too long");
      if (done) return;
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// One request and its answer, JSON or the response event of an SSE stream; progress goes to onProgress.
async function rpc(method, params, options = {}) {
  const { id, response } = await post(method, params, options);
  const type = (response.headers.get("Content-Type") || "").toLowerCase();
  let answer = null;
  if (type.startsWith("text/event-stream")) {
    for await (const data of sseEvents(response)) {
      const message = JSON.parse(data);
      if (message.id === id && ("result" in message || "error" in message)) {
        answer = message;
        break;
      }
      if (message.method === "notifications/progress" && options.onProgress) options.onProgress(message.params);
    }
  } else if (type.startsWith("application/json")) {
    answer = await response.json();
  } else {
    const text = (await response.text()).slice(0, 300);
    throw new RpcError(`HTTP ${response.status}${text ? `: ${text}` : ""}`, null, response.status);
  }
  if (!answer || typeof answer !== "object") throw new RpcError(`no answer (HTTP ${response.status})`);
  if (typeof answer.error === "string") { // an OAuth refusal (401, 403): {error, error_description}
    const said = answer.error_description ? `${answer.error}: ${answer.error_description}` : answer.error;
    throw new RpcError(`HTTP ${response.status}, ${said}`, null, response.status);
  }
  if (answer.error) {
    throw new RpcError(String(answer.error.message ?? "error"), answer.error.code, response.status);
  }
  return answer.result ?? {};
}

function describeError(error) {
  if (error instanceof RpcError) return error.code != null ? `${error.message} (${error.code})` : error.message;
  return String(error && error.message ? error.message : error);
}
