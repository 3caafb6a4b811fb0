"""sd_notify(3) without libsystemd: one datagram per message to $NOTIFY_SOCKET.

READY=1 once the socket listens and registrations are re-adopted; STATUS=
a one-line summary; WATCHDOG=1 every WatchdogSec/2 from the event loop (so a
wedged loop gets the daemon restarted); STOPPING=1 / RELOADING=1 around
shutdown and SIGHUP. Outside systemd every call is a no-op.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    def __init__(self, environ: dict | None = None):
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket: the kernel wants a leading NUL byte.
        self.addr = "\0" + addr[1:] if addr.startswith("@") else addr
        self.watchdog_usec = 0
        wd = env.get("WATCHDOG_USEC", "")
        wpid = env.get("WATCHDOG_PID", "")
        if wd.isdigit() and (not wpid or wpid == str(os.getpid())):
            self.watchdog_usec = int(wd)
        self.sock: socket.socket | None = None
        if self.addr:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self.sock is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the timeout), None if off."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def notify(self, *fields: str) -> bool:
        if self.sock is None:
            return False
        msg = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            self.sock.sendto(msg, self.addr)
            return True
        except OSError:
            return False  # systemd gone or socket full: never fatal

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []), f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def reloading(self) -> bool:
        return self.notify("RELOADING=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
