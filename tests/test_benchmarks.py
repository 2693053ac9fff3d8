"""The benchmark scripts keep working: each one's --smoke mode runs on CPU (in its own process, as
the GPU run starts them) and writes JSON with the keys the report, the plot and docs rely on; plus
the byte model of the physical floor and the verify fit, checked in process.

The smoke runs start together (step_times then e2e, which reuses step_times' executables through
the session's persistent cache; kernels and peers beside them), so the module costs about the
longest chain, not the sum.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import common
from jaxspec import demo

REPO = Path(__file__).resolve().parents[1]
# Smoke runs only check that the scripts run: skip LLVM's expensive passes to compile faster.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
SCRIPTS = ("step_times", "e2e", "kernels", "kernel_sweep", "peers", "profile_step", "demo_drafters", "startup",
           "throughput", "plot", "plot_acceptance", "report", "tp", "static_code")


def _start(script: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FAST_XLA).strip())
    return subprocess.Popen([sys.executable, str(REPO / "benchmarks" / f"{script}.py"), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """{script: (json dict, stdout)} of every smoke run, plus the --help outputs."""
    out = tmp_path_factory.mktemp("bench")
    path = {name: out / f"{name}.json" for name in ("step_times", "e2e", "kernels", "kernel_sweep", "peers",
                                                   "profile_step", "demo_drafters", "startup", "throughput", "tp")}
    step = _start("step_times", "--smoke", "--out", str(path["step_times"]))
    beside = ("kernels", "kernel_sweep", "peers", "profile_step", "demo_drafters", "startup", "throughput", "tp")
    side = {name: _start(name, "--smoke", "--out", str(path[name])) for name in beside}
    runs = {"step_times": _finish(step)}
    e2e = _start("e2e", "--smoke", "--out", str(path["e2e"]))
    plot = _start("plot", "--input", str(path["step_times"]), "--out", str(out / "verify_curve.png"))
    runs["plot"] = _finish(plot)
    runs["e2e"] = _finish(e2e)
    runs.update({name: _finish(proc) for name, proc in side.items()})
    runs["plot_acceptance"] = _finish(_start("plot_acceptance", "--input", str(path["demo_drafters"]),
                                             "--out", str(out / "acceptance.png")))
    runs["report"] = _finish(_start("report", str(out)))
    return {"dir": out, "stdout": runs, "json": {n: json.loads(p.read_text()) for n, p in path.items()}}


def _common_keys(doc: dict, name: str) -> None:
    assert doc["benchmark"] == name
    assert doc["status"] == "complete", doc["errors"]
    assert {"date_utc", "versions", "python"} <= set(doc["env"])
    assert doc["args"]["smoke"] is True


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_has_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_step_times_smoke(smoke):
    doc = smoke["json"]["step_times"]
    _common_keys(doc, "step_times")
    assert doc["bandwidth"]["bytes_per_s"] > 0 and doc["env"]["backend"] == "cpu"
    (shape,) = doc["results"]
    assert shape["shape"] == "demo-qwen3.5" and shape["kernels"] == "xla"
    (batch,) = shape["batches"]
    assert [(i["kind"], i["T"]) for i in batch["items"]] == [("decode", 1), ("verify", 2)]
    for item in batch["items"]:
        assert item["latency_ms"] > 0 and item["pipelined_ms"] > 0 and item["floor_ms"] > 0
        assert item["ratio_to_floor"] > 0 and len(item["timing"]["latency"]["samples_ms"]) == 3
        assert {"weights", "kv", "gdn_state", "floor", "logits"} <= set(item["bytes"])
    assert {"a_ms", "b_ms_per_token", "r2"} <= set(batch["fit"]["pipelined_ms"])
    mem = shape["memory"]
    assert mem["kv_bytes_per_token"] > 0 and mem["gdn_state_bytes_per_slot"] > 0
    assert all(r["max_batch"] >= 1 for r in mem["rows"])
    assert "verify(t) fit" in smoke["stdout"]["step_times"]


def test_tp_smoke(smoke):
    """One and two of the suite's virtual CPU devices: step times, collectives, profile, end to end."""
    doc = smoke["json"]["tp"]
    _common_keys(doc, "tp")
    one, two = doc["results"]
    assert (one["tp"], two["tp"]) == (1, 2) and two["weights_bytes_per_device"] < one["weights_bytes_per_device"]
    for rec in (one, two):
        assert [b["R"] for b in rec["batches"]] == [1, 2]
        assert all(i["pipelined_ms"] > 0 and i["floor_per_device_ms"] > 0 for b in rec["batches"] for i in b["items"])
        assert set(rec["e2e"]) == {"R=1 plain", "R=1 replay a0.8 k3", "R=2 plain", "R=2 replay a0.8 k3"}
    assert all(c == {} for c in one["collectives"].values()) and one["profile"]["all_reduce_share"] == 0
    assert all(c["all-reduce"] == 2 * 4 + 1 for c in two["collectives"].values())  # demo-qwen3: 4 layers
    assert 0 < two["profile"]["all_reduce_share"] < 1
    assert "vs tp1" in smoke["stdout"]["tp"]


