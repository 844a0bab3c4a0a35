// The chat page: wires the page's elements to the shared conversation client in widget.js
// (one WebSocket to /ws, replies streamed in as deltas arrive, text always set as text).
(function () {
  "use strict";
  var $ = function (id) { return document.getElementById(id); };
  var proto = location.protocol === "https:" ? "wss://" : "ws://";
  var conversation = new window.LlamaRelay.Conversation({
    url: proto + location.host + "/ws",
    els: {
      log: $("log"), live: $("live"), input: $("input"), send: $("send"), stop: $("stop"),
      conn: $("conn"), model: $("model"), newChat: $("new-chat"), form: $("composer")
    }
  });
  conversation.start();
  // For the browser tests and the console.
  window.llamaRelayChat = conversation;
  $("input").focus();
}());
