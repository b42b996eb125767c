"""Serving end to end: a zoo model and a KJT model deployed once on this process's Ray (the
handle path and HTTP), a saved program deployed there too (``slow``: the last test kills its
replica), and ``rocs serve --address auto`` of that program in a subprocess, joining a cluster
that ``ray start --head`` runs (HTTP, overload, SIGTERM leaves the cluster up). Every test reuses
them.

This process's Ray starts once for the whole run: this module is one xdist group (the README's
and .ci/run's ``pytest -n 2 --dist loadgroup`` keep it on one worker), with ``num_cpus=2``, no
dashboard, and HTTP on 127.0.0.1 at free ports. The cluster starts once its Serve proxy is up (one
cold start at a time), while the replicas load. Every request loop is bounded in count and time;
the teardowns check that no process either Ray started is left. The command's own-Ray default is
covered by ``server`` (the same ``launch.start``/``launch.stop``) and ``test_serve_command.py``
(the command's choice between them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.serve", reason="the serving tests need the serve extra (ray[serve])")

import ray
import serving_models as H
from ray_processes import alive, cmdline, descendants, wait_dead
from models_for_tests import DICT_FEATURES
from ray import serve
from ray.exceptions import RayActorError

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.serving import launch
from rocs_compiler.serving.deployment import deployment
from rocs_compiler.serving.settings import ServeSettings

pytestmark = pytest.mark.xdist_group("ray")

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 60  # any one HTTP request or handle call
COMMAND_START_S, COMMAND_STOP_S = 240, 60
RESTART_S = 180  # a killed replica's replacement answers within this
RAY = Path(sys.executable).with_name("ray")  # the CLI next to this interpreter
# Batches of up to 400 candidates, a wait long enough that concurrent requests meet.
TWO_TOWER = ServeSettings(
    max_batch_candidates=400, batch_wait_ms=100, replica_cpus=0, body_limit=2**20
)
KJT = ServeSettings(max_batch_candidates=1000, batch_wait_ms=100, replica_cpus=0)
# A request under the cap waits for company far longer than any client's timeout: it is in
# flight until its replica dies. A request over the cap runs at once.
SLOW = ServeSettings(max_batch_candidates=8, batch_wait_ms=600_000, replica_cpus=0)


def _http(url: str, body=None, raw: bytes | None = None):
    """(status, JSON answer, headers with lower-case names) of a GET, or of a POST of ``body``."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
            status, text, headers = answer.status, answer.read(), answer.headers
    except urllib.error.HTTPError as err:
        status, text, headers = err.code, err.read(), err.headers
    try:
        value = json.loads(text or b"null")
    except ValueError:  # Serve's own errors are plain text
        value = {"error": text.decode(errors="replace"), "field": None}
    return status, value, {k.lower(): v for k, v in headers.items()}


