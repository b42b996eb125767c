"""The processes a Ray start leaves on this machine, read from /proc: descendants of a process,
whether one still runs, its command line, and the TCP sockets they listen on (the serving tests'
checks that every process stops and that a local start listens on 127.0.0.1 only)."""

from __future__ import annotations

import ipaddress
import os
import time
from pathlib import Path


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def wait_dead(pids, timeout_s: float) -> list[int]:
    """Waits (bounded) until none of ``pids`` runs: those still running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.5)
    return [pid for pid in pids if alive(pid)]


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return mapped or address


def listening(pids) -> list[tuple[int, str, int, str]]:
    """Every TCP socket in the listening state that one of ``pids`` holds open: (pid, address,
    port, command line), found by the inode of each socket among the processes' descriptors."""
    sockets = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                address, port = fields[1].split(":")
                sockets[fields[9]] = (_address(address), int(port, 16))
    found = []
    for pid in pids:
        try:
            descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in descriptors:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            inode = target.removeprefix("socket:[").removesuffix("]")
            if inode in sockets:
                address, port = sockets[inode]
                found.append((pid, str(address), port, cmdline(pid)[:80]))
    return sorted(set(found))


def non_loopback(pids) -> list[tuple[int, str, int, str]]:
    """The listening sockets of ``pids`` that other machines could reach."""
    return [s for s in listening(pids) if not ipaddress.ip_address(s[1]).is_loopback]
