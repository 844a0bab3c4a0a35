// Browser scenarios for the chat page and the embeddable widget, in Debian's chromium driven by
// playwright-core. Started by tests/integration/browser.rs, which runs the relay on the default
// model and a second server for the host page; it passes:
//   RELAY      the relay's base URL, e.g. http://127.0.0.1:41234
//   HOST_PORT  the port of the host-page server (reached as allowed.test and blocked.test)
//   ARTIFACTS  where screenshots go
//   CHROMIUM   the browser binary (default /usr/bin/chromium)
// Run alone: node --test --test-concurrency=1 tests/browser/scenarios.test.mjs (with those set).
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdirSync, readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import path from "node:path";
import { chromium } from "playwright-core";

const RELAY = process.env.RELAY;
const HOST_PORT = process.env.HOST_PORT;
const ARTIFACTS = process.env.ARTIFACTS || "target/browser-artifacts";
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
const WIDGET_JS = fileURLToPath(new URL("../../static/widget.js", import.meta.url));
const AXE_JS = fileURLToPath(new URL("./node_modules/axe-core/axe.min.js", import.meta.url));
const ALLOWED = `http://allowed.test:${HOST_PORT}/`;
const BLOCKED = `http://blocked.test:${HOST_PORT}/`;
/** A reply should start streaming well within this (cold default model on 2 shared cores). */
const REPLY_MS = 60_000;

let browser;

before(async () => {
  assert.ok(RELAY && HOST_PORT, "RELAY and HOST_PORT must be set (run through cargo test)");
  mkdirSync(ARTIFACTS, { recursive: true });
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    args: [
      "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
      // Two origins for the host page, both served on loopback.
      "--host-resolver-rules=MAP allowed.test 127.0.0.1, MAP blocked.test 127.0.0.1",
    ],
  });
});

after(async () => { await browser?.close(); });

async function newPage(viewport = { width: 1100, height: 760 }) {
  const context = await browser.newContext({ viewport });
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(e.message));
  page.on("dialog", (d) => { errors.push("dialog: " + d.message()); d.dismiss(); });
  // The console too: a failed load, a CSP violation or a script's console.error.
  page.on("console", (m) => { if (m.type() === "error") { errors.push("console: " + m.text() + " " + (m.location() || {}).url); } });
  return { page, context, errors };
}

/** Polls `fn` in the page every 15 ms until it returns a truthy value; collects what it saw. */
async function until(page, fn, arg, timeout = REPLY_MS) {
  const handle = await page.waitForFunction(fn, arg, { timeout, polling: 15 });
  return handle.jsonValue();
}

/** Records in the page, from each DOM change under `rootSel` (the element, or its shadow root),
 * every distinct length of the newest `.assistant .body` added after this call: each WebSocket
 * frame is its own task, so the observer sees each delta the page shows however slowly the test
 * polls (`grownLengths` reads them). */
async function recordGrowth(page, rootSel) {
  await page.evaluate((sel) => {
    const host = document.querySelector(sel);
    const root = host.shadowRoot || host;
    const before = new Set(root.querySelectorAll(".assistant .body"));
    const seen = (window.__replyGrowth = []);
    new MutationObserver(() => {
      const fresh = [...root.querySelectorAll(".assistant .body")].filter((b) => !before.has(b));
      const b = fresh[fresh.length - 1];
      if (!b) { return; }
      const n = (b.markdownSource != null ? b.markdownSource : b.textContent).length;
      if (n && seen[seen.length - 1] !== n) { seen.push(n); }
    }).observe(root, { subtree: true, childList: true, characterData: true });
  }, rootSel);
}

async function grownLengths(page) {
  return page.evaluate(() => window.__replyGrowth);
}

/** Watches the text of the last `.assistant .body` under `rootSel` (piercing shadow roots) and
 * records each distinct length until its stats line fills; returns { lengths, stats, text }. */
async function watchReply(page, rootSel, onFirstGrowth) {
  const lengths = [];
  const t0 = Date.now();
  let shot = false;
  for (;;) {
    const s = await page.locator(rootSel).locator(".assistant").last().evaluate((div) => ({
      // The reply's text as it arrived (its body shows it as Markdown).
      text: (b => (b.markdownSource != null ? b.markdownSource : b.textContent))(div.querySelector(".body")),
      stats: (div.querySelector(".stats") || {}).textContent || "",
    }));
    if (s.text.length && lengths[lengths.length - 1] !== s.text.length) { lengths.push(s.text.length); }
    if (!shot && lengths.length >= 3 && onFirstGrowth) { shot = true; await onFirstGrowth(); }
    if (/TTFT|finished|connection lost/.test(s.stats)) { return { lengths, ...s }; }
    assert.ok(Date.now() - t0 < REPLY_MS * 2, `reply did not finish: ${JSON.stringify(s)}`);
    await page.waitForTimeout(10);
  }
}

async function metrics() {
  const text = await (await fetch(RELAY + "/metrics")).text();
  const get = (name) => Number((text.match(new RegExp("^" + name + " (\\S+)$", "m")) || [])[1]);
  return {
    running: get("vllm:num_requests_running"), waiting: get("vllm:num_requests_waiting"),
    used: get("llama_relay_kv_blocks_used"), held: get("llama_relay_kv_blocks_held"),
  };
}

