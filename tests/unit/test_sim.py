import json

import numpy as np
import pytest

from kvtier.errors import ConfigError, InvalidArgument
from kvtier.policy import PolicyConfig
from kvtier.sim import cli
from kvtier.sim.gen import PRESETS, generate
from kvtier.sim.model import GIB, SimConfig, SimTier, load_config
from kvtier.sim.oracles import FeasibleOracle, belady_min
from kvtier.sim.policies import LRU, POLICIES, Kvtier
from kvtier.sim.runner import capacity_cost, simulate
from kvtier.sim.trace import OP_ACCESS, OP_ALLOC, OP_FREE, Trace, load

BS = 2 << 20


def tiers_cfg(dram_blocks, cxl_blocks=64, migrate_gbps=100.0, tick_s=1.0):
    return SimConfig(
        (
            SimTier("dram", "dram", dram_blocks * BS, 100.0, 40.0, migrate_gbps, 3.0),
            SimTier("cxl", "cxl", cxl_blocks * BS, 250.0, 20.0, migrate_gbps, 1.5),
        ),
        tick_s,
    )


def mk(events, nblocks=8):
    """events: (t, block, op, count) tuples."""
    t, b, o, c = zip(*events)
    return Trace(np.array(t), np.array(b), np.array(o), np.array(c), nblocks, BS)


def oracle_trace():
    # DRAM holds 2: A and B land there, C on CXL. Tick 0 reads each once,
    # tick 1 reads C 10 times and A once, tick 2 reads B 10 times.
    A, B, C = 0, 1, 2
    ev = [(0.0, b, OP_ALLOC, 0) for b in (A, B, C)]
    ev += [(0.1, A, OP_ACCESS, 1), (0.2, B, OP_ACCESS, 1), (0.3, C, OP_ACCESS, 1)]
    ev += [(1.1, C, OP_ACCESS, 10), (1.2, A, OP_ACCESS, 1), (2.1, B, OP_ACCESS, 10)]
    return mk(ev)


def test_feasible_oracle_reaches_the_optimum_with_a_fast_migrator():
    # Only C's first read can miss: exchange B for C after tick 0, then A or
    # C for B after tick 1: 23 of 24 reads from DRAM.
    r = simulate(oracle_trace(), tiers_cfg(2), FeasibleOracle())
    assert r.served == [23.0, 1.0]
    assert r.migrated_bytes["cxl->dram"] == 2 * BS  # C, then B; blocks never read again leave with spare time


def test_feasible_oracle_stays_within_the_migrator_budget():
    # One move per tick: the B<->C exchange cannot finish before tick 1, so the
    # best any placement can do is leave C on CXL: 13 of 24 (A 1+1, B 1+10).
    one_move = 1.5 * BS / 1e9  # GB/s: one block move takes ~0.67 s of the 1 s tick
    r = simulate(oracle_trace(), tiers_cfg(2, migrate_gbps=one_move), FeasibleOracle())
    assert r.served == [13.0, 11.0]
    assert sum(r.migrated_bytes.values()) <= r.ticks * BS  # at most one move per tick


def _min_misses(seq, cap):
    """Exact minimum misses over every demand-fetch choice (fetch on a miss,
    then keep any ``cap`` of the blocks), by dynamic programming over cache sets."""
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(seq):
            return 0
        b = seq[i]
        full = cache | {b}
        opts = [best(i + 1, frozenset(full - {x})) for x in full]
        if len(full) <= cap:
            opts.append(best(i + 1, frozenset(full)))
        return (b not in cache) + min(opts)

    return best


