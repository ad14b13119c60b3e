"""``hpctrain report``'s page in a real browser: Debian's headless chromium, driven by
selenium through chromium-driver (``make test-report`` installs both). Every image must
have loaded (a non-zero natural size) and the console must hold no error; a screenshot
of the whole page is kept as ``test-reports/report-page.png``. A page with a broken
image and a console error is opened too, to show the checks catch them."""

import shutil
from pathlib import Path

import pytest

from hpctrain.report.page import build_report
from tests.report_runs import finished_run, resumed_run

pytestmark = pytest.mark.report
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-reports"
CHROMIUM = ("chromium", "chromium-browser")
DRIVER = ("chromedriver", "chromium-driver")


def _which(names) -> str | None:
    return next((shutil.which(n) for n in names if shutil.which(n)), None)


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is missing (pip install '.[report]')")
    binary, driver = _which(CHROMIUM), _which(DRIVER)
    if binary is None or driver is None:
        pytest.skip("chromium or chromium-driver cannot be installed here "
                    "(make test-report: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service

    drv = webdriver.Chrome(service=Service(driver), options=options)
    yield drv
    drv.quit()


IMAGES = """return Array.from(document.images).map(i => ({
    alt: i.alt, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight}));"""


def open_page(browser, page: Path) -> tuple[list[dict], list[dict]]:
    """(the page's images with their natural sizes, the console's errors)."""
    browser.get_log("browser")  # drop what an earlier page left
    browser.get(page.as_uri())
    browser.execute_script("return document.readyState")
    images = browser.execute_script(IMAGES)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    return images, errors


def test_every_image_loads_and_the_console_is_clean(browser, tmp_path):
    page = build_report([finished_run(tmp_path / "dp2"), resumed_run(tmp_path / "pp2")],
                        tmp_path / "report")
    shutil.rmtree(tmp_path / "report" / "plots")  # the page must stand alone
    images, errors = open_page(browser, page)
    assert len(images) == 5
    for image in images:
        assert image["complete"] and image["w"] > 0 and image["h"] > 0, image
    assert errors == []
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1200, min(int(height) + 300, 8000))
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "report-page.png"))


def test_the_checks_see_a_broken_image_and_a_console_error(browser, tmp_path):
    page = build_report([finished_run(tmp_path / "run")])
    text = page.read_text()
    start = text.index("base64,") + len("base64,")
    broken = text[:start] + "AAAA" + text[start + 40:]  # the first PNG is corrupt
    page.write_text(broken.replace("</body>", "<script>console.error('planted')</script>"
                                              "</body>"))
    images, errors = open_page(browser, page)
    assert [i["w"] for i in images].count(0) == 1
    assert any("planted" in e["message"] for e in errors)
