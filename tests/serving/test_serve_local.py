"""``rocs serve ARTIFACT`` on a Ray of its own (the default: no ``--address``), in a subprocess:
every process of the Ray it starts listens on 127.0.0.1 only (its GCS, raylet, agents, workers,
Serve's proxy and replicas), it scores, and Ctrl-C (SIGINT) stops it with exit status 0, nothing
alarming on its console, and none of its processes left.

In the ``ray`` xdist group, as the other serving tests, in a module of its own so that its Ray
and the one of ``test_ray_serve.py`` do not start at the same time (that module's Ray stops with
its last test). Bounded: the command must answer within ``START_S`` and stop within ``STOP_S``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import serving_models as H
import torch
from models_for_tests import DICT_FEATURES
from ray_processes import descendants, non_loopback, wait_dead

import rocs_compiler as rocs

pytest.importorskip("ray.serve", reason="the serving tests need the serve extra (ray[serve])")

from rocs_compiler.serving import launch  # noqa: E402 - needs Ray

pytestmark = pytest.mark.xdist_group("ray")

START_S, STOP_S, TIMEOUT_S = 240, 90, 60
# What a clean stop must not print (Ray's report of a task killed under it, a traceback).
ALARMING = ("Traceback", "killed by", "failed", "Error", "error:")


def _get(url: str, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
        return answer.status, json.loads(answer.read())


def _ready(process: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if _get(f"{url}/healthz")[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise AssertionError(f"rocs serve did not come up:\n{log.read_text()}")


def test_a_local_rocs_serve_listens_on_loopback_only_and_stops_quietly_on_sigint(tmp_path):
    model = DICT_FEATURES.build()
    artifact = tmp_path / "dict_features.pt2"
    rocs.save(rocs.export(DICT_FEATURES.compile(model, options={})), artifact)
    port = launch.free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "rocs_compiler.cli.main", "serve", str(artifact),
               "--port", str(port), "--threads", "1"]  # fmt: skip
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    started: set[int] = set()
    try:
        _ready(process, url, log)
        started = descendants(process.pid) | {process.pid}
        exposed = non_loopback(started)
        assert not exposed, f"listening beyond 127.0.0.1: {exposed}"
        body = H.dense_requests(DICT_FEATURES.batch([3], seed=6), DICT_FEATURES.request_inputs)[0]
        status, answer = _get(f"{url}/score", body)
        assert status == 200
        want = H.dense_alone(model, body)
        for key, value in want.items():
            torch.testing.assert_close(torch.tensor(answer["scores"][key]), value)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=STOP_S) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    output = log.read_text()
    assert f"at {url}/score" in output, output
    alarming = [line for line in output.splitlines() if any(w in line for w in ALARMING)]
    assert not alarming, output
    left = wait_dead(started, STOP_S)
    assert not left, f"processes left after rocs serve stopped: {left}"
