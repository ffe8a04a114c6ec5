"""NAT traversal probes for nat-bench: one process per leaf pod namespace.

run PORT NAME READY STOP RESULT TARGET...: binds one UDP socket on PORT, writes the file READY,
then answers every query it receives with a reply (noting, per sender, when its first query
arrived) and sends a query to every TARGET (NAME=IP, another pod's name and address) every
FAST seconds until that target's first reply, then every SLOW seconds (so that the pairs
already through do not load the gateways while the others are still being timed). Every
second, and once the file STOP exists, writes a JSON summary to RESULT (atomically); exits
after the last one.

Times in the summary are time.time() (CLOCK_REALTIME): the benchmark stamps its own events
with the same clock on the same machine. Scheduling uses the monotonic clock.
"""

import json
import os
import random
import select
import socket
import sys
import time

FAST = 0.01
SLOW = 0.1
# Sends this close to the stop are not counted as lost (their replies may be in flight).
GRACE = 1.0


def write(path, summary):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f)
    os.replace(tmp, path)


def run(port, name, ready, stop, result, target_args):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    sock.setblocking(False)
    start = time.monotonic()
    targets = {}
    for arg in target_args:
        tname, ip = arg.split("=", 1)
        targets[tname] = {
            "ip": ip,
            "sent": 0,
            "replies": 0,
            "first_reply": None,
            "first_reply_sent": None,
            # After the first reply: (seq, monotonic send time) of each query, and the seqs
            # answered, to count what was lost once the pair was through.
            "after": [],
            "answered_after": set(),
            "last_reply": None,
            "max_gap_after_first": 0.0,
            # Spread the first sends over one interval: no burst of every target at once.
            "next": start + random.random() * FAST,
        }
    heard = {}
    with open(ready, "w") as f:
        f.write("ready\n")

    def summary():
        now = time.monotonic()
        out = {"name": name, "heard": heard, "targets": {}}
        for tname, t in targets.items():
            counted = [s for s, at in t["after"] if at < now - GRACE]
            lost = sum(1 for s in counted if s not in t["answered_after"])
            out["targets"][tname] = {
                "ip": t["ip"],
                "sent": t["sent"],
                "replies": t["replies"],
                "first_reply": t["first_reply"],
                "first_reply_sent": t["first_reply_sent"],
                "sent_after_first": len(counted),
                "lost_after_first": lost,
                "max_gap_after_first_ms": t["max_gap_after_first"] * 1000.0,
            }
        return out

    next_write = start + 1.0
    while True:
        now = time.monotonic()
        if now >= next_write:
            next_write = now + 1.0
            if os.path.exists(stop):
                write(result, summary())
                return
            write(result, summary())
        for tname, t in targets.items():
            if now < t["next"]:
                continue
            seq = t["sent"]
            t["sent"] += 1
            wall = time.time()
            if t["first_reply"] is not None:
                t["after"].append((seq, now))
            payload = ("Q %s %s %d %.6f" % (name, tname, seq, wall)).encode()
            try:
                sock.sendto(payload, (t["ip"], port))
            except OSError:
                pass
            t["next"] = now + (FAST if t["first_reply"] is None else SLOW)
        wake = min([t["next"] for t in targets.values()] + [next_write])
        readable, _, _ = select.select([sock], [], [], max(0.0, wake - time.monotonic()))
        if not readable:
            continue
        while True:
            try:
                data, peer = sock.recvfrom(2048)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            arrived = time.time()
            fields = data.decode(errors="replace").split()
            if len(fields) < 5:
                continue
            if fields[0] == "Q":
                sender = fields[1]
                h = heard.get(sender)
                if h is None:
                    heard[sender] = {"first": arrived, "first_sent": float(fields[4]), "count": 1}
                else:
                    h["count"] += 1
                try:
                    sock.sendto(b"R" + data[1:] + (" %.6f" % arrived).encode(), peer)
                except OSError:
                    pass
            elif fields[0] == "R" and fields[1] == name:
                t = targets.get(fields[2])
                if t is None:
                    continue
                seq = int(fields[3])
                t["replies"] += 1
                mono = time.monotonic()
                if t["first_reply"] is None:
                    t["first_reply"] = arrived
                    t["first_reply_sent"] = float(fields[4])
                    t["next"] = mono + SLOW
                else:
                    t["answered_after"].add(seq)
                    if t["last_reply"] is not None:
                        gap = mono - t["last_reply"]
                        if gap > t["max_gap_after_first"]:
                            t["max_gap_after_first"] = gap
                t["last_reply"] = mono


def main():
    if len(sys.argv) < 7 or sys.argv[1] != "run":
        sys.exit("usage: probe.py run PORT NAME READY STOP RESULT TARGET...")
    run(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7:])


if __name__ == "__main__":
    main()
