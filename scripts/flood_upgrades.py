"""Opens N TCP connections to 127.0.0.1:PORT, 500 at a time, sends a WebSocket upgrade on each and
keeps them all open for HOLD seconds; prints how the upgrades were answered.

    python3 scripts/flood_upgrades.py N PORT HOLD

Loopback only; the figures in docs/performance.md ("A socket flood against the connection caps").
"""
import asyncio, sys, time
N=int(sys.argv[1]); port=int(sys.argv[2])
UP=b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n" % port
held=[]; stats={"101":0,"503":0,"err":0}
async def one():
    try:
        r,w=await asyncio.open_connection("127.0.0.1",port)
        w.write(UP); await w.drain()
        line=await asyncio.wait_for(r.readline(),30)
        code=line.split(b" ")[1].decode() if line else "err"
        stats[code]=stats.get(code,0)+1
        held.append(w)
    except Exception as e:
        stats["err"]+=1
async def main():
    t=time.time()
    for i in range(0,N,500):
        await asyncio.gather(*[one() for _ in range(min(500,N-i))])
    print("opened",len(held),stats,"in %.1fs"%(time.time()-t),flush=True)
    await asyncio.sleep(float(sys.argv[3]))
asyncio.run(main())