/** Waits until nothing runs and the KV blocks in use are only the held ones (leases, pins). */
async function kvIdle(timeout = 15_000) {
  const t0 = Date.now();
  for (;;) {
    const m = await metrics();
    if (m.running === 0 && m.waiting === 0 && m.used === m.held) { return m; }
    assert.ok(Date.now() - t0 < timeout, `KV pool never idle: ${JSON.stringify(m)}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Runs axe-core in the page (evaluated, so the page's CSP does not stop it) over `include`
 * (selectors; shadow roots are checked, null for the whole page) and fails on any violation of
 * the `impacts` named. */
async function axeCheck(page, what, include, impacts = ["minor", "moderate", "serious", "critical"]) {
  await page.evaluate(readFileSync(AXE_JS, "utf8"));
  const found = await page.evaluate(async (inc) => {
    const r = await window.axe.run(inc ? { include: inc } : document, { resultTypes: ["violations"] });
    return r.violations.map((v) => ({ id: v.id, impact: v.impact, help: v.help,
      nodes: v.nodes.slice(0, 3).map((n) => `${JSON.stringify(n.target)} ${n.failureSummary}`) }));
  }, include || null);
  const bad = found.filter((v) => impacts.includes(v.impact));
  assert.deepEqual(bad, [], `${what}: axe-core found ${JSON.stringify(bad, null, 1)}`);
  return found;
}

const HOSTILE = [
  "<img src=x onerror=\"window.__pwned='img'\">",
  "<script>window.__pwned='script'</script>",
  "<svg onload=\"window.__pwned='svg'\"></svg><b>bold?</b> &amp; &lt;",
];

// ---- Unit tests of the rendering path (the static file alone, no server) ----------------------

test("renderText and the reply path render hostile text inertly", async () => {
  const { page, context, errors } = await newPage();
  await page.setContent("<div id='t'></div><div id='log'></div><div id='live'></div>" +
    "<textarea id='input'></textarea><button id='send'></button><button id='stop'></button><span id='conn'></span>");
  await page.addScriptTag({ path: WIDGET_JS });
  const out = await page.evaluate(async (hostile) => {
    const R = window.LlamaRelay;
    const t = document.getElementById("t");
    const direct = hostile.map((h) => { R.renderText(t, h); return { text: t.textContent, children: t.children.length }; });
    // The reply path: a Conversation over a fake socket, fed frames as the server would send them.
    const sent = [];
    let sock;
    class FakeSocket { constructor(url) { this.url = url; this.readyState = 1; sock = this; } send(m) { sent.push(JSON.parse(m)); } }
    const $ = (id) => document.getElementById(id);
    const c = new R.Conversation({ url: "ws://fake/ws", WebSocket: FakeSocket,
      els: { log: $("log"), live: $("live"), input: $("input"), send: $("send"), stop: $("stop"), conn: $("conn") } });
    c.start();
    await new Promise((r) => setTimeout(r, 0));
    const frame = (f) => sock.onmessage({ data: JSON.stringify(f) });
    frame({ type: "ready", session_id: "s", model: "m", limits: {} });
    $("input").value = hostile[0];
    c.send();
    const id = sent[0].id;
    frame({ type: "started", id, prompt_tokens: 9, cached_tokens: 0 });
    // The hostile reply arrives split across deltas, as tokens do.
    [hostile[1].slice(0, 9), hostile[1].slice(9), hostile[2]].forEach((piece, index) => frame({ type: "delta", id, index, text: piece }));
    frame({ type: "done", id, finish_reason: "length", usage: { prompt_tokens: 9, completion_tokens: 3, cached_tokens: 4 },
      timings: { queue_ms: 1, ttft_ms: 12.4, decode_tokens_per_s: 40 } });
    frame({ type: "error", error_type: "invalid_request", message: hostile[0] });
    await new Promise((r) => setTimeout(r, 200));
    const log = $("log");
    return {
      direct, sent: sent[0], bodies: [...log.querySelectorAll(".body")].map((b) => b.textContent),
      stats: log.querySelector(".stats").textContent, elements: log.querySelectorAll("img,script,svg,b").length,
      pwned: window.__pwned === undefined ? null : window.__pwned,
    };
  }, HOSTILE);
  out.direct.forEach((d, i) => assert.deepEqual(d, { text: HOSTILE[i], children: 0 }));
  assert.deepEqual(out.sent.messages, [{ role: "user", content: HOSTILE[0] }]);
  assert.deepEqual(out.bodies, [HOSTILE[0], HOSTILE[1] + HOSTILE[2], "invalid_request: " + HOSTILE[0]]);
  assert.equal(out.stats, "TTFT 12 ms · 40.0 tok/s · 4 cached tokens · finished: length");
  assert.equal(out.elements, 0);
  assert.equal(out.pwned, null);
  assert.deepEqual(errors, []);
  await context.close();
});

test("Stop sends what was shown, Regenerate and Edit send their frames and undo on an error", async () => {
  const { page, context, errors } = await newPage();
  await page.setContent("<div id='log'></div><div id='live'></div>" +
    "<textarea id='input'></textarea><button id='send'></button><button id='stop'></button><span id='conn'></span>");
  await page.addScriptTag({ path: WIDGET_JS });
  const out = await page.evaluate(async () => {
    const sent = [];
    let sock;
    class FakeSocket { constructor(url) { this.url = url; this.readyState = 1; sock = this; } send(m) { sent.push(JSON.parse(m)); } }
    const $ = (id) => document.getElementById(id);
    const c = new window.LlamaRelay.Conversation({ url: "ws://fake/ws", WebSocket: FakeSocket,
      els: { log: $("log"), live: $("live"), input: $("input"), send: $("send"), stop: $("stop"), conn: $("conn") } });
    c.start();
    await new Promise((r) => setTimeout(r, 0));
    const frame = (f) => sock.onmessage({ data: JSON.stringify(f) });
    const done = (id, reason) => frame({ type: "done", id, finish_reason: reason,
      usage: { prompt_tokens: 9, completion_tokens: 3, cached_tokens: 8 }, timings: { queue_ms: 1, ttft_ms: 5, decode_tokens_per_s: 40 } });
    const bodies = () => [...$("log").querySelectorAll(".body")].map((b) => b.textContent);
    frame({ type: "ready", session_id: "s", model: "m", limits: {} });
    $("input").value = "Tell a story";
    c.send();
    const id1 = sent[0].id;
    ["Once ", "upon ", "a "].forEach((t, i) => frame({ type: "delta", id: id1, index: i, text: t }));
    c.stop();
    // A delta already on its way when Stop was pressed is not shown: the user never saw it.
    frame({ type: "delta", id: id1, index: 3, text: "time" });
    done(id1, "cancelled");
    const afterStop = bodies();
    const buttons = { edit: $("log").querySelectorAll(".user button.edit").length,
      regenerate: $("log").querySelectorAll(".assistant .actions button").length };
    $("log").querySelector(".actions button").click();
    const id2 = sent[2].id;
    frame({ type: "delta", id: id2, index: 0, text: "Another story." });
    done(id2, "stop");
    const afterRegenerate = bodies();
    // A refused regenerate leaves the reply as it was.
    $("log").querySelector(".actions button").click();
    frame({ type: "error", id: sent[3].id, error_type: "overloaded", message: "full" });
    const afterRefusal = bodies();
    $("input").value = "Go on";
    c.send();
    frame({ type: "delta", id: sent[4].id, index: 0, text: "More." });
    done(sent[4].id, "stop");
    const regenerateButtons = $("log").querySelectorAll(".actions button").length;
    $("log").querySelector(".user button.edit").click();
    const editing = $("input").value;
    $("input").value = "Tell a joke";
    c.send();
    const edit = sent[5];
    frame({ type: "delta", id: edit.id, index: 0, text: "A joke." });
    done(edit.id, "stop");
    return { sent, afterStop, buttons, afterRegenerate, afterRefusal, regenerateButtons, editing, afterEdit: bodies() };
  });
  assert.deepEqual(out.sent[1], { type: "cancel", id: out.sent[0].id, heard_index: 2 });
  assert.deepEqual(out.afterStop, ["Tell a story", "Once upon a "]);
  assert.deepEqual(out.buttons, { edit: 1, regenerate: 1 });
  assert.deepEqual(out.sent[2], { type: "regenerate", id: out.sent[2].id });
  assert.deepEqual(out.afterRegenerate, ["Tell a story", "Another story."]);
  assert.deepEqual(out.afterRefusal.slice(0, 2), ["Tell a story", "Another story."]);
  assert.equal(out.regenerateButtons, 1, "only the last reply can be regenerated");
  assert.equal(out.editing, "Tell a story");
  assert.deepEqual(out.sent[5], { type: "edit", id: out.sent[5].id, turn: 0, messages: [{ role: "user", content: "Tell a joke" }] });
  assert.deepEqual(out.afterEdit.filter((b) => !b.startsWith("overloaded")), ["Tell a joke", "A joke."]);
  assert.deepEqual(errors, []);
  await context.close();
});

/** The page's elements and the widget script, with `window.fakeChat()`: a started Conversation
 * over a fake socket, as { c, sent (the frames it sent), frame (feeds it a server frame), $ }. */
async function fakeChatPage(page) {
  await page.setContent("<div id='log'></div><div id='live'></div>" +
    "<textarea id='input'></textarea><button id='send'></button><button id='stop'></button><span id='conn'></span>");
  await page.addScriptTag({ path: WIDGET_JS });
  await page.addScriptTag({ content: `window.fakeChat = async (extra) => {
    const sent = [];
    let sock;
    class FakeSocket { constructor(url) { this.url = url; this.readyState = 1; sock = this; } send(m) { sent.push(JSON.parse(m)); } }
    const $ = (id) => document.getElementById(id);
    const c = new window.LlamaRelay.Conversation({ url: "ws://fake/ws", WebSocket: FakeSocket,
      els: { log: $("log"), live: $("live"), input: $("input"), send: $("send"), stop: $("stop"), conn: $("conn") },
      ...(extra || {}) });
    c.start();
    await new Promise((r) => setTimeout(r, 0));
    return { c, sent, frame: (f) => sock.onmessage({ data: JSON.stringify(f) }), $ };
  };` });
}

test("turns the server dropped lose Edit, leave a restore, and edits keep the server's numbering", async () => {
  const { page, context, errors } = await newPage();
  await fakeChatPage(page);
  const out = await page.evaluate(async () => {
    const { c, sent, frame, $ } = await window.fakeChat();
    const turn = (text, truncated) => {
      $("input").value = text;
      c.send();
      const id = sent[sent.length - 1].id;
      frame({ type: "started", id, prompt_tokens: 9, cached_tokens: 0, truncated });
      frame({ type: "delta", id, index: 0, text: "Re " + text });
      frame({ type: "done", id, finish_reason: "stop", seal: "ab".repeat(32),
        usage: { prompt_tokens: 9, completion_tokens: 1, cached_tokens: 0 }, timings: { queue_ms: 1, ttft_ms: 5, decode_tokens_per_s: 40 } });
    };
    frame({ type: "ready", session_id: "s", model: "m", limits: {} });
    ["a", "b", "c"].forEach((t) => turn(t));
    turn("d", { dropped_turns: 2, first_kept_turn: 2 });
    const users = [...$("log").querySelectorAll(".user")];
    const marks = users.map((u) => ({ dropped: u.classList.contains("dropped"), edit: !!u.querySelector("button.edit") }));
    // Editing a kept turn names it as the server numbers it (from the session's first turn).
    users[2].querySelector("button.edit").click();
    $("input").value = "c2";
    c.send();
    const edit = sent[sent.length - 1];
    frame({ type: "done", id: edit.id, finish_reason: "stop", seal: "cd".repeat(32),
      usage: { prompt_tokens: 9, completion_tokens: 0, cached_tokens: 0 }, timings: {} });
    // The session is lost: the restore carries the kept turns only; the new session numbers
    // them from 0.
    c.lostSession();
    const restore = sent[sent.length - 1];
    frame({ type: "restored", messages: restore.messages.length });
    const kept = [...$("log").querySelectorAll(".user")].filter((u) => u.querySelector("button.edit"));
    kept[kept.length - 1].querySelector("button.edit").click();
    $("input").value = "again";
    c.send();
    return { marks, edit, restore, after: sent[sent.length - 1] };
  });
  assert.deepEqual(out.marks, [
    { dropped: true, edit: false }, { dropped: true, edit: false },
    { dropped: false, edit: true }, { dropped: false, edit: true }]);
  assert.equal(out.edit.type, "edit");
  assert.equal(out.edit.turn, 2);
  assert.deepEqual(out.restore.messages.map((m) => m.content), ["c2", ""]);
  assert.equal(out.after.type, "edit");
  assert.equal(out.after.turn, 0);
  assert.deepEqual(errors, []);
  await context.close();
});

test("page settings reach the frames: params every turn, the system prompt with the first and in restores; a bad setting sends nothing", async () => {
  const { page, context, errors } = await newPage();
  await fakeChatPage(page);
  const out = await page.evaluate(async () => {
    let params = { temperature: 0.3, max_tokens: 12 };
    const changes = [];
    const { c, sent, frame, $ } = await window.fakeChat({
      params: () => { if (!params) { throw new Error("Temperature must be a number from 0 to 2."); } return params; },
      system: () => "Answer in French.",
      onChange: (why) => changes.push(why),
    });
    const answer = (id, text) => {
      frame({ type: "delta", id, index: 0, text });
      frame({ type: "done", id, finish_reason: "stop", seal: text.length.toString(16).padStart(64, "0"),
        usage: { prompt_tokens: 9, completion_tokens: 1, cached_tokens: 0 }, timings: {} });
    };
    frame({ type: "ready", session_id: "s", model: "m", limits: {}, roles: ["system", "user", "assistant"], resume_token: "t1" });
    $("input").value = "Bonjour";
    c.send();
    const first = sent[sent.length - 1];
    answer(first.id, "Salut");
    $("input").value = "Encore";
    c.send();
    const second = sent[sent.length - 1];
    answer(second.id, "Oui");
    params = null;
    $("input").value = "Trop chaud";
    const refused = c.send();
    const count = sent.length;
    const error = $("log").querySelector(".error .body").textContent;
    const input = $("input").value;
    c.regenerate();
    const afterRegenerate = sent.length;
    params = { max_tokens: 5 };
    c.regenerate();
    const regenerate = sent[sent.length - 1];
    answer(regenerate.id, "Oui oui");
    c.lostSession();
    const restore = sent[sent.length - 1];
    return { first, second, refused, count, afterRegenerate, error, input, regenerate, restore, saved: c.saved(), changes };
  });
  assert.deepEqual(out.first.messages, [{ role: "system", content: "Answer in French." }, { role: "user", content: "Bonjour" }]);
  assert.deepEqual(out.first.params, { temperature: 0.3, max_tokens: 12 });
  assert.deepEqual(out.second.messages, [{ role: "user", content: "Encore" }]);
  assert.deepEqual(out.second.params, { temperature: 0.3, max_tokens: 12 });
  // Out of range: an error on screen naming the setting, the question kept, nothing sent.
  assert.equal(out.refused, false);
  assert.match(out.error, /^Temperature must be/);
  assert.equal(out.input, "Trop chaud");
  assert.equal(out.afterRegenerate, out.count);
  assert.deepEqual(out.regenerate, { type: "regenerate", id: out.regenerate.id, params: { max_tokens: 5 } });
  // The system prompt leads the restore of a lost session; the regenerated reply replaced the last.
  assert.deepEqual(out.restore.messages.map((m) => [m.role, m.content]), [
    ["system", "Answer in French."], ["user", "Bonjour"], ["assistant", "Salut"], ["user", "Encore"], ["assistant", "Oui oui"]]);
  assert.deepEqual(out.saved, { system: "Answer in French.", firstKept: 0, sessionBase: 0, turns: [
    { user: "Bonjour", reply: "Salut", seal: "5".padStart(64, "0"), calls: 0 },
    { user: "Encore", reply: "Oui oui", seal: "7".padStart(64, "0"), calls: 0 }] });
  assert.deepEqual(out.changes, ["ready", "send", "turn", "send", "turn", "send", "turn"]);
  assert.deepEqual(errors, []);
  await context.close();
});

test("a saved conversation loads with Edit and Regenerate, by a reset and restore or by resuming its session", async () => {
  const { page, context, errors } = await newPage();
  await fakeChatPage(page);
  const out = await page.evaluate(async () => {
    const { c, sent, frame, $ } = await window.fakeChat();
    const saved = { system: "Sys", firstKept: 1, sessionBase: 0, turns: [
      { user: "a", reply: "**A**", seal: "1".repeat(64), calls: 0 },
      { user: "b", reply: "B", seal: "2".repeat(64), calls: 0 }] };
    frame({ type: "ready", session_id: "s", model: "m", limits: {}, resume_token: "t1" });
    c.load(saved, null);
    const reset = sent[sent.length - 2], restore = sent[sent.length - 1];
    frame({ type: "restored", messages: 3 });
    const users = [...$("log").querySelectorAll(".user")];
    const shown = {
      users: users.map((u) => [u.querySelector(".body").textContent, u.classList.contains("dropped"), !!u.querySelector("button.edit")]),
      strong: $("log").querySelector(".assistant .body strong").textContent,
      regenerate: $("log").querySelectorAll(".assistant")[1].querySelector("button.regenerate") !== null,
    };
    users[1].querySelector("button.edit").click();
    $("input").value = "b2";
    c.send();
    const edit = sent[sent.length - 1];
    frame({ type: "done", id: edit.id, finish_reason: "stop", seal: "3".repeat(64), usage: {}, timings: {} });
    // Loaded with the token of the session that holds it: nothing is restored, and the next
    // connection's `ready` resumes that session.
    const before = sent.length;
    c.load(saved, "t-saved");
    const quiet = sent.slice(before);
    frame({ type: "ready", session_id: "s2", model: "m", limits: {}, resume_token: "t2" });
    return { reset, restore, shown, edit, quiet, resume: sent[sent.length - 1], turns: $("log").querySelectorAll(".user").length };
  });
  assert.deepEqual(out.reset, { type: "reset" });
  assert.deepEqual(out.restore.messages, [{ role: "system", content: "Sys" }, { role: "user", content: "b" },
    { role: "assistant", content: "B", seal: "2".repeat(64) }]);
  assert.deepEqual(out.shown, { users: [["a", true, false], ["b", false, true]], strong: "A", regenerate: true });
  assert.equal(out.edit.type, "edit");
  assert.equal(out.edit.turn, 0, "the restored session numbers from its first turn");
  assert.deepEqual(out.quiet, []);
  assert.deepEqual(out.resume, { type: "resume", token: "t-saved" });
  assert.equal(out.turns, 2);
  assert.deepEqual(errors, []);
  await context.close();
});

test("replies render as Markdown from elements: structure, safe links, code blocks with Copy", async () => {
  const { page, context, errors } = await newPage();
  await fakeChatPage(page);
  const out = await page.evaluate(async () => {
    const copied = [];
    Object.defineProperty(navigator, "clipboard", { value: { writeText: (t) => { copied.push(t); return Promise.resolve(); } } });
    const box = document.createElement("div");
    document.body.appendChild(box);
    const md = new window.LlamaRelay.Markdown(box);
    md.set([
      "## Your order",
      "It **shipped** on *Monday*; track it [here](https://track.example/1?a=b) or [mail us](mailto:help@example.com).",
      "",
      "Not a link: [click](javascript:alert(1)) and [data](data:text/html,<b>x</b>); snake_case_name stays.",
      "",
      "- first",
      "  - nested `code`",
      "- second",
      "3. three",
      "",
      "> quoted **text**",
      "",
      "| item | qty |",
      "|---|---:|",
      "| <img src=x onerror=\"window.__pwned=1\"> | 2 |",
      "",
      "```js",
      "const x = \"<script>window.__pwned=2</script>\";",
      "```",
    ].join("\n"));
    box.querySelector(".md-copy").click();
    await new Promise((r) => setTimeout(r, 0));
    const links = [...box.querySelectorAll("a")].map((a) => ({ href: a.getAttribute("href"), rel: a.rel, target: a.target, text: a.textContent }));
    return {
      tags: [...box.children].map((e) => e.tagName.toLowerCase() + (e.className ? "." + e.className : "")),
      strong: box.querySelector("p strong").textContent, em: box.querySelector("p em").textContent,
      links, paragraph2: box.querySelectorAll("p")[1].textContent,
      nested: box.querySelectorAll("ul ul li").length, items: box.querySelectorAll("li").length,
      quote: box.querySelector("blockquote strong").textContent,
      cells: [...box.querySelectorAll("td")].map((td) => td.textContent),
      lang: box.querySelector(".md-lang").textContent, code: box.querySelector("pre code").textContent,
      copied, dangerous: box.querySelectorAll("img,script,iframe,svg,object").length,
      pwned: window.__pwned === undefined ? null : window.__pwned, source: box.markdownSource.length,
    };
  });
  assert.deepEqual(out.tags, ["h4.md-h", "p", "p", "ul", "ol", "blockquote", "div.md-table", "div.md-code"]);
  assert.equal(out.strong, "shipped");
  assert.equal(out.em, "Monday");
  assert.deepEqual(out.links, [
    { href: "https://track.example/1?a=b", rel: "noopener noreferrer", target: "_blank", text: "here" },
    { href: "mailto:help@example.com", rel: "noopener noreferrer", target: "_blank", text: "mail us" }]);
  assert.equal(out.paragraph2, "Not a link: [click](javascript:alert(1)) and [data](data:text/html,<b>x</b>); snake_case_name stays.");
  assert.equal(out.nested, 1);
  assert.equal(out.items, 4);
  assert.equal(out.quote, "text");
  assert.deepEqual(out.cells, ["<img src=x onerror=\"window.__pwned=1\">", "2"]);
  assert.equal(out.lang, "js");
  assert.equal(out.code, "const x = \"<script>window.__pwned=2</script>\";");
  assert.deepEqual(out.copied, [out.code]);
  assert.equal(out.dangerous, 0);
  assert.equal(out.pwned, null);
  assert.deepEqual(errors, []);
  await context.close();
});

