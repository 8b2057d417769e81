// Forms of the task console: small DOM helpers, the policy's rule matching, and inputs built from JSON Schema (a
// tool's input schema, an elicitation's requested schema). Loaded before console.js. Everything a server or a
// policy says is set as text (textContent), never as markup.
"use strict";

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value === true) node.setAttribute(key, "");
    else if (value !== false && value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children) if (child !== null && child !== undefined && child !== false) node.append(child);
  return node;
}

function json(value) {
  return JSON.stringify(value, null, 2);
}

function clock(iso) {
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? String(iso) : date.toLocaleTimeString();
}

function seconds(ms) {
  return ms < 10_000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms / 1000)} s`;
}

// --- the policy's rules (proxy/config.py ToolRule.matches: a name, or a shell-style glob as Python's fnmatch) ----

function globRegExp(pattern) {
  let source = "";
  for (let at = 0; at < pattern.length; at++) {
    const char = pattern[at];
    if (char === "*") source += "[\\s\\S]*";
    else if (char === "?") source += "[\\s\\S]";
    else if (char === "[") {
      let end = at + 1;
      if (pattern[end] === "!") end++;
      if (pattern[end] === "]") end++;
      while (end < pattern.length && pattern[end] !== "]") end++;
      if (end >= pattern.length) {
        source += "\\[";
        continue;
      }
      let set = pattern.slice(at + 1, end).replace(/\\/g, "\\\\");
      at = end;
      if (set.startsWith("!")) set = `^${set.slice(1)}`;
      else if (set.startsWith("^")) set = `\\${set}`;
      source += set === "" ? "(?!)" : set === "^" ? "[\\s\\S]" : `[${set.replace(/[[\]]/g, "\\$&")}]`;
    } else source += char.replace(/[.*+?^${}()|[\]\\/-]/g, "\\$&");
  }
  return new RegExp(`^(?:${source})$`);
}

function globMatches(pattern, name) {
  if (!/[*?[]/.test(pattern)) return pattern === name;
  try {
    return globRegExp(pattern).test(name);
  } catch {
    return false; // a set JavaScript cannot read (a reversed range): said as "no rule", never a wrong rule
  }
}

function ruleFor(name) {
  return RULES.find((rule) => globMatches(rule.match, name)) ?? null;
}

function describeRule(rule) {
  if (!rule) return ["passes through", "No rule names it: the call goes to the server and answers when the tool is done."];
  if (rule.task === "never") return ["passes through", `Rule "${rule.match}" (task: never): the call passes through.`];
  const when = rule.syncWindowMs > 0 ? `when it takes longer than ${rule.syncWindowMs} ms` : "at once";
  const kind = rule.task === "required" ? "always a task" : "a task";
  return [kind, `Rule "${rule.match}": ${kind}, created ${when}; the call gives up after ${rule.timeoutS} s `
    + "(timeout_s)."];
}

// --- forms from JSON Schema (a tool's input schema, an elicitation's requested schema) -----------------------------

function choices(schema) {
  if (Array.isArray(schema.enum)) {
    const names = Array.isArray(schema.enumNames) ? schema.enumNames : [];
    return schema.enum.map((value, at) => [value, String(names[at] ?? value)]);
  }
  const options = schema.oneOf ?? schema.anyOf;
  if (Array.isArray(options) && options.every((option) => option && "const" in option)) {
    return options.map((option) => [option.const, String(option.title ?? option.const)]);
  }
  return null;
}

function isSimple(schema) {
  if (!schema || typeof schema !== "object") return false;
  if (choices(schema)) return true;
  if (["string", "number", "integer", "boolean"].includes(schema.type)) return true;
  return schema.type === "array" && schema.items && choices(schema.items) !== null;
}

// One labelled input for `schema`; read() gives its value, or undefined when left empty.
function fieldFor(key, schema, required, onChange) {
  const title = String(schema.title ?? key);
  const id = `field-${Math.random().toString(36).slice(2)}`;
  const options = choices(schema);
  const items = schema.type === "array" && schema.items ? choices(schema.items) : null;
  let input;
  let read;
  let write;
  if (items) {
    const boxes = items.map(([value, label]) => {
      const box = el("input", { type: "checkbox" });
      box.checked = Array.isArray(schema.default) && schema.default.includes(value);
      return [box, value, el("label", { class: "choice" }, box, ` ${label}`)];
    });
    input = el("span", { id, class: "choices" }, ...boxes.map(([, , label]) => label));
    read = () => boxes.filter(([box]) => box.checked).map(([, value]) => value);
    write = (value) => boxes.forEach(([box, choice]) => (box.checked = Array.isArray(value) && value.includes(choice)));
  } else if (options) {
    input = el("select", { id });
    input.append(el("option", { value: "" }, required ? "choose…" : "—")); // never a value the user did not pick
    options.forEach(([, label], at) => input.append(el("option", { value: String(at) }, label)));
    if (schema.default !== undefined) {
      const at = options.findIndex(([value]) => value === schema.default);
      if (at >= 0) input.value = String(at);
    }
    read = () => (input.value === "" ? undefined : options[Number(input.value)][0]);
    write = (value) => {
      const at = options.findIndex(([choice]) => choice === value);
      input.value = at >= 0 ? String(at) : "";
    };
  } else if (schema.type === "boolean") {
    input = el("input", { id, type: "checkbox" });
    input.checked = schema.default === true;
    read = () => input.checked;
    write = (value) => (input.checked = value === true);
  } else if (schema.type === "number" || schema.type === "integer") {
    input = el("input", { id, type: "number", step: schema.type === "integer" ? "1" : "any" });
    if (typeof schema.default === "number") input.value = String(schema.default);
    read = () => (input.value === "" ? undefined : Number(input.value));
    write = (value) => (input.value = typeof value === "number" ? String(value) : "");
  } else {
    const type = { email: "email", uri: "url", date: "date" }[schema.format] ?? "text"; // (date-time: typed as text)
    input = el("input", { id, type });
    if (typeof schema.default === "string") input.value = schema.default;
    read = () => (input.value === "" ? undefined : input.value);
    write = (value) => (input.value = typeof value === "string" ? value : "");
  }
  if (onChange) input.addEventListener("input", onChange);
  input.dataset.key = key;
  const description = schema.description ? el("span", { class: "quiet" }, ` ${schema.description}`) : null;
  const row = el("div", { class: "field" }, el("label", { for: id }, title, required ? " *" : ""), input, description);
  return { row, read, write, key, required };
}

// The arguments a form starts from: each property's default. (A required one without a default is left out, so
// that the server, not a made-up empty value, says it is missing.)
function skeleton(schema) {
  const value = {};
  const properties = schema && typeof schema === "object" ? schema.properties : null;
  for (const [key, sub] of Object.entries(properties && typeof properties === "object" ? properties : {})) {
    if (sub && typeof sub === "object" && "default" in sub) value[key] = sub.default;
  }
  return value;
}