class Cluster:
    """``ray start --head`` on 127.0.0.1 at free ports, in the foreground (``--block``) so that
    every process of the cluster descends from it and the teardown ends exactly those: ``ray
    stop`` would end every Ray of the machine (this module's own too), and a SIGTERM drains
    Serve for up to 30 s.

    Its clients (``env``) find it as the documented ``--address auto`` does, through the record
    of the latest ``ray start`` (``ray_current_cluster``), kept in a folder of its own
    (``RAY_TMPDIR``) so that no other Ray on the machine follows it; ``auto`` also turns on Ray's
    token authentication where ``ray start`` did (an explicit address needs RAY_AUTH_MODE=token).
    Its workers import this checkout (``PYTHONPATH``)."""

    def __init__(self, tmp: Path):
        port, client_port = launch.free_port(), launch.free_port()
        # short: Ray's socket paths below it must fit in 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="rocs-ray-")
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env["RAY_TMPDIR"] = self.temp_dir
        paths = [str(HERE.parents[1]), *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
        env = {**self.env, "PYTHONPATH": os.pathsep.join(paths)}
        self.log_path = tmp / "ray.log"
        self.log = open(self.log_path, "w+")  # noqa: SIM115 - open while the cluster runs
        command = [
            str(RAY),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--ray-client-server-port={client_port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
        ]
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def ready(self) -> None:
        """Wait (bounded) until ``ray start`` says the cluster runs."""
        deadline = time.monotonic() + COMMAND_START_S
        while time.monotonic() < deadline and self.process.poll() is None:
            if "Ray runtime started" in self.log_path.read_text():
                return
            time.sleep(0.5)
        raise AssertionError(f"ray start did not come up:\n{self.log_path.read_text()}")

    def up(self) -> bool:
        """A client joins the cluster (``ray status`` would need the authentication mode)."""
        join = "import ray; ray.init(address='auto', log_to_driver=False); ray.shutdown()"
        status = subprocess.run(
            [sys.executable, "-c", join],
            check=False,
            env=self.env,
            capture_output=True,
            timeout=COMMAND_STOP_S,
        )
        return status.returncode == 0

    def processes(self, word: str = "") -> set[int]:
        """The cluster's processes whose command line holds ``word``."""
        return {pid for pid in descendants(self.process.pid) if word in cmdline(pid)}

    def stop(self) -> None:
        if self.log.closed:
            return
        processes = self.processes() | {self.process.pid}
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: pgid == pid
        except ProcessLookupError:
            pass
        for pid in filter(alive, processes):  # one that left the group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=COMMAND_STOP_S)
        self.log.close()
        left = wait_dead(processes, COMMAND_STOP_S)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        assert not left, f"cluster processes left: {left}"


class Server:
    def __init__(self, url: str, handles: dict, started_s: float, cluster: Cluster):
        self.url, self.handles, self.started_s = url, handles, started_s
        self.cluster = cluster

    def post(self, name: str, body, raw: bytes | None = None):
        return _http(f"{self.url}/{name}/score", body, raw)

    def get(self, name: str, path: str):
        return _http(f"{self.url}/{name}/{path}")

    def score(self, name: str, body):
        return self.handles[name].score.remote(body).result(timeout_s=TIMEOUT_S)

    def stats(self, name: str) -> dict:
        return self.handles[name].stats.remote().result(timeout_s=TIMEOUT_S)


class Program:
    """The dict-input model and its saved program (``slow`` and ``rocs serve`` serve it: a
    replica loads it in a fraction of the time a compile takes)."""

    def __init__(self, tmp: Path):
        self.model = DICT_FEATURES.build()
        compiled = DICT_FEATURES.compile(self.model, options={})
        self.artifact = tmp / "dict_features.pt2"
        rocs.save(rocs.export(compiled), self.artifact)

    def bodies(self, counts, seed: int) -> list[dict]:
        return H.dense_requests(
            DICT_FEATURES.batch(counts, seed=seed), DICT_FEATURES.request_inputs
        )


class Command:
    """``rocs serve ARTIFACT --address auto`` in a subprocess, joining ``cluster``."""

    def __init__(self, tmp: Path, program: Program, cluster: Cluster):
        self.cluster = cluster
        self.model, self.artifact = program.model, program.artifact
        self.port = launch.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "serve.log"
        self.log = open(self.log_path, "w+")  # noqa: SIM115 - open while the command runs
        command = [
            sys.executable,
            "-m",
            "rocs_compiler.cli.main",
            "serve",
            str(self.artifact),
            "--port",
            str(self.port),
            "--max-batch-candidates",
            "512",
            # a small queue and a long wait, so that a burst overflows it
            "--max-queued",
            "2",
            "--batch-wait-ms",
            "300",
            "--address",
            "auto",
        ]
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=cluster.env
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def ready(self) -> None:
        """Wait (bounded) until the command answers ``GET /healthz``."""
        deadline = time.monotonic() + COMMAND_START_S
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if _http(f"{self.url}/healthz")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        raise AssertionError(f"rocs serve did not come up:\n{self.output()}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return Program(tmp_path_factory.mktemp("program"))


# Module scope: --dist loadgroup runs this module's tests on one worker, one after another, so
# Ray starts once and stops after the last of them (its idle processes cost CPU while they run).
# One Ray starts at a time: two cold starts at once on a 2-core machine can miss Serve's 60 s
# wait for its HTTP proxy.
@pytest.fixture(scope="module")
def server(program, tmp_path_factory):
    start = time.monotonic()
    port = launch.free_port()
    paths = [str(HERE), str(HERE.parent), str(HERE.parents[1])]
    launch.start(port, num_cpus=2, pythonpath=paths)
    before = descendants(os.getpid())
    try:
        # The cluster for rocs serve starts while the replicas load, once this Ray's Serve proxy
        # is up.
        cluster = Cluster(tmp_path_factory.mktemp("cluster"))
        try:
            apps = {
                "two_tower": deployment(H.two_tower_factory, TWO_TOWER, name="two_tower"),
                "kjt": deployment(H.kjt_factory, KJT, name="kjt"),
            }
            handles = launch.run_many(apps)
            started = time.monotonic() - start
            print(f"\n[serving tests] Ray and 2 deployments up in {started:.1f} s", file=sys.stderr)
            # The last test's: its replica loads while the others run.
            slow = deployment(str(program.artifact), SLOW, name="slow")
            target = serve.RunTarget(slow, name="slow", route_prefix="/slow")
            (handles["slow"],) = serve.run_many([target], wait_for_applications_running=False)
            yield Server(f"http://127.0.0.1:{port}", handles, started, cluster)
        finally:
            cluster.stop()
        # This Ray's processes (the ``rocs serve`` command and its cluster are gone).
        ray_processes = descendants(os.getpid()) | before
    finally:
        launch.stop()
    left = wait_dead(ray_processes, 180)  # a loaded machine can take a minute to reap them
    assert not left, f"processes left after shutdown: {left}"


@pytest.fixture(scope="module")
def command(server, program, tmp_path_factory):
    """``rocs serve --address auto`` on the cluster ``server`` started."""
    server.cluster.ready()
    started = Command(tmp_path_factory.mktemp("serve"), program, server.cluster)
    yield started
    started.close()


def _two_tower_bodies(counts, seed=3):
    entry = ZOO["two_tower"]
    return H.dense_requests(entry.make_batch(counts, seed=seed), entry.request_inputs)


@pytest.fixture(scope="module")
def two_tower_model():
    return ZOO["two_tower"].build()


def _assert_scores(got, want):
    """``got`` (tensors, or JSON lists from HTTP) equals ``want`` in the model's structure."""
    if isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            _assert_scores(got[key], want[key])
        return
    torch.testing.assert_close(torch.as_tensor(got), want, rtol=1e-5, atol=1e-6)


def test_requests_with_1_7_and_300_candidates_share_one_batch(server, two_tower_model):
    bodies = _two_tower_bodies([1, 7, 300])
    handle = server.handles["two_tower"]
    batches = []
    # Three tries at most: on a loaded machine the three calls can reach the replica further
    # apart than its batch wait (100 ms), which splits them; packing must happen in one of them.
    for _ in range(3):
        before = server.stats("two_tower")["batches"]
        responses = [handle.score.remote(b) for b in bodies]
        results = [r.result(timeout_s=TIMEOUT_S) for r in responses]
        for body, got in zip(bodies, results):
            _assert_scores(got, H.dense_alone(two_tower_model, body))
        stats = server.stats("two_tower")
        batches.append((stats["batches"] - before, sorted(stats["recent"][-1])))
        if batches[-1] == (1, [1, 7, 300]):
            break
    assert batches[-1] == (1, [1, 7, 300]), batches


def test_http_scores_equal_the_model_on_each_request_alone(server, two_tower_model):
    body = _two_tower_bodies([5], seed=8)[0]
    status, answer, _ = server.post("two_tower", body)
    assert status == 200
    _assert_scores(answer["scores"], H.dense_alone(two_tower_model, body))


def test_a_request_over_the_cap_runs_alone(server, two_tower_model):
    body = _two_tower_bodies([450], seed=9)[0]
    _assert_scores(server.score("two_tower", body), H.dense_alone(two_tower_model, body))
    assert server.stats("two_tower")["recent"][-1] == [450]


def test_concurrent_http_clients(server, two_tower_model):
    bodies = _two_tower_bodies([3, 60, 1, 17, 120, 2, 9, 33], seed=11)
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda b: server.post("two_tower", b), bodies, timeout=TIMEOUT_S * 2)
        )
    for body, (status, answer, _) in zip(bodies, answers):
        assert status == 200
        _assert_scores(answer["scores"], H.dense_alone(two_tower_model, body))


def test_bad_input_answers_400_naming_the_field(server):
    good = _two_tower_bodies([2], seed=12)[0]
    cases = [
        (H.changed(good, request__user_dense=None), "user_dense"),
        (H.changed(good, request__age=1), "age"),
        (H.changed(good, candidates__item_dense=[[1.0] * 5] * 2), "item_dense"),
        (H.changed(good, candidates__item_id=[1.5, 2.5]), "item_id"),
        (H.changed(good, candidates__item_id=[1, 2, 3]), "item_id"),
        (
            H.changed(
                good, candidates__item_id=[], candidates__item_cat=[], candidates__item_dense=[]
            ),
            "item_id",
        ),
    ]
    for body, field in cases:
        status, answer, _ = server.post("two_tower", body)
        assert status == 400 and answer["field"] == field, answer
        assert "\n" not in answer["error"]
    status, answer, _ = server.post("two_tower", None, raw=b'{"request": [')
    assert status == 400 and answer["field"] == "body" and "malformed JSON" in answer["error"]
    status, answer, _ = server.post("two_tower", None, raw=b" " * (2**20 + 1))
    assert status == 413
    assert server.get("two_tower", "nothing")[0] == 404


def test_a_bad_request_never_fails_its_batch_mates(server, two_tower_model):
    """Ids past an embedding table, negative ids and NaN features are refused (400 naming the
    field) when they arrive, before their request joins a batch; the requests sent with them
    are scored exactly."""
    good = _two_tower_bodies([4, 6], seed=13)
    past = H.changed(good[0], candidates__item_id=[10**9] * 4)
    negative = H.changed(good[0], request__user_id=-1)
    dense = good[0]["candidates"]["item_dense"]
    nan = H.changed(good[0], candidates__item_dense=[[float("nan")] * len(dense[0])] * 4)
    handle = server.handles["two_tower"]
    bodies = (good[0], past, negative, nan, good[1])
    calls = [handle.score.remote(b) for b in bodies]
    _assert_scores(calls[0].result(timeout_s=TIMEOUT_S), H.dense_alone(two_tower_model, good[0]))
    _assert_scores(calls[4].result(timeout_s=TIMEOUT_S), H.dense_alone(two_tower_model, good[1]))
    for call, words in zip(calls[1:4], ("item_id", "user_id", "item_dense")):
        with pytest.raises(Exception, match=words):
            call.result(timeout_s=TIMEOUT_S)
    cases = ((past, "item_id", "outside embedding table"), (negative, "user_id", "id -1 "),
             (nan, "item_dense", "NaN or infinity"))  # fmt: skip
    for body, field, words in cases:
        status, answer, _ = server.post("two_tower", body)
        assert status == 400 and answer["field"] == field and words in answer["error"], answer


def test_health_and_info(server):
    assert server.get("two_tower", "healthz")[:2] == (200, {"status": "ok"})
    status, info, _ = server.get("kjt", "info")
    assert status == 200 and info["kind"] == "compiled"
    assert info["request_inputs"] == ["sparse_features[user_id]", "sparse_features[history]"]
    assert {
        "name": "dense_features",
        "side": "candidate",
        "dtype": "float32",
        "shape": [4],
    } in info["inputs"]
    assert info["batch"]["max_batch_candidates"] == 1000


def test_dict_input_model_over_http(command):
    command.ready()
    bodies = H.dense_requests(DICT_FEATURES.batch([3, 1], seed=4), DICT_FEATURES.request_inputs)
    for body in bodies:
        status, answer, _ = _http(f"{command.url}/score", body)
        assert status == 200 and set(answer["scores"]) == {"ctr", "cvr", "user"}
        _assert_scores(answer["scores"], H.dense_alone(command.model, body))


def test_kjt_model_requests_batched(server):
    pytest.importorskip("torchrec")
    model, _ = H.kjt_model()
    bodies = H.kjt_requests([1, 7, 300], seed=14)
    handle = server.handles["kjt"]
    calls = [handle.score.remote(b) for b in bodies]
    for body, call in zip(bodies, calls):
        _assert_scores(call.result(timeout_s=TIMEOUT_S), H.kjt_alone(model, body))
    status, answer, _ = server.post("kjt", bodies[1])
    assert status == 200
    _assert_scores(answer["scores"], H.kjt_alone(model, bodies[1]))


def test_a_full_queue_answers_503_with_retry_after(command):
    command.ready()
    body = H.dense_requests(DICT_FEATURES.batch([2], seed=5), DICT_FEATURES.request_inputs)[0]
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda _: _http(f"{command.url}/score", body), range(8), timeout=TIMEOUT_S * 2)
        )
    statuses = sorted(status for status, _, _ in answers)
    assert 200 in statuses and 503 in statuses, statuses
    answer, headers = next((a, h) for status, a, h in answers if status == 503)
    assert headers.get("retry-after") == "1" and "max_queued" in answer["error"]