test("Markdown streams incrementally: finished blocks are kept, an open fence shows as code, hostile sizes stay bounded", async () => {
  const { page, context, errors } = await newPage();
  await fakeChatPage(page);
  const out = await page.evaluate(async () => {
    const { c, sent, frame, $ } = await window.fakeChat();
    frame({ type: "ready", session_id: "s", model: "m", limits: {} });
    $("input").value = "Show me";
    c.send();
    const id = sent[0].id;
    const reply = "Here is the **plan**.\n\n```python\nprint('a')\nprint('b')\n```\n\nDone.";
    const body = () => $("log").querySelector(".assistant .body");
    let firstP = null, kept = true, openFence = null;
    for (let i = 0; i < reply.length; i++) {
      frame({ type: "delta", id, index: i, text: reply[i] });
      const p = body().firstElementChild;
      if (i > reply.indexOf("\n\n")) {
        if (!firstP) { firstP = p; } else if (p !== firstP) { kept = false; }
      }
      if (i === reply.indexOf("print('b')") + 4 && !openFence) {
        openFence = { tag: body().children[1].className, code: body().querySelector("pre code").textContent };
      }
    }
    frame({ type: "done", id, finish_reason: "stop", seal: "ab".repeat(32),
      usage: { prompt_tokens: 9, completion_tokens: 3, cached_tokens: 0 }, timings: { queue_ms: 1, ttft_ms: 5, decode_tokens_per_s: 40 } });
    const done = [...body().children].map((e) => e.tagName.toLowerCase());
    // Hostile sizes: a 2,000-row table of 100 columns and a list nested 300 deep.
    const box = document.createElement("div");
    document.body.appendChild(box);
    const md = new window.LlamaRelay.Markdown(box);
    const row = "|" + Array.from({ length: 100 }, (_, k) => "c" + k).join("|") + "|";
    md.set([row, "|" + "---|".repeat(100), ...Array.from({ length: 2000 }, () => row)].join("\n"));
    const columns = box.querySelector("tr").children.length, rows = box.querySelectorAll("tr").length;
    md.set(Array.from({ length: 300 }, (_, k) => " ".repeat(k * 2) + "- level " + k).join("\n"));
    let depth = 0;
    for (let e = box.querySelector("ul"); e; e = e.querySelector("ul")) { depth++; }
    return { kept, openFence, done, columns, rows, depth, items: box.querySelectorAll("li").length };
  });
  assert.ok(out.kept, "the first paragraph's node is kept while later blocks stream");
  assert.deepEqual(out.openFence, { tag: "md-code", code: "print('a')\nprint" });
  assert.deepEqual(out.done, ["p", "div", "p"]);
  assert.equal(out.columns, 32);
  assert.equal(out.rows, 2001);
  assert.equal(out.depth, 6);
  assert.equal(out.items, 300);
  assert.deepEqual(errors, []);
  await context.close();
});

