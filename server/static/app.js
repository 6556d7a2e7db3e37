// The memvit page: a plain client of the public API (GET/POST/DELETE /adapters, POST /classify).
// No framework and no build step; every URL is relative, so the page works behind a path prefix.
// API data is only ever written with textContent, never parsed as HTML.

const $ = (id) => document.getElementById(id);

const SHOWN = 1000; // adapters listed (and offered as tasks): a registry may hold 100,000

const state = {
  files: [], // the images last chosen: re-sent when the tasks or top-k change
  tasks: [], // "base" and the listed adapters, by name
  unchecked: new Set(), // tasks the user turned off (new adapters start on while the registry is small)
  checked: new Set(), // tasks the user turned on (in a large registry, adapters start off)
  small: true, // the whole registry is listed and one request may ask for all of it (no filter)
  maxTasks: 64, // adapters one request may ask for (the server says, with every list)
  version: null, // the registry's version as last listed
  previews: [], // object URLs of the shown images, revoked when replaced
  asked: 0, // classify requests sent: only the latest one's answer is shown
};

// ---- talking to the API -------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, type, message, field) {
    super(message);
    this.status = status;
    this.type = type;
    this.field = field;
  }

  describe() {
    const field = this.field ? ` (${this.field})` : "";
    return `${this.status} ${this.type}${field}: ${this.message}`;
  }
}

// fetch, then the JSON body; a non-2xx answer becomes an ApiError from the service's error body.
// The token field's value goes with every request: a tenant's API key reads only its own adapters.
async function api(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { ...options, headers: { ...authHeaders(), ...(options.headers || {}) } });
  } catch (err) {
    throw new ApiError(0, "NetworkError", `the server did not answer (${err.message})`);
  }
  const text = await response.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!response.ok) {
    const error = body && body.error;
    if (error) throw new ApiError(response.status, error.type, error.message, error.field);
    throw new ApiError(
      response.status,
      response.statusText || "HTTPError",
      text.slice(0, 300) || "no details",
    );
  }
  return body;
}

function authHeaders() {
  const token = $("token").value.trim();
  return token ? { Authorization: `Bearer ${token}` } : {};
}

// The first SHOWN adapters of GET /adapters (paged by name), and the registry they belong to.
async function listAdapters() {
  const adapters = [];
  const invalid = {};
  let after = null;
  let first = null;
  do {
    const query = new URLSearchParams({ limit: String(Math.min(1000, SHOWN - adapters.length)) });
    if (after !== null) query.set("after", after);
    const page = await api(`adapters?${query}`);
    first = first || page;
    adapters.push(...page.adapters);
    Object.assign(invalid, page.invalid);
    after = page.next;
  } while (after && adapters.length < SHOWN);
  return { registry: first.registry, maxTasks: first.max_tasks_per_request, adapters, invalid };
}

// ---- messages -----------------------------------------------------------------------------------

function say(where, text) {
  $(`${where}-status`).textContent = text;
}

function showError(where, err) {
  const box = $(`${where}-error`);
  if (err === null) {
    box.hidden = true;
    box.textContent = "";
    return;
  }
  box.textContent = err instanceof ApiError ? err.describe() : String(err);
  box.hidden = false;
}

// ---- the registry --------------------------------------------------------------------------------

// A new element: props are its properties (dataset entries included), then its children.
function el(tag, { dataset = {}, ...props } = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  Object.assign(node.dataset, dataset);
  node.append(...children);
  return node;
}

async function refreshAdapters() {
  try {
    const { registry, maxTasks, adapters, invalid } = await listAdapters();
    state.version = registry.version;
    state.maxTasks = maxTasks;
    // Past maxTasks adapters a request must name its tasks: adapters start unchecked, and the page
    // sends the checked ones. Below it, all checked means no filter (new adapters included).
    state.small = registry.adapters <= maxTasks && adapters.length === registry.adapters;
    const count = registry.adapters.toLocaleString("en");
    const shown = adapters.length < registry.adapters ? ` (the first ${adapters.length} listed)` : "";
    $("set-version").textContent = `v${registry.version}: ${count} adapter${registry.adapters === 1 ? "" : "s"}${shown}`;
    renderAdapters(adapters, invalid);
    renderTasks(["base", ...adapters.map((a) => a.name)]);
  } catch (err) {
    $("set-version").textContent = "unavailable";
    showError("admin", err);
  }
}