def test_rocs_serve_joins_a_cluster_and_leaves_it_running_on_sigterm(command):
    """Last of the tests using the command: it stops it. Its application goes (the replica's
    process ends; the cluster's Serve proxy answers 404), the cluster stays."""
    command.ready()
    process, url = command.process, command.url
    status, info, _ = _http(f"{url}/info")
    assert status == 200 and info["kind"] == "saved program", command.output()
    assert info["batch"]["max_batch_candidates"] == 512
    body = H.dense_requests(DICT_FEATURES.batch([6], seed=2), info["request_inputs"])[0]
    status, answer, _ = _http(f"{url}/score", body)
    assert status == 200
    _assert_scores(answer["scores"], H.dense_alone(command.model, body))
    replicas = command.cluster.processes("ServeReplica:rocs")
    assert replicas, "the application has no replica process in the cluster"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=COMMAND_STOP_S) == 0, command.output()
    assert f"at {url}/score" in command.output()
    left = wait_dead(replicas, COMMAND_STOP_S)
    assert not left, f"replica processes left after rocs serve stopped: {left}"
    assert _http(f"{url}/healthz")[0] == 404
    assert command.cluster.up(), "the cluster stopped with rocs serve"


def _replica(app: str) -> str:
    """The name of the live replica actor of the one-replica application ``app``."""
    prefix = f"SERVE_REPLICA::{app}#"  # Serve's name: SERVE_REPLICA::<app>#<deployment>#<id>
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    (name,) = [n for n in names if n.startswith(prefix)]
    return name