// ---- The chat page on the real server --------------------------------------------------------

test("chat page streams a reply with TTFT and tok/s, and a second turn hits the cache", async () => {
  const { page, context, errors } = await newPage();
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await page.locator("#input").fill("Tell me three facts about the Moon.");
  await recordGrowth(page, "#log");
  await page.locator("#input").press("Enter");
  const first = await watchReply(page, "#log", () => page.screenshot({ path: path.join(ARTIFACTS, "chat-midstream.png") }));
  const grown = await grownLengths(page);
  assert.ok(grown.length >= 3, `text grew over several frames: ${grown}`);
  assert.equal(grown[grown.length - 1], first.text.length, "the last frame shows the whole reply");
  assert.match(first.stats, /^TTFT \d+ ms · \d+\.\d tok\/s · \d+ cached tokens/);
  await page.locator("#input").fill("And one about the Sun?");
  await page.keyboard.press("Enter");
  const second = await watchReply(page, "#log");
  assert.ok(second.text.length > 0, "second reply");
  const cached = Number(second.stats.match(/(\d+) cached tokens/)[1]);
  assert.ok(cached > 0, `turn two reuses turn one's KV: ${second.stats}`);
  assert.equal(await page.locator("#log .user").count(), 2);
  await page.screenshot({ path: path.join(ARTIFACTS, "chat.png") });
  assert.deepEqual(errors, []);
  await context.close();
});