def test_belady_min_matches_the_exact_optimum_on_the_textbook_string():
    # Silberschatz's reference string, 3 frames: OPT takes 9 faults, 3 of them
    # compulsory. Here all six blocks are allocated (written) at t=0, which
    # puts the first three read into the cache for free: 6 misses remain for
    # a cache that must keep every fetched block; one fewer (5) when a fetched
    # block read farther in the future than all the others need not be kept
    # (the exhaustive search agrees).
    ref = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    ids = {b: i for i, b in enumerate(sorted(set(ref)))}
    ev = [(0.0, i, OP_ALLOC, 0) for i in range(len(ids))]
    ev += [(k + 1.5, ids[b], OP_ACCESS, 1) for k, b in enumerate(ref)]
    r = belady_min(mk(ev), tiers_cfg(3))
    assert r.served == [15.0, 5.0]
    seq = tuple(ids[b] for b in ref)
    start = frozenset(ids[b] for b in (7, 0, 1))
    assert _min_misses(seq, 3)(0, start) == 5


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_belady_min_equals_exhaustive_search_on_random_strings(seed):
    rng = np.random.default_rng(seed)
    seq = tuple(int(x) for x in rng.integers(0, 5, 14))
    ev = [(k + 0.5, b, OP_ACCESS, 1) for k, b in enumerate(seq)]
    first = {b: k for k, b in reversed(list(enumerate(seq)))}
    # allocate each block in the tick of its first read: written, not fetched
    ev += [(first[b] + 0.0, b, OP_ALLOC, 0) for b in first]
    r = belady_min(mk(ev), tiers_cfg(2))

    # the exact optimum with the same rule: a first read is a write (no miss)
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(seq):
            return 0
        b = seq[i]
        miss = b not in cache and first[b] != i
        full = cache | {b}
        opts = [best(i + 1, frozenset(full - {x})) for x in full]
        if len(full) <= 2:
            opts.append(best(i + 1, frozenset(full)))
        return miss + min(opts)

    assert r.served[1] == best(0, frozenset())


def test_lru_matches_hand_checked_reference():
    # one access per tick; DRAM holds 2 and starts with A, B (first touch)
    A, B, C, D = range(4)
    seq = [A, B, C, A, D, B, A, C]
    ev = [(0.0, b, OP_ALLOC, 0) for b in range(4)]
    ev += [(k + 0.5, b, OP_ACCESS, 1) for k, b in enumerate(seq)]
    r = simulate(mk(ev), tiers_cfg(2), LRU())
    # classic LRU, cache {A,B}: hit, hit, then every access misses
    assert r.served == [2.0, 6.0]
    # after each miss it moves the block in: C (A out), A (B out), D (C out),
    # B (A out), A (D out), C (B out)
    assert r.migrated_bytes == {"dram->cxl": 6 * BS, "cxl->dram": 6 * BS}


def small_trace(seed=3):
    return generate("chat", seed=seed, nblocks=4096, max_accesses=30_000, max_batch=16, arrival_rate=1.0)


@pytest.mark.parametrize("seed", [3, 11])
def test_every_policy_respects_capacity_and_counts_every_read(seed):
    tr = small_trace(seed)
    cfg = tiers_cfg(120, 4096)
    total = float(tr.count[tr.op == OP_ACCESS].sum())
    for name, cls in POLICIES.items():
        r = simulate(tr, cfg, cls())
        assert sum(r.served) == pytest.approx(total), name
        assert r.overflow_blocks == 0
    r = simulate(tr, cfg, FeasibleOracle())
    assert sum(r.served) == pytest.approx(total)
    assert belady_min(tr, cfg).served[0] <= total


def test_kvtier_in_sim_runs_the_real_policy_and_respects_capacity():
    tr = small_trace()
    cfg = tiers_cfg(120, 4096)
    pol = Kvtier()
    r = simulate(tr, cfg, pol)
    assert r.fast_hit >= 0.9 * simulate(tr, cfg, FeasibleOracle()).fast_hit
    # the engine's placement and the policy's block table agree at the end
    eng_tier = pol.eng.tier
    live = pol.eng.alive
    np.testing.assert_array_equal(pol.table.tier[live], eng_tier[live])
    assert np.count_nonzero(eng_tier == 0) <= 120


def test_migrator_bandwidth_caps_moves_per_tick():
    # DRAM holds 4 of 5 blocks; all are read, block 4 (in CXL) last
    ev = [(0.0, b, OP_ALLOC, 0) for b in range(5)]
    ev += [(0.1 * (b + 1), b, OP_ACCESS, 1) for b in range(5)]
    slow = 2.2 * BS / 1e9  # GB/s: one block takes ~0.45 s, two fit, three do not
    r = simulate(mk(ev), tiers_cfg(4, migrate_gbps=slow), LRU())
    # tick 0: LRU wants block 4 in and the least recent resident out: 2 moves fit
    assert r.migrated_bytes == {"dram->cxl": BS, "cxl->dram": BS}
    r2 = simulate(mk(ev), tiers_cfg(4, migrate_gbps=1.5 * BS / 1e9), LRU())
    assert sum(r2.migrated_bytes.values()) == BS  # only the demotion fits; the promotion waits


