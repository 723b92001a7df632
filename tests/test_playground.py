"""The playground page at `/`, driven in a real headless Chromium (Debian's chromium + chromium-driver,
installed by `./setup.sh --test` where it can) against a real `kstep serve` of a diffusion model
and an AR model: no console errors, the canvas refines (masks while running, none at the end), the
final text is the API's greedy completion, the AR pane streams, the stats fill in, a bad setting
shows the server's message, and an API key is asked for once.

KSTEP_SCREENSHOT=PATH also runs the bundled pair and saves a finished race there (docs/serving/playground.png)."""
import os
import shutil
from pathlib import Path

import pytest
from test_server import client

from kstep.bench.server_process import running_server
from kstep.engine.text_stream import MASK_PLACEHOLDER

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (BROWSER and DRIVER),
                                reason="needs chromium and chromedriver (apt-get install chromium chromium-driver)")
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def pair(llada_path, llama_path, tmp_path_factory):
    with running_server(f"diff={llada_path}", "--model", f"ar={llama_path}",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_page(driver, url: str) -> None:
    driver.get(url + "/")
    WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".pane"))


def set_value(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def finished(driver, timeout: float = 60) -> None:
    WebDriverWait(driver, timeout).until(lambda d: all(
        p.get_attribute("data-state") in ("done", "error") for p in d.find_elements(By.CSS_SELECTOR, ".pane")))


def pane(driver, model: str):
    return driver.find_element(By.CSS_SELECTOR, f'.pane[data-model="{model}"]')


def test_a_race_refines_streams_and_matches_the_api(browser, pair):
    open_page(browser, pair)
    assert [p.get_attribute("data-model") for p in browser.find_elements(By.CSS_SELECTOR, ".pane")] == ["diff", "ar"]
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    set_value(browser, "max-tokens", "16")
    prompt.send_keys(Keys.CONTROL, Keys.ENTER)  # keyboard-usable: Ctrl+Enter runs
    finished(browser)
    runs = browser.execute_script("return window.kstepRuns")
    api = client(pair)
    for model in ("diff", "ar"):
        expected = api.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
        assert runs[model]["error"] is None and runs[model]["text"] == expected
        assert pane(browser, model).find_element(By.CSS_SELECTOR, ".completion").get_attribute("textContent") == expected
    diff_states = runs["diff"]["states"]
    assert any(None in s["pieces"] for s in diff_states[:-1])  # masked positions while refining ...
    assert None not in diff_states[-1]["pieces"]               # ... none at the end
    assert MASK_PLACEHOLDER not in pane(browser, "diff").find_element(By.CSS_SELECTOR, ".completion").text
    assert len(runs["ar"]["states"]) > 1 and all(s["pieces"] is None for s in runs["ar"]["states"])  # token stream
    for model in ("diff", "ar"):
        stats = {dd.get_attribute("data-stat"): dd.text for dd in pane(browser, model).find_elements(By.CSS_SELECTOR, "dd")}
        assert "–" not in stats.values(), stats
        assert int(stats["tokens"]) == 16 and float(stats["rate"]) > 0
    assert console_errors(browser) == []


def test_masks_are_drawn_while_refining(browser, pair):
    """Paced drawing (the speed control) shows the canvas mid-refinement, masks and all."""
    open_page(browser, pair)
    set_value(browser, "max-tokens", "16")
    Select(browser.find_element(By.ID, "speed")).select_by_value("300")
    browser.find_element(By.ID, "run").click()
    completion = pane(browser, "diff").find_element(By.CSS_SELECTOR, ".completion")
    WebDriverWait(browser, 30).until(lambda d: MASK_PLACEHOLDER in completion.text)
    assert completion.find_elements(By.CSS_SELECTOR, ".mask")
    finished(browser)
    WebDriverWait(browser, 30).until(lambda d: MASK_PLACEHOLDER not in completion.text)
    replay = browser.find_element(By.ID, "replay")
    WebDriverWait(browser, 30).until(lambda d: replay.is_enabled())  # once every pane has drawn its run
    assert browser.find_element(By.ID, "run").is_enabled()
    replay.click()  # a finished run replays from its first state
    WebDriverWait(browser, 30).until(lambda d: MASK_PLACEHOLDER in completion.text)
    assert console_errors(browser) == []


def test_a_bad_setting_shows_the_servers_message(browser, pair):
    open_page(browser, pair)
    Select(browser.find_element(By.ID, "decoding")).select_by_value("threshold")
    set_value(browser, "threshold", "2")
    browser.find_element(By.ID, "run").click()
    finished(browser)
    error = pane(browser, "diff").find_element(By.CSS_SELECTOR, ".error")
    assert error.is_displayed() and "threshold" in error.text
    assert error.text == browser.execute_script("return window.kstepRuns.diff.error")
    assert pane(browser, "ar").get_attribute("data-state") == "done"  # the AR pane takes no threshold: it ran


def test_an_api_key_is_asked_for_once(browser, llama_path, tmp_path):
    with running_server(f"ar={llama_path}", "--api-key", "s3cret", log=tmp_path / "serve.log") as (url, _):
        browser.get(url + "/")
        key = browser.find_element(By.ID, "api-key")
        WebDriverWait(browser, 30).until(lambda d: key.is_displayed())
        assert "needs an API key" in browser.find_element(By.ID, "page-error").text
        key.send_keys("s3cret", Keys.ENTER)
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".pane"))
        browser.refresh()  # kept for the session: no second prompt
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".pane"))
        assert not browser.find_element(By.ID, "api-key").is_displayed()
        browser.find_element(By.ID, "run").click()
        finished(browser)
        assert browser.execute_script("return window.kstepRuns.ar.error") is None
    browser.execute_script("sessionStorage.clear()")


@pytest.mark.skipif(not os.environ.get("KSTEP_SCREENSHOT"), reason="KSTEP_SCREENSHOT=PATH saves a finished race")
def test_screenshot_of_the_bundled_pair(browser, tmp_path):
    with running_server("default", "--model", "default-ar", log=tmp_path / "serve.log") as (url, _):
        open_page(browser, url)
        Select(browser.find_element(By.ID, "speed")).select_by_value("100")
        browser.find_element(By.ID, "run").click()
        finished(browser)
        WebDriverWait(browser, 60).until(lambda d: "done" == pane(d, "default").get_attribute("data-state"))
        browser.save_screenshot(str(Path(os.environ["KSTEP_SCREENSHOT"])))
