"""``rocs serve`` without Ray running: usage errors, and which Ray the command starts or joins
and how it lets go of it (Ray's calls replaced by recorders). The command serving a saved
program on a running cluster is tested in ``test_ray_serve.py``."""

from __future__ import annotations

import os
import signal

import pytest

# On the worker that runs test_ray_serve.py, which imports Ray anyway (2 s).
pytestmark = pytest.mark.xdist_group("ray")


def test_rocs_serve_refuses_a_missing_artifact(tmp_path, capsys):
    from rocs_compiler.cli import main as cli

    assert cli.main(["serve", str(tmp_path / "none.pt2")]) == 1
    assert "no such artifact" in capsys.readouterr().err


@pytest.mark.parametrize(("address", "ends_with"), [(None, ("stop",)), ("auto", ("leave", "rocs"))])
def test_rocs_serve_stops_its_own_ray_and_leaves_a_cluster_running(
    tmp_path, monkeypatch, address, ends_with
):
    """Without ``--address`` the command stops the Ray it started (the Ray processes are
    checked in ``test_ray_serve.py``'s ``server`` teardown, which uses the same ``launch``
    calls); with one it removes its application and disconnects."""
    pytest.importorskip("ray.serve", reason="rocs serve needs the serve extra (ray[serve])")
    from rocs_compiler.cli import main as cli
    from rocs_compiler.serving import deployment, launch

    calls = []

    def run(app, name):
        calls.append(("run", name))
        os.kill(os.getpid(), signal.SIGTERM)  # as a supervisor stops it; the command handles it

    monkeypatch.setattr(
        launch, "start", lambda port, host, address: calls.append(("start", address))
    )
    monkeypatch.setattr(launch, "run", run)
    monkeypatch.setattr(launch, "stop", lambda: calls.append(("stop",)))
    monkeypatch.setattr(launch, "leave", lambda name: calls.append(("leave", name)))
    monkeypatch.setattr(deployment, "deployment", lambda *args, **kwargs: "app")
    artifact = tmp_path / "model.pt2"
    artifact.write_bytes(b"")
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = cli.main(["serve", str(artifact), *(["--address", address] if address else [])])
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    assert status == 0
    assert calls == [("start", address), ("run", "rocs"), ends_with]


def test_a_local_start_ignores_a_cluster_named_in_ray_address(monkeypatch):
    """``ray.init()`` joins the cluster ``RAY_ADDRESS`` names; the local default must not (it
    passes ``num_cpus``, which a cluster refuses, and stopping would shut the cluster's Serve
    down)."""
    pytest.importorskip("ray.serve", reason="the launch module needs the serve extra")
    from rocs_compiler.serving import launch

    seen = {}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.ray, "init", lambda **options: seen.update(options))
    monkeypatch.setattr(launch.serve, "start", lambda **options: None)
    launch.start(8000, num_cpus=2)
    assert seen["address"] == "local" and seen["num_cpus"] == 2


def test_a_local_start_whose_proxy_died_starts_ray_once_more(monkeypatch):
    """Serve kills an HTTP proxy that is not up within its fixed 60 s (a cold start on a loaded
    machine): a local start then stops Ray and starts it again, once; a second failure, or one
    on a joined cluster, is raised."""
    pytest.importorskip("ray.serve", reason="the launch module needs the serve extra")
    from rocs_compiler.serving import launch

    calls = []
    failures = []

    def serve_start(**options):
        calls.append("serve.start")
        if failures:
            raise failures.pop()

    def ray_call(name):
        def call(**options):
            calls.append(name)
            running[:] = [name == "ray.init"]

        return call

    running = [False]
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: running[0])
    monkeypatch.setattr(launch.ray, "init", ray_call("ray.init"))
    monkeypatch.setattr(launch.ray, "shutdown", ray_call("ray.shutdown"))
    monkeypatch.setattr(launch.serve, "start", serve_start)
    monkeypatch.setattr(launch, "_applications", lambda: calls.append("applications") or [])
    failures.append(launch.ray.exceptions.RayActorError())
    with pytest.warns(RuntimeWarning, match="HTTP proxy"):
        launch.start(8000, num_cpus=2)
    assert calls == ["ray.init", "serve.start", "applications", "ray.shutdown", "ray.init",
                     "serve.start"]  # fmt: skip
    calls.clear()
    running[:] = [False]
    failures[:] = [launch.ray.exceptions.RayActorError()] * 2
    with pytest.warns(RuntimeWarning), pytest.raises(launch.ray.exceptions.RayActorError):
        launch.start(8000, num_cpus=2)
    running[:] = [False]
    failures[:] = [launch.ray.exceptions.RayActorError()]
    with pytest.raises(launch.ray.exceptions.RayActorError):
        launch.start(8000, address="auto")