def test_e2e_smoke(smoke):
    doc = smoke["json"]["e2e"]
    _common_keys(doc, "e2e")
    (rec,) = doc["results"]
    assert rec["plain"]["tokens"] == 12 and rec["plain"]["tokens_per_s"] > 0 and rec["prefill_s"] > 0
    assert [r["method"] for r in rec["runs"]] == ["replay", "ngram", "draft_model", "eagle3", "dflash"]
    for r in rec["runs"]:
        # Deterministic CPU smoke: every speculative output equals plain (measured; bfloat16 may part
        # elsewhere, docs/user_guide.md); tau = 1 + the summed acceptance by position (each round
        # drafts every position once), so a wrong tau or acceptance column fails here.
        assert r["tokens"] == 12 and r["identical_fraction"] == 1.0 and r["first_divergence"] == [None]
        assert len(r["acceptance_by_position"]) == r["k"]
        assert r["tau"] == pytest.approx(1.0 + sum(r["acceptance_by_position"]))
        assert {"speedup", "speedup_e2e", "model_speedup", "c", "acceptance_by_position"} <= set(r)
    assert rec["runs"][0]["expected_tau"] == pytest.approx(1.8)
    assert rec["precompile"]["executables"] >= 8 and not rec["precompile"]["errors"]


def test_kernels_smoke(smoke):
    doc = smoke["json"]["kernels"]
    _common_keys(doc, "kernels")
    assert doc["fla"]["available"] is False and "cpu" in doc["fla"]["reason"]
    done = {(r["kernel"], r["impl"]) for r in doc["results"]}
    # Every kernel ran both ways: a Pallas row may not vanish into errors or a budget skip.
    one_kernel = {("attention", "pallas_onepass"), ("gdn_verify", "pallas_fused")}
    assert done == {(kernel, impl) for kernel in ("gdn_verify", "attention", "conv", "prefill")
                    for impl in ("xla", "pallas")} | one_kernel, done
    assert not doc["errors"] and [s["what"] for s in doc["skipped"]] == ["fla"], (doc["errors"], doc["skipped"])
    for r in doc["results"]:
        assert r["us"] > 0 and r["floor_us"] > 0 and r["T"] == r["k"] + 1


def test_kernel_sweep_smoke(smoke):
    doc = smoke["json"]["kernel_sweep"]
    _common_keys(doc, "kernel_sweep")
    assert not doc["errors"] and not doc["skipped"], (doc["errors"], doc["skipped"])
    rows = doc["results"]
    configs = {k: {tuple(r["config"]) for r in rows if r["kernel"] == k}
               for k in ("attention", "gdn_verify", "gdn_verify_mixed")}
    # The grid (pages per step 1, 2 x splits 1, 2) plus the default (4 pages, its own split count).
    # one split has nothing to merge (fused only); two splits run both merges
    want = {(p, 1, 4, 2, "fused") for p in (1, 2)} | {(p, 2, 4, 2, m) for p in (1, 2) for m in ("fused", "kernel")}
    assert want < configs["attention"], configs
    assert not {c for c in configs["attention"] if c[1] == 1 and c[4] != "fused"}, configs
    assert configs["gdn_verify"] == configs["gdn_verify_mixed"] == {(bv, 4, form) for bv in (16, 32)
                                                                     for form in ("sequential", "chunk")}, configs
    # chunk 16, V-blocks 16 / 32, 4 warps, 1 stage, IEEE dots; plus the default (chunk 64, 2 stages, TF32)
    prefill = {tuple(r["config"]) for r in rows if r["kernel"] == "gdn_prefill"}
    assert prefill == {(16, 16, 4, 1, "ieee"), (16, 32, 4, 1, "ieee"), (64, 32, 4, 2, "tf32")}, prefill
    # each prefill config's output against the reference (interpreted: IEEE dots, float32's error)
    errors = {tuple(r["config"]): r["error"] for r in rows if r["kernel"] == "gdn_prefill"}
    assert all(0 <= e < 1e-5 for e in errors.values()), errors
    # each verify config's readout and pool against the reference (the fused kernel reads bf16 inputs)
    errors = {(r["kernel"], tuple(r["config"])): r["error"] for r in rows if r["kernel"].startswith("gdn_verify")}
    assert len(errors) == 8 and all(0 <= e < 1e-5 for e in errors.values()), errors
    assert all(r["error"] is None for r in rows if not r["kernel"].startswith("gdn_"))
    # token tiles 4 / 8 x 64 channels, 4 warps, the line's tail copied or skipped; plus the default (8 tokens,
    # 256 channels, copied), for the prefill conv and the decode / verify step's
    for kernel in ("conv_prefill", "conv_verify"):
        conv = {tuple(r["config"]) for r in rows if r["kernel"] == kernel}
        assert conv == {(t, 64, 4, tail) for t in (4, 8) for tail in ("copy", "skip")} | {(8, 256, 4, "copy")}, conv
    # K slabs of 64 (the gated norm: its 128-channel group) x column blocks 16 / 32, 4 warps, 3 stages, weights
    # [K, N] and [N, K], splits 1 / 2 where they divide the K slabs (out's 256 = two slabs; gate_up's and
    # down's K fit one), the dot and fma bodies, merge "kernel"; the default (64 columns, 4 stages, [K, N],
    # `split_count`'s splits, dot); XLA's ops
    linear = {(r["layout"], tuple(r["config"])) for r in rows if r["kernel"] == "linear"}

    def grid(k, splits, default):
        return {(k, n, 4, 3, w, s, b, "kernel") for n in (16, 32) for w in ("kn", "nk") for s in splits
                for b in ("dot", "fma")} | {default, ("xla",)}

    want = grid(64, (1,), (64, 64, 4, 4, "kn", 1, "dot", "kernel"))
    assert linear == ({(f"demo:{proj}", c) for proj in ("gate_up", "down") for c in want}
                      | {("demo:out", c) for c in grid(128, (1, 2), (128, 64, 4, 4, "kn", 2, "dot", "kernel"))}), linear
    assert sum(r["default"] for r in rows) == 9  # one default per (kernel, shape)
    for r in rows:
        assert r["wall_us"] > 0 and r["floor_us"] > 0 and r["busy_us"] is None  # no GPU kernels on CPU
    assert "busy/floor" in smoke["stdout"]["kernel_sweep"]