def test_swap_tier_faults_blocks_back_into_memory():
    ev = [(0.0, b, OP_ALLOC, 0) for b in range(3)] + [(1.5, 2, OP_ACCESS, 1)]
    cfg = SimConfig(
        (
            SimTier("dram", "dram", 2 * BS, 100.0, 40.0, 10.0, 3.0),
            SimTier("swap", "swap", 8 * BS, 80_000.0, 3.0, 2.0, 0.1),
        )
    )
    r = simulate(mk(ev), cfg, POLICIES["damos"]())
    # block 2 found no room in DRAM and memory is the only first-touch target: overflow
    assert r.overflow_blocks == 1


def test_engine_rejects_inconsistent_traces():
    with pytest.raises(InvalidArgument):
        simulate(mk([(0.0, 1, OP_ACCESS, 1)]), tiers_cfg(2), LRU())
    with pytest.raises(InvalidArgument):
        simulate(mk([(0.0, 1, OP_ALLOC, 0), (0.5, 1, OP_ALLOC, 0)]), tiers_cfg(2), LRU())


def test_trace_roundtrip_npz_and_csv(tmp_path):
    tr = small_trace()
    for name in ("t.npz", "t.csv"):
        tr.save(tmp_path / name)
        back = load(tmp_path / name)
        np.testing.assert_array_equal(back.block, tr.block)
        np.testing.assert_array_equal(back.op, tr.op)
        np.testing.assert_allclose(back.t, tr.t, atol=1e-6)
        np.testing.assert_allclose(back.count, tr.count)
        assert back.nblocks == tr.nblocks and back.block_bytes == tr.block_bytes
        assert back.meta["blocks_per_seq"] == pytest.approx(tr.meta["blocks_per_seq"], rel=1e-5)


def test_csv_from_an_engine_with_foreign_ids(tmp_path):
    p = tmp_path / "rec.csv"
    p.write_text("time,block,op,count\n0,900,alloc,0\n0,77,alloc,0\n0.5,77,access,3\n1,900,free,0\n")
    tr = load(p)
    assert tr.nblocks == 2 and tr.block.tolist() == [0, 1, 1, 0]
    assert tr.op.tolist() == [OP_ALLOC, OP_ALLOC, OP_ACCESS, OP_FREE]
    p.write_text("time,block,op,count\n0,1,touch,0\n")
    with pytest.raises(InvalidArgument):
        load(p)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_generated_traces_are_consistent(preset):
    tr = generate(preset, nblocks=8192, max_accesses=20_000)
    alive = np.zeros(tr.nblocks, bool)
    # replay the ops in order: alloc only dead ids, access/free only live ones
    for op in (OP_ALLOC, OP_ACCESS, OP_FREE):
        assert np.any(tr.op == op) or op == OP_FREE
    order = np.arange(len(tr))
    for i in order[tr.op != OP_ACCESS]:
        b = tr.block[i]
        assert alive[b] == (tr.op[i] == OP_FREE)
        alive[b] = tr.op[i] == OP_ALLOC
    assert tr.accesses >= 20_000 and np.all(tr.count[tr.op == OP_ACCESS] >= 1)
    again = generate(preset, nblocks=8192, max_accesses=20_000)
    np.testing.assert_array_equal(again.block, tr.block)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_pool_pressure_evicts_and_respects_the_quarantine(preset):
    # a pool far too small for the load: idle conversations (and documents)
    # get evicted, and no id comes back within a 1 s tick of its free
    tr = generate(preset, nblocks=1500, max_accesses=60_000)
    assert np.count_nonzero(tr.op == OP_FREE) > 0
    simulate(tr, tiers_cfg(200, 2000, tick_s=1.0), LRU())  # raises on reuse within a tick
    frees = {}
    for t, b, o in zip(tr.t.tolist(), tr.block.tolist(), tr.op.tolist()):
        if o == OP_FREE:
            frees[b] = t
        elif o == OP_ALLOC and b in frees:
            assert t - frees[b] >= PRESETS[preset].quarantine_s


def test_multi_turn_chats_reuse_their_blocks_and_share_prefixes():
    tr = generate("chat", nblocks=8192, max_accesses=100_000)
    acc = tr.block[tr.op == OP_ACCESS]
    ids, n = np.unique(acc, return_counts=True)
    # shared system-prompt blocks are read in almost every step
    steps = np.unique(tr.t[tr.op == OP_ACCESS]).size
    assert n.max() >= 0.9 * steps
    assert np.median(n) > 1