test("typing then sending shows cached tokens for the new message (type-ahead drafts)", async () => {
  const text = "I would like to know how the tides work, why there are two of them every day, and what the moon has to do with it.";
  const cachedOf = (stats) => Number(stats.match(/(\d+) cached tokens/)[1]);
  // Pasted and sent at once: no draft goes out, little of the prompt is cached.
  const { page, context, errors } = await newPage();
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await page.locator("#input").fill(text);
  await page.locator("#input").press("Enter");
  const pasted = await watchReply(page, "#log");
  await context.close();
  // Typed: drafts go out while the user types; the reply starts from what they computed.
  const typed = await newPage();
  const drafts = [];
  typed.page.on("websocket", (ws) => ws.on("framesent", (f) => {
    if (String(f.payload).includes('"draft"')) { drafts.push(JSON.parse(f.payload).text); }
  }));
  await typed.page.goto(RELAY + "/");
  await typed.page.locator("#conn", { hasText: "connected" }).waitFor();
  await typed.page.locator("#input").pressSequentially(text, { delay: 15 });
  await typed.page.waitForTimeout(1_500);
  await typed.page.locator("#input").press("Enter");
  const reply = await watchReply(typed.page, "#log");
  assert.ok(drafts.length >= 2 && drafts[drafts.length - 1] === text, `drafts sent: ${JSON.stringify(drafts)}`);
  assert.ok(cachedOf(reply.stats) > cachedOf(pasted.stats) + 20,
    `typed: ${reply.stats}; pasted: ${pasted.stats}`);
  console.log(`# cached tokens: typed ${cachedOf(reply.stats)}, pasted ${cachedOf(pasted.stats)}`);
  assert.deepEqual(errors, []);
  assert.deepEqual(typed.errors, []);
  await typed.context.close();
});

test("Stop ends the reply at once and the KV pool returns to idle", async () => {
  const { page, context, errors } = await newPage();
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await page.locator("#input").fill("Write a long story about a lighthouse keeper and a storm.");
  await page.locator("#send").click();
  await until(page, () => (document.querySelector("#log .assistant:last-child .body") || {}).textContent?.length > 0);
  const t0 = Date.now();
  await page.locator("#stop").click();
  await page.locator("#log .assistant .stats", { hasText: "finished: cancelled" }).waitFor({ timeout: 5_000 });
  const stopMs = Date.now() - t0;
  assert.ok(await page.locator("#send").isEnabled(), "send enabled again");
  await kvIdle();
  await context.close();
  // The socket is gone too: the session's lease ends after its grace, and the pool is idle again.
  await kvIdle();
  assert.deepEqual(errors, []);
  console.log(`# stop to cancelled: ${stopMs} ms`);
});

test("after Stop the next question follows the shown text; Regenerate and Edit on the page", async () => {
  const { page, context, errors } = await newPage();
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await page.locator("#input").fill("Write a long story about a lighthouse keeper and a storm.");
  await page.locator("#send").click();
  await until(page, () => (document.querySelector("#log .assistant:last-child .body") || {}).textContent?.length > 40);
  await page.locator("#stop").click();
  await page.locator("#log .assistant .stats", { hasText: "finished: cancelled" }).waitFor({ timeout: 5_000 });
  const shown = await page.locator("#log .assistant .body").first().textContent();
  await page.waitForTimeout(300);
  assert.equal(await page.locator("#log .assistant .body").first().textContent(), shown, "nothing more shown after Stop");
  await page.locator("#input").fill("What happened next?");
  await page.keyboard.press("Enter");
  const next = await watchReply(page, "#log");
  const cachedNext = Number(next.stats.match(/(\d+) cached tokens/)[1]);
  assert.ok(cachedNext > 0, `the next turn reuses the heard turn: ${next.stats}`);
  // Regenerate the last reply: the same prompt, all but its last token from the KV.
  await page.locator("#log .assistant .actions button").click();
  const again = await watchReply(page, "#log");
  assert.ok(again.text.length > 0, "a regenerated reply");
  assert.ok(Number(again.stats.match(/(\d+) cached tokens/)[1]) >= cachedNext, again.stats);
  assert.equal(await page.locator("#log .user").count(), 2);
  // Edit the first message: it and everything after it are replaced.
  await page.locator("#log .user button.edit").first().click();
  assert.equal(await page.locator("#input").inputValue(), "Write a long story about a lighthouse keeper and a storm.");
  await page.locator("#input").fill("Write a haiku about the sea.");
  await page.keyboard.press("Enter");
  const edited = await watchReply(page, "#log");
  assert.ok(edited.text.length > 0, "a reply to the edited message");
  assert.deepEqual(await page.locator("#log .user .body").allTextContents(), ["Write a haiku about the sea."]);
  assert.equal(await page.locator("#log .assistant").count(), 1);
  await page.screenshot({ path: path.join(ARTIFACTS, "chat-edit.png") });
  assert.deepEqual(errors, []);
  await context.close();
});

// Records, on every socket the page opens: its URL (`__urls`), each JSON frame it receives
// (`__in`) and sends (`__out`).
async function captureSockets(page) {
  await page.addInitScript(() => {
    const Real = window.WebSocket;
    window.__urls = [];
    window.__in = [];
    window.__out = [];
    window.WebSocket = function (url, protocols) {
      window.__urls.push(String(url));
      const ws = protocols ? new Real(url, protocols) : new Real(url);
      ws.addEventListener("message", (ev) => { try { window.__in.push(JSON.parse(ev.data)); } catch (e) { /* not JSON */ } });
      const send = ws.send.bind(ws);
      ws.send = (data) => { try { window.__out.push(JSON.parse(data)); } catch (e) { /* not JSON */ } send(data); };
      return ws;
    };
    window.WebSocket.prototype = Real.prototype;
  });
}

test("a socket killed mid-reply resumes: the page finishes the same reply without loss or duplicates", async () => {
  const { page, context, errors } = await newPage();
  await captureSockets(page);
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await page.locator("#input").fill("Write a long story about a lighthouse keeper and a storm.");
  await page.locator("#send").click();
  await until(page, () => (document.querySelector("#log .assistant:last-child .body") || {}).textContent?.length > 40);
  await page.evaluate(() => window.llamaRelayChat.ws.close());
  const reply = await watchReply(page, "#log");
  assert.match(reply.stats, /^TTFT/, `the reply finished after the resume: ${reply.stats}`);
  const frames = await page.evaluate(() => window.__in);
  const readies = frames.filter((f) => f.type === "ready");
  assert.equal(readies.length, 3, "ready, ready on the new socket, ready resumed");
  assert.equal(readies[2].resumed, true);
  const deltas = frames.filter((f) => f.type === "delta");
  assert.deepEqual(deltas.map((d) => d.index), deltas.map((_, i) => i), "every index once, in order");
  assert.equal(deltas.map((d) => d.text).join(""), reply.text);
  assert.equal(frames.filter((f) => f.type === "done").length, 1);
  // Both sockets named the same conversation (a load balancer's routing key), and so does the
  // page after a reload in the same tab.
  const conversation = (u) => new URL(u).searchParams.get("conversation");
  const urls = await page.evaluate(() => window.__urls);
  assert.equal(urls.length, 2, urls.join(" "));
  assert.match(conversation(urls[0]), /^[0-9a-f]{32}$/);
  assert.equal(conversation(urls[1]), conversation(urls[0]));
  await page.reload();
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  const after = await page.evaluate(() => window.__urls);
  assert.equal(conversation(after[0]), conversation(urls[0]), "kept in sessionStorage");
  assert.deepEqual(errors, []);
  await context.close();
});

