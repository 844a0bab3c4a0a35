// The chat page: one WebSocket to /ws (docs/protocol.md), the reply streamed into the page as
// deltas arrive. Model output is always set as text (textContent), never parsed as HTML.
(function () {
  "use strict";
  var log = document.getElementById("log");
  var live = document.getElementById("live");
  var input = document.getElementById("input");
  var sendBtn = document.getElementById("send");
  var stopBtn = document.getElementById("stop");
  var conn = document.getElementById("conn");
  var modelEl = document.getElementById("model");
  var ws = null, backoff = 500, current = null, counter = 0, resetAfterDone = false;

  // Appends a message bubble whose text is inert (no HTML is ever interpreted).
  function bubble(kind, text) {
    var div = document.createElement("div");
    div.className = "msg " + kind;
    var body = document.createElement("span");
    body.textContent = text;
    div.appendChild(body);
    log.appendChild(div);
    log.scrollTop = log.scrollHeight;
    return { div: div, body: body };
  }

  function setConn(text, cls) { conn.textContent = text; conn.className = "conn " + (cls || ""); }
  function setBusy(b) { stopBtn.disabled = !b; sendBtn.disabled = b; }

  function connect() {
    var proto = location.protocol === "https:" ? "wss://" : "ws://";
    ws = new WebSocket(proto + location.host + "/ws");
    setConn("connecting…");
    ws.onopen = function () { backoff = 500; };
    ws.onmessage = function (ev) {
      var f;
      try { f = JSON.parse(ev.data); } catch (e) { return; }
      handle(f);
    };
    ws.onclose = function () {
      setConn("disconnected, retrying in " + Math.round(backoff / 1000) + " s", "bad");
      if (current) { finish(null, "connection lost"); }
      setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 15000);
    };
  }

  function handle(f) {
    switch (f.type) {
      case "ready":
        setConn("connected", "ok");
        modelEl.textContent = f.model;
        break;
      case "queued":
        if (current && f.id === current.id && f.position > 0) { current.stats.textContent = "queued, position " + f.position; }
        break;
      case "started":
        if (current && f.id === current.id) { current.cached = f.cached_tokens; current.stats.textContent = ""; }
        break;
      case "delta":
        if (current && f.id === current.id) {
          current.text += f.text;
          current.body.textContent = current.text;
          live.textContent = f.text;
          log.scrollTop = log.scrollHeight;
        }
        break;
      case "done":
        if (current && f.id === current.id) { finish(f); }
        break;
      case "error":
        if (current && f.id === current.id) { current.div.remove(); current = null; setBusy(false); }
        bubble("error", (f.error_type || "error") + ": " + f.message);
        break;
    }
  }

  function finish(done, reason) {
    var c = current;
    current = null;
    setBusy(false);
    if (resetAfterDone) {
      resetAfterDone = false;
      if (ws && ws.readyState === 1) { ws.send(JSON.stringify({ type: "reset" })); }
      return;
    }
    if (!c) { return; }
    if (!done) { c.stats.textContent = reason; return; }
    var t = done.timings || {}, u = done.usage || {};
    var parts = ["TTFT " + Math.round(t.ttft_ms || 0) + " ms", (t.decode_tokens_per_s || 0).toFixed(1) + " tok/s",
      (u.cached_tokens || 0) + " cached tokens"];
    if (done.finish_reason !== "stop") { parts.push("finished: " + done.finish_reason); }
    c.stats.textContent = parts.join(" · ");
  }

  function send() {
    var text = input.value;
    if (!text.trim() || current || !ws || ws.readyState !== 1) { return; }
    bubble("user", text);
    var b = bubble("assistant", "");
    var stats = document.createElement("span");
    stats.className = "stats";
    b.div.appendChild(stats);
    current = { id: "m" + (++counter), text: "", body: b.body, div: b.div, stats: stats };
    ws.send(JSON.stringify({ type: "chat", id: current.id, messages: [{ role: "user", content: text }] }));
    input.value = "";
    setBusy(true);
  }

  document.getElementById("composer").addEventListener("submit", function (e) { e.preventDefault(); send(); });
  input.addEventListener("keydown", function (e) {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  stopBtn.addEventListener("click", function () {
    if (current && ws) { ws.send(JSON.stringify({ type: "cancel", id: current.id })); }
  });
  document.getElementById("new-chat").addEventListener("click", function () {
    // A reset is refused while a reply runs: cancel it first and reset on its `done`.
    if (current && ws && ws.readyState === 1) {
      resetAfterDone = true;
      ws.send(JSON.stringify({ type: "cancel", id: current.id }));
    } else if (ws && ws.readyState === 1) {
      ws.send(JSON.stringify({ type: "reset" }));
    }
    log.textContent = "";
    input.focus();
  });
  connect();
  input.focus();
}());
