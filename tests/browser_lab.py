"""The browser tests' plumbing: Debian Chromium, and one JupyterLab server for all of them.

    from browser_lab import CHROMIUM, CHROMIUM_ARGS, marks   # in a test (pytest puts tests/ on sys.path)

conftest.py starts the server (``running_lab``) and the browser once per session, as the
fixtures ``lab`` and ``browser``, shared by tests/test_browser.py (Run All, widgets) and
tests/test_browser_saved.py (reopened notebooks); tests/test_book.py reads the website in the
same Chromium. The server: 127.0.0.1, a free port, a random token, smoke mode, serving a copy of
notebooks/ and images/, and reopened/ for executed notebooks.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from course_lib.utils import free_port, repo_root

ROOT = repo_root()
CHROMIUM = os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
# What a saved notebook or a web page must not show: widget reprs instead of widgets.
RAW_REPRS = ("VBox(children=", "HBox(children=", "FloatSlider(", "IntSlider(", "interactive(children=",
             "Error displaying widget", "Loading widget...")


def marks() -> list:
    """A browser test module's ``pytestmark``: skipped without Chromium (failed as root, who can
    install it with `make browser-deps`)."""
    found = [pytest.mark.browser, pytest.mark.slow]
    if CHROMIUM is None:
        if os.geteuid() == 0:
            pytest.fail("chromium is missing: run `make browser-deps` (apt-get install chromium)", pytrace=False)
        found.append(pytest.mark.skip(reason="chromium is not installed and installing it needs root: "
                                             "sudo apt-get install chromium (or `make browser-deps` as root)"))
    return found


def settings(settings_dir: Path) -> None:
    """User settings for the test server: no autosave, no news or update checks (offline)."""
    for plugin, values in {"@jupyterlab/docmanager-extension/plugin": {"autosave": False},
                           # render every cell (no virtual scrolling): widgets stay where we found them
                           "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
                           "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                                           "checkForUpdates": False}}.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@contextmanager
def running_lab(tmp: Path):
    """Run JupyterLab (state under ``tmp``) until the block ends; yields (base URL, token,
    served folder): a copy of notebooks/ and images/, and reopened/ for notebooks as executed in
    smoke mode (outputs saved, no kernel behind them)."""
    served = tmp / "course"
    shutil.copytree(ROOT / "notebooks", served / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    shutil.copytree(ROOT / "images", served / "images")
    (served / "reopened").mkdir()
    settings(tmp / "settings")
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "COURSE_SMOKE": "1", "JUPYTER_CONFIG_DIR": str(tmp / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "PYDEVD_DISABLE_FILE_VALIDATION": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={served}", "--LabApp.expose_app_in_browser=True",
           f"--LabApp.user_settings_dir={tmp / 'settings'}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           # a kernel that started ranks has children that ignore SIGTERM (multiprocessing's resource
           # tracker): ipykernel waits for them, and the server would wait 2.5 s before its SIGTERM
           "--KernelManager.shutdown_wait_time=1"]
    if os.geteuid() == 0:  # containers and CI runners
        cmd.append("--ServerApp.allow_root=True")
    log = open(tmp / "jupyterlab.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, env=env, cwd=served, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{(tmp / 'jupyterlab.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within 60 s:\n{(tmp / 'jupyterlab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield base, token, served
    finally:
        _stop(proc, base, token)
        log.close()


def _stop(proc: subprocess.Popen, base: str, token: str) -> None:
    """Ask the server to shut down (it stops its kernels), then make sure its process group is gone."""
    if proc.poll() is None:
        try:
            req = urllib.request.Request(f"{base}/api/shutdown", method="POST",
                                         headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(req, timeout=5).close()
            proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
