"""One WebSocket client sending ~63 KB chat frames of CJK text (each tokenized, then refused
`prompt_too_long`) as fast as the refusals come back, reconnecting when closed, for SECONDS.
Needs the `websockets` package (pip install websockets).

    python3 scripts/cjk_flood.py PORT SECONDS

Loopback only; the figures in docs/performance.md ("One session flooding 63 KB CJK frames").
"""
import asyncio, json, sys, time
import websockets
port=int(sys.argv[1]); dur=float(sys.argv[2])
text="漢字测试日本語한국어"*2100  # ~21,000 CJK characters, ~63 KB
frame=json.dumps({"type":"chat","id":"x","messages":[{"role":"user","content":text}]}, ensure_ascii=False)
async def main():
    end=time.time()+dur; sent=0; errs={}; conns=0
    while time.time()<end:
        try:
            async with websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None) as ws:
                conns+=1
                await ws.recv()  # ready
                while time.time()<end:
                    await ws.send(frame); sent+=1
                    r=json.loads(await ws.recv())
                    errs[r.get("error_type")]=errs.get(r.get("error_type"),0)+1
        except Exception as e:
            errs[type(e).__name__]=errs.get(type(e).__name__,0)+1
    print("attack: frames", sent, "connections", conns, errs)
asyncio.run(main())
