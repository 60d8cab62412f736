"""Importing ultrafast sets how long libgomp's idle threads spin (omp_env.py), unless the user
chose; peers a benchmark starts get their own default back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ultrafast.bench.serve_servers import llama_cpp_spec, ours_spec, spawn_env
from ultrafast.omp_env import SPIN_COUNT

REPO = Path(__file__).resolve().parents[2]
PROBE = (
    "import os, ultrafast; from ultrafast.omp_env import peer_env; "
    "print(os.environ.get('GOMP_SPINCOUNT'), peer_env().get('GOMP_SPINCOUNT'))"
)


def _probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, **env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


@pytest.mark.parametrize(
    ("env", "ours", "peers"),
    [
        ({}, SPIN_COUNT, "None"),  # ours spins briefly; a peer runs on libgomp's default
        ({"GOMP_SPINCOUNT": "77"}, "77", "77"),  # the user's choice, for everyone
        ({"OMP_WAIT_POLICY": "active"}, "None", "None"),  # a wait policy: left to libgomp
    ],
)
def test_the_spin_count_is_ours_unless_the_user_chose(env, ours, peers):
    assert _probe(**env) == [ours, peers]


def test_peer_servers_start_without_our_spin_count(tmp_path):
    import ultrafast.omp_env as omp_env

    if not omp_env._SET_BY_US:  # this test process inherited a user's setting
        pytest.skip("GOMP_SPINCOUNT was set by the user")
    gguf = tmp_path / "m.gguf"
    assert spawn_env(ours_spec(gguf, "bf16", []))["GOMP_SPINCOUNT"] == SPIN_COUNT
    assert "GOMP_SPINCOUNT" not in spawn_env(llama_cpp_spec(gguf, "bf16", 2, 512))
