#!/usr/bin/env python3
"""How slow the guest runs right now: a factor >= 1 over a quiet host.

The guest runs under TCG on a host that other work shares, so how much the
guest gets done per second varies several-fold from one run to the next
(measured: a fixed Python loop 1.2 s in the guest at host load ~4, 2.4 s with
two ``stress-ng --cpu 2`` beside it; boot to the command 9 s against 30 s).
Every wall-clock limit in the guest (test deadlines, per-test timeouts, the
whole guest run's timeout in run.py) is a nominal figure for a quiet host
multiplied by this factor, so a slow but correct run passes and a hang is
still caught.

The measurement is a fixed pure-Python loop (what most guest work is: the
daemon, the tests, the workload drivers), timed by the guest clock. run.py
boots the guest with clocksource=hpet, which QEMU emulates from the host's
clock, so guest seconds are host seconds here (the TSC is not: TCG on a
loaded host calibrates it wrong).

Why not QEMU's -icount (a guest clock that counts instructions)? It needs
single-threaded TCG (boot 16 s against 9 s at host load ~4, 25 s against
13 s with other work), and with sleep=off every idle wait for the 9p root
(Python imports, module loads) jumps the guest clock to its next timer: an
import of numpy + kvtier read 10.8 "s" of icount time, so a deadline
would depend on timer layout instead of work. run.py keeps --icount for
benchmarks that time pure CPU work (scripts/bench/vm_migrate.py).

Stdlib only: guest_setup.sh runs this with ``python3 -S`` at boot.

    python3 scripts/vm/speed.py          # prints the factor
    python3 scripts/vm/speed.py --report # also KVTIER_SLOWNESS=<f> on /dev/console
    python3 scripts/vm/speed.py --raw    # the loop's seconds (to set REFERENCE_S)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

# Loop iterations of one sample, and the guest time of one sample on a quiet
# host. Measured on the 2-core development VM (Python 3.11.7, MTTCG, guest
# 6.12): 2 M iterations took 1.24 s in the guest at host load ~3 (the least
# loaded of the runs), against 0.109 s natively; `--raw` in the guest read
# 0.079-0.21 s at load 6. A faster machine measures < 1, clamped to 1.
LOOP = 100_000
REFERENCE_S = 0.06
SAMPLES = 3
# A factor beyond this is a broken measurement, not a slow host: every limit
# would grow past what CI can wait for.
MAX_FACTOR = 10.0
# What the guest prints on its console for run.py, which stretches the whole
# run's timeout by the largest factor it has seen.
MARK = "KVTIER_SLOWNESS="
ENV = "KVTIER_VM_SLOWNESS"  # the boot-time factor, exported by guest_setup.sh


def _sample(n: int) -> float:
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i % 7
    return time.perf_counter() - t


def sample_seconds(samples: int = SAMPLES) -> float:
    """Median time of ``samples`` timed loops."""
    return statistics.median(_sample(LOOP) for _ in range(samples))


def measure(samples: int = SAMPLES) -> float:
    """The factor now: the loop's time over REFERENCE_S, clamped to
    [1, MAX_FACTOR]. Costs about samples * 60 ms * factor."""
    return min(MAX_FACTOR, max(1.0, sample_seconds(samples) / REFERENCE_S))


def current() -> float:
    """The factor last measured in this guest: $KVTIER_VM_SLOWNESS, set by
    guest_setup.sh at boot and refreshed before each vm test by
    tests/vm/conftest.py (1 outside the guest)."""
    try:
        return min(MAX_FACTOR, max(1.0, float(os.environ.get(ENV, "1"))))
    except ValueError:
        return 1.0


def report(factor: float, console: str = "/dev/console") -> None:
    """Tell run.py (it reads the guest console) how slow the guest is."""
    try:
        with open(console, "w") as f:
            # On a line of its own: pytest may be mid-line on the same console.
            f.write(f"\n{MARK}{factor:.2f}\n")
    except OSError:
        pass  # not in a guest (or no console): nobody to tell


def main(argv: list[str]) -> int:
    if "--raw" in argv:  # how REFERENCE_S is measured
        print(f"{sample_seconds():.4f}")
        return 0
    f = measure()
    if "--report" in argv:
        report(f)
    print(f"{f:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
