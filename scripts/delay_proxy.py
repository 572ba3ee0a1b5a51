"""A TCP proxy that delays every chunk by a fixed time in each direction, for benchmarks of a slow
store (docs/benchmarks.md, "A slow shared store"). Order is kept: each direction is a queue of
(due time, bytes) drained by one writer, so the delay adds latency without limiting throughput.

    python3 scripts/delay_proxy.py --listen 127.0.0.1:7001 --target 127.0.0.1:6379 --delay-ms 200

``--stall-over BYTES`` makes a half-broken path: once the server sends a chunk larger than BYTES
(a block's value, not a short reply), nothing more reaches the client on that connection, which
stays open (small replies pass, large values never arrive).

Prints "listening HOST:PORT" once it accepts connections (port 0 picks a free one). Stops on
SIGTERM / SIGINT, or after --max-secs (default 3600) so a forgotten proxy ends by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
               stall_over: int = 0) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def drain() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    out = asyncio.create_task(drain())
    stalled = False
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            if stall_over and len(data) > stall_over:
                stalled = True
            if not stalled:
                queue.put_nowait((loop.time() + delay, data))
    except (ConnectionError, OSError):
        pass
    finally:
        queue.put_nowait((0.0, None))
        try:
            await out
        except (ConnectionError, OSError):
            pass
        try:
            writer.close()
        except (ConnectionError, OSError):
            pass


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--target", required=True)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--max-secs", type=float, default=3600.0)
    ap.add_argument("--stall-over", type=int, default=0)
    a = ap.parse_args()
    lhost, lport = a.listen.rsplit(":", 1)
    thost, tport = a.target.rsplit(":", 1)
    delay = a.delay_ms / 1000.0

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(thost, int(tport))
        except OSError:
            cw.close()
            return
        await asyncio.gather(pipe(cr, sw, delay), pipe(sr, cw, delay, a.stall_over))

    server = await asyncio.start_server(handle, lhost, int(lport))
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), a.max_secs)
    except asyncio.TimeoutError:
        pass
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
