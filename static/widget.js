// llama-relay browser client: the conversation logic shared by the chat page (index.html) and
// the embeddable support widget. Embedding is one tag:
//
//   <script src="https://HOST/widget.js" data-widget="ID" async></script>
//
// with optional data-title, data-accent (a CSS colour), data-position ("bottom-right" |
// "bottom-left") and data-greeting. The server URL comes from the script's own src. The widget
// lives in a Shadow DOM under a custom element (host CSS such as `div { display: none }` cannot
// reach it, and its CSS cannot leak out) and defines one global, `LlamaRelay`.
//
// Every piece of user or model text goes through `renderText`, which sets text, never HTML:
// a reply containing `<img src=x onerror=...>` shows those characters and runs nothing.
// Replies render as Markdown (`Markdown`), built from elements and text nodes the same way.
// The wire protocol is docs/protocol.md.
(function (global) {
  "use strict";
  if (global.LlamaRelay && global.LlamaRelay.version) { return; }
  var doc = global.document;

  /** Backoff bounds for reconnecting, in ms. */
  var BACKOFF_MIN_MS = 500, BACKOFF_MAX_MS = 15000;
  // While the user types, what is in the input goes to the server at most this often as a
  // `draft` (type-ahead prefill: the reply to it starts sooner).
  var DRAFT_MS = 500;

  /** The host page's handlers of the widget's functions (`LlamaRelay.onToolCall`), by name. */
  var toolHandlers = {};

  /** Registers the host page's handler of function `name`: called with the call's arguments (an
   * object), it returns (or resolves to) the result the model reads: a string, or anything
   * JSON can write. A handler that throws gives the model "error: <message>". */
  function onToolCall(name, handler) {
    if (typeof handler !== "function") { throw new TypeError("onToolCall(name, handler): handler must be a function"); }
    toolHandlers[String(name)] = handler;
  }

  /** The one rendering function for user and model text: inert text, never markup. */
  function renderText(el, text) {
    el.textContent = text;
  }

  /**
   * This tab's conversation id for `url`: sent as `?conversation=ID` on every connection, so a
   * load balancer hashing it sends every reconnect to the replica that holds the conversation.
   * Kept in sessionStorage (one per tab), in memory where storage is refused.
   */
  function conversationId(url) {
    var key = "llama-relay-conversation:" + url, id = null;
    try { id = global.sessionStorage.getItem(key); } catch (e) { id = null; }
    if (!id || !/^[A-Za-z0-9_-]{1,64}$/.test(id)) {
      var bytes = new Uint8Array(16);
      global.crypto.getRandomValues(bytes);
      id = Array.prototype.map.call(bytes, function (b) { return ("0" + b.toString(16)).slice(-2); }).join("");
      try { global.sessionStorage.setItem(key, id); } catch (e) { /* this page view only */ }
    }
    return id;
  }

  function el(tag, cls, text) {
    var e = doc.createElement(tag);
    if (cls) { e.className = cls; }
    if (text != null) { renderText(e, text); }
    return e;
  }

  // ---- Markdown for replies ------------------------------------------------------------------
  //
  // Replies render as Markdown built from DOM nodes and text nodes only: model text never
  // becomes HTML (`<b>` in a reply shows those characters). Paragraphs, headings, emphasis,
  // inline code, links (http, https and mailto only; others show as text), bullet and numbered
  // lists (nested by indent), block quotes, tables and fenced code blocks (a language label and
  // a Copy button). Written by hand in a few hundred lines, as no parser this small builds DOM
  // nodes without going through HTML strings, and the widget ships no dependencies.
  //
  // Incremental: each update splits the whole text into blocks and rebuilds only the blocks
  // from the first one whose source changed (while a reply streams, the last one), so a delta
  // costs the last block, not the reply, and nothing above it flickers. An unfinished fence
  // shows as code so far; a table shows once its separator row has arrived.
  //
  // Bounds keep hostile text cheap: lists nest at most MD_MAX_DEPTH deep (deeper items join the
  // deepest list), block quotes MD_MAX_DEPTH deep, tables at most MD_MAX_COLUMNS columns, and an
  // emphasis or link looks at most MD_SCAN characters ahead for its end.
  var MD_MAX_DEPTH = 6, MD_MAX_COLUMNS = 32, MD_SCAN = 2000;

  var FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
  var HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  var ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  var QUOTE = /^ {0,3}>\s?(.*)$/;
  var RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  var TABLE_SEP = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;

  /** A link target the page may follow: http, https or mailto, or nothing. */
  function safeHref(url) {
    var u;
    try { u = new URL(url); } catch (e) { return null; }
    return (u.protocol === "http:" || u.protocol === "https:" || u.protocol === "mailto:") ? u.href : null;
  }

  /** Splits text into blocks: { type, lines, info? } (a block's source is its lines joined). */
  function mdBlocks(text) {
    var lines = text.split("\n"), blocks = [], i = 0;
    var isTableStart = function (k) {
      return lines[k].indexOf("|") >= 0 && k + 1 < lines.length && lines[k + 1].indexOf("-") >= 0 &&
        TABLE_SEP.test(lines[k + 1]) && lines[k + 1].indexOf("|") >= 0;
    };
    while (i < lines.length) {
      var line = lines[i], m;
      if (!line.trim()) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        var fence = m[1], body = [], j = i + 1, closed = false;
        for (; j < lines.length; j++) {
          var t = lines[j].trim();
          if (t.length >= fence.length && t.charAt(0) === fence.charAt(0) && t.replace(new RegExp("\\" + fence.charAt(0), "g"), "") === "") {
            closed = true;
            break;
          }
          body.push(lines[j]);
        }
        blocks.push({ type: "code", lines: body, info: m[2], closed: closed });
        i = closed ? j + 1 : j;
        continue;
      }
      if ((m = HEADING.exec(line))) { blocks.push({ type: "heading", lines: [m[2]], info: m[1].length }); i++; continue; }
      if (RULE.test(line)) { blocks.push({ type: "rule", lines: [] }); i++; continue; }
      if (isTableStart(i)) {
        var rows = [lines[i]];
        for (i += 2; i < lines.length && lines[i].trim() && lines[i].indexOf("|") >= 0; i++) { rows.push(lines[i]); }
        blocks.push({ type: "table", lines: rows });
        continue;
      }
      var type = QUOTE.test(line) ? "quote" : ITEM.test(line) ? "list" : "para", own = [line];
      // A list ends where an item at its first item's indent switches between bullets and numbers.
      var first = type === "list" ? ITEM.exec(line) : null;
      var kind = function (m) { return m[1].length + (/\d/.test(m[2]) ? "n" : "b"); };
      for (i++; i < lines.length; i++) {
        var next = lines[i];
        if (!next.trim() || FENCE.test(next) || HEADING.test(next) || isTableStart(i)) { break; }
        if (type === "quote" && !QUOTE.test(next)) { break; }
        if (type === "para" && (QUOTE.test(next) || ITEM.test(next))) { break; }
        if (type === "list" && !ITEM.test(next) && !/^\s/.test(next)) { break; }
        var item = type === "list" ? ITEM.exec(next) : null;
        if (item && item[1].length === first[1].length && kind(item) !== kind(first)) { break; }
        own.push(next);
      }
      blocks.push({ type: type, lines: own });
    }
    return blocks;
  }

  /** Appends `text` with its inline Markdown (code, emphasis, links, line breaks) to `parent`. */
  function mdInline(parent, text, depth) {
    var buf = "", i = 0;
    var flush = function () { if (buf) { parent.appendChild(doc.createTextNode(buf)); buf = ""; } };
    while (i < text.length) {
      var ch = text.charAt(i), j, m;
      if (ch === "`") {
        var ticks = /^`+/.exec(text.slice(i, i + 16))[0];
        j = text.indexOf(ticks, i + ticks.length);
        if (j > i && j - i < MD_SCAN) {
          flush();
          parent.appendChild(el("code", null, text.slice(i + ticks.length, j)));
          i = j + ticks.length;
          continue;
        }
        buf += ticks;
        i += ticks.length;
        continue;
      }
      if (ch === "*" || ch === "_") {
        // A run of one (emphasis) or two (strong) markers, closed by a run of the same length
        // after non-space text; `_` only at word edges (snake_case stays as it is).
        var run = 1;
        while (text.charAt(i + run) === ch) { run++; }
        var before = i > 0 ? text.charAt(i - 1) : " ", open = text.charAt(i + run);
        var word = /[A-Za-z0-9]/;
        j = -1;
        if (run <= 2 && depth < MD_MAX_DEPTH && open && !/\s/.test(open) && !(ch === "_" && word.test(before))) {
          var mark = text.substr(i, run);
          for (var from = i + run + 1; ; from = j + 1) {
            j = text.indexOf(mark, from);
            if (j < 0 || j - i > MD_SCAN) { j = -1; break; }
            var after = text.charAt(j + run);
            if (text.charAt(j - 1) !== ch && after !== ch && !/\s/.test(text.charAt(j - 1)) &&
                !(ch === "_" && word.test(after))) { break; }
          }
        }
        if (j > 0 && text.slice(i + run, j).indexOf("\n\n") < 0) {
          flush();
          var e = el(run === 2 ? "strong" : "em");
          mdInline(e, text.slice(i + run, j), depth + 1);
          parent.appendChild(e);
          i = j + run;
          continue;
        }
        buf += text.substr(i, run);
        i += run;
        continue;
      }
      if (ch === "[" && (m = /^\[([^\]\n]{1,500})\]\(([^()\s]{1,2000})\)/.exec(text.slice(i, i + 2600)))) {
        flush();
        var href = safeHref(m[2]);
        if (href) {
          var a = el("a");
          a.href = href;
          a.rel = "noopener noreferrer";
          a.target = "_blank";
          mdInline(a, m[1], MD_MAX_DEPTH);
          parent.appendChild(a);
        } else {
          parent.appendChild(doc.createTextNode(m[0]));
        }
        i += m[0].length;
        continue;
      }
      if (ch === "\n") { flush(); parent.appendChild(el("br")); i++; continue; }
      if (ch === "\\" && i + 1 < text.length && /[\\`*_[\]()#>|-]/.test(text.charAt(i + 1))) {
        buf += text.charAt(i + 1);
        i += 2;
        continue;
      }
      buf += ch;
      i++;
    }
    flush();
  }

  /** A table row's cells (outer pipes dropped, escaped pipes kept), at most MD_MAX_COLUMNS. */
  function mdCells(row) {
    var s = row.trim().replace(/^\|/, "").replace(/\|$/, ""), cells = [], cur = "";
    for (var i = 0; i < s.length; i++) {
      if (s.charAt(i) === "\\" && s.charAt(i + 1) === "|") { cur += "|"; i++; continue; }
      if (s.charAt(i) === "|" && cells.length < MD_MAX_COLUMNS - 1) { cells.push(cur.trim()); cur = ""; continue; }
      cur += s.charAt(i);
    }
    cells.push(cur.trim());
    return cells;
  }

  /** A fenced code block: its language label, a Copy button, the code as text. */
  function mdCode(block) {
    var code = block.lines.join("\n");
    var box = el("div", "md-code");
    var head = el("div", "md-code-head");
    head.appendChild(el("span", "md-lang", block.info || "code"));
    var copy = el("button", "md-copy", "Copy");
    copy.type = "button";
    copy.setAttribute("aria-label", "Copy the code");
    copy.addEventListener("click", function () {
      var done = function () { renderText(copy, "Copied"); global.setTimeout(function () { renderText(copy, "Copy"); }, 1500); };
      var clip = global.navigator && global.navigator.clipboard;
      if (clip && clip.writeText) { clip.writeText(code).then(done, function () { renderText(copy, "Copy failed"); }); } else { renderText(copy, "Copy failed"); }
    });
    head.appendChild(copy);
    box.appendChild(head);
    var pre = el("pre");
    pre.appendChild(el("code", null, code));
    box.appendChild(pre);
    return box;
  }

  /** Bullet or numbered list items, nested by their indent (at most MD_MAX_DEPTH deep). */
  function mdList(block) {
    var stack = [], root = null;
    block.lines.forEach(function (line) {
      var m = ITEM.exec(line);
      if (!m) {
        var last = stack.length && stack[stack.length - 1].list.lastChild;
        if (last) { last.appendChild(el("br")); mdInline(last, line.trim(), 0); }
        return;
      }
      var indent = m[1].replace(/\t/g, "    ").length, ordered = /\d/.test(m[2]);
      while (stack.length && indent < stack[stack.length - 1].indent) { stack.pop(); }
      var top = stack[stack.length - 1];
      if (!top || (indent > top.indent && stack.length < MD_MAX_DEPTH)) {
        var list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[2], 10) !== 1) { list.start = parseInt(m[2], 10); }
        if (top && top.list.lastChild) { top.list.lastChild.appendChild(list); } else if (!root) { root = list; }
        else { root.appendChild(list); }
        top = { indent: indent, list: list };
        stack.push(top);
      }
      var li = el("li");
      mdInline(li, m[3], 0);
      top.list.appendChild(li);
    });
    return root;
  }

  /** The DOM node of one block. */
  function mdBlock(block, depth) {
    var node, text = block.lines.join("\n");
    switch (block.type) {
      case "code": return mdCode(block);
      case "heading":
        node = el("h" + Math.min(6, block.info + 2), "md-h");
        mdInline(node, text, 0);
        return node;
      case "rule": return el("hr");
      case "list": return mdList(block) || el("p");
      case "quote":
        node = el("blockquote");
        var inner = block.lines.map(function (l) { return QUOTE.exec(l) ? QUOTE.exec(l)[1] : l; }).join("\n");
        if (depth < MD_MAX_DEPTH) {
          mdBlocks(inner).forEach(function (b) { node.appendChild(mdBlock(b, depth + 1)); });
        } else {
          mdInline(node, inner, 0);
        }
        return node;
      case "table":
        var wrap = el("div", "md-table"), table = el("table"), head = el("thead"), body = el("tbody");
        var header = el("tr");
        mdCells(block.lines[0]).forEach(function (c) { var th = el("th"); mdInline(th, c, 0); header.appendChild(th); });
        head.appendChild(header);
        block.lines.slice(1).forEach(function (r) {
          var tr = el("tr");
          mdCells(r).forEach(function (c) { var td = el("td"); mdInline(td, c, 0); tr.appendChild(td); });
          body.appendChild(tr);
        });
        table.appendChild(head);
        table.appendChild(body);
        wrap.appendChild(table);
        return wrap;
      default:
        node = el("p");
        mdInline(node, text, 0);
        return node;
    }
  }

  /** A reply's Markdown in `container`, rebuilt block by block as its text grows (`set`). */
  function Markdown(container) {
    this.root = container;
    this.sources = [];
    this.nodes = [];
    container.classList.add("md");
  }

  Markdown.prototype.set = function (text) {
    this.root.markdownSource = text;
    var blocks = mdBlocks(text), i = 0;
    var key = function (b) { return b.type + "\u0000" + (b.info || "") + "\u0000" + (b.closed ? 1 : 0) + "\u0000" + b.lines.join("\n"); };
    while (i < blocks.length && i < this.sources.length && this.sources[i] === key(blocks[i])) { i++; }
    for (var k = this.nodes.length - 1; k >= i; k--) { this.nodes[k].remove(); }
    this.nodes.length = i;
    this.sources.length = i;
    for (; i < blocks.length; i++) {
      var node = mdBlock(blocks[i], 0);
      this.root.appendChild(node);
      this.nodes.push(node);
      this.sources.push(key(blocks[i]));
    }
  };

  /** Shows `text` as the reply in `body`, as Markdown (only what changed is rebuilt). */
  function showReply(body, text) {
    if (!body.markdown) { body.textContent = ""; body.markdown = new Markdown(body); }
    body.markdown.set(text);
  }

  /**
   * One conversation over one WebSocket (reconnecting with backoff), wired to a set of elements:
   * els = { log, live, input, send, stop, conn, model?, newChat? }.
   * opts = { url, els, greeting?, precheck?() -> Promise<{ok, fatal?, message?}>, WebSocket?,
   *   params?() -> the turn's `params` (throws an Error whose message the page shows when a
   *     setting is out of range: nothing is sent),
   *   system?() -> a system prompt for the conversation's first turn ("" for none),
   *   onChange?(reason) -> told "ready", "send", "turn", "restored", "error" and "new", so a
   *     page can keep the conversation (`saved()`) and the session's resume token }.
   */
  function Conversation(opts) {
    this.opts = opts;
    this.els = opts.els;
    this.WS = opts.WebSocket || global.WebSocket;
    this.conversationId = conversationId(opts.url);
    this.ws = null;
    this.backoff = BACKOFF_MIN_MS;
    this.current = null;
    this.counter = 0;
    this.resetAfterDone = false;
    this.refused = false;
    this.started = false;
    this.timer = null;
    // The user bubbles of the server's conversation, in order (an edit names one by its index),
    // the last reply (which Regenerate replaces), and a user turn being edited.
    this.turns = [];
    this.lastReply = null;
    this.editing = null;
    // The server's conversation as it recorded it, one { user, reply, seal } per turn (a reply's
    // seal comes with its `done`), and what is carried to a session that lost it: a `restore`
    // of that transcript, then the question that was interrupted, asked again.
    this.transcript = [];
    this.carry = null;
    this.limits = {};
    // The roles this client may send (from `ready`), and the conversation's system prompt
    // (sent with its first turn, and leading every restore).
    this.roles = null;
    this.system = "";
    // The first turn the model still reads (the server drops the oldest when the conversation
    // outgrows its context: `started.truncated`), and the first turn the server's session was
    // given (a `restore` carries the turns from `firstKept` on): edits count turns from there.
    this.firstKept = 0;
    this.sessionBase = 0;
    // The session's resume token (from `ready`), and the one to resume with after a drop.
    this.resumeToken = null;
    this.pendingResume = null;
    // The draft timer, and the text last sent as a draft.
    this.draftTimer = null;
    this.draftSent = "";
  }

  Conversation.prototype.start = function () {
    if (this.started) { return; }
    this.started = true;
    var self = this, e = this.els;
    e.input.addEventListener("keydown", function (ev) {
      // An Enter that commits an IME composition (Korean, Japanese, Chinese input) is not a
      // send: browsers mark it `isComposing`, and Safari gives it keyCode 229 instead.
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229) {
        ev.preventDefault();
        self.send();
      }
    });
    e.input.addEventListener("input", function () { self.typed(); });
    if (e.form) {
      e.form.addEventListener("submit", function (ev) { ev.preventDefault(); self.send(); });
    } else {
      e.send.addEventListener("click", function () { self.send(); });
    }
    e.stop.addEventListener("click", function () { self.stop(); });
    if (e.newChat) { e.newChat.addEventListener("click", function () { self.newChat(); }); }
    this.greet();
    this.setBusy(false);
    this.connect();
  };

  Conversation.prototype.greet = function () {
    if (this.opts.greeting) { this.bubble("assistant", this.opts.greeting); }
  };

  Conversation.prototype.setConn = function (text, cls) {
    renderText(this.els.conn, text);
    this.els.conn.className = "conn " + (cls || "");
  };

  Conversation.prototype.setBusy = function (busy) {
    this.els.stop.disabled = !busy;
    this.els.send.disabled = busy || this.refused;
    this.els.input.disabled = this.refused;
  };

  Conversation.prototype.connect = function () {
    var self = this;
    if (this.refused) { return; }
    this.setConn("connecting…");
    var check = this.opts.precheck ? this.opts.precheck() : Promise.resolve({ ok: true });
    check.then(function (r) {
      if (r.ok) { self.open(); } else if (r.fatal) { self.refuse(r.message); } else { self.retry(r.message); }
    }, function () { self.retry("cannot reach the server"); });
  };

  Conversation.prototype.open = function () {
    var self = this, ws;
    var url = this.opts.url + (this.opts.url.indexOf("?") < 0 ? "?" : "&") + "conversation=" + this.conversationId;
    try { ws = new this.WS(url); } catch (e) { this.retry("cannot connect"); return; }
    this.ws = ws;
    ws.onmessage = function (ev) {
      var f;
      try { f = JSON.parse(ev.data); } catch (e) { return; }
      if (self.ws === ws) { self.handle(f); }
    };
    ws.onclose = function () {
      if (self.ws !== ws) { return; }
      self.ws = null;
      if (self.resumeToken) {
        // The session waits on the server: the next connection resumes it, the running reply
        // included (docs/protocol.md, "Resume").
        self.pendingResume = self.resumeToken;
        if (self.current) { renderText(self.current.stats, "reconnecting…"); }
      } else {
        self.lostSession();
      }
      self.retry("disconnected");
    };
  };

  Conversation.prototype.retry = function (why) {
    var self = this;
    this.setConn((why || "disconnected") + ", retrying in " + Math.max(1, Math.round(this.backoff / 1000)) + " s", "bad");
    clearTimeout(this.timer);
    this.timer = setTimeout(function () { self.connect(); }, this.backoff);
    this.backoff = Math.min(this.backoff * 2, BACKOFF_MAX_MS);
  };

  /** The server will never accept us (an origin the widget does not allow): say so and stop. */
  Conversation.prototype.refuse = function (message) {
    this.refused = true;
    this.setConn("not available here", "bad");
    this.bubble("error", message || "This chat is not available on this site.");
    this.setBusy(false);
  };

  Conversation.prototype.isOpen = function () { return this.ws && this.ws.readyState === 1; };

  Conversation.prototype.bubble = function (kind, text) {
    var div = el("div", "msg " + kind);
    var body = el(kind === "assistant" ? "div" : "span", "body", text);
    div.appendChild(body);
    this.els.log.appendChild(div);
    this.els.log.scrollTop = this.els.log.scrollHeight;
    return { div: div, body: body };
  };

  /** The server's session is gone (its replica drained or died, or it expired): the
   * conversation moves to the new session with a `restore` of the transcript, and a question
   * whose reply was interrupted is asked again. An interrupted edit or regenerate, or a refused
   * restore, leaves the screen as it is with nothing to edit or regenerate any more. */
  Conversation.prototype.lostSession = function () {
    var c = this.current;
    if (c && c.kind !== "chat") {
      this.finish(null, "connection lost");
      this.forgetTurns();
      return;
    }
    if (c && c.stopped) { this.finish(null, "connection lost"); c = null; }
    if (!c && !this.transcript.length) { return; }
    this.carry = { messages: this.transcriptMessages(), reask: c, sent: false };
    if (c) {
      c.text = "";
      c.lastIndex = -1;
      showReply(c.body, "");
      renderText(c.stats, "reconnecting…");
    }
    if (this.isOpen()) { this.sendCarry(); }
  };

  /** The transcript as `restore` messages, its oldest turns dropped to fit the session's limits
   * (`max_messages`, and the frame within `max_frame_bytes`). */
  Conversation.prototype.transcriptMessages = function () {
    var all = [], base = Math.min(this.firstKept, this.transcript.length);
    for (var i = base; i < this.transcript.length; i++) {
      var t = this.transcript[i];
      all.push({ role: "user", content: t.user });
      all.push({ role: "assistant", content: t.reply, seal: t.seal });
    }
    // The system prompt leads, and stays when old turns must go.
    var lead = 0;
    if (this.system) { all.unshift({ role: "system", content: this.system }); lead = 1; }
    var maxMessages = this.limits.max_messages || 64, maxBytes = (this.limits.max_frame_bytes || 65536) - 256;
    while (all.length > lead && (all.length > maxMessages ||
        new TextEncoder().encode(JSON.stringify({ type: "restore", messages: all })).length > maxBytes)) {
      all.splice(lead, 2);
      base++;
    }
    if (all.length === lead) { all = []; }
    this.restoreBase = base;
    return all;
  };

  /** Page turns from `firstKept` up to `upTo` no longer reach the model: shown dimmed, with no
   * Edit. */
  Conversation.prototype.dropTurns = function (upTo) {
    for (var t = this.firstKept; t < upTo && t < this.turns.length; t++) {
      var div = this.turns[t], reply = div.nextSibling, b = div.querySelector("button.edit");
      if (b) { b.remove(); }
      div.classList.add("dropped");
      div.title = "No longer in the model's context";
      if (reply && reply.classList.contains("assistant")) { reply.classList.add("dropped"); }
    }
    this.firstKept = Math.max(this.firstKept, upTo);
  };

  /** `started.truncated`: the server dropped its `n` oldest user turns (function results count
   * as user turns there) from the conversation. */
  Conversation.prototype.truncated = function (n) {
    var t = this.firstKept;
    while (n > 0 && t < this.transcript.length) {
      n -= 1 + (this.transcript[t].calls || 0);
      t++;
    }
    this.dropTurns(t);
  };

  Conversation.prototype.sendCarry = function () {
    var k = this.carry;
    if (!k || k.sent || !this.isOpen()) { return; }
    if (k.messages.length) {
      k.sent = true;
      this.ws.send(JSON.stringify({ type: "restore", messages: k.messages }));
    } else {
      this.carry = null;
      this.reask(k.reask);
    }
  };

  /** Asks an interrupted question again on a new session (its reply starts over). */
  Conversation.prototype.reask = function (c) {
    if (!c || this.current !== c || !this.isOpen()) { return; }
    renderText(c.stats, "");
    this.ws.send(JSON.stringify(this.chatFrame(c)));
  };

  /** The `chat` frame of reply `c`: its question, after the conversation's system prompt when
   * it is the first turn. */
  Conversation.prototype.chatFrame = function (c) {
    var messages = [{ role: "user", content: c.userText }];
    if (c.system) { messages.unshift({ role: "system", content: c.system }); }
    var frame = { type: "chat", id: c.id, messages: messages };
    if (c.params) { frame.params = c.params; }
    return frame;
  };

  /** The page's `onChange` hook, told why. */
  Conversation.prototype.changed = function (reason) {
    if (this.opts.onChange && !this.loading) { this.opts.onChange(reason); }
  };

  /** The turn's `params` from the page's settings (null for none); throws when one is out of
   * range. */
  Conversation.prototype.params = function () {
    var p = this.opts.params ? this.opts.params() : null;
    return p && Object.keys(p).length ? p : null;
  };

  Conversation.prototype.handle = function (f) {
    var c = this.current;
    var mine = c && f.id === c.id;
    if (f.type === "error" && f.error_type === "resume_failed") {
      if (mine && c.kind === "chat" && c.lastIndex < 0 && this.isOpen()) {
        // The session came back but the question never reached it: ask again.
        this.ws.send(JSON.stringify(this.chatFrame(c)));
        return;
      }
      this.lostSession();
      return;
    }
    switch (f.type) {
      case "ready":
        this.backoff = BACKOFF_MIN_MS;
        this.setConn("connected", "ok");
        if (this.els.model) { renderText(this.els.model, f.model || ""); }
        this.resumeToken = f.resume_token || null;
        this.limits = f.limits || {};
        this.roles = f.roles || null;
        if (f.resumed) {
          if (c) { renderText(c.stats, ""); }
        } else if (this.pendingResume) {
          var resume = { type: "resume", token: this.pendingResume };
          if (c) { resume.id = c.id; if (c.lastIndex >= 0) { resume.after_index = c.lastIndex; } }
          this.ws.send(JSON.stringify(resume));
        } else {
          this.sendCarry();
        }
        this.pendingResume = null;
        this.changed("ready");
        break;
      case "restored":
        // The restored conversation holds the turns' questions and replies only, from
        // `restoreBase` on.
        for (var r = 0; r < this.transcript.length; r++) { this.transcript[r].calls = 0; }
        this.dropTurns(this.restoreBase || 0);
        this.sessionBase = this.firstKept;
        if (this.carry) {
          var again = this.carry.reask;
          this.carry = null;
          this.reask(again);
        }
        this.changed("restored");
        break;
      case "queued":
        if (mine) {
          // Position 0 is next; the estimate comes once the server has seen requests start.
          var wait = f.eta_ms ? " · about " + Math.max(1, Math.round(f.eta_ms / 1000)) + " s" : "";
          // (Every request is queued at 0 for a moment: that is not shown.)
          if (f.position > 0 || wait) {
            renderText(c.stats, "queued, " + (f.position > 0 ? f.position + " ahead" : "next") + wait);
          }
        }
        break;
      case "started":
        if (mine) { renderText(c.stats, ""); }
        if (mine && f.truncated) { this.truncated(f.truncated.dropped_turns); }
        break;
      case "delta":
        // After Stop, nothing more is shown: the conversation keeps what was (heard_index).
        if (mine && !c.stopped && f.index > c.lastIndex) {
          c.lastIndex = f.index;
          c.text += f.text;
          showReply(c.body, c.text);
          renderText(this.els.live, f.text);
          this.els.log.scrollTop = this.els.log.scrollHeight;
        }
        break;
      case "tool_call":
        if (mine) { this.runTool(c, f); }
        break;
      case "done":
        if (mine) { this.finish(f); }
        break;
      case "error":
        if (!f.id && this.carry && this.carry.sent) {
          // The restore was refused: the conversation cannot move.
          this.carry = null;
          if (c) { this.finish(null, "connection lost"); }
          this.forgetTurns();
        }
        if (mine) { this.undo(c); this.current = null; this.setBusy(false); }
        this.bubble("error", (f.error_type || "error") + ": " + (f.message || ""));
        this.changed("error");
        break;
    }
  };

  /** The reply calls a function of the host page's: its handler runs, its result goes back as a
   * `tool_result`, and the reply goes on (deltas from index 0 again). */
  Conversation.prototype.runTool = function (c, f) {
    var self = this;
    c.called = c.called || {};
    if (c.called[f.call_id]) { return; }  // replayed after a resume: already answered
    c.called[f.call_id] = true;
    c.calls = (c.calls || []).concat([f.name]);
    c.lastIndex = -1;
    renderText(c.stats, "calling " + f.name + "…");
    // A collapsible line above the reply: the call, and its result once the handler answers.
    var args = JSON.stringify(f.arguments || {});
    if (args.length > 200) { args = args.slice(0, 199) + "…"; }
    var line = el("details", "call");
    line.appendChild(el("summary", null, "called " + f.name + "(" + args + ")"));
    var shown = el("pre", null, "…");
    line.appendChild(shown);
    c.div.insertBefore(line, c.body);
    var handler = toolHandlers[f.name];
    var run = handler
      ? new Promise(function (resolve) { resolve(handler(f.arguments || {})); })
      : Promise.reject(new Error("this page has no handler for " + f.name));
    run.then(function (result) {
      if (typeof result === "string") { return result; }
      return JSON.stringify(result === undefined ? null : result);
    }).catch(function (err) {
      return "error: " + (err && err.message ? err.message : String(err));
    }).then(function (content) {
      var max = self.limits.max_message_chars || 32768;
      if (content.length > max) { content = content.slice(0, max); }
      renderText(shown, content);
      if (self.current === c && self.isOpen()) {
        self.ws.send(JSON.stringify({ type: "tool_result", call_id: f.call_id, content: content }));
      }
    });
  };

  Conversation.prototype.finish = function (done, reason) {
    var c = this.current;
    this.current = null;
    this.setBusy(false);
    if (this.resetAfterDone) {
      this.resetAfterDone = false;
      if (this.isOpen()) { this.ws.send(JSON.stringify({ type: "reset" })); }
      return;
    }
    if (!c) { return; }
    if (!done) { renderText(c.stats, reason); return; }
    this.recordTurn(c, done);
    var t = done.timings || {}, u = done.usage || {};
    var parts = ["TTFT " + Math.round(t.ttft_ms || 0) + " ms", (t.decode_tokens_per_s || 0).toFixed(1) + " tok/s",
      (u.cached_tokens || 0) + " cached tokens"];
    if (c.calls && c.calls.length) { parts.push("called " + c.calls.join(", ")); }
    if (done.finish_reason !== "stop") { parts.push("finished: " + done.finish_reason); }
    renderText(c.stats, parts.join(" · "));
    this.els.log.scrollTop = this.els.log.scrollHeight;
  };

  /** The input changed: its text goes out as a `draft` within DRAFT_MS (not for an edit,
   * which replaces an earlier turn). */
  Conversation.prototype.typed = function () {
    if (this.draftTimer) { return; }
    var self = this;
    this.draftTimer = setTimeout(function () {
      self.draftTimer = null;
      var text = self.els.input.value;
      if (self.editing || !self.isOpen() || text === self.draftSent || !text.trim()) { return; }
      self.draftSent = text;
      self.ws.send(JSON.stringify({ type: "draft", text: text }));
    }, DRAFT_MS);
  };

  Conversation.prototype.send = function () {
    var text = this.els.input.value;
    if (!text.trim() || this.current || !this.isOpen()) { return false; }
    var params;
    try { params = this.params(); } catch (err) { this.bubble("error", err.message); return false; }
    // The system prompt goes with the conversation's first turn (the session keeps it).
    var system = !this.transcript.length && this.opts.system ? this.opts.system() : "";
    var edit = this.editing, removed = [];
    this.setEditing(null);
    if (edit) {
      // The edited turn and everything after it leave the screen (they come back on an error).
      var node = edit.div;
      while (node) { var next = node.nextSibling; removed.push(node); node.remove(); node = next; }
    }
    var u = this.bubble("user", text);
    var b = this.bubble("assistant", "");
    var stats = el("span", "stats");
    b.div.appendChild(stats);
    this.current = { id: "m" + (++this.counter), text: "", body: b.body, div: b.div, stats: stats,
      userDiv: u.div, userText: text, kind: edit ? "edit" : "chat", turn: edit ? edit.turn : this.turns.length,
      removed: removed, lastIndex: -1, params: params, system: edit ? "" : system };
    var frame = this.chatFrame(this.current);
    if (edit) { frame.type = "edit"; frame.turn = this.serverTurn(edit.turn); }
    clearTimeout(this.draftTimer);
    this.draftTimer = null;
    this.draftSent = "";
    this.ws.send(JSON.stringify(frame));
    this.els.input.value = "";
    this.setBusy(true);
    this.changed("send");
    return true;
  };

  /** Stop: the reply ends, and the conversation keeps what was shown (the last delta's index). */
  Conversation.prototype.stop = function () {
    var c = this.current;
    if (!c || c.stopped || !this.isOpen()) { return; }
    c.stopped = true;
    var frame = { type: "cancel", id: c.id };
    if (c.lastIndex >= 0) { frame.heard_index = c.lastIndex; }
    this.ws.send(JSON.stringify(frame));
  };

  /** A new reply to the same conversation, in place of the last one. */
  Conversation.prototype.regenerate = function () {
    var r = this.lastReply;
    if (!r || this.current || !this.isOpen()) { return; }
    var params;
    try { params = this.params(); } catch (err) { this.bubble("error", err.message); return; }
    this.current = { id: "m" + (++this.counter), text: "", body: r.body, div: r.div, stats: r.stats,
      kind: "regenerate", oldText: r.body.markdownSource != null ? r.body.markdownSource : r.body.textContent,
      oldStats: r.stats.textContent, lastIndex: -1 };
    showReply(r.body, "");
    renderText(r.stats, "");
    r.actions.remove();
    // The old reply's function calls go with it.
    Array.prototype.forEach.call(r.div.querySelectorAll(".call"), function (e) { e.remove(); });
    var frame = { type: "regenerate", id: this.current.id };
    if (params) { frame.params = params; }
    this.ws.send(JSON.stringify(frame));
    this.setBusy(true);
    this.changed("send");
  };

  /** What a refused request leaves on screen: the page as it was before it. */
  Conversation.prototype.undo = function (c) {
    if (c.kind === "regenerate") {
      showReply(c.body, c.oldText);
      renderText(c.stats, c.oldStats);
      this.showRegenerate();
      return;
    }
    c.div.remove();
    if (c.kind === "edit") {
      c.userDiv.remove();
      for (var i = 0; i < c.removed.length; i++) { this.els.log.appendChild(c.removed[i]); }
    }
  };

  /** A reply ended with `done`: its turn is part of the server's conversation now. */
  Conversation.prototype.recordTurn = function (c, done) {
    var self = this;
    // What the server recorded: the text shown (after Stop, the deltas through heard_index).
    // `calls`: the function results the server's conversation holds for this turn (each a
    // user message there, which an edit's turn number counts).
    var turn = { user: c.userText, reply: c.text, seal: done.seal, calls: (c.calls || []).length };
    if (c.kind === "regenerate") {
      if (this.transcript.length) {
        turn.user = this.transcript[this.transcript.length - 1].user;
        this.transcript[this.transcript.length - 1] = turn;
      }
    } else {
      this.transcript = this.transcript.slice(0, c.turn);
      this.transcript.push(turn);
      if (c.system) { this.system = c.system; }
    }
    if (c.kind !== "regenerate") {
      this.turns = this.turns.slice(0, c.turn);
      this.turns.push(c.userDiv);
      var edit = el("button", "edit", "Edit");
      edit.type = "button";
      edit.title = "Edit this message and reply again";
      edit.addEventListener("click", function () { self.startEdit(c.userDiv); });
      c.userDiv.appendChild(edit);
      if (this.lastReply && this.lastReply.actions) { this.lastReply.actions.remove(); }
      this.lastReply = { div: c.div, body: c.body, stats: c.stats };
    }
    this.showRegenerate();
    this.changed("turn");
  };

  Conversation.prototype.showRegenerate = function () {
    var self = this, r = this.lastReply;
    if (!r) { return; }
    if (r.actions) { r.actions.remove(); }
    r.actions = el("span", "actions");
    var b = el("button", "regenerate", "Regenerate");
    b.type = "button";
    b.addEventListener("click", function () { self.regenerate(); });
    r.actions.appendChild(b);
    r.div.appendChild(r.actions);
  };

  /** The server's number of user turn `t` of the page: function results count as user turns
   * there. */
  Conversation.prototype.serverTurn = function (t) {
    var n = t - this.sessionBase;
    for (var i = this.sessionBase; i < t && i < this.transcript.length; i++) { n += this.transcript[i].calls || 0; }
    return n;
  };

  /** Puts a past user message in the input; sending replaces it and everything after it. */
  Conversation.prototype.startEdit = function (div) {
    var turn = this.turns.indexOf(div);
    if (turn < this.firstKept || this.current) { return; }
    this.setEditing({ turn: turn, div: div });
    this.els.input.value = div.querySelector(".body").textContent;
    this.els.input.focus();
  };

  Conversation.prototype.setEditing = function (edit) {
    if (this.editing) { this.editing.div.classList.remove("editing"); }
    this.editing = edit;
    if (edit) { edit.div.classList.add("editing"); }
  };

  Conversation.prototype.forgetTurns = function () {
    var buttons = this.els.log.querySelectorAll("button.edit, .actions");
    for (var i = 0; i < buttons.length; i++) { buttons[i].remove(); }
    this.turns = [];
    this.lastReply = null;
    this.transcript = [];
    this.firstKept = 0;
    this.sessionBase = 0;
    this.system = "";
    this.setEditing(null);
  };

  Conversation.prototype.newChat = function () {
    // A reset is refused while a reply runs: cancel it first and reset on its `done`.
    if (this.current && this.isOpen()) {
      this.resetAfterDone = true;
      this.ws.send(JSON.stringify({ type: "cancel", id: this.current.id }));
    } else if (this.isOpen()) {
      this.ws.send(JSON.stringify({ type: "reset" }));
    }
    this.els.log.textContent = "";
    this.forgetTurns();
    this.pendingResume = null;
    this.carry = null;
    this.greet();
    this.els.input.focus();
    this.changed("new");
  };

  /** The conversation as a page keeps it: { turns: [{ user, reply, seal, calls }], firstKept,
   * sessionBase, system }. */
  Conversation.prototype.saved = function () {
    return { turns: this.transcript.map(function (t) { return { user: t.user, reply: t.reply, seal: t.seal, calls: t.calls || 0 }; }),
      firstKept: this.firstKept, sessionBase: this.sessionBase, system: this.system };
  };

  /** Shows a conversation `saved()` earlier in place of this one, its turns ready to edit and
   * regenerate, and moves the server's session to it: with `resumeToken`, by resuming the
   * session that holds it (a reload: its cached prompt is still there), else by a `reset` and
   * a `restore` of its transcript. Not while a reply runs (returns false). */
  Conversation.prototype.load = function (saved, resumeToken) {
    if (this.current) { return false; }
    if (this.isOpen() && !resumeToken) { this.ws.send(JSON.stringify({ type: "reset" })); }
    this.els.log.textContent = "";
    this.forgetTurns();
    this.carry = null;
    this.pendingResume = resumeToken || null;
    this.greet();
    var turns = (saved && saved.turns) || [];
    this.loading = true;
    for (var i = 0; i < turns.length; i++) {
      var t = turns[i], u = this.bubble("user", t.user), b = this.bubble("assistant", "");
      showReply(b.body, t.reply);
      var stats = el("span", "stats");
      b.div.appendChild(stats);
      this.recordTurn({ userText: t.user, text: t.reply, userDiv: u.div, div: b.div, body: b.body, stats: stats,
        kind: "chat", turn: i, calls: new Array(t.calls || 0), system: i === 0 ? (saved.system || "") : "" }, { seal: t.seal });
    }
    this.loading = false;
    this.dropTurns(Math.min((saved && saved.firstKept) || 0, turns.length));
    this.sessionBase = Math.min((saved && saved.sessionBase) || 0, this.firstKept);
    if (!resumeToken && this.transcript.length) {
      this.carry = { messages: this.transcriptMessages(), reask: null, sent: false };
      this.sendCarry();
    }
    return true;
  };

  // ---- The embeddable widget -------------------------------------------------------------

  var CSS = [
    ".root{all:initial;position:fixed;bottom:20px;right:20px;z-index:2147483000;display:flex;flex-direction:column;align-items:flex-end;gap:12px;",
    "font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;color:var(--fg);--accent:#2f6fdf;",
    "--fg:#1b1d21;--panel:#f6f7f9;--surface:#fff;--line:#dde1e6;--field:#c4cad3;--muted:#5b6270;",
    "--err-bg:#fff1f0;--err-line:#f3b4ae;--err-fg:#8a1c12;--focus:#8bb4ff}",
    // The visitor's system theme, unless the host page pins one (`data-theme`); text keeps at
    // least 4.5:1 against its background in both.
    "@media (prefers-color-scheme:dark){.root:not(.light){--fg:#e6e8eb;--panel:#16181c;--surface:#23262b;--line:#3a3f47;",
    "--field:#4f5661;--muted:#aab1bc;--err-bg:#3a1714;--err-line:#8a2c22;--err-fg:#ffb4a9}}",
    ".root.dark{--fg:#e6e8eb;--panel:#16181c;--surface:#23262b;--line:#3a3f47;",
    "--field:#4f5661;--muted:#aab1bc;--err-bg:#3a1714;--err-line:#8a2c22;--err-fg:#ffb4a9}",
    ".root.left{right:auto;left:20px;align-items:flex-start}",
    "*{box-sizing:border-box}",
    ".launcher{all:unset;box-sizing:border-box;width:56px;height:56px;border-radius:50%;background:var(--accent);color:#fff;cursor:pointer;",
    "display:flex;align-items:center;justify-content:center;box-shadow:0 4px 14px rgba(0,0,0,.25)}",
    ".launcher svg{width:28px;height:28px;fill:currentColor}",
    ".launcher:focus-visible,button:focus-visible,textarea:focus-visible{outline:3px solid var(--focus);outline-offset:2px}",
    ".panel{display:flex;flex-direction:column;width:min(380px,calc(100vw - 24px));height:min(560px,calc(100vh - 100px));background:var(--panel);",
    "border-radius:12px;box-shadow:0 8px 30px rgba(0,0,0,.3);overflow:hidden}",
    ".panel[hidden]{display:none}",
    "header{display:flex;align-items:center;gap:8px;padding:10px 12px;background:var(--accent);color:#fff}",
    ".title{font-weight:600;flex:1;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}",
    ".conn{font-size:12px;opacity:.9}",
    "header button{all:unset;cursor:pointer;padding:2px 6px;border-radius:4px;font-size:13px;color:#fff}",
    "header button.close{font-size:20px;line-height:1}",
    ".log{flex:1;overflow-y:auto;padding:12px;display:flex;flex-direction:column;gap:8px}",
    ".msg{max-width:85%;padding:8px 10px;border-radius:10px;white-space:pre-wrap;overflow-wrap:anywhere}",
    ".user{align-self:flex-end;background:var(--accent);color:#fff}",
    ".assistant{align-self:flex-start;background:var(--surface);border:1px solid var(--line)}",
    ".error{align-self:stretch;background:var(--err-bg);border:1px solid var(--err-line);color:var(--err-fg)}",
    ".stats{display:block;margin-top:4px;font-size:11px;color:var(--muted);white-space:normal}",
    "form{display:flex;gap:6px;padding:8px;background:var(--surface);border-top:1px solid var(--line);margin:0}",
    "textarea{flex:1;resize:none;font:inherit;color:inherit;background:var(--surface);padding:6px;border:1px solid var(--field);border-radius:6px;min-height:40px}",
    "form button{font:inherit;padding:4px 10px;border-radius:6px;border:1px solid var(--field);background:var(--surface);color:var(--fg);cursor:pointer}",
    "form button.send{background:var(--accent);color:#fff;border-color:var(--accent)}",
    "button:disabled{opacity:.5;cursor:default}",
    ".msg button.edit,.actions button{display:block;margin-top:4px;font:inherit;font-size:11px;padding:1px 6px;border-radius:4px;border:1px solid var(--field);background:var(--surface);color:var(--fg);cursor:pointer}",
    ".user button.edit{margin-left:auto}",
    ".editing{outline:2px dashed var(--focus);outline-offset:2px}",
    // Turns the model no longer reads: marked by their outline, not by fading (contrast stays).
    ".dropped{border:1px dashed var(--field)}",
    // Replies' Markdown.
    ".md{white-space:normal}",
    ".md>:first-child{margin-top:0}.md>:last-child{margin-bottom:0}",
    ".md p,.md ul,.md ol,.md blockquote,.md .md-table,.md .md-code{margin:0 0 8px}",
    ".md ul,.md ol{padding-left:20px}",
    ".md .md-h{font-size:1em;margin:0 0 6px}",
    ".md blockquote{padding-left:8px;border-left:3px solid var(--line);color:var(--muted)}",
    ".md code{font:12px/1.4 ui-monospace,monospace;background:var(--panel);border-radius:3px;padding:0 3px}",
    ".md a{color:inherit;text-decoration:underline}",
    ".md-code{border:1px solid var(--line);border-radius:6px;overflow:hidden}",
    ".md-code-head{display:flex;justify-content:space-between;align-items:center;padding:2px 6px;font-size:11px;color:var(--muted);background:var(--panel)}",
    ".md-copy{font:inherit;font-size:11px;padding:0 6px;border-radius:4px;border:1px solid var(--field);background:var(--surface);color:var(--fg);cursor:pointer}",
    ".md-code pre{margin:0;padding:6px;overflow-x:auto;white-space:pre}",
    ".md-code pre code{background:none;padding:0}",
    ".md-table{overflow-x:auto}",
    ".md table{border-collapse:collapse;font-size:13px}",
    ".md th,.md td{border:1px solid var(--line);padding:2px 6px;text-align:left;vertical-align:top}",
    ".call{display:block;margin-bottom:4px;font-size:12px;color:var(--muted);white-space:normal}",
    ".call summary{cursor:pointer;overflow-wrap:anywhere}",
    ".call pre{margin:4px 0 0;white-space:pre-wrap;overflow-wrap:anywhere;font:11px/1.4 ui-monospace,monospace}",
    ".sr-only{position:absolute;width:1px;height:1px;overflow:hidden;clip:rect(0 0 0 0);white-space:nowrap}"
  ].join("\n");

  var ICON = "M4 4h16a2 2 0 0 1 2 2v10a2 2 0 0 1-2 2H8l-4 4V6a2 2 0 0 1 2-2z";

  function attachStyle(shadow) {
    try {
      var sheet = new global.CSSStyleSheet();
      sheet.replaceSync(CSS);
      shadow.adoptedStyleSheets = [sheet];
    } catch (e) {
      shadow.appendChild(el("style", null, CSS));
    }
  }

  /**
   * Mounts the widget for `script` (the <script data-widget> element that loaded this file).
   * Returns { host, conversation, open(), close() }.
   */
  function mountWidget(script) {
    var d = script.dataset, id = d.widget;
    var base = new URL("./", script.src);
    var wsUrl = base.href.replace(/^http/, "ws") + "ws?widget=" + encodeURIComponent(id);
    var checkUrl = base.href + "widget/" + encodeURIComponent(id);
    var title = d.title || "Chat with us";
    var accent = d.accent && global.CSS && global.CSS.supports("color", d.accent) ? d.accent : null;

    var host = doc.createElement("llama-relay-widget");
    var shadow = host.attachShadow({ mode: "open" });
    attachStyle(shadow);
    var theme = d.theme === "light" || d.theme === "dark" ? " " + d.theme : "";
    var root = el("div", "root" + (d.position === "bottom-left" ? " left" : "") + theme);
    if (accent) { root.style.setProperty("--accent", accent); }

    var panel = el("section", "panel");
    panel.hidden = true;
    panel.setAttribute("role", "dialog");
    panel.setAttribute("aria-label", title);
    var header = el("header");
    var conn = el("span", "conn", "");
    conn.setAttribute("role", "status");
    var newChat = el("button", "new", "New chat");
    newChat.type = "button";
    var close = el("button", "close", "×");
    close.type = "button";
    close.setAttribute("aria-label", "Close chat");
    header.appendChild(el("span", "title", title));
    header.appendChild(conn);
    header.appendChild(newChat);
    header.appendChild(close);
    var log = el("div", "log");
    log.setAttribute("role", "log");
    log.setAttribute("aria-label", "Conversation");
    var live = el("div", "sr-only");
    live.setAttribute("aria-live", "polite");
    var form = el("form");
    var label = el("label", "sr-only", "Message");
    label.htmlFor = "lr-input";
    var input = el("textarea");
    input.id = "lr-input";
    input.rows = 2;
    input.placeholder = "Type a message…";
    var send = el("button", "send", "Send");
    send.type = "submit";
    var stop = el("button", "stop", "Stop");
    stop.type = "button";
    form.appendChild(label);
    form.appendChild(input);
    form.appendChild(send);
    form.appendChild(stop);
    panel.appendChild(header);
    panel.appendChild(log);
    panel.appendChild(live);
    panel.appendChild(form);

    var launcher = el("button", "launcher");
    launcher.type = "button";
    launcher.setAttribute("aria-label", "Open chat: " + title);
    launcher.setAttribute("aria-expanded", "false");
    launcher.setAttribute("aria-haspopup", "dialog");
    var svg = doc.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", "0 0 24 24");
    svg.setAttribute("aria-hidden", "true");
    var path = doc.createElementNS("http://www.w3.org/2000/svg", "path");
    path.setAttribute("d", ICON);
    svg.appendChild(path);
    launcher.appendChild(svg);
    root.appendChild(panel);
    root.appendChild(launcher);
    shadow.appendChild(root);

    var conversation = new Conversation({
      url: wsUrl,
      greeting: d.greeting,
      els: { log: log, live: live, input: input, send: send, stop: stop, conn: conn, newChat: newChat, form: form },
      // Ask first whether this page's origin may use the widget: a refused WebSocket upgrade
      // tells a page nothing, this answer does (and the upgrade is checked again all the same).
      precheck: function () {
        return global.fetch(checkUrl, { mode: "cors", credentials: "omit" }).then(function (r) {
          if (r.ok) { return { ok: true }; }
          return r.json().then(function (j) { return j; }, function () { return {}; }).then(function (j) {
            var fatal = r.status === 403 || r.status === 404;
            return { ok: false, fatal: fatal, message: fatal ? "This chat is not available on this site: " + (j.message || r.status) : "server busy" };
          });
        });
      }
    });

    var api = {
      host: host,
      conversation: conversation,
      open: function () {
        panel.hidden = false;
        launcher.setAttribute("aria-expanded", "true");
        conversation.start();
        input.focus();
      },
      close: function () {
        panel.hidden = true;
        launcher.setAttribute("aria-expanded", "false");
        launcher.focus();
      }
    };
    launcher.addEventListener("click", function () { if (panel.hidden) { api.open(); } else { api.close(); } });
    close.addEventListener("click", api.close);
    panel.addEventListener("keydown", function (ev) { if (ev.key === "Escape") { api.close(); } });

    var attach = function () { doc.body.appendChild(host); };
    if (doc.body) { attach(); } else { doc.addEventListener("DOMContentLoaded", attach); }
    return api;
  }

  var widgets = [];
  global.LlamaRelay = {
    version: "1",
    renderText: renderText,
    Markdown: Markdown,
    Conversation: Conversation,
    mountWidget: mountWidget,
    onToolCall: onToolCall,
    widgets: widgets
  };

  var me = doc.currentScript;
  if (!me || !me.dataset) {
    me = doc.querySelector("script[data-widget][src*='widget.js']");
  }
  if (me && me.dataset && me.dataset.widget) {
    widgets.push(mountWidget(me));
  }
}(window));