function renderAdapters(adapters, invalid) {
  const rows = adapters.map((a) => {
    const remove = el("button", { type: "button", className: "danger", textContent: "Delete" });
    remove.setAttribute("aria-label", `Delete adapter ${a.name}`);
    remove.addEventListener("click", () => deleteAdapter(a.name));
    const sha = el("code", { textContent: a.sha256.slice(0, 12), title: a.sha256 });
    const labels = a.labels.slice(0, 6).join(", ") + (a.labels.length > 6 ? ", …" : "");
    return el(
      "tr",
      { dataset: { adapter: a.name } },
      el("th", { scope: "row", textContent: a.name }),
      el("td", { textContent: String(a.num_classes), title: labels }),
      el("td", { textContent: `${a.memory_tokens} (${a.memory_norm})` }),
      el("td", { textContent: a.parent || "—" }),
      el("td", {}, sha),
      el("td", {}, remove),
    );
  });
  if (rows.length === 0) {
    rows.push(
      el(
        "tr",
        {},
        el("td", { colSpan: 6, className: "empty", textContent: "No adapters: the base answers alone." }),
      ),
    );
  }
  $("adapter-rows").replaceChildren(...rows);
  const names = Object.keys(invalid);
  $("invalid").hidden = names.length === 0;
  $("invalid-list").replaceChildren(
    ...names.map((n) => el("li", {}, el("code", { textContent: n }), `: ${invalid[n]}`)),
  );
}

// In a small registry every task starts on; in a large one only base and what the user turned on.
function isOn(task) {
  if (state.small || task === "base") return !state.unchecked.has(task);
  return state.checked.has(task);
}

function renderTasks(tasks) {
  state.tasks = tasks;
  const boxes = tasks.map((task) => {
    const box = el("input", { type: "checkbox", name: "task", value: task, checked: isOn(task) });
    box.addEventListener("change", () => {
      if (box.checked) {
        state.unchecked.delete(task);
        state.checked.add(task);
      } else {
        state.unchecked.add(task);
        state.checked.delete(task);
      }
      classify();
    });
    return el("label", { className: "task" }, box, ` ${task}`);
  });
  $("task-list").replaceChildren(...boxes);
}

async function registerAdapter(event) {
  event.preventDefault();
  showError("admin", null);
  const file = $("bundle").files[0];
  if (!file) {
    showError("admin", "choose a bundle file first");
    return;
  }
  const form = new FormData();
  form.append("bundle", file, file.name);
  const replace = $("replace").checked ? "true" : "false";
  say("admin", `Registering ${file.name}…`);
  try {
    const created = await api(`adapters?replace=${replace}`, {
      method: "POST",
      body: form,
    });
    const verb = created.replaced ? "Replaced" : "Registered";
    say("admin", `${verb} ${created.adapter.name}: registry v${created.registry.version}.`);
    $("bundle").value = "";
  } catch (err) {
    say("admin", "");
    showError("admin", err);
  }
  await refreshAdapters();
}

async function deleteAdapter(name) {
  showError("admin", null);
  if (!window.confirm(`Delete adapter ${name}? Every replica stops serving it.`)) return;
  say("admin", `Deleting ${name}…`);
  try {
    const deleted = await api(`adapters/${encodeURIComponent(name)}`, {
      method: "DELETE",
    });
    say("admin", `Deleted ${deleted.deleted}: registry v${deleted.registry.version}.`);
  } catch (err) {
    say("admin", "");
    showError("admin", err);
  }
  await refreshAdapters();
}

// ---- classifying ---------------------------------------------------------------------------------

function chosenTasks() {
  const on = state.tasks.filter(isOn);
  // All of a small registry: send no filter, so the answer is every task (new adapters included).
  return state.small && on.length === state.tasks.length ? null : on;
}

async function classify() {
  if (state.files.length === 0) return;
  // Answers can arrive out of order (the tasks or top-k changed while one was on its way): only the
  // latest request's answer or error is shown, and asking again with bad options drops older ones.
  const ticket = ++state.asked;
  $("classify-button").disabled = false;
  showError("classify", null);
  const refuse = (why) => {
    say("classify", "");
    showError("classify", why);
  };
  const tasks = chosenTasks();
  if (tasks !== null && tasks.length === 0) return refuse("choose at least one task");
  const adapters = tasks === null ? 0 : tasks.filter((t) => t !== "base").length;
  if (adapters > state.maxTasks) return refuse(`choose at most ${state.maxTasks} adapters per request`);
  const topK = $("top-k").valueAsNumber;
  if (!Number.isInteger(topK) || topK < 1) return refuse("top-k must be a whole number of at least 1");
  const query = new URLSearchParams({ top_k: String(topK) });
  if (tasks !== null) query.set("tasks", tasks.join(","));
  const form = new FormData();
  for (const file of state.files) form.append("image", file, file.name);
  const count = state.files.length;
  say("classify", `Classifying ${count} image${count === 1 ? "" : "s"}…`);
  $("classify-button").disabled = true;
  const files = state.files;
  const started = performance.now();
  try {
    const answer = await api(`classify?${query}`, { method: "POST", body: form });
    if (ticket !== state.asked) return;
    const ms = Math.round(performance.now() - started);
    renderResults(answer, files);
    say("classify", `Answered by registry v${answer.registry.version} in ${ms} ms.`);
    if (answer.registry.version !== state.version) await refreshAdapters();
  } catch (err) {
    if (ticket !== state.asked) return;
    say("classify", "");
    showError("classify", err);
  } finally {
    if (ticket === state.asked) $("classify-button").disabled = false;
  }
}

