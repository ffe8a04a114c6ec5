"""Long-lived flows across a failover, run inside pod namespaces by the integration tests.

serve PORT: echoes every TCP connection and every UDP datagram on PORT; a connection that
starts with "PUSH\n" instead gets an 8-digit sequence number and a newline every 50 ms.
run RESULT STOP TARGET...: each TARGET is tcp:IP:PORT:N (N connections, each sending an
8-digit sequence number and a newline every 50 ms and checking that the echo comes back
unchanged and in order), push:IP:PORT:N (N connections that only receive the server's
numbers, checking their order: after a failover only the server's side speaks first), or
udp:IP:PORT (a datagram every 10 ms). Runs until the file STOP exists, then writes a JSON
summary to RESULT: per target, the connections broken (reset, closed, an echo that does not
match, or a push connection silent for 3 s at the end) and the longest time without an echo;
per probe, every gap over 100 ms as [seconds since the start, milliseconds]. Probes still on
their way when STOP appears get a second to come back before the unanswered count as lost.
"""

import json
import os
import selectors
import socket
import sys
import time

TCP_EVERY = 0.05
UDP_EVERY = 0.01
PUSH_SILENT = 3.0
# How long the probes sent just before the stop may take to come back.
DRAIN = 1.0


def serve(port):
    sel = selectors.DefaultSelector()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(1024)
    listener.setblocking(False)
    sel.register(listener, selectors.EVENT_READ, "accept")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))
    udp.setblocking(False)
    sel.register(udp, selectors.EVENT_READ, "udp")
    pushed = {}
    next_push = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= next_push:
            next_push = now + TCP_EVERY
            for conn, seq in list(pushed.items()):
                try:
                    conn.send(b"%08d\n" % (seq % 100000000))
                    pushed[conn] = seq + 1
                except BlockingIOError:
                    pass
                except OSError:
                    del pushed[conn]
                    sel.unregister(conn)
                    conn.close()
        for key, _ in sel.select(max(0.0, next_push - time.monotonic())):
            if key.data == "accept":
                conn, _ = listener.accept()
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ, "conn")
            elif key.data == "udp":
                try:
                    data, peer = udp.recvfrom(2048)
                    udp.sendto(data, peer)
                except OSError:
                    pass
            else:
                conn = key.fileobj
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    pushed.pop(conn, None)
                    sel.unregister(conn)
                    conn.close()
                    continue
                if data.startswith(b"PUSH\n") or conn in pushed:
                    pushed.setdefault(conn, 0)
                    continue
                conn.setblocking(True)
                try:
                    conn.sendall(data)
                except OSError:
                    sel.unregister(conn)
                    conn.close()
                    continue
                conn.setblocking(False)


def connect(addr):
    """A connection to addr, retried while the server is still starting (refused)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(addr, timeout=10)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Conn:
    def __init__(self, addr):
        self.sock = connect(addr)
        self.sock.setblocking(False)
        self.seq = 0
        self.expected = 0
        self.buf = b""
        self.last_echo = time.monotonic()
        self.max_stall = 0.0
        self.error = None
        self.push = False


def run(result_path, stop_path, targets):
    sel = selectors.DefaultSelector()
    summary = []
    conns = []
    probes = []
    for target in targets:
        kind, ip, port, *rest = target.split(":")
        entry = {"target": target, "broken": [], "max_gap_ms": 0.0}
        summary.append(entry)
        if kind in ("tcp", "push"):
            for _ in range(int(rest[0])):
                c = Conn((ip, int(port)))
                if kind == "push":
                    c.push = True
                    c.sock.setblocking(True)
                    c.sock.sendall(b"PUSH\n")
                    c.sock.setblocking(False)
                c.entry = entry
                conns.append(c)
                sel.register(c.sock, selectors.EVENT_READ, c)
            entry["connections"] = int(rest[0])
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.connect((ip, int(port)))
            s.setblocking(False)
            entry["gaps"] = []
            probe = {"sock": s, "seq": 0, "received": 0, "last": time.monotonic(), "entry": entry}
            probes.append(probe)
            sel.register(s, selectors.EVENT_READ, probe)
    begin = next_tcp = next_udp = time.monotonic()
    while not os.path.exists(stop_path):
        now = time.monotonic()
        if now >= next_tcp:
            next_tcp += TCP_EVERY
            for c in conns:
                if c.error or c.push:
                    continue
                try:
                    c.sock.send(b"%08d\n" % (c.seq % 100000000))
                    c.seq += 1
                except BlockingIOError:
                    pass
                except OSError as e:
                    c.error = "send at %.3f s: %s" % (now - begin, e)
        if now >= next_udp:
            next_udp += UDP_EVERY
            for p in probes:
                try:
                    p["sock"].send(b"%d" % p["seq"])
                except OSError:
                    pass
                p["seq"] += 1
        timeout = max(0.0, min(next_tcp, next_udp) - time.monotonic())
        for key, _ in sel.select(timeout):
            now = time.monotonic()
            if isinstance(key.data, Conn):
                c = key.data
                try:
                    data = c.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError as e:
                    c.error = "recv at %.3f s: %s" % (now - begin, e)
                    sel.unregister(c.sock)
                    continue
                if not data:
                    c.error = "closed by the peer"
                    sel.unregister(c.sock)
                    continue
                c.buf += data
                while b"\n" in c.buf:
                    line, c.buf = c.buf.split(b"\n", 1)
                    if line != b"%08d" % (c.expected % 100000000):
                        c.error = "echo %r where %d was expected" % (line, c.expected)
                        break
                    c.expected += 1
                    c.max_stall = max(c.max_stall, now - c.last_echo)
                    c.last_echo = now
            else:
                p = key.data
                try:
                    while True:
                        p["sock"].recv(2048)
                        p["received"] += 1
                        gap = now - p["last"]
                        p["entry"]["max_gap_ms"] = max(p["entry"]["max_gap_ms"], gap * 1000)
                        if gap > 0.1:
                            p["entry"]["gaps"].append([round(p["last"] - begin, 3), round(gap * 1000)])
                        p["last"] = now
                except OSError:
                    pass
    now = time.monotonic()
    drain_probes(sel, probes, conns, now + DRAIN)
    for c in conns:
        stall = max(c.max_stall, now - c.last_echo)
        c.entry["max_gap_ms"] = max(c.entry["max_gap_ms"], stall * 1000)
        if c.push and not c.error and now - c.last_echo > PUSH_SILENT:
            c.error = "silent for the last %.1f s" % (now - c.last_echo)
        if c.error:
            c.entry["broken"].append(c.error)
        c.entry.setdefault("echoes", 0)
        c.entry["echoes"] += c.expected
    for p in probes:
        e = p["entry"]
        e["max_gap_ms"] = max(e["max_gap_ms"], (now - p["last"]) * 1000)
        e["sent"] = p["seq"]
        e["received"] = p["received"]
    with open(result_path, "w") as f:
        json.dump(summary, f)


def drain_probes(sel, probes, conns, deadline):
    """Counts the answers to probes still on their way at the stop, until `deadline` or until
    every probe is answered. Gaps end at the stop: nothing is sent any more."""
    for c in conns:
        try:
            sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
    while any(p["received"] < p["seq"] for p in probes):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        for key, _ in sel.select(left):
            try:
                while True:
                    key.data["sock"].recv(2048)
                    key.data["received"] += 1
            except OSError:
                pass


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    else:
        run(sys.argv[2], sys.argv[3], sys.argv[4:])