def test_a_local_start_whose_raylet_timed_out_starts_ray_once_more(monkeypatch):
    """The raylet waits a fixed 15 s for its agents' ports, which a loaded machine can miss:
    ``ray.init`` then raises; a local start ends the processes that failed start left (its
    children, which ``ray.shutdown`` does not know of) and tries once more; a second failure,
    and any other error, is raised."""
    pytest.importorskip("ray.serve", reason="the launch module needs the serve extra")
    import subprocess

    from rocs_compiler.serving import launch

    started = []

    def failing_init(**options):
        started.append(subprocess.Popen(["sleep", "60"]))  # one of the failed start's processes
        raise Exception("The current node timed out during startup. This could happen ...")

    attempts = [failing_init, lambda **options: None]
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.ray, "init", lambda **options: attempts.pop(0)(**options))
    monkeypatch.setattr(launch.ray, "shutdown", lambda: None)
    monkeypatch.setattr(launch.serve, "start", lambda **options: None)
    with pytest.warns(RuntimeWarning, match="did not start"):
        launch.start(8000, num_cpus=2)
    assert not attempts and started[0].wait(timeout=10) == -signal.SIGKILL
    attempts[:] = [failing_init, failing_init]
    with pytest.warns(RuntimeWarning), pytest.raises(Exception, match="timed out"):
        launch.start(8000, num_cpus=2)
    started[-1].kill()
    started[-1].wait(timeout=10)


def test_an_aoti_bounds_check_failure_answers_400():
    """An AOTInductor package has no graph to read id ranges from; its compiled bounds check
    raises a RuntimeError, which the replica answers as this request's bad input (400), while any
    other RuntimeError stays a server error."""
    pytest.importorskip("ray.serve", reason="the deployment module needs the serve extra")
    from rocs_compiler.serving.deployment import _model_error
    from rocs_compiler.serving.schema import RequestError

    bounds = RuntimeError("index out of bounds: 0 <= tmp2 < 10L\nException raised from cpp_fused")
    answer = _model_error(bounds)
    assert isinstance(answer, RequestError) and answer.status == 400
    assert "index out of bounds: 0 <= tmp2 < 10L" in str(answer) and "\n" not in str(answer)
    other = RuntimeError("out of memory")
    assert _model_error(other) is other


def test_a_batch_the_model_fails_on_is_run_again_one_request_at_a_time():
    """What the value checks cannot see (a model's own refusal): the packed call fails, each
    request runs alone, and only the one the model fails on gets the error (400)."""
    pytest.importorskip("ray.serve", reason="the deployment module needs the serve extra")
    import torch

    from rocs_compiler.serving.deployment import Scorer, _Failed
    from rocs_compiler.serving.schema import CANDIDATE, Field, Schema
    from rocs_compiler.serving.served import ServedModel

    schema = Schema([Field("item_id", CANDIDATE, torch.int64)])

    def score(packed):
        ids = packed.leaves["item_id"]
        if bool((ids == 13).any()):
            raise IndexError("index out of range in self")
        return ids * 2.0

    scorer = Scorer(ServedModel("doubles", schema, score, None, "test"))
    requests = [schema.check({"candidates": {"item_id": ids}}) for ids in ([1, 2], [13], [4])]
    first, failed, last = scorer._run(requests)
    assert first.tolist() == [2.0, 4.0] and last.tolist() == [8.0]
    assert isinstance(failed, _Failed) and failed.error.status == 400
    assert "IndexError: index out of range in self" in str(failed.error)