def _answers(server: Server, app: str) -> bool:
    try:
        return server.get(app, "healthz")[0] == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


def test_a_replica_that_dies_fails_its_requests_and_is_replaced(server, program):
    """Requests in flight on a replica killed by ``ray.kill`` fail at once (HTTP 500 from
    Serve's proxy, ``RayActorError`` on the handle) instead of hanging; Serve replaces the
    replica and the next requests are scored right."""
    waiting = program.bodies([2, 3, 1], seed=15)  # under SLOW's cap: they wait for company
    alone = program.bodies([9], seed=16)[0]  # over it: runs at once
    handle = server.handles["slow"]
    _until(lambda: _answers(server, "slow"), RESTART_S, "slow's replica up")
    killed = _replica("slow")
    with ThreadPoolExecutor(2) as pool:
        posts = [pool.submit(server.post, "slow", body) for body in waiting[:2]]
        call = handle.score.remote(waiting[2])
        _until(lambda: server.stats("slow")["held"] == 3, TIMEOUT_S, "3 requests held")
        ray.kill(ray.get_actor(killed, namespace="serve"))
        answers = [post.result(timeout=TIMEOUT_S) for post in posts]
    # Serve's proxy answers for the dead replica, in plain text (docs/serving.md says so)
    dead = (500, {"error": "Internal Server Error", "field": None})
    assert [answer[:2] for answer in answers] == [dead, dead], answers
    with pytest.raises(RayActorError):
        call.result(timeout_s=TIMEOUT_S)

    # Requests sent now wait in Serve's queue for the replacement; one routed to the dead
    # replica before Serve knew fails, and is sent again.
    start, deadline = time.monotonic(), time.monotonic() + RESTART_S
    while True:
        try:
            got = server.score("slow", alone)
            break
        except (RayActorError, TimeoutError):
            assert time.monotonic() < deadline, f"no replica answered within {RESTART_S} s"
    print(
        f"\n[serving tests] replica replaced in {time.monotonic() - start:.1f} s", file=sys.stderr
    )
    want = H.dense_alone(program.model, alone)
    _assert_scores(got, want)
    status, answer, _ = server.post("slow", alone)
    assert status == 200
    _assert_scores(answer["scores"], want)
    assert _replica("slow") != killed
