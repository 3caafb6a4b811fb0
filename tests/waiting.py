"""Polling for tests that watch a real daemon or kernel settle."""

from __future__ import annotations

import time


def wait_for(pred, what: str, *, timeout: float, interval: float):
    """Call ``pred`` until it returns something truthy and return that;
    fail the test after ``timeout`` seconds, naming ``what`` was awaited."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
