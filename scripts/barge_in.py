"""Barge-in on a running server: for each of N greedy replies, the client cancels after a
pseudo-random number of deltas with `heard_index` (the last delta it showed), then asks a next
turn, and reports how much of that turn's prompt came from the cache against what the user
heard. Needs the `websockets` package (pip install websockets).

    python3 scripts/barge_in.py PORT [N]

Loopback only; the figures in docs/performance.md ("Barge-in").
"""
import asyncio, json, random, sys
import websockets

port = int(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
QUESTION = "Tell me a long story about a lighthouse keeper and a storm."

async def frames(ws, want_id):
    while True:
        f = json.loads(await ws.recv())
        if f.get("id") == want_id:
            yield f

async def one(i, rng):
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None) as ws:
        await ws.recv()  # ready
        await ws.send(json.dumps({"type": "chat", "id": "a", "messages": [{"role": "user", "content": QUESTION}],
                                  "params": {"temperature": 0, "max_tokens": 300, "ignore_eos": True}}))
        cut = rng.randint(2, 120)
        deltas, prompt1 = [], 0
        async for f in frames(ws, "a"):
            if f["type"] == "started":
                prompt1 = f["prompt_tokens"]
            elif f["type"] == "delta":
                deltas.append(f["text"])
                if len(deltas) == cut:
                    await ws.send(json.dumps({"type": "cancel", "id": "a", "heard_index": cut - 1}))
            elif f["type"] in ("done", "error"):
                break
        await ws.send(json.dumps({"type": "chat", "id": "b", "messages": [{"role": "user", "content": "Go on."}],
                                  "params": {"temperature": 0, "max_tokens": 4}}))
        async for f in frames(ws, "b"):
            if f["type"] == "started":
                prompt2, cached2 = f["prompt_tokens"], f["cached_tokens"]
            elif f["type"] in ("done", "error"):
                break
        # The second prompt is the first, the heard text re-tokenized, the end of that turn and
        # the new question: the cache should cover the first prompt and most of the heard part.
        return cut, prompt1, prompt2, cached2

async def main():
    rng = random.Random(7)
    rows = [await one(i, rng) for i in range(n)]
    for cut, p1, p2, c2 in rows:
        print(f"heard {cut:3d} deltas: first prompt {p1}, next prompt {p2}, cached {c2} "
              f"(uncached {p2 - c2}: the heard text's last tokens, end of turn, the new question)")
    covered = sum(1 for cut, p1, p2, c2 in rows if c2 >= p1 + cut - 3)
    unc = sorted(p2 - c2 for _, _, p2, c2 in rows)
    print(f"barge-in: {covered}/{len(rows)} next turns cached the first prompt and all but at most 3 heard tokens; "
          f"uncached tokens p50 {unc[len(unc)//2]}, max {unc[-1]}")

asyncio.run(main())
