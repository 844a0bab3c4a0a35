"""Asks GET /health on 127.0.0.1:PORT every 100 ms for SECONDS, each on a fresh connection, and
prints the latency p50/p99/max and the failures.

    python3 scripts/health_probe.py PORT SECONDS
"""
import socket,time,sys
port=int(sys.argv[1]); dur=float(sys.argv[2]); lat=[]; fails=0
end=time.time()+dur
while time.time()<end:
    t=time.time()
    try:
        s=socket.create_connection(("127.0.0.1",port),timeout=3); s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n"%port)
        d=s.recv(100); s.close(); lat.append((time.time()-t)*1e3)
        if b"200" not in d: fails+=1
    except Exception: fails+=1
    time.sleep(0.1)
lat.sort(); print("health n=%d p50 %.1f ms p99 %.1f ms max %.1f ms fails %d"%(len(lat),lat[len(lat)//2],lat[int(len(lat)*0.99)],lat[-1],fails))
