"""`make docs-screenshots`: the built site as a reader sees it, in headless Chromium.

Serves site/ on localhost (the site's search runs in a web worker, which a file:// page may not
start) and takes screenshots of the pages a newcomer opens first: the home page, a guide with a
picture, the API page of DistributedDataParallel, and a search for `bucket_cap_mb`, taken once
its results (among them the benchmark records) are shown. Chromium is driven through Selenium
and Debian's chromedriver, which can wait for the search; `chromium --screenshot` cannot.
Needs `apt-get install chromium chromium-driver` and `pip install selenium`.

    python docs/screenshots.py --site site --out run/docs-screenshots
"""
from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import sys
import threading
import time

# (file name, page, window height in px): what a reader sees first on each
SHOTS = [
    ("home.png", "index.html", 2200),
    ("guide-with-picture.png", "guides/timeline.html#the-plots", 2400),
    ("api-ddp.png", "reference/ddp.html", 2400),
    ("search-bucket_cap_mb.png", "results/netem_20261122.html?q=bucket_cap_mb", 1100),
]
WIDTH_PX = 1280
SEARCH_WAIT_S = 60  # the search index loads in a second or two here
# Chromium as root in a machine with no network: no sandbox, no GPU, none of its background
# connections (refused here, many at a time).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        raise SystemExit("chromium and chromedriver are needed: apt-get install chromium "
                         f"chromium-driver (found: {binary}, {driver})")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(site: str) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(QuietHandler, directory=site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_for_search(driver) -> str:
    """The search's result line ("18 matching documents") once the index has loaded."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + SEARCH_WAIT_S
    while time.monotonic() < deadline:
        meta = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__meta")
        text = meta[0].text.strip() if meta else ""
        if text and "Initializing" not in text:
            return text
        time.sleep(0.25)
    raise SystemExit(f"the search showed no results within {SEARCH_WAIT_S} s")


def small(path: str, colors: int = 128) -> None:
    """The screenshot in a palette of `colors` (text and flat colours survive; about a third
    of the bytes), so that the records keep them small."""
    from PIL import Image  # Pillow: matplotlib's own dependency

    Image.open(path).convert("RGB").quantize(colors=colors).save(path, optimize=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", default="site", help="the built site (make docs); default site")
    parser.add_argument("--out", default="run/docs-screenshots", help="output folder")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.site, "index.html")):
        raise SystemExit(f"{args.site}/index.html not found: build the site first (make docs)")
    os.makedirs(args.out, exist_ok=True)
    server = serve(os.path.abspath(args.site))
    driver = browser()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        for name, page, height_px in SHOTS:
            driver.set_window_size(WIDTH_PX, height_px)
            driver.get(base + page)
            note = f": {wait_for_search(driver)}" if "?q=" in page else ""
            time.sleep(0.5)  # fonts and images settle
            path = os.path.join(args.out, name)
            driver.save_screenshot(path)
            small(path)
            print(f"wrote {path}  ({os.path.getsize(path) // 1024} KiB; {page}{note})",
                  flush=True)
    finally:
        driver.quit()
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