function renderResults(answer, files) {
  for (const url of state.previews) URL.revokeObjectURL(url);
  state.previews = files.map((file) => URL.createObjectURL(file));
  const cards = answer.results.map((result, i) => {
    const preview = el("img", { src: state.previews[i], alt: "", width: 112, height: 112 });
    // Small images (the demo's 28x28) are scaled up with sharp pixels, photos smoothly.
    preview.addEventListener("load", () => preview.classList.toggle("pixel", preview.naturalWidth < 112));
    const figure = el("figure", {}, preview, el("figcaption", { textContent: result.image }));
    const tasks = Object.entries(result.tasks).map(([task, { predictions }]) =>
      renderTask(task, predictions),
    );
    return el(
      "article",
      { className: "result", dataset: { image: result.image } },
      figure,
      el("div", { className: "tasks" }, ...tasks),
    );
  });
  $("results").replaceChildren(...cards);
}

function renderTask(task, predictions) {
  const items = predictions.map((p, rank) => {
    const percent = (100 * p.probability).toFixed(1);
    const bar = el("span", { className: "bar" });
    bar.style.setProperty("--p", `${Math.max(0, Math.min(1, p.probability))}`);
    return el(
      "li",
      { className: rank === 0 ? "prediction top" : "prediction" },
      el("span", { className: "label", textContent: p.label, title: `${p.label} (row ${p.index})` }),
      el("span", { className: "track" }, bar),
      el("span", { className: "percent", textContent: `${percent}%` }),
    );
  });
  return el(
    "section",
    { className: "task-result", dataset: { task } },
    el("h3", { textContent: task }),
    el("ol", {}, ...items),
  );
}

function useFiles(files) {
  const images = [...files];
  if (images.length === 0) return;
  state.files = images;
  $("classify-button").disabled = false; // from now on it re-sends these images
  classify();
}

// ---- samples (the embedded demo's, when it is served) ------------------------------------------

async function loadSamples() {
  let names = [];
  try {
    names = (await api("ui/samples")).samples;
  } catch {
    return; // no samples to offer: the page works without them
  }
  const buttons = names.map((name) => {
    const button = el("button", { type: "button", className: "sample", title: `Classify ${name}` });
    button.setAttribute("aria-label", `Classify the sample ${name}`);
    button.append(
      el("img", { src: `ui/samples/${encodeURIComponent(name)}`, alt: "", width: 48, height: 48 }),
      el("span", { textContent: name.replace(/\.png$/, "") }),
    );
    button.addEventListener("click", async () => {
      try {
        const response = await fetch(`ui/samples/${encodeURIComponent(name)}`);
        if (!response.ok) throw new ApiError(response.status, "HTTPError", `cannot load the sample ${name}`);
        useFiles([new File([await response.blob()], name, { type: "image/png" })]);
      } catch (err) {
        showError("classify", err);
      }
    });
    return button;
  });
  $("sample-list").replaceChildren(...buttons);
  $("samples").hidden = buttons.length === 0;
}

// ---- wiring ---------------------------------------------------------------------------------------

function wire() {
  const drop = $("drop");
  $("images").addEventListener("change", (event) => {
    useFiles(event.target.files);
    event.target.value = ""; // so choosing the same file again is a change too
  });
  for (const type of ["dragenter", "dragover"]) {
    drop.addEventListener(type, (event) => {
      event.preventDefault();
      drop.classList.add("over");
    });
  }
  for (const type of ["dragleave", "drop"]) drop.addEventListener(type, () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    useFiles(event.dataTransfer.files);
  });
  $("classify-form").addEventListener("submit", (event) => {
    event.preventDefault();
    classify();
  });
  $("top-k").addEventListener("change", () => classify());
  $("register-form").addEventListener("submit", registerAdapter);
  $("token").addEventListener("change", () => {
    showError("admin", null);
    refreshAdapters();
  });
  $("refresh").addEventListener("click", () => {
    showError("admin", null);
    refreshAdapters();
  });
}

wire();
refreshAdapters();
loadSamples();