def test_toml_config(tmp_path):
    p = tmp_path / "tiers.toml"
    p.write_text(
        'tick_s = 0.5\n[[tier]]\nname = "dram"\ncapacity_gib = 8\n'
        '[[tier]]\nname = "cxl"\nkind = "cxl"\ncapacity_gib = 32\nlatency_ns = 300\n'
    )
    c = load_config(p)
    assert c.tick_s == 0.5 and c.tiers[0].capacity_bytes == 8 * GIB
    assert c.tiers[1].latency_ns == 300 and c.tiers[1].read_gbps == 20.0
    p.write_text('[[tier]]\nname = "dram"\nspeed = 3\n')
    with pytest.raises(ConfigError):
        load_config(p)
    with pytest.raises(ConfigError):
        SimConfig((SimTier("x", "tape", 1, 1, 1, 1, 1),))


def test_capacity_cost_dram_only_vs_tiered():
    tr = oracle_trace()
    tr.meta["blocks_per_seq"] = 512.0  # 1 GiB per sequence
    cfg = SimConfig().with_capacities([64, 256])
    c = capacity_cost(tr, cfg)
    assert c["seq_gib"] == pytest.approx(1.0)
    assert c["dram_only"]["max_seqs"] == 64 and c["tiered"]["max_seqs"] == 320
    # DDR5 at $3/GB, CXL at $1.5/GB: tiered is cheaper per sequence
    assert c["tiered"]["usd_per_seq"] < c["dram_only"]["usd_per_seq"]


