"""A real browser opens an executed lab in JupyterLab: headless Debian Chromium driven by playwright-core.

The setup installs what is missing (apt-get's `chromium` when running as root, `playwright-core` from npm into a user
cache); the test skips, saying why, only when Chromium cannot be installed. The screenshot is saved in the lab's run
directory beside the executed notebook.
"""
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from labkit import lab
from labkit.net import free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PLAYWRIGHT_CORE = "playwright-core@1.65.1"
TOOLS_DIR = Path.home() / ".cache" / "labkit" / "browser-test"
LAB = "05_performance_estimation"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def _find_chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def chromium() -> str:
    path = _find_chromium()
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, capture_output=True, timeout=900)
        path = _find_chromium()
    if path is None:
        pytest.skip("Chromium is not installed and cannot be installed here (needs root and apt-get with Debian's "
                    "`chromium` package)")
    return path


@pytest.fixture(scope="module")
def playwright_core() -> Path:
    module = TOOLS_DIR / "node_modules" / "playwright-core"
    if not module.exists():
        if not shutil.which("npm"):
            pytest.fail("npm is needed to install playwright-core (Debian: apt-get install nodejs npm)")
        TOOLS_DIR.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1"}
        done = subprocess.run(["npm", "install", "--prefix", str(TOOLS_DIR), "--no-audit", "--no-fund", PLAYWRIGHT_CORE],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"npm install {PLAYWRIGHT_CORE} failed:\n{done.stderr[-3000:]}"
    return module


@pytest.fixture(scope="module")
def executed_lab(tmp_path_factory):
    run = lab.run_lab(only=[LAB], runs_dir=tmp_path_factory.mktemp("runs"), progress=False, html_index=False)
    assert run.ok, run.summary()
    return run


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read() or b"null")


@pytest.fixture(scope="module")
def jupyterlab(executed_lab):
    port, token = free_port(), secrets.token_hex(16)
    log = open(executed_lab.directory / "jupyterlab.log", "w")
    # Every cell stays in the page (JupyterLab otherwise drops cells scrolled far out of view), so the page's text
    # holds the whole lab.
    settings = executed_lab.directory / "jupyterlab-settings"
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True, exist_ok=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={executed_lab.directory}",
         f"--LabApp.user_settings_dir={settings}",
         "--LabApp.expose_app_in_browser=True"] + (["--allow-root"] if os.geteuid() == 0 else []),
        stdout=log, stderr=subprocess.STDOUT, cwd=executed_lab.directory)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            _get(f"{base}/api/status?token={token}")
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start: {(executed_lab.directory / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.5)
    yield base, token
    for kernel in _get(f"{base}/api/kernels?token={token}") or []:
        request = urllib.request.Request(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=10).close()
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


BROWSER_SCRIPT = textwrap.dedent("""
    const { chromium } = require(process.env.PLAYWRIGHT_CORE);
    (async () => {
      const browser = await chromium.launch({ executablePath: process.env.CHROMIUM, args: JSON.parse(process.env.FLAGS) });
      const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
      const result = { console_errors: [] };
      page.on('pageerror', e => result.console_errors.push(String(e)));
      try {
        await page.goto(process.env.URL, { waitUntil: 'domcontentloaded', timeout: 90000 });
        await page.waitForSelector('.jp-Notebook .jp-Cell', { timeout: 90000 });
        await page.waitForFunction(() => window.jupyterapp && window.jupyterapp.shell.currentWidget
                                          && window.jupyterapp.shell.currentWidget.sessionContext
                                          && window.jupyterapp.shell.currentWidget.sessionContext.session
                                          && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel,
                                   null, { timeout: 90000 });
        // Saved plotly outputs render on opening; widgets need the kernel: run every cell.
        await page.waitForSelector('.js-plotly-plot .main-svg', { timeout: 60000 });
        result.plots_before_run = await page.locator('.js-plotly-plot').count();
        await page.evaluate(() => window.jupyterapp.commands.execute('notebook:run-all-cells'));
        await page.waitForSelector('.jupyter-widgets .widget-slider', { timeout: 120000 });
        await page.waitForFunction(() => !document.querySelector('.jp-InputArea-prompt')
                                          || ![...document.querySelectorAll('.jp-InputArea-prompt')]
                                               .some(p => p.textContent.includes('[*]')), null, { timeout: 120000 });
        const slider = page.locator('.jupyter-widgets .widget-slider').first();
        await slider.scrollIntoViewIfNeeded();
        result.plots = await page.locator('.js-plotly-plot .main-svg').count();
        result.sliders = await page.locator('.jupyter-widgets .widget-slider').count();
        result.widget_outputs = await page.locator('.jupyter-widgets.widget-interact').count();
        result.text = await page.locator('.jp-Notebook').innerText();
        result.title = await page.title();
        await page.screenshot({ path: process.env.SCREENSHOT });
        const figure = page.locator('.js-plotly-plot').first();
        await figure.scrollIntoViewIfNeeded();
        await figure.screenshot({ path: process.env.SCREENSHOT.replace('.png', '.figure.png') });
      } catch (e) {
        result.error = String(e);
        await page.screenshot({ path: process.env.SCREENSHOT }).catch(() => {});
      }
      await browser.close();
      console.log(JSON.stringify(result));
    })();
""")


def test_executed_lab_renders_figures_and_widgets_in_jupyterlab(chromium, playwright_core, executed_lab, jupyterlab):
    base, token = jupyterlab
    screenshot = executed_lab.directory / f"{LAB}.browser.png"
    script = executed_lab.directory / "browser_check.js"
    script.write_text(BROWSER_SCRIPT)
    env = {**os.environ, "PLAYWRIGHT_CORE": str(playwright_core), "CHROMIUM": chromium,
           "FLAGS": json.dumps(CHROMIUM_FLAGS), "SCREENSHOT": str(screenshot),
           "URL": f"{base}/lab/tree/{LAB}.ipynb?token={token}"}
    done = subprocess.run(["node", str(script)], env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in result, f"{result.get('error')} (screenshot: {screenshot})"
    assert result["plots_before_run"] >= 2  # saved plotly outputs draw without a kernel
    assert result["plots"] >= 2 and result["sliders"] >= 2 and result["widget_outputs"] >= 2
    assert "18,437,806,080 parameters" in result["text"]
    assert "157.7 TFLOP/s per GPU, 50.55%" in result["text"]
    assert "203 days per epoch on 16 GPUs" in result["text"]
    for png in (screenshot, screenshot.with_suffix(".figure.png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, png