test("a session lost with its replica: the page restores the conversation and asks the interrupted question again", async () => {
  const { page, context, errors } = await newPage();
  await captureSockets(page);
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await page.locator("#input").fill("My name is Ada. Please remember it.");
  await page.locator("#send").click();
  const first = await watchReply(page, "#log");
  assert.match(first.stats, /^TTFT/);
  await page.locator("#input").fill("Write a long story about a lighthouse keeper and a storm.");
  await page.locator("#send").click();
  await until(page, () => (document.querySelector("#log .assistant:last-child .body") || {}).textContent?.length > 40);
  // As if the replica went away: the next connection finds no session to resume.
  await page.evaluate(() => { window.llamaRelayChat.resumeToken = "gone-with-its-replica"; window.llamaRelayChat.ws.close(); });
  const second = await watchReply(page, "#log");
  assert.match(second.stats, /^TTFT/, `the interrupted question was answered again: ${second.stats}`);
  const [sent, got] = await page.evaluate(() => [window.__out, window.__in]);
  const restore = sent.find((f) => f.type === "restore");
  assert.ok(restore, "a restore was sent");
  assert.deepEqual(restore.messages.map((m) => m.role), ["user", "assistant"]);
  assert.equal(restore.messages[0].content, "My name is Ada. Please remember it.");
  assert.equal(restore.messages[1].content, first.text);
  assert.match(restore.messages[1].seal, /^[0-9a-f]{64}$/);
  assert.ok(got.some((f) => f.type === "restored" && f.messages === 2));
  // The question asked again carried the restored turn: its prompt holds the first turn's
  // prompt and reply.
  const dones = got.filter((f) => f.type === "done");
  const firstUsage = dones[0].usage, lastUsage = dones[dones.length - 1].usage;
  assert.ok(lastUsage.prompt_tokens > firstUsage.prompt_tokens + firstUsage.completion_tokens,
    `${JSON.stringify(firstUsage)} then ${JSON.stringify(lastUsage)}`);
  assert.equal(await page.locator("#log .msg.error").count(), 0);
  assert.deepEqual(errors, []);
  await context.close();
});

/** Waits until the conversations the page keeps in IndexedDB ([{ title, turns }]) satisfy
 * `want` (its writes commit a moment after the screen changes). */
async function savedUntil(page, want, timeout = 5_000) {
  for (const t0 = Date.now(); ;) {
    const saved = await page.evaluate(() => new Promise((resolve, reject) => {
      const open = indexedDB.open("llama-relay");
      open.onerror = () => reject(open.error);
      open.onsuccess = () => {
        const all = open.result.transaction("conversations").objectStore("conversations").getAll();
        all.onsuccess = () => {
          open.result.close();
          resolve(all.result.map((r) => ({ title: r.title, turns: r.turns.length })));
        };
      };
    }));
    if (want(saved)) { return saved; }
    assert.ok(Date.now() - t0 < timeout, `saved conversations: ${JSON.stringify(saved)}`);
    await page.waitForTimeout(20);
  }
}

