// The chat page: wires the page's elements to the shared conversation client in widget.js
// (one WebSocket to /ws, replies streamed in as deltas arrive, text always set as text), and
// adds what only the page has:
//
// - Local history: every conversation is kept in this browser's IndexedDB (nothing leaves the
//   visitor's machine), listed in a side panel, reopened (its transcript restored on the server's
//   session, seals included), renamed, deleted, exported as Markdown or JSON. A reload shows the
//   conversation again and resumes the server's session that holds it (the resume token is kept
//   in sessionStorage, for this tab), so its cached prompt is still hit; where that session is
//   gone the transcript is restored instead.
// - Per-conversation settings: temperature, max tokens, and a system prompt where the server
//   lets this client send one (`ready.roles`).
(function () {
  "use strict";
  var $ = function (id) { return document.getElementById(id); };
  var proto = location.protocol === "https:" ? "wss://" : "ws://";
  var SESSION_KEY = "llama-relay-page-session";
  var TITLE_CHARS = 60;

  // ---- Storage: IndexedDB, one record per conversation ----------------------------------------

  /** Resolves to the database, or null where IndexedDB is refused (private modes, policies). */
  function openStore() {
    return new Promise(function (resolve) {
      var req;
      try { req = indexedDB.open("llama-relay", 1); } catch (e) { resolve(null); return; }
      req.onupgradeneeded = function () {
        req.result.createObjectStore("conversations", { keyPath: "id" });
      };
      req.onsuccess = function () { resolve(req.result); };
      req.onerror = function () { resolve(null); };
      req.onblocked = function () { resolve(null); };
    });
  }

  /** Runs `fn(store)` in a transaction; resolves to the last request's result. */
  function tx(db, mode, fn) {
    return new Promise(function (resolve, reject) {
      if (!db) { resolve(null); return; }
      var t = db.transaction("conversations", mode), req = fn(t.objectStore("conversations"));
      t.oncomplete = function () { resolve(req ? req.result : null); };
      t.onerror = function () { reject(t.error); };
      t.onabort = function () { reject(t.error); };
    });
  }

  /** This tab's page session: { id: the conversation on screen, token: the resume token of the
   * server's session holding it, when no reply runs }. */
  function readSession() {
    try { return JSON.parse(sessionStorage.getItem(SESSION_KEY)) || {}; } catch (e) { return {}; }
  }
  function writeSession(v) {
    try { sessionStorage.setItem(SESSION_KEY, JSON.stringify(v)); } catch (e) { /* this view only */ }
  }

  function newId() {
    var bytes = new Uint8Array(8);
    crypto.getRandomValues(bytes);
    return Array.prototype.map.call(bytes, function (b) { return ("0" + b.toString(16)).slice(-2); }).join("");
  }

  function titleOf(text) {
    var t = text.replace(/\s+/g, " ").trim();
    return t.length > TITLE_CHARS ? t.slice(0, TITLE_CHARS - 1) + "…" : t || "Untitled";
  }

  // ---- Settings ------------------------------------------------------------------------------

  var temperature = $("temperature"), maxTokens = $("max-tokens"), system = $("system");

  /** The turn's params from the settings; throws naming a setting out of range. */
  function readParams() {
    var p = {};
    [[temperature, "temperature", "Temperature must be a number from 0 to 2"],
      [maxTokens, "max_tokens", "Max tokens must be a whole number from 1 to " + (maxTokens.max || "the server's limit")]]
      .forEach(function (f) {
        var input = f[0];
        input.removeAttribute("aria-invalid");
        if (input.value === "" && input.validity.valid) { return; }
        if (!input.validity.valid || input.value === "") {
          input.setAttribute("aria-invalid", "true");
          $("settings").open = true;
          throw new Error(f[2] + ".");
        }
        p[f[1]] = Number(input.value);
      });
    return p;
  }

  function settingsOf() {
    return { temperature: temperature.value, max_tokens: maxTokens.value };
  }

  function showSettings(s) {
    temperature.value = (s && s.temperature) || "";
    maxTokens.value = (s && s.max_tokens) || "";
  }

  /** The system prompt field: offered where the server lets this client send one, editable until
   * the conversation's first message. */
  function showSystem() {
    var allowed = (conversation.roles || []).indexOf("system") >= 0;
    var started = conversation.transcript.length > 0 || !!conversation.current;
    $("system-label").hidden = system.hidden = !allowed;
    $("system-note").hidden = !allowed || !started;
    system.disabled = started;
    if (started) { system.value = conversation.system; }
  }

  // ---- The conversation ----------------------------------------------------------------------

  var db = null, records = [], currentId = null;

  var conversation = new window.LlamaRelay.Conversation({
    url: proto + location.host + "/ws",
    els: {
      log: $("log"), live: $("live"), input: $("input"), send: $("send"), stop: $("stop"),
      conn: $("conn"), model: $("model"), newChat: $("new-chat"), form: $("composer")
    },
    params: readParams,
    system: function () {
      return system.hidden ? "" : system.value.trim().slice(0, conversation.limits.max_message_chars || 32768);
    },
    onChange: changed
  });

  function changed(reason) {
    if (reason === "ready" && conversation.limits.max_tokens) { maxTokens.max = conversation.limits.max_tokens; }
    if (reason === "new") {
      currentId = null;
      system.value = "";
      renderList();
    }
    if (reason === "turn" || reason === "restored") { save(); }
    // The resume token names a session whose conversation matches what is saved only while no
    // reply runs.
    writeSession({ id: currentId, token: conversation.current ? null : conversation.resumeToken });
    showSystem();
  }

  /** Saves the conversation on screen (a new record at its first turn). */
  function save() {
    var s = conversation.saved();
    if (!s.turns.length) { return; }
    var now = Date.now(), rec = null;
    for (var i = 0; i < records.length; i++) { if (records[i].id === currentId) { rec = records[i]; } }
    if (!rec) {
      rec = { id: newId(), title: titleOf(s.turns[0].user), created: now };
      records.unshift(rec);
      currentId = rec.id;
    }
    rec.updated = now;
    rec.model = $("model").textContent;
    rec.turns = s.turns;
    rec.firstKept = s.firstKept;
    rec.sessionBase = s.sessionBase;
    rec.system = s.system;
    rec.settings = settingsOf();
    put(rec);
    renderList();
  }

  function put(rec) {
    tx(db, "readwrite", function (st) { return st.put(rec); }).catch(storageFailed);
  }

  function storageFailed() {
    $("history-note").textContent = "History cannot be saved in this browser.";
  }

  // ---- The side panel ------------------------------------------------------------------------

  function button(text, cls, label) {
    var b = document.createElement("button");
    b.type = "button";
    b.className = cls;
    b.textContent = text;
    if (label) { b.setAttribute("aria-label", label); }
    return b;
  }

  function renderList() {
    var list = $("history-list");
    list.textContent = "";
    records.sort(function (a, b) { return b.updated - a.updated; });
    records.forEach(function (rec) {
      var li = document.createElement("li");
      var open = button(rec.title, "open");
      open.title = new Date(rec.updated).toLocaleString();
      if (rec.id === currentId) { open.setAttribute("aria-current", "true"); li.className = "current"; }
      open.addEventListener("click", function () { reopen(rec); });
      var rename = button("Rename", "rename", "Rename " + rec.title);
      rename.addEventListener("click", function () { startRename(li, rec); });
      var del = button("Delete", "delete", "Delete " + rec.title);
      del.addEventListener("click", function () { remove(rec); });
      li.appendChild(open);
      li.appendChild(rename);
      li.appendChild(del);
      list.appendChild(li);
    });
    $("export-md").disabled = $("export-json").disabled = !currentId;
  }

  function reopen(rec) {
    if (rec.id === currentId || !conversation.load(rec, null)) { return; }
    currentId = rec.id;
    showSettings(rec.settings);
    system.value = rec.system || "";
    writeSession({ id: currentId, token: null });
    renderList();
    showSystem();
    if (narrow()) { setPanel(false); }
    $("input").focus();
  }

  function startRename(li, rec) {
    var input = document.createElement("input");
    input.type = "text";
    input.value = rec.title;
    input.maxLength = 100;
    input.setAttribute("aria-label", "New name for " + rec.title);
    li.textContent = "";
    li.appendChild(input);
    input.focus();
    input.select();
    var done = false;
    var finish = function (keep) {
      if (done) { return; }
      done = true;
      var title = input.value.replace(/\s+/g, " ").trim();
      if (keep && title) { rec.title = title; put(rec); }
      renderList();
    };
    input.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter") { ev.preventDefault(); finish(true); }
      if (ev.key === "Escape") { ev.preventDefault(); ev.stopPropagation(); finish(false); }
    });
    input.addEventListener("blur", function () { finish(true); });
  }

  function remove(rec) {
    records = records.filter(function (r) { return r.id !== rec.id; });
    tx(db, "readwrite", function (st) { return st.delete(rec.id); }).catch(storageFailed);
    if (rec.id === currentId) { conversation.newChat(); } else { renderList(); }
  }

  // ---- Export ----------------------------------------------------------------------------------

  function current() {
    for (var i = 0; i < records.length; i++) { if (records[i].id === currentId) { return records[i]; } }
    return null;
  }

  function messagesOf(rec) {
    var out = rec.system ? [{ role: "system", content: rec.system }] : [];
    rec.turns.forEach(function (t) {
      out.push({ role: "user", content: t.user });
      out.push({ role: "assistant", content: t.reply });
    });
    return out;
  }

  function download(name, type, text) {
    var a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([text], { type: type }));
    a.download = name;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(function () { URL.revokeObjectURL(a.href); }, 10000);
  }

  function fileName(rec, ext) {
    return (rec.title.replace(/[^A-Za-z0-9]+/g, "-").replace(/^-+|-+$/g, "").slice(0, 40).toLowerCase() || "conversation") + ext;
  }

  $("export-md").addEventListener("click", function () {
    var rec = current();
    if (!rec) { return; }
    var parts = ["# " + rec.title, "", "_" + new Date(rec.updated).toISOString() + (rec.model ? " · " + rec.model : "") + "_", ""];
    var names = { system: "System", user: "You", assistant: "Assistant" };
    messagesOf(rec).forEach(function (m) { parts.push("## " + names[m.role], "", m.content, ""); });
    download(fileName(rec, ".md"), "text/markdown", parts.join("\n"));
  });

  $("export-json").addEventListener("click", function () {
    var rec = current();
    if (!rec) { return; }
    download(fileName(rec, ".json"), "application/json", JSON.stringify({
      title: rec.title, created: new Date(rec.created).toISOString(), updated: new Date(rec.updated).toISOString(),
      model: rec.model || null, settings: rec.settings || {}, messages: messagesOf(rec)
    }, null, 2));
  });

  // ---- Panel and settings wiring ---------------------------------------------------------------

  function narrow() { return !window.matchMedia("(min-width: 800px)").matches; }

  function setPanel(open) {
    $("history").hidden = !open;
    $("history-toggle").setAttribute("aria-expanded", String(open));
  }

  $("history-toggle").addEventListener("click", function () { setPanel($("history").hidden); });
  // Over the conversation (narrow screens), the panel closes with Escape.
  document.addEventListener("keydown", function (ev) {
    if (ev.key === "Escape" && narrow() && !$("history").hidden && !ev.defaultPrevented) {
      setPanel(false);
      $("history-toggle").focus();
    }
  });
  [temperature, maxTokens].forEach(function (input) {
    input.addEventListener("change", function () {
      input.removeAttribute("aria-invalid");
      var rec = current();
      if (rec) { rec.settings = settingsOf(); put(rec); }
    });
  });
  setPanel(!narrow());

  // For the browser tests and the console.
  window.llamaRelayChat = conversation;

  // The saved conversations, then the one this tab showed before a reload (resuming its
  // session), then the connection.
  openStore().then(function (d) {
    db = d;
    if (!db) { storageFailed(); return []; }
    return tx(db, "readonly", function (st) { return st.getAll(); }).catch(function () { storageFailed(); return []; });
  }).then(function (all) {
    records = all || [];
    var s = readSession(), rec = null;
    for (var i = 0; i < records.length; i++) { if (records[i].id === s.id) { rec = records[i]; } }
    if (rec) {
      currentId = rec.id;
      showSettings(rec.settings);
      system.value = rec.system || "";
    }
    if (rec || s.token) { conversation.load(rec, s.token || null); }
    renderList();
    conversation.start();
    showSystem();
    $("input").focus();
  });
}());