def test_cli_gen_run_json_and_plot(tmp_path, capsys):
    out = tmp_path / "t.npz"
    assert cli.main(["gen", "--preset", "rag", "--accesses", "20000", "--nblocks", "8192", "-o", str(out)]) == 0
    capsys.readouterr()
    rc = cli.main(["run", "--trace", str(out), "--policy", "kvtier,lru,feasible-oracle,belady-min", "--json",
                   "--plot", str(tmp_path)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["results"]] == ["kvtier", "lru", "feasible-oracle", "belady-min"]
    assert doc["results"][2]["extra"]["of_oracle"] == 1.0
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert (tmp_path / "t-timeline.png").stat().st_size > 1000
    assert cli.main(["run", "--trace", str(out), "--policy", "nope"]) == 2
    rc = cli.main(["run", "--preset", "chat", "--accesses", "5000", "--policy", "kvtier,feasible-oracle", "--swap"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "hit swap" in text and "of oracle" in text


def _jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_request_trace_prefill_decode_and_prefix_cache(tmp_path):
    from kvtier.sim.requests import RequestTrace

    # 4-token blocks, 2 tokens/s decode, 1 s ticks. Request 1 at t=0: prompt
    # of 6 tokens (blocks 10, 11), 3 output tokens: decode steps at 0.5, 1.0,
    # 1.5 s; the 7th token fills block 11, the 9th opens a generated block.
    # Request 2 at t=2.2 shares block 10 and adds 12 and 13.
    p = _jsonl(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 6, "output_length": 3, "hash_ids": [10, 11]},
        {"timestamp": 2200, "input_length": 12, "output_length": 0, "hash_ids": [10, 12, 13]},
    ])
    tr = RequestTrace(p, kv_bytes=100, block_tokens=4, decode_tps=2.0)
    assert tr.fmt == "mooncake" and tr.block_bytes == 400
    assert tr.unique_prompt_blocks == 4 and tr.footprint_blocks == 5  # + one generated block
    ticks = list(tr.ticks(1.0))
    a, b = 0, 1  # pool slots of hash ids 10, 11
    t0, t1, t2 = ticks[:3]
    assert t0.alloc.tolist() == [a, b]
    # prefill 1 read each + one decode step (0.5 s) in tick 0
    assert dict(zip(t0.rows.tolist(), t0.counts.tolist())) == {a: 2.0, b: 2.0}
    # steps at 1.0 and 1.5 s: the second brings the 9th token, a generated block
    g = int(t1.alloc[0])
    assert dict(zip(t1.rows.tolist(), t1.counts.tolist())) == {a: 2.0, b: 2.0, g: 1.0}
    assert t1.free.tolist() == [g] and sorted(t1.released.tolist()) == [a, b]
    # request 2 takes the cached block of hash 10 back and allocates 12 and 13
    assert t2.acquired.tolist() == [a] and t2.alloc.size == 2
    assert sorted(t2.released.tolist()) == sorted([a] + t2.alloc.tolist())
    # a pool of 3: hash 12 takes the generated block's freed slot, hash 13
    # evicts the cached block released longest ago (hash 11)
    tr3 = RequestTrace(p, kv_bytes=100, block_tokens=4, decode_tps=2.0, pool_blocks=3)
    t2 = list(tr3.ticks(1.0))[2]
    assert t2.evict.tolist() == [b] and t2.alloc.tolist() == [g, b]
    for pol in (LRU(), Kvtier(), FeasibleOracle()):  # the engine takes evictions before placement
        r = simulate(tr3, SimConfig((SimTier("dram", "dram", 800, 100.0, 40.0, 4.0, 3.0),
                                     SimTier("cxl", "cxl", 400, 250.0, 20.0, 4.0, 1.5))), pol)
        assert sum(r.served) == 2 + 2 + 2 + 2 + 1 + 3 and r.overflow_blocks == 0
    with pytest.raises(InvalidArgument, match="pool"):
        list(RequestTrace(p, kv_bytes=100, block_tokens=4, decode_tps=2.0, pool_blocks=2).ticks(1.0))


def test_request_trace_formats_and_bad_input(tmp_path):
    from kvtier.sim.requests import RequestTrace, kv_bytes_per_token

    assert kv_bytes_per_token("llama-3-8b") == 131072  # 2 x 32 layers x 8 KV heads x 128 x fp16
    assert kv_bytes_per_token("llama-3-70b") == 327680
    # a Hugging Face name is the same model: its path, case and variant do not matter
    assert kv_bytes_per_token("meta-llama/Meta-Llama-3-8B-Instruct") == 131072
    assert kv_bytes_per_token("meta-llama/Llama-2-7b-chat-hf") == 524288  # MHA: 32 KV heads
    assert kv_bytes_per_token("Qwen/Qwen2.5-72B-Instruct") == 327680
    assert kv_bytes_per_token("google/gemma-2-9b-it") == 344064  # head dim 256
    with pytest.raises(InvalidArgument, match="unknown model 'gpt-4'"):
        kv_bytes_per_token("gpt-4")
    p = _jsonl(tmp_path / "b.jsonl", [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40, "output_length": 2,
         "type": "text", "turn": 1, "hash_ids": [1, 2, 3]},
    ])
    tr = RequestTrace(p, model="qwen2-7b")
    assert tr.fmt == "bailian" and tr.block_tokens == 16 and tr.block_bytes == 16 * 57344
    assert list(tr.ticks(1.0))[0].alloc.size == 3
    _jsonl(p, [{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [1]},
               {"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [2]}])
    with pytest.raises(InvalidArgument, match="sort"):
        RequestTrace(p)
    _jsonl(p, [{"timestamp": 5, "input_length": 1}])
    with pytest.raises(InvalidArgument, match="b.jsonl:1"):
        RequestTrace(p)
    with pytest.raises(InvalidArgument, match="unknown model"):
        RequestTrace(p, model="gpt-9")
    p.write_text("\n\n")
    with pytest.raises(InvalidArgument, match="empty trace"):
        RequestTrace(p)


def test_cli_refuses_traces_that_read_nothing(tmp_path, capsys):
    # An empty request trace, one whose requests read no block, and a block
    # trace with a header and no record: exit 1 and a reason, never a
    # traceback or a table of 0/0 hit ratios.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    noread = _jsonl(tmp_path / "noread.jsonl",
                    [{"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": []}])
    header = tmp_path / "header.csv"
    header.write_text("time,block,op,count\n")
    for path, why in ((empty, "empty trace"), (noread, "reads no block"), (header, "reads no block")):
        assert cli.main(["run", "--trace", str(path), "--policy", "kvtier,lru"]) == 1
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err, err
    # numbers out of range are usage errors (exit 2), not a default, nor a traceback
    trace = ["--trace", str(noread)]
    for opt, val, src in (("--tick", "0", None), ("--tick", "-1", None), ("--tick", "nan", None),
                          ("--tick", "inf", None), ("--tick", "x", None), ("--dram-frac", "nan", None),
                          ("--dram-frac", "inf", None), ("--dram-gib", "nan", None), ("--cxl-gib", "-2", None),
                          ("--accesses", "0", None), ("--decode-tps", "inf", trace),
                          ("--block-tokens", "0", trace), ("--kv-bytes-per-token", "-5", trace),
                          ("--requests", "0", trace), ("--pool-blocks", "0", trace)):
        args = ["run"] + (src or ["--preset", "chat", "--accesses", "500"]) + ["--policy", "lru", opt, val]
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 2, args
        assert opt in capsys.readouterr().err


def test_cli_set_reaches_the_policy_and_refuses_unknown_keys(capsys):
    assert cli.kvtier_settings(["policy.min_residence_s=2", "hotness.tau_s=5"])[0].min_residence_s == 2.0
    assert cli.kvtier_settings(["hotness.tau_s=5"])[1] == 5.0
    for bad in (["policy.nope=1"], ["hotness.tau=1"], ["tau_s=1"], ["policy.low_wm=0.99"]):
        with pytest.raises(ConfigError):
            cli.kvtier_settings(bad)
    assert cli.main(["run", "--preset", "chat", "--accesses", "2000", "--policy", "kvtier",
                     "--set", "policy.nope=1"]) == 1
    assert "nope" in capsys.readouterr().err


def test_belady_min_shortcut_agrees_with_the_full_search(monkeypatch):
    import kvtier.sim.oracles as oracles

    tr = small_trace()
    for cap in (4096, 300, 40):  # shortcut taken, maybe, and surely not
        fast = belady_min(tr, tiers_cfg(cap, 4096)).served
        monkeypatch.setattr(oracles, "_min_if_nothing_is_evicted", lambda *a: None)
        full = belady_min(tr, tiers_cfg(cap, 4096)).served
        monkeypatch.undo()
        assert fast == pytest.approx(full), cap


def test_cli_replays_a_mooncake_trace_with_model_and_rates(capsys):
    from pathlib import Path

    trace = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"
    rc = cli.main(["run", "--trace", str(trace), "--requests", "150", "--model", "llama-3-70b", "--decode-tps", "20",
                   "--dram-frac", "0.25", "--policy", "kvtier,lru,feasible-oracle,belady-min", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert "llama-3-70b (327680 B/token)" in doc["source"] and "decode 20 tokens/s" in doc["source"]
    hits = {r["policy"]: r["hit_ratio"][0] for r in doc["results"]}
    assert 0 < hits["kvtier"] <= 1 and hits["belady-min"] >= hits["lru"]
    from kvtier.hotness import DEFAULT_TAU_S

    assert doc["kvtier_settings"]["hotness"]["tau_s"] == DEFAULT_TAU_S  # the shipped default, not a sim one


def _returning_prefix(tmp_path, migrate_gbps=None):
    """A cached prefix on CXL that a later request takes. 64-token blocks of
    256 MiB; DRAM holds 16. At t=0 X's 16 blocks fill DRAM, so A's two
    blocks (hash 1, 2) land on CXL; both end at once (no decode). At t=10 s
    A returns: prefill reads 1 and 2 (and its new block 3) at 10.0, decode
    at 10 tokens/s reads all three at 10.1, 10.2, ... (no generated block:
    129 + 20 tokens fit in three blocks)."""
    from kvtier.sim.requests import RequestTrace

    p = _jsonl(tmp_path / "r.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 0, "hash_ids": list(range(100, 116))},
        {"timestamp": 10, "input_length": 128, "output_length": 0, "hash_ids": [1, 2]},
        {"timestamp": 10000, "input_length": 129, "output_length": 20, "hash_ids": [1, 2, 3]},
    ])
    tr = RequestTrace(p, kv_bytes=4 << 20, block_tokens=64, decode_tps=10.0)
    bb = tr.block_bytes
    gbps = 4.0 if migrate_gbps is None else migrate_gbps
    cfg = SimConfig((SimTier("dram", "dram", 16 * bb, 100.0, 40.0, gbps, 3.0),
                     SimTier("cxl", "cxl", 20 * bb, 250.0, 20.0, gbps, 1.5)), 1.0)
    return tr, cfg


ROOMY = PolicyConfig(low_wm=0.7)  # DRAM's room at 10 s holds both of A's blocks


def _dram_reads(r, k):
    fast, every = r.timeline
    return float(fast[k]), float(every[k])


def test_kvtier_prefetch_serves_a_returning_prefix_from_dram_after_its_move(tmp_path):
    tr, cfg = _returning_prefix(tmp_path)
    bb = tr.block_bytes
    without = simulate(tr, cfg, Kvtier(prefetch=False))
    # the prefix is read from CXL for the whole tick it is taken in: only block 3 from DRAM
    assert _dram_reads(without, 10) == (10.0, 30.0)
    # low_wm 0.7: the plans before 10 s demote X's cold blocks far enough
    # below the promote limit for both of A's blocks to fit.
    r = simulate(tr, cfg, Kvtier(ROOMY, prefetch=True))
    # Asked at 10.0 s, block 1 is in DRAM at 10.067 s and block 2 at 10.134 s
    # (256 MiB each at 4 GB/s, one after the other): the two prefill reads
    # and block 2's first decode step (10.1 s) come from CXL, the rest from DRAM.
    assert _dram_reads(r, 10) == (27.0, 30.0)
    assert r.extra["prefetch_blocks_moved"] == 2 and r.extra["prefetch_blocks_refused"] == 0
    assert r.migrated_bytes["cxl->dram"] == 2 * bb  # the prefetch's bytes count as moved


def test_kvtier_prefetch_beyond_drams_room_is_left_to_the_plan(tmp_path):
    """Kills: a prefetch that moves more than DRAM's room below the promote
    limit (``engine.dram_room``), or a deferred block the plan does not take.
    With the shipped low_wm the room at 10 s holds one of A's blocks: block 1
    moves at once, block 2 stays on CXL for tick 10 (only its reads, no
    refused move, no tokens) and the plan at 11 s promotes it, making room by
    demoting X's cold blocks: tick 11 reads everything from DRAM."""
    tr, cfg = _returning_prefix(tmp_path)
    bb = tr.block_bytes
    r = simulate(tr, cfg, Kvtier(prefetch=True))
    assert _dram_reads(r, 10) == (10.0 + 9.0, 30.0)  # block 3 and block 1 from 10.1 s
    assert _dram_reads(r, 11) == (30.0, 30.0)
    assert r.extra["prefetch_blocks_moved"] == 1 and r.extra["prefetch_blocks_refused"] == 0
    assert r.migrated_bytes["cxl->dram"] == 2 * bb  # one by the prefetch, one by the plan


def test_kvtier_prefetch_moves_within_the_migrator_budget_and_the_token_buckets(tmp_path):
    # 0.62 s per move: block 1 is in DRAM at 10.62 s, block 2 at 11.24 s, in the next tick
    tr, cfg = _returning_prefix(tmp_path, migrate_gbps=(256 << 20) / 0.62e9)
    r = simulate(tr, cfg, Kvtier(ROOMY, prefetch=True))
    # tick 10: block 1's reads from 10.7 s on (3) and block 3's 10 from DRAM
    assert _dram_reads(r, 10) == (13.0, 30.0)
    # tick 11: block 2's steps at 11.0, 11.1 and 11.2 s still from CXL
    assert _dram_reads(r, 11) == (27.0, 30.0)
    assert r.extra["ticks_busy"] == 1  # the tick at 11 s found the migrator busy: no plan, as in the daemon
    assert r.migrated_bytes["cxl->dram"] == 2 * tr.block_bytes
    # A promote bucket of one block a second pays for block 1 at 10.0 s only;
    # block 2 waits for tokens until the tick at 11 s (which moves it first
    # and plans nothing): its step at 11.0 s is still read from CXL.
    tr, cfg = _returning_prefix(tmp_path)
    slow = simulate(tr, cfg, Kvtier(PolicyConfig(promote_mbps=256.0, low_wm=ROOMY.low_wm), prefetch=True))
    assert _dram_reads(slow, 10) == (10.0 + 9.0, 30.0)
    assert _dram_reads(slow, 11) == (29.0, 30.0)
    assert slow.extra["prefetch_blocks_moved"] == 2 and slow.extra["ticks_busy"] == 0


def test_cli_kvtier_prefetch_option(tmp_path, capsys):
    tr, _ = _returning_prefix(tmp_path)
    base = ["run", "--trace", str(tr.path), "--kv-bytes-per-token", str(4 << 20), "--block-tokens", "64",
            "--decode-tps", "10", "--dram-gib", "4", "--cxl-gib", "5", "--policy", "kvtier", "--json"]
    hits = {}
    for flag in ("on", "off"):
        assert cli.main(base + ["--kvtier-prefetch", flag]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["kvtier_settings"]["prefetch"] is (flag == "on")
        hits[flag] = doc["results"][0]["hit_ratio"][0]
    assert hits["on"] > hits["off"]


def _short_resident_and_two_long_new_blocks():
    """DRAM holds 2 and moves 2 blocks a tick. R and F fill it at t=0 (F is
    read once, then never); X and Y come at t=1 and are read twice a tick
    for ten ticks, R once a tick for three more. Every tick from 1 to 3
    reads three blocks, so at least one read a tick misses: the optimum,
    42 of 45, demotes F and R after tick 0 so that X and Y both land in
    DRAM, and loses R's three reads."""
    R, F, X, Y = range(4)
    ev = [(0.0, R, OP_ALLOC, 0), (0.0, F, OP_ALLOC, 0), (0.5, F, OP_ACCESS, 1), (0.5, R, OP_ACCESS, 1),
          (1.0, X, OP_ALLOC, 0), (1.0, Y, OP_ALLOC, 0)]
    ev += [(t + 0.5, R, OP_ACCESS, 1) for t in range(1, 4)]
    ev += [(t + 0.5, b, OP_ACCESS, 2) for t in range(1, 11) for b in (X, Y)]
    return mk(sorted(ev)), tiers_cfg(2, migrate_gbps=2.5 * BS / 1e9)


def test_feasible_oracle_weighs_reads_over_a_horizon_not_the_next_read():
    from kvtier.sim.oracles import HorizonPlanner, NextUsePlanner

    tr, cfg = _short_resident_and_two_long_new_blocks()
    # R is read in the next tick like X and Y, so next-use time keeps it, Y
    # lands on CXL and goes up only once R ends: 41
    assert simulate(tr, cfg, NextUsePlanner()).served == [41.0, 4.0]
    assert simulate(tr, cfg, HorizonPlanner()).served == [42.0, 3.0]
    oracle = FeasibleOracle()
    assert simulate(tr, cfg, oracle).served == [42.0, 3.0]
    assert oracle.tried == {"horizon": 42 / 45, "next-use": 41 / 45}


def test_feasible_oracle_is_the_better_of_its_planners_on_the_bad_old_cases():
    from kvtier.sim.oracles import HorizonPlanner, NextUsePlanner

    # with a fast migrator the horizon planner alone finds the hand-worked
    # optimum (23); with one move a tick it cuts the exchange after the
    # demotion and gets 12 where the next-use planner gets the optimum, 13:
    # the oracle takes the better
    assert simulate(oracle_trace(), tiers_cfg(2), HorizonPlanner()).served == [23.0, 1.0]
    one_move = 1.5 * BS / 1e9
    oracle = FeasibleOracle()
    assert simulate(oracle_trace(), tiers_cfg(2, migrate_gbps=one_move), oracle).served == [13.0, 11.0]
    assert oracle.tried == {"horizon": 12 / 24, "next-use": 13 / 24}
    tr = small_trace()
    cfg = tiers_cfg(120, 4096)
    oracle = FeasibleOracle()
    hit = simulate(tr, cfg, oracle).fast_hit
    assert hit == max(oracle.tried.values())
    assert hit == simulate(tr, cfg, max((HorizonPlanner(), NextUsePlanner()), key=lambda p: oracle.tried[p.name])).fast_hit


@pytest.mark.parametrize("frac", [0.1, 0.25])
def test_feasible_oracle_beats_lru_and_kvtier_on_a_bailian_trace(frac):
    # tests/data/bailian/small.jsonl: 150 requests at 2/s, 20-200 new 16-token
    # blocks each, half the turns extending an earlier chat (gen_bailian.py
    # --requests 150 --seed 7). The next-use oracle alone fell below kvtier on
    # such traces (0.949 against 0.986 at 25 %, 400 requests).
    from pathlib import Path

    from kvtier.sim.requests import RequestTrace

    tr = RequestTrace(Path(__file__).resolve().parents[1] / "data" / "bailian" / "small.jsonl", model="qwen2-7b")
    dram = int(tr.footprint_blocks * frac)
    cfg = SimConfig().with_capacities([dram * tr.block_bytes / GIB, (tr.nblocks - dram) * tr.block_bytes / GIB])
    oracle = simulate(tr, cfg, FeasibleOracle()).fast_hit
    assert oracle >= simulate(tr, cfg, LRU()).fast_hit
    assert oracle >= simulate(tr, cfg, Kvtier()).fast_hit
