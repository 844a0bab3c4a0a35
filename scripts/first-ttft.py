"""Time to first token of a server's first two requests: `python3 scripts/first-ttft.py PORT N`
streams two chat completions of the same length (N repeats of a ~20-token sentence, different
words) to the server on 127.0.0.1:PORT and prints each one's time to its first content chunk.
Start the server fresh before each run (docs/performance.md, "Warm-up before ready")."""
import http.client, json, sys, time
port = int(sys.argv[1])
def ttft(prompt):
    c = http.client.HTTPConnection("127.0.0.1", port)
    body = json.dumps({"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "stream": True, "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": prompt}]})
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    first = None
    usage = None
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        d = json.loads(line[5:])
        ch = d.get("choices") or []
        if ch and ch[0].get("delta", {}).get("content") and first is None:
            first = time.perf_counter() - t0
    c.close()
    return first * 1000
# Two prompts of the same length in tokens (different words).
a = "Please tell me about the opening hours of the shop on weekends and public holidays in winter. " * int(sys.argv[2])
b = "Could you explain the return policy for damaged items bought online during the summer sale? " * int(sys.argv[2])
print(f"first {ttft(a):.1f} ms, second {ttft(b):.1f} ms")
