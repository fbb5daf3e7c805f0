"""Headless Chromium for the dashboard tests, driven through selenium and Debian's
`chromium` + `chromium-driver` (installed by `make browser`; nothing is downloaded).

`chrome()` starts one browser with a fresh profile and the flags that work as root on a
closed network; `SCREENSHOTS` is where the tests write PNGs of the pages (reported at the
end of the run by conftest.py). Without Chromium the tests skip, and fail under CI=true.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from farm_fixtures import service_unavailable

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOTS = Path(__file__).resolve().parents[1] / "tunefarm-test-artifacts" / "screenshots"

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,1000",
)


def chrome():
    """A started selenium driver; the caller quits it."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        service_unavailable(f"selenium is not installed ({exc}): make setup")
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not Path(binary).exists():
            service_unavailable(f"{binary} is missing: make browser (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="tunefarm-chromium-")
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    original_quit = driver.quit

    def quit_and_clean() -> None:
        original_quit()
        shutil.rmtree(profile, ignore_errors=True)

    driver.quit = quit_and_clean
    return driver


def screenshot(driver, name: str) -> Path:
    """A PNG of the whole page (beyond the window's height) under SCREENSHOTS."""
    import base64

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    width, height = driver.execute_script(  # the window's width at least: captured beyond the viewport,
        "return [Math.max(document.documentElement.scrollWidth, window.innerWidth),"  # the page loses its scrollbar
        " document.documentElement.scrollHeight]"
    )
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": width, "height": min(height, 4000), "scale": 1},
    })
    path = SCREENSHOTS / f"{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    return path