test("history survives a reload and reopens with the server's prompt cache hit; settings apply; rename, export, delete", async () => {
  const { page, context, errors } = await newPage();
  await captureSockets(page);
  const cachedOf = (stats) => Number(stats.match(/(\d+) cached tokens/)[1]);
  const ask = async (text) => {
    await page.locator("#input").fill(text);
    await page.locator("#input").press("Enter");
    return watchReply(page, "#log");
  };
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  // Settings for this conversation: short greedy replies and a system prompt (an anonymous
  // client of the page may send one).
  await page.locator("#settings summary").click();
  await page.locator("#temperature").fill("0");
  await page.locator("#max-tokens").fill("12");
  await page.locator("#system").fill("You are a terse assistant.");
  const a1 = await ask("My name is Ada.");
  await ask("What is my name?");
  const chats = (await page.evaluate(() => window.__out)).filter((f) => f.type === "chat");
  assert.deepEqual(chats[0].messages, [{ role: "system", content: "You are a terse assistant." }, { role: "user", content: "My name is Ada." }]);
  assert.deepEqual(chats[0].params, { temperature: 0, max_tokens: 12 });
  assert.deepEqual(chats[1].messages, [{ role: "user", content: "What is my name?" }]);
  const dones = (await page.evaluate(() => window.__in)).filter((f) => f.type === "done");
  assert.ok(dones.every((d) => d.usage.completion_tokens <= 12), JSON.stringify(dones.map((d) => d.usage)));
  assert.equal(await page.locator("#system").isDisabled(), true, "the system prompt is set once the conversation starts");
  assert.deepEqual(await page.locator("#history-list li .open").allTextContents(), ["My name is Ada."]);
  const shownBefore = await page.evaluate(() => [...document.querySelectorAll("#log .assistant .body")].map((b) => b.markdownSource));

  // A reload shows the conversation again and resumes the session that holds it: the next
  // turn's prompt is cached up to the new question.
  await savedUntil(page, (r) => r.length === 1 && r[0].turns === 2);
  await page.reload();
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await until(page, () => document.querySelectorAll("#log .user").length === 2 && window.__in.some((f) => f.type === "ready" && f.resumed));
  assert.deepEqual(await page.evaluate(() => [...document.querySelectorAll("#log .assistant .body")].map((b) => b.markdownSource)), shownBefore);
  assert.equal(shownBefore[0], a1.text);
  assert.equal(await page.locator("#max-tokens").inputValue(), "12");
  assert.equal(await page.locator("#system").inputValue(), "You are a terse assistant.");
  const a3 = await ask("And my name again?");
  const prior = dones[1].usage.prompt_tokens + dones[1].usage.completion_tokens;
  assert.ok(cachedOf(a3.stats) >= prior - 2, `resumed: ${a3.stats}; the last turn held ${prior} tokens`);
  assert.equal((await page.evaluate(() => window.__out)).filter((f) => f.type === "restore").length, 0);

  // A second conversation, then the first reopened from the panel: its transcript is restored
  // on this session, whose cache still holds it.
  await page.locator("#new-chat").click();
  assert.equal(await page.locator("#system").isDisabled(), false);
  await ask("Hello there.");
  assert.deepEqual(await page.locator("#history-list li .open").allTextContents(), ["Hello there.", "My name is Ada."]);
  await page.locator("#history-list li .open", { hasText: "My name is Ada." }).click();
  await until(page, () => document.querySelectorAll("#log .user").length === 3 && window.__in.some((f) => f.type === "restored"));
  const restore = (await page.evaluate(() => window.__out)).filter((f) => f.type === "restore").pop();
  assert.deepEqual(restore.messages.map((m) => m.role), ["system", "user", "assistant", "user", "assistant", "user", "assistant"]);
  const a4 = await ask("Thanks, bye.");
  const last = (await page.evaluate(() => window.__in)).filter((f) => f.type === "done").pop().usage;
  assert.ok(cachedOf(a4.stats) > last.prompt_tokens / 2, `reopened: ${a4.stats} of ${last.prompt_tokens}`);
  assert.equal(await page.locator("#history-list li.current .open").textContent(), "My name is Ada.");

  // Renamed, exported as Markdown and JSON.
  await page.locator("#history-list li.current .rename").click();
  await page.locator("#history-list li input").fill("Ada's chat");
  await page.locator("#history-list li input").press("Enter");
  assert.equal(await page.locator("#history-list li.current .open").textContent(), "Ada's chat");
  const exported = async (sel) => {
    const [d] = await Promise.all([page.waitForEvent("download"), page.locator(sel).click()]);
    return { name: d.suggestedFilename(), text: readFileSync(await d.path(), "utf8") };
  };
  const md = await exported("#export-md");
  assert.equal(md.name, "ada-s-chat.md");
  assert.match(md.text, /^# Ada's chat\n/);
  assert.ok(md.text.includes("## System\n\nYou are a terse assistant.\n"), md.text);
  assert.ok(md.text.includes("## You\n\nMy name is Ada.\n\n## Assistant\n\n" + a1.text + "\n"), md.text);
  const json = await exported("#export-json");
  assert.equal(json.name, "ada-s-chat.json");
  const doc = JSON.parse(json.text);
  assert.equal(doc.title, "Ada's chat");
  assert.deepEqual(doc.messages.map((m) => m.role), ["system", ...Array(4).fill(["user", "assistant"]).flat()]);
  assert.equal(doc.messages[8].content, a4.text);
  assert.equal(doc.settings.max_tokens, "12");

  // Deleted: gone from the panel, and (once IndexedDB has committed it) after a reload too.
  await page.locator("#history-list li", { hasText: "Hello there." }).locator(".delete").click();
  assert.deepEqual(await page.locator("#history-list li .open").allTextContents(), ["Ada's chat"]);
  await savedUntil(page, (r) => r.length === 1 && r[0].title === "Ada's chat");
  await page.reload();
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await until(page, () => document.querySelectorAll("#log .user").length === 4);
  assert.deepEqual(await page.locator("#history-list li .open").allTextContents(), ["Ada's chat"]);
  await page.screenshot({ path: path.join(ARTIFACTS, "chat-history.png") });
  assert.deepEqual(errors, []);
  await context.close();
  await kvIdle();
});

test("hostile user text shows as characters on the chat page", async () => {
  const { page, context, errors } = await newPage();
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await page.locator("#input").fill(HOSTILE[0]);
  await page.locator("#input").press("Enter");
  await watchReply(page, "#log");
  assert.equal(await page.locator("#log .user .body").textContent(), HOSTILE[0]);
  assert.equal(await page.locator("#log img").count(), 0);
  assert.equal(await page.evaluate(() => window.__pwned), undefined);
  assert.deepEqual(errors, []);
  await context.close();
});

test("an Enter that commits an IME composition does not send; a plain Enter does", async () => {
  const { page, context, errors } = await newPage();
  await captureSockets(page);
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  await page.locator("#input").fill("안녕하세요");
  // Chromium's and Firefox's committing Enter (isComposing), then Safari's (keyCode 229).
  await page.locator("#input").evaluate((el) => {
    el.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", isComposing: true, bubbles: true, cancelable: true }));
    el.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", keyCode: 229, bubbles: true, cancelable: true }));
  });
  await page.waitForTimeout(300);
  assert.equal(await page.locator("#log .user").count(), 0, "nothing sent while composing");
  assert.equal(await page.locator("#input").inputValue(), "안녕하세요");
  assert.equal((await page.evaluate(() => window.__out)).filter((f) => f.type === "chat").length, 0);
  await page.locator("#input").press("Enter");
  await watchReply(page, "#log");
  assert.equal(await page.locator("#log .user .body").textContent(), "안녕하세요");
  assert.deepEqual(errors, []);
  await context.close();
  await kvIdle();
});

test("chat page fits a phone-sized screen", async () => {
  const { page, context } = await newPage({ width: 390, height: 844 });
  await page.goto(RELAY + "/");
  await page.locator("#conn", { hasText: "connected" }).waitFor();
  const fit = await page.evaluate(() => {
    const r = (id) => document.getElementById(id).getBoundingClientRect();
    const inside = (b) => b.left >= 0 && b.right <= innerWidth && b.bottom <= innerHeight && b.width > 0;
    return { overflow: document.documentElement.scrollWidth - innerWidth, input: inside(r("input")),
      send: inside(r("send")), stop: inside(r("stop")), newChat: inside(r("new-chat")) };
  });
  assert.deepEqual(fit, { overflow: 0, input: true, send: true, stop: true, newChat: true });
  await page.screenshot({ path: path.join(ARTIFACTS, "chat-phone.png") });
  // The history panel starts closed on a phone; the keyboard opens it over the conversation,
  // inside the screen, and Escape closes it, focus back on its button.
  const toggle = page.locator("#history-toggle");
  assert.equal(await page.locator("#history").isVisible(), false);
  await toggle.focus();
  await page.keyboard.press("Enter");
  assert.equal(await toggle.getAttribute("aria-expanded"), "true");
  const panel = await page.locator("#history").boundingBox();
  assert.ok(panel && panel.x >= 0 && panel.x + panel.width <= 390, JSON.stringify(panel));
  await page.keyboard.press("Escape");
  assert.equal(await page.locator("#history").isVisible(), false);
  assert.equal(await page.evaluate(() => document.activeElement.id), "history-toggle");
  await context.close();
});

/** WCAG contrast ratio of two computed `rgb(...)` colours. */
function contrast(a, b) {
  const lum = (c) => {
    const [r, g, bl] = c.match(/\d+(\.\d+)?/g).slice(0, 3).map((v) => {
      const s = Number(v) / 255;
      return s <= 0.03928 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * bl;
  };
  const [hi, lo] = [lum(a), lum(b)].sort((x, y) => y - x);
  return (hi + 0.05) / (lo + 0.05);
}

test("the chat page follows the system's light or dark theme, readable in both, with its favicon and no failed request", async () => {
  for (const colorScheme of ["light", "dark"]) {
    const context = await browser.newContext({ viewport: { width: 1100, height: 760 }, colorScheme });
    const page = await context.newPage();
    const errors = [];
    const failed = [];
    page.on("pageerror", (e) => errors.push(e.message));
    page.on("response", (r) => { if (r.status() >= 400) failed.push(`${r.status()} ${r.url()}`); });
    page.on("requestfailed", (r) => failed.push(`failed ${r.url()}`));
    await page.goto(RELAY + "/");
    await page.locator("#conn", { hasText: "connected" }).waitFor();
    const icon = await page.evaluate(async () => {
      const r = await fetch(document.querySelector("link[rel=icon]").href);
      return { status: r.status, type: r.headers.get("content-type") };
    });
    assert.deepEqual(icon, { status: 200, type: "image/svg+xml" });
    await page.locator("#input").fill("Say hello.");
    await page.locator("#input").press("Enter");
    await watchReply(page, "#log");
    const c = await page.evaluate(() => {
      const s = (sel, p = "color") => getComputedStyle(document.querySelector(sel))[p];
      const bg = (sel) => s(sel, "backgroundColor");
      return {
        body: [s("body"), bg("body")], reply: [s("#log .assistant"), bg("#log .assistant")],
        question: [s("#log .user"), bg("#log .user")], stats: [s("#log .assistant .stats"), bg("#log .assistant")],
        input: [s("#input"), bg("#input")],
      };
    });
    const dark = contrast(c.body[1], "rgb(0, 0, 0)") < 2;
    assert.equal(dark, colorScheme === "dark", `${colorScheme}: body background ${c.body[1]}`);
    for (const [what, [fg, bg]] of Object.entries(c)) {
      assert.ok(contrast(fg, bg) >= 4.5, `${colorScheme} ${what}: ${fg} on ${bg} is ${contrast(fg, bg).toFixed(2)}:1`);
    }
    // The page with a reply, the history panel and the settings open: no accessibility
    // violation axe-core knows (contrast included) in either theme.
    await page.locator("#settings summary").click();
    await axeCheck(page, `chat page, ${colorScheme}`);
    await page.screenshot({ path: path.join(ARTIFACTS, `chat-${colorScheme}.png`) });
    assert.deepEqual(failed, []);
    assert.deepEqual(errors, []);
    await context.close();
  }
});

// ---- The widget on a second origin -----------------------------------------------------------

test("widget on an allowed origin opens, streams a reply, survives hostile host CSS and scripts", async () => {
  const { page, context, errors } = await newPage();
  await page.goto(ALLOWED);
  const launcher = page.locator("llama-relay-widget .launcher");
  await launcher.waitFor();
  // Hostile host CSS (`* { all: unset }`, `div { display: none }`) does not reach inside.
  const box = await launcher.boundingBox();
  assert.ok(box && box.width === 56 && box.height === 56, `launcher box ${JSON.stringify(box)}`);
  assert.ok(box.x < 100, "data-position=bottom-left");
  assert.equal(await launcher.evaluate((b) => getComputedStyle(b).backgroundColor), "rgb(10, 125, 79)", "data-accent");
  // ... and the widget's CSS does not leak out: the host's own button keeps the host's style.
  assert.equal(await page.locator("#host-button").evaluate((b) => getComputedStyle(b).backgroundColor), "rgb(200, 0, 0)");
  assert.equal(await page.locator("#hidden-by-host").isVisible(), false);
  // One global: LlamaRelay (the host's own scripts add __globalsBefore).
  const added = await page.evaluate(() => Object.getOwnPropertyNames(window).filter((k) => !window.__globalsBefore.includes(k)));
  assert.deepEqual(added.filter((k) => k !== "__globalsBefore"), ["LlamaRelay"]);
  assert.ok(errors.some((e) => /fails at load/.test(e)), "the host's script did throw");

  await page.screenshot({ path: path.join(ARTIFACTS, "widget-closed.png") });
  await launcher.click();
  const panel = page.locator("llama-relay-widget .panel");
  assert.ok(await panel.isVisible());
  assert.equal(await launcher.getAttribute("aria-expanded"), "true");
  assert.equal(await page.locator("llama-relay-widget .title").textContent(), "Acme Help");
  assert.equal(await page.locator("llama-relay-widget .assistant .body").first().textContent(), "Hi! Ask us anything about your order.");
  await page.locator("llama-relay-widget .conn", { hasText: "connected" }).waitFor({ timeout: REPLY_MS });
  await page.locator("llama-relay-widget textarea").fill("Where is my order?");
  await recordGrowth(page, "llama-relay-widget");
  await page.locator("llama-relay-widget textarea").press("Enter");
  const reply = await watchReply(page, "llama-relay-widget", () => page.screenshot({ path: path.join(ARTIFACTS, "widget-midstream.png") }));
  const grown = await grownLengths(page);
  assert.ok(grown.length >= 3, `text grew over several frames: ${grown}`);
  assert.equal(grown[grown.length - 1], reply.text.length, "the last frame shows the whole reply");
  assert.match(reply.stats, /^TTFT \d+ ms/);
  // The widget's pinned system prompt was prefilled at start: the first turn is a cache hit.
  assert.ok(Number(reply.stats.match(/(\d+) cached tokens/)[1]) > 0, reply.stats);
  await page.screenshot({ path: path.join(ARTIFACTS, "widget-open.png") });
  // Escape closes the panel and gives focus back to the launcher.
  await page.locator("llama-relay-widget textarea").press("Escape");
  assert.equal(await panel.isVisible(), false);
  assert.equal(await launcher.getAttribute("aria-expanded"), "false");
  assert.deepEqual(errors.filter((e) => !/host (click handler|timer) fails|fails at load/.test(e)), []);
  await context.close();
  await kvIdle();
});

test("the widget follows the visitor's light or dark theme, readable in both, its accent kept", async () => {
  for (const colorScheme of ["light", "dark"]) {
    const context = await browser.newContext({ viewport: { width: 1100, height: 760 }, colorScheme });
    const page = await context.newPage();
    await page.goto(ALLOWED);
    await page.locator("llama-relay-widget .launcher").click();
    await page.locator("llama-relay-widget .panel").waitFor();
    const c = await page.locator("llama-relay-widget").evaluate((host) => {
      const q = (sel) => host.shadowRoot.querySelector(sel);
      const s = (sel, p = "color") => getComputedStyle(q(sel))[p];
      const pair = (sel) => [s(sel), s(sel, "backgroundColor")];
      return {
        panel: s(".panel", "backgroundColor"), accent: s(".launcher", "backgroundColor"),
        greeting: pair(".assistant"), input: pair("textarea"), header: pair("header"),
        button: pair("form button:not(.send)"), send: pair("form button.send"),
      };
    });
    const dark = contrast(c.panel, "rgb(0, 0, 0)") < 2;
    assert.equal(dark, colorScheme === "dark", `${colorScheme}: panel ${c.panel}`);
    assert.equal(c.accent, "rgb(10, 125, 79)", "data-accent in both schemes");
    for (const what of ["greeting", "input", "header", "button", "send"]) {
      const [fg, bg] = c[what];
      assert.ok(contrast(fg, bg) >= 4.5, `${colorScheme} ${what}: ${fg} on ${bg} is ${contrast(fg, bg).toFixed(2)}:1`);
    }
    // The widget's own elements: no serious or critical violation (landmarks are the host
    // page's to give).
    await axeCheck(page, `widget, ${colorScheme}`, [["llama-relay-widget"]], ["serious", "critical"]);
    await page.screenshot({ path: path.join(ARTIFACTS, `widget-${colorScheme}.png`) });
    await context.close();
  }
});

test("a widget's function runs in the host page and its result reaches the reply", async () => {
  const { page, context, errors } = await newPage();
  await captureSockets(page);
  await page.goto(ALLOWED + "tools");
  await page.locator("llama-relay-widget .launcher").click();
  await page.locator("llama-relay-widget .conn", { hasText: "connected" }).waitFor({ timeout: REPLY_MS });
  await page.locator("llama-relay-widget textarea").fill("Where is my order A-1234?");
  await page.locator("llama-relay-widget textarea").press("Enter");
  const reply = await watchReply(page, "llama-relay-widget");
  assert.match(reply.stats, /^TTFT \d+ ms.*called order_status/, reply.stats);
  assert.ok(reply.text.trim().length > 0, "the reply goes on after the call");
  assert.ok(!reply.text.includes('"arguments"'), `the call's JSON is not shown: ${reply.text}`);
  // The handler ran with arguments valid for the schema.
  const calls = await page.evaluate(() => window.__toolCalls);
  assert.equal(calls.length, 1);
  assert.equal(typeof calls[0].order, "string");
  assert.ok(calls[0].order.length <= 12);
  assert.deepEqual(Object.keys(calls[0]), ["order"]);
  // Its result went back, and the reply went on with it in its prompt (and the rest cached).
  const out = await page.evaluate(() => window.__out);
  const result = out.find((f) => f.type === "tool_result");
  assert.ok(result && /Parcelwise/.test(result.content), JSON.stringify(out));
  const frames = await page.evaluate(() => window.__in);
  const call = frames.find((f) => f.type === "tool_call");
  assert.equal(call.name, "order_status");
  assert.equal(call.call_id, result.call_id);
  const started = frames.filter((f) => f.type === "started" && f.id === call.id);
  assert.equal(started.length, 2, JSON.stringify(frames.map((f) => f.type)));
  // The call is shown above the reply, collapsed: its name and arguments, then its result.
  const line = page.locator("llama-relay-widget .assistant details.call");
  assert.equal(await line.count(), 1);
  assert.equal(await line.locator("summary").textContent(), `called order_status(${JSON.stringify(call.arguments)})`);
  assert.equal(await line.evaluate((d) => d.open), false);
  await line.locator("summary").click();
  assert.equal(await line.locator("pre").textContent(), result.content);
  assert.ok(!(await page.locator("llama-relay-widget .assistant .body").last().textContent()).includes("order_status("));
  assert.ok(started[1].prompt_tokens > started[0].prompt_tokens + 10, JSON.stringify(started));
  assert.ok(started[1].cached_tokens >= started[0].prompt_tokens, JSON.stringify(started));
  await page.screenshot({ path: path.join(ARTIFACTS, "widget-tool-call.png") });
  assert.deepEqual(errors, []);
  await context.close();
  await kvIdle();
});

test("widget on an origin it does not allow cannot connect, and says so", async () => {
  const { page, context } = await newPage();
  await page.goto(BLOCKED);
  await page.locator("llama-relay-widget .launcher").click();
  const err = page.locator("llama-relay-widget .error .body");
  await err.waitFor({ timeout: 10_000 });
  assert.match(await err.textContent(), /not available on this site: origin http:\/\/blocked\.test:\d+ may not embed widget `acme-help`/);
  assert.equal(await page.locator("llama-relay-widget textarea").isDisabled(), true);
  // The WebSocket itself is refused too (403 on the upgrade), not only the widget's check.
  const ws = await page.evaluate((url) => new Promise((resolve) => {
    const s = new WebSocket(url);
    s.onopen = () => resolve("open");
    s.onclose = () => resolve("closed");
  }), RELAY.replace(/^http/, "ws") + "/ws?widget=acme-help");
  assert.equal(ws, "closed");
  await page.screenshot({ path: path.join(ARTIFACTS, "widget-refused.png") });
  await context.close();
});
