"""``rocs serve`` without Ray running: usage errors. The command serving a saved program is
tested in ``test_ray_serve.py``, whose Ray start it overlaps."""

from __future__ import annotations


def test_rocs_serve_refuses_a_missing_artifact(tmp_path, capsys):
    from rocs_compiler.cli import main as cli

    assert cli.main(["serve", str(tmp_path / "none.pt2")]) == 1
    assert "no such artifact" in capsys.readouterr().err
