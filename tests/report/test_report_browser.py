"""The HTML report in a real browser: headless Chromium loads the reports of three zoo models.

The page checks itself when its address has ``?selftest`` (``render/viewer.js``): every view
renders with a non-empty bounding box that fits the canvas width, a search finds and selects a
node, collapsing a module replaces its nodes with a group box and expanding restores them. It
writes the result as JSON into ``#rocs-selftest``; ``--dump-dom`` returns the DOM after the
script ran. Console errors are caught both in the page and on Chromium's log.

Needs a Chromium binary (CI installs Debian's ``chromium``, best effort): ``$ROCS_CHROMIUM``, or
``chromium``, ``chromium-headless-shell``, ``chromium-browser`` or ``google-chrome`` on PATH.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess

import pytest
from models_for_tests import zoo_compiled

NAMES = ("chromium", "chromium-headless-shell", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    explicit = os.environ.get("ROCS_CHROMIUM")
    if explicit:
        return explicit
    return next((shutil.which(n) for n in NAMES if shutil.which(n)), None)


CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason=f"no Chromium binary: set ROCS_CHROMIUM or install one of {', '.join(NAMES)} "
    "(apt-get install chromium)",
)


def chromium(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--window-size=1400,1000", "--virtual-time-budget=10000",
        "--enable-logging=stderr", "--v=0", *args,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["dlrm", "target_attention", "bst"])
def test_report_works_in_a_browser(name, tmp_path):
    path = tmp_path / f"{name}.html"
    zoo_compiled(name).report(candidates=512).to_html(path, title=name)
    proc = chromium("--dump-dom", f"{path.as_uri()}?selftest")
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r'<pre id="rocs-selftest"[^>]*>(.*?)</pre>', proc.stdout, re.S)
    assert found and found.group(1), f"the self test did not run:\n{proc.stderr[-2000:]}"
    result = json.loads(html.unescape(found.group(1)))
    assert result["errors"] == []
    for check, outcome in result["checks"].items():
        assert outcome["ok"], (check, outcome)
    assert {"render captured", "render logical", "search", "collapse"} <= set(result["checks"])
    console = [
        line for line in proc.stderr.splitlines()
        if "CONSOLE" in line and re.search(r"uncaught|error", line, re.I)
    ]  # fmt: skip
    assert console == []
    assert result["ok"]