def test_kernel_sweep_counters_only_launches(tmp_path, monkeypatch):
    """`kernel_sweep --counters` (for a hardware-counter profiler) runs each config --repeats times and
    neither probes the bandwidth, nor times, nor opens a JAX profile."""
    from benchmarks import common, kernel_sweep

    def refuse(*_, **__):
        raise AssertionError("--counters must not measure")

    for name in ("measure_bandwidth", "time_steps"):
        monkeypatch.setattr(common, name, refuse)
    monkeypatch.setattr(kernel_sweep, "_busy_us", refuse)
    batches = []
    monkeypatch.setattr(common, "block", lambda outs: batches.append(len(outs)))
    out = tmp_path / "counters.json"
    assert kernel_sweep.main(["--smoke", "--counters", "--kernels", "gdn_verify_mixed", "--gdn-forms", "sequential",
                              "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["status"] == "complete", doc["errors"]
    rows = doc["results"]
    assert len(rows) == 2 and {tuple(r["config"][:1]) for r in rows} == {(16,), (32,)}
    assert all(r["calls"] == 3 and r["wall_us"] is None and r["floor_us"] is None for r in rows)
    assert batches == [3, 3] and doc["bandwidth"] is None


def test_static_code_reads_each_configs_kernel(tmp_path):
    """static_code --smoke lowers one kernel per config and counts its own Triton IR: the unrolled
    sequential form grows with the span, the chunk form differs from it; with triton installed every
    row also has its compiled registers and SASS, without it the JSON says why they are missing."""
    from benchmarks import static_code

    out = tmp_path / "static_code.json"
    assert static_code.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    _common_keys(doc, "static_code")
    ops = {(r["T"], r["form"]): sum(r["ir_ops"].values()) for r in doc["results"]}
    assert set(ops) == {(2, "sequential"), (2, "chunk"), (4, "sequential"), (4, "chunk")}
    assert ops[(4, "sequential")] > ops[(2, "sequential")] > 0 and ops[(2, "chunk")] != ops[(2, "sequential")]
    assert all(r["ir_ops"].get("tt.store", 0) > 0 for r in doc["results"])
    compiled = doc["sass_unavailable"] is None
    assert all(("registers" in r and r["sass_instructions"] > 0) == compiled for r in doc["results"])
    with pytest.raises(SystemExit, match="--forms: unknown form 'unrolled'; valid: sequential, chunk"):
        static_code.parse(["--forms", "sequential,unrolled"])
    with pytest.raises(SystemExit, match="--block-v 'wide': 'default' or a comma list"):
        static_code.parse(["--block-v", "wide"])


def test_static_code_conv_tails(tmp_path):
    """static_code's conv update: without the line's tail the kernel stores exactly the rows past the new
    window fewer (K-1+k_max line rows, K-2+T of them the window) and loads fewer."""
    from benchmarks import static_code

    out = tmp_path / "static_code_conv.json"
    assert static_code.main(["--smoke", "--kernels", "conv_verify", "--tails", "copy,skip", "--out", str(out)]) == 0
    rows = {(r["T"], r["form"]): r["ir_ops"] for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {(T, f"tail {t}") for T in (2, 4) for t in ("copy", "skip")}
    for T in (2, 4):
        copy, skip = rows[(T, "tail copy")], rows[(T, "tail skip")]
        tail_rows = (static_code.CONV_K - 1 + static_code.KMAX) - (static_code.CONV_K - 2 + T)
        assert copy["tt.store"] - skip["tt.store"] == tail_rows and skip["tt.load"] < copy["tt.load"], (copy, skip)
    with pytest.raises(SystemExit, match="--tails: unknown tail 'drop'; valid: copy, skip"):
        static_code.parse(["--tails", "drop"])


@pytest.mark.parametrize("mixed", [False, True])
def test_verify_error_catches_a_wrong_kernel(monkeypatch, mixed):
    """The sweep's verify check measures the kernel it times: right, the error is float32's; a kernel
    that forgets the snapshots (the readout right, the pool as it came) is off by the state's size."""
    import numpy as np

    from benchmarks import kernel_sweep, kernels
    from pallas_kernels.gated_delta import recurrent

    layout, B, T = kernels.SMOKE_GDN["demo"], 2, 3
    state, per, fixed, _, _ = kernels._gdn_inputs(np.random.default_rng(0), layout, B, T, 1)
    check = kernel_sweep._verify_check(state, per[0], fixed, mixed)
    assert kernel_sweep._verify_error((16, 4, "sequential"), check, True, mixed) < 1e-5
    name = "gdn_verify_mixed_pallas" if mixed else "gdn_verify_pallas"
    real = getattr(recurrent, name)

    def forgets_the_snapshots(*args, **kw):
        o, _ = real(*args, **kw)
        return o, args[5]

    monkeypatch.setattr(recurrent, name, forgets_the_snapshots)
    assert kernel_sweep._verify_error((16, 4, "sequential"), check, True, mixed) > 0.1


def test_gdn_valid_counts_the_snapshots_stored():
    """`kernel_sweep --gdn-valid`: inert tokens store no snapshot, so the floor counts the start state and
    one snapshot per valid token; the kernel gets that many valid tokens per row."""
    import numpy as np

    from benchmarks import kernels

    layout, B, T = kernels.SMOKE_GDN["demo"], 2, 4
    _, _, fixed, nbytes, _ = kernels._gdn_inputs(np.random.default_rng(0), layout, B, T, 1)
    state = layout[1] * layout[2] * layout[3] * 4
    assert nbytes["state"] == B * (1 + T) * state
    _, _, fixed1, nbytes1, _ = kernels._gdn_inputs(np.random.default_rng(0), layout, B, T, 1, valid=1)
    assert np.asarray(fixed1["nv"]).tolist() == [1, 1] and np.asarray(fixed["nv"]).tolist() == [T, T]
    assert nbytes1["state"] == B * 2 * state and nbytes1["floor"] == nbytes1["state"] + nbytes["io"]


def test_attention_pools_are_per_layout():
    """One pool cache serves several head layouts (kernel_sweep runs them in turn): each layout
    gets pools of its own shape, not the previous layout's."""
    from benchmarks import kernels

    cache = {}
    for layout in ((4, 2, 32), (8, 4, 16)):
        (k_pages, v_pages), _, _ = kernels._attn_pages(layout, 1, 16, 1, cache)
        assert k_pages.shape[2:] == v_pages.shape[2:] == layout[1:]


def test_peers_smoke(smoke):
    doc = smoke["json"]["peers"]
    _common_keys(doc, "peers")
    assert "backend" not in doc["env"]  # the torch script never starts a JAX backend
    by = {r["shape"]: r["modes"] for r in doc["results"]}
    for mode in ("eager", "assisted", "static_compile"):
        assert by["demo-qwen3"][mode]["tokens_per_s"] > 0 and by["demo-qwen3"][mode]["tokens"] == 8
    assisted = by["demo-qwen3.5"]["assisted"]
    if "refused" in assisted:  # transformers 5.17 refused assisted generation for stateful (GDN) models
        assert "stateful" in assisted["refused"]
    else:  # 5.25 runs it
        assert assisted["tokens"] == 8 and assisted["same_tokens_as_eager"] is True
    assert by["demo-qwen3.5"]["static_compile"]["compiled"] is True


def test_profile_step_smoke(smoke):
    doc = smoke["json"]["profile_step"]
    _common_keys(doc, "profile_step")
    steps = [r["step"] for r in doc["results"]]
    assert steps == ["decode (engine round, greedy, 0 inert)", "decode (engine round, sampling, 0 inert)",
                     "decode x4 rounds per dispatch (0 inert)", "decode T=1 (engine round, greedy, no inert column)",
                     "forward+argmax T=1", "forward+argmax T=2", "verify round k=1 T=2",
                     "prefill chunk C=16 x 1 request"]
    for r in doc["results"]:
        assert r["pipelined_ms"] > 0 and r["floor_ms"] > 0 and r["kernels_per_step"] > 0 and r["top"]
        assert r["steady_ms"] > 0 and r["dispatch_ms"] > 0
    prefill = doc["results"][-1]  # its floor: the slower of its bytes and its FLOPs at the measured matmul rate
    assert prefill["floor_ms"] == max(prefill["bytes_floor_ms"], prefill["compute_floor_ms"]) > 0
    assert doc["matmul"]["flop_per_s"] > 0
    assert "top kernels" in smoke["stdout"]["profile_step"] and "steady ms" in smoke["stdout"]["profile_step"]


def test_profile_step_engine_holds_the_context():
    """profile_step / step_times: --context past the engine's max_model_len grows it (whole pages,
    half its length of room after the context), so the block table covers every cached token the
    floor counts."""
    from benchmarks import common
    from benchmarks.profile_step import parse

    assert parse(["--context", "512"]).engine == common.ENGINE  # the default fits: unchanged
    engine = parse(["--context", "8192"]).engine
    assert engine["max_model_len"] == 8192 + 512 and engine["max_model_len"] % engine["page_size"] == 0
    assert {k: v for k, v in engine.items() if k != "max_model_len"} == \
        {k: v for k, v in common.ENGINE.items() if k != "max_model_len"}
    assert common.engine_for_context(common.ENGINE, 8190)["max_model_len"] == 8704  # rounded up to a page
    from benchmarks.step_times import parse as step_times_parse

    assert step_times_parse(["--context", "8192"]).engine == engine  # step_times sizes its engine alike


def test_profile_step_rows_keeps_the_matching_steps():
    from benchmarks.profile_step import select_rows

    plan = [("decode (greedy)", 1, None), ("forward+argmax T=2", 2, None), ("verify round k=1 T=2", 2, None)]
    assert select_rows(plan, None) == plan
    assert [r[0] for r in select_rows(plan, re.compile("greedy|verify"))] == ["decode (greedy)", "verify round k=1 T=2"]
    with pytest.raises(SystemExit, match=r"matches no step(.|\n)*forward\+argmax T=2"):
        select_rows(plan, re.compile("prefill"))


def test_profile_step_sequence_is_the_second_call_in_launch_order():
    from benchmarks.profile_step import call_sequence

    # two calls of three kernels each, listed out of start order (trace lines interleave streams)
    events = [("b", 20, 2000), ("a", 0, 1000), ("c", 30, 500), ("a2", 100, 1500), ("c2", 130, 250),
              ("b2", 120, 3000)]
    assert call_sequence(events, 2) == [["a2", 1.5], ["b2", 3.0], ["c2", 0.25]]
    assert call_sequence(events[:3], 1) == [["a", 1.0], ["b", 2.0], ["c", 0.5]]


def test_bandwidth_probe_reads_every_pass():
    from benchmarks.common import measure_bandwidth

    bw = measure_bandwidth(2**20, repeats=2, pipeline=2)
    assert set(bw["readings_tb_per_s"]) == {"copy_float32", "copy_uint32", "column_sum_float32", "row_sum_float32",
                                            "column_sum_bfloat16", "row_sum_bfloat16", "matvec_bfloat16",
                                            "matvec_rows_bfloat16"}
    assert bw["tb_per_s"] == max(bw["readings_tb_per_s"].values()) > 0


class _FakeDevice:
    """A device that runs each call `step_s` after the previous one ends and whose result reaches the
    host `readback_s` later; dispatch is free."""

    def __init__(self, step_s: float, readback_s: float):
        self.step_s, self.readback_s, self.free_at = step_s, readback_s, 0.0

    def __call__(self):
        self.free_at = max(self.free_at, time.perf_counter()) + self.step_s
        return _FakeResult(self.free_at + self.readback_s)


class _FakeResult:
    def __init__(self, ready_at: float):
        self.ready_at = ready_at

    def block_until_ready(self):
        time.sleep(max(0.0, self.ready_at - time.perf_counter()))
        return self


def test_time_steps_steady_cancels_fill_and_drain():
    """A 1 ms step read back 10 ms later: 8 pipelined calls carry the readback (~2.25 ms a call), the
    slope between 8 and 40 calls does not (~1 ms); dispatch is the host's share (~0)."""
    t = common.time_steps(_FakeDevice(1e-3, 10e-3), warmup=1, repeats=5, pipeline=8)
    assert t["pipeline_long"] == 40 and t["latency"]["median_ms"] > 10
    assert t["pipelined"]["median_ms"] > 2.0 and 0.8 < t["steady"]["median_ms"] < 1.3
    assert t["dispatch"]["median_ms"] < 0.5 and t["dispatch_idle"]["median_ms"] < 0.5
    bare = common.time_steps(_FakeDevice(1e-4, 0.0), warmup=0, repeats=1, pipeline=0)
    assert bare["latency"] and bare["pipelined"] is bare["steady"] is bare["dispatch"] is None
    assert bare["dispatch_idle"] is None


class _QueuedDevice(_FakeDevice):
    """A device whose launch queue holds `depth` calls: a call past it waits for a slot to free."""

    def __init__(self, step_s: float, depth: int):
        super().__init__(step_s, 0.0)
        self.depth = depth

    def __call__(self):
        time.sleep(max(0.0, self.free_at - self.depth * self.step_s - time.perf_counter()))
        return super().__call__()


def test_dispatch_idle_is_the_hosts_cost_when_the_queue_is_full():
    """With a 2-call queue and a 2 ms step, a long run's calls wait for queue slots (dispatch ~ the step);
    the first call of each long run, on an idle device, returns at once."""
    t = common.time_steps(_QueuedDevice(2e-3, 2), warmup=1, repeats=3, pipeline=8)
    assert t["dispatch"]["median_ms"] > 1.5 and t["dispatch_idle"]["median_ms"] < 0.5, t


def test_throughput_smoke(smoke):
    doc = smoke["json"]["throughput"]
    _common_keys(doc, "throughput")
    rows = {(r["batch"], r["method"], r["k"]): r for r in doc["results"]}
    assert set(rows) == {(b, m, k) for b in (1, 3) for m, k in (("plain", 0), ("ngram", 2), ("replay", 2))}
    for (batch, _, _), r in rows.items():
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and 0 < r["pool_peak"] <= 1
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert (r["token_latency_p50_ms"] is None) == (r["tokens"] == batch)  # one token each: no gaps
    # replay's reference is the speculative path's own output, so every undisturbed draft is accepted
    assert all(rows[(b, "replay", 2)]["tau"] > 1 for b in (1, 3))
    assert "tok/s" in smoke["stdout"]["throughput"]


def test_demo_drafters_smoke(smoke):
    doc = smoke["json"]["demo_drafters"]
    _common_keys(doc, "demo_drafters")
    assert len(doc["prompts"]) == 2 and all(p.endswith(".py") for p in doc["prompts"])
    rows = {(r["method"], r["k"], r.get("dynamic_k", False)): r for r in doc["results"]}
    shipped = [m for m in ("eagle3", "dflash") if (demo.TRAINED_ROOT / m).is_dir()]  # the tap drafters
    assert set(rows) == {("plain", 0, False), ("draft_model", 2, False), ("ngram", 2, False), ("mtp", 2, False),
                         ("draft_model", 2, True), ("ngram", 2, True), *((m, 2, False) for m in shipped)}
    skipped = {s["what"]: s["reason"] for s in doc["skipped"]}
    for method in {"eagle3", "dflash"} - set(shipped):  # recorded, with the reason, not silently left out
        assert "does not ship" in skipped[f"{method} k=2"]
    assert all(r["tokens"] == 2 * 8 and r["tokens_per_s"] > 0 for r in rows.values())  # exact lengths
    for method in ("draft_model", "ngram", "mtp"):
        r = rows[(method, 2, False)]
        assert r["greedy_equal"] and len(r["acceptance_by_position"]) == 2
        assert r["tau"] == pytest.approx(1.0 + sum(r["acceptance_by_position"]))
        assert r["acceptance"] == pytest.approx(sum(r["acceptance_by_position"]) / 2)
    for method in ("draft_model", "ngram"):  # dynamic k: rounds at k 1 or 2
        r = rows[(method, 2, True)]
        assert r["greedy_equal"] and sum(r["stats"]["k_histogram"][1:]) == r["stats"]["steps"]
    assert rows[("mtp", 2, False)]["tau"] > 1.0  # the trained head's drafts are accepted
    assert "acceptance by position" in smoke["stdout"]["demo_drafters"]


def test_startup_smoke(smoke):
    doc = smoke["json"]["startup"]
    _common_keys(doc, "startup")
    runs = doc["results"][0]["runs"]
    assert list(runs) == ["cold", "warm", "precompile", "after_precompile"]
    assert all(r["returncode"] == 0 for r in runs.values())
    assert runs["cold"]["compiles"] > 0 and runs["cold"]["cache_loads"] == 0
    for warm in ("warm", "after_precompile"):  # served from the persistent cache: nothing compiles
        assert runs[warm]["compiles"] == 0 and runs[warm]["cache_loads"] == runs["cold"]["compiles"]
    assert "ttft s" in smoke["stdout"]["startup"]


def test_plot_and_report(smoke):
    for png in ("verify_curve.png", "acceptance.png"):
        assert (smoke["dir"] / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "acceptance by position" in smoke["stdout"]["plot_acceptance"]
    summary = (smoke["dir"] / "summary.md").read_text()
    for name in ("step_times", "e2e", "kernels", "peers"):
        assert f"## {name}" in summary
    assert "bandwidth" in smoke["stdout"]["report"]


def test_headline_reads_the_steady_wall_and_startup(tmp_path):
    """report.headline: the decode wall is the steady column where the run has it (the 8-call
    pipelined figure otherwise), next to busy and floor; warm and cold time to first token from
    startup.json; ratios to HF static + compile."""
    from benchmarks import report

    decode = {"step": "decode (engine round, greedy, 1 inert)", "pipelined_ms": 2.5, "steady_ms": 1.9,
              "device_busy_ms": 1.88, "floor_ms": 1.0}
    (tmp_path / "profile_step_qwen3.5-2b.json").write_text(json.dumps(
        {"results": [decode], "bandwidth": {"tb_per_s": 3.78}}))
    (tmp_path / "profile_step_qwen3-4b.json").write_text(json.dumps(
        {"results": [{k: v for k, v in decode.items() if k != "steady_ms"}]}))
    (tmp_path / "startup.json").write_text(json.dumps({"results": [
        {"shape": "qwen3.5-2b", "runs": {"cold": {"ttft_s": 11.2}, "warm": {"ttft_s": 3.4}}}]}))
    (tmp_path / "e2e.json").write_text(json.dumps({"results": [
        {"shape": "qwen3.5-2b", "batch": 1, "plain": {"tokens_per_s": 500.0},
         "runs": [{"method": "replay", "k": 7, "alpha": 0.8, "tokens_per_s": 1600.0, "tau": 3.6}]}]}))
    (tmp_path / "peers.json").write_text(json.dumps({"results": [
        {"shape": "qwen3.5-2b",
         "modes": {"static_compile": {"tokens_per_s": 250.0}, "eager": {"tokens_per_s": 28.0}}}]}))
    head = report.headline(tmp_path)
    row = head["qwen3.5-2b"]
    assert row["decode_step_wall_ms"] == 1.9 and row["decode_step_pipelined_8_ms"] == 2.5
    assert row["decode_device_busy_ms"] == 1.88 and row["bandwidth_tb_s"] == 3.78
    assert (row["startup_warm_ttft_s"], row["startup_cold_ttft_s"]) == (3.4, 11.2)
    assert row["plain_over_hf_static_compile"] == 2.0 and row["spec_over_hf_static_compile"] == 6.4
    assert head["qwen3-4b"]["decode_step_wall_ms"] == 2.5  # an older run without the steady column


# ---- the byte model and the fit, in process ------------------------------------------------------


def test_floor_counts_the_union_of_routed_experts():
    cfg = common.model_config(common.shape_config("qwen3.5-35b-a3b"))
    row = cfg.hidden_size * 2  # one gathered bf16 embedding row (untied: the lm_head is read in full)
    weights = {"embed": 1000 * row, "lm_head": 20, "experts": 256 * 1000, "rest": 5}
    one = common.step_bytes(cfg, weights, 1, 1, 0)
    assert one["weights"] == row + 20 + 8 * 1000 + 5  # top-8 of 256 experts
    full = common.step_bytes(cfg, weights, 8, 16, 0)  # 128 random tokens x top-8 of 256: most experts
    union = 256 * (1 - (1 - 8 / 256) ** 128)  # expected distinct experts, ~251.6
    assert full["experts_per_layer"] == pytest.approx(union, abs=0.01) and 250 < union < 256
    assert full["weights"] == 128 * row + 20 + round(union * 1000) + 5
    assert common.expected_experts(cfg, 10_000) == pytest.approx(256)
    # GDN: the start state once plus one fp32 snapshot per token, per GDN layer and request
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = (2 * 3 + 16) * cfg.gdn_conv_dim * 2
    assert full["gdn_state"] == len(cfg.gdn_layers) * 8 * (17 * state + conv)


def test_published_shapes_have_their_parameter_counts():
    expect = {"qwen3-4b": 4.02e9, "qwen3.5-2b": 1.88e9, "qwen3.5-27b": 26.9e9, "qwen3.5-35b-a3b": 34.7e9,
              "qwen3-next-80b-a3b": 79.7e9}
    for name, count in expect.items():
        cfg = common.model_config(common.shape_config(name))
        params = sum(common.params_bytes_by_kind(cfg).values()) / 2  # bf16
        assert params == pytest.approx(count, rel=0.01), name
    cut = common.model_config(common.shape_config("qwen3.5-27b", layers=8))
    assert cut.num_hidden_layers == 8 and len(cut.attention_layers) == 2
    cut = common.model_config(common.shape_config("qwen3-next-80b-a3b", layers=8))
    assert len(cut.attention_layers) == 2 and set(cut.mlp_kinds) == {"moe"} and cut.num_experts == 512


def test_fit_line_recovers_a_line():
    from benchmarks.step_times import fit_line

    t = [1, 2, 4, 8, 16]
    fit = fit_line(t, [3.0 + 0.5 * x for x in t])
    assert fit["a_ms"] == pytest.approx(3.0) and fit["b_ms_per_token"] == pytest.approx(0.5)
    assert fit["r2"] == pytest.approx(1.0) and fit_line([1], [1.0]) is None
    assert common.parse_layers("a=4,b=8", ["a", "b", "c"]) == {"a": 4, "b": 8, "c": None}
    assert np.isclose(common.median([3, 1, 2, 10]), 2.5)


@pytest.mark.parametrize("name", [s for s in SCRIPTS if hasattr(importlib.import_module(f"benchmarks.{s}"), "parse")])
def test_default_arguments_parse(name):
    """The GPU run takes each script's defaults: they must pass the script's own checks (a default
    of one repeat once made throughput.py refuse to start on the GPU)."""
    args = importlib.import_module(f"benchmarks.{name}").parse([])
    assert args.smoke is False


def test_throughput_sustained_load_workload():
    """--requests-per-slot W: a cell draws B x W requests (a seed of its own; W = 1 keeps the one-wave
    workload of earlier runs), and a count below 1 is refused."""
    from benchmarks import throughput

    one, three = throughput.parse(["--smoke"]), throughput.parse(["--smoke", "--requests-per-slot", "3"])
    prompts, news = throughput.workload(2, three, vocab=256)
    assert len(prompts) == len(news) == 6
    assert throughput.workload(2, one, vocab=256)[0] != prompts[:2]
    with pytest.raises(SystemExit, match="requests-per-slot"):
        throughput.parse(["--smoke", "--requests-per-slot", "0"])


def test_throughput_profiled_call_reports_busy_time_and_kernels():
    """--profile: one call inside a profiler trace gives its wall time beside the device-busy time
    (on CPU the XLA runtime threads' events stand in for kernels), the prefill calls and top kernels."""
    import jaxspec
    from benchmarks import throughput

    model = jaxspec.load("demo:qwen3", max_num_seqs=2, max_model_len=64, prefill_chunk=8)
    prof = throughput.profiled_stream(model, [[1, 2, 3, 4, 5], list(range(3, 15))], [4, 6], None, top=3)
    assert prof["prefill_calls"] >= 2 and prof["kernels"] > 0 and len(prof["top"]) == 3
    assert 0 < prof["device_busy_s"] and prof["wall_s"] > 0
    assert prof["top"][0]["ms"] >= prof["top"][-1]["ms"] and all(t["calls"] >= 1 for t in prof["top"])


def test_load_paths_fresh_probes_each_phase_in_new_processes(tmp_path):
    """tools/load_paths.py --fresh: two new processes per pool setting, each timing the backend's
    start, its first put, the reads, the puts and jaxspec's restore of a saved params file."""
    from jaxspec import saved

    path = saved.save_params({"embed": np.ones((16, 8), np.float32), "layers": [{"w": np.eye(4, dtype=np.float32)}]},
                             tmp_path / "ck")
    out = tmp_path / "fresh.json"
    subprocess.run([sys.executable, str(REPO / "tools" / "load_paths.py"), "--fresh", str(path), str(out)], check=True,
                   capture_output=True, timeout=600)
    lines = json.loads(out.read_text())["fresh"]
    assert [line["preallocate"] for line in lines] == ["true", "true", "false", "false"]
    for line in lines:
        assert line["file_bytes"] == path.stat().st_size
        assert all(line[k] > 0 for k in ("backend_start_s", "first_put_s", "read_8_threads_s", "put_8_threads_s",
                                         "put_again_8_threads_s", "jaxspec_restore_s"))


def test_fla_child_failure_is_recorded_and_the_run_goes_on(tmp_path):
    """Each fla config runs in a process of its own (a failed CUDA-graph capture poisons torch for the
    rest of its process): a child that fails (here: no fla, no CUDA) becomes an error entry per config,
    and the parent keeps going."""
    from benchmarks import kernels

    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla is installed here: its children would run, not fail")
    args = kernels.parse(["--smoke", "--out", str(tmp_path / "k.json"), "--prefill-lens", "16,32"])
    res = common.Results("kernels", args)
    res.data["bandwidth"] = {"bytes_per_s": 1e12}
    kernels.run_fla("prefill", "demo", kernels.SMOKE_GDN["demo"], args, res)
    assert [e["what"] for e in res.data["errors"]] == ["fla prefill demo B=1 T=16", "fla prefill demo B=1 T=32"]
    assert all("exit" in e["error"] for e in res.data["errors"]) and not res.data["results"]
