"""The real kvtierd hears the real kernel's memory uevents (netlink,
pyroute2): a synthetic ``change`` uevent on a memory block (written to its
``uevent`` file, as udevadm trigger does) makes it re-discover the topology
once per burst. This host has one node, so tiers are not expected to change
(the guest test does that); the event path is what is checked here."""

from __future__ import annotations

import glob

import pytest
from test_daemon import DaemonProc, wait_for, workdir  # noqa: F401  (fixture)

pytestmark = pytest.mark.root


def test_memory_uevents_trigger_one_rediscovery_per_burst(workdir):
    blocks = sorted(glob.glob("/sys/devices/system/memory/memory[0-9]*/uevent"))[:3]
    if not blocks:
        pytest.skip("no memory block devices in sysfs (CONFIG_MEMORY_HOTPLUG=n)")
    d = DaemonProc(workdir).start()
    try:
        def events():
            with d.client() as c:
                return c.request("stats")["topology_events"]

        wait_for(lambda: "uevent_listening" in d.read_log(), "the uevent socket to be bound")
        assert events().get("rediscovered", 0) == 0
        for path in blocks:  # one burst: several blocks within the debounce time
            with open(path, "w") as f:
                f.write("change")
        wait_for(lambda: events().get("rediscovered", 0) >= 1, "a re-discovery after the uevents")
        log = d.read_log()
        assert "topology_changed" in log and "memory:change" in log, log
        assert events().get("tier_added", 0) == events().get("tier_removed", 0) == 0
        with d.client() as c:
            assert [t["name"] for t in c.request("tiers")["tiers"]][0] == "dram"
    finally:
        rc = d.stop()
    assert rc == 0 and "Traceback" not in d.read_log(), d.read_log()
    # Three blocks' events within the debounce time: one re-discovery.
    assert d.read_log().count("event=topology_changed") == 1, d.read_log()
