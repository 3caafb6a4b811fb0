"""Trace-driven simulator: replays KV-block access traces through kvtier's own
policy (kvtier.policy + kvtier.hotness, imported, not copied) and the usual
alternatives, with a modelled migrator and tier/cost model. Entry point:
``kvtier-sim`` (kvtier.sim.cli:main); docs/simulator.md describes it."""
