"""Kernel adapters: everything that reads /proc and /sys or makes a syscall.

The pure core (blocks, hotness, policy, registry) imports nothing from here;
tests/unit/test_layout.py enforces it.
"""
