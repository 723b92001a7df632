"""The playground with a DiffusionGemma pane beside an AR one, in a real headless Chromium (as
tests/test_playground.py): its canvas has no masks and its tokens change in place (drawn as edits),
the seeded run's final text is the API's, and its own knobs (fixed passes per canvas) are sent."""
import pytest
from test_playground import browser, console_errors, finished, open_page, pane, set_value  # noqa: F401
from test_server import client

from kstep.bench.server_process import running_server

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def pair(gemma_path, llama_path, tmp_path_factory):
    with running_server(f"gemma={gemma_path}", "--model", f"ar={llama_path}",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


def test_a_gemma_pane_shows_tokens_changing_and_ends_on_the_apis_text(browser, pair):  # noqa: F811
    open_page(browser, pair)
    set_value(browser, "prompt", PROMPT)
    set_value(browser, "max-tokens", "16")
    set_value(browser, "seed", "4")
    Select(browser.find_element(By.ID, "speed")).select_by_value("100")
    browser.find_element(By.ID, "run").click()
    completion = pane(browser, "gemma").find_element(By.CSS_SELECTOR, ".completion")
    WebDriverWait(browser, 60).until(lambda d: completion.find_elements(By.CSS_SELECTOR, ".edit"))
    finished(browser)
    runs = browser.execute_script("return window.kstepRuns")
    expected = client(pair).completions.create(model="gemma", prompt=PROMPT, max_tokens=16, temperature=0,
                                               seed=4).choices[0].text
    states = runs["gemma"]["states"]
    assert runs["gemma"]["error"] is None and runs["gemma"]["text"] == expected
    assert all(None not in s["pieces"] for s in states if s["pieces"])  # no masks: random tokens refined
    assert any(s["edits"] for s in states)
    WebDriverWait(browser, 60).until(lambda d: pane(d, "gemma").get_attribute("data-state") == "done")
    assert completion.get_attribute("textContent") == expected
    assert console_errors(browser) == []


def test_fixed_steps_become_passes_per_canvas(browser, pair):  # noqa: F811
    open_page(browser, pair)
    set_value(browser, "max-tokens", "8")
    Select(browser.find_element(By.ID, "decoding")).select_by_value("steps")
    set_value(browser, "steps", "5")
    browser.find_element(By.ID, "run").click()
    finished(browser)
    runs = browser.execute_script("return window.kstepRuns")
    assert runs["gemma"]["error"] is None and runs["gemma"]["usage"]["nfe"] == 1 + 5  # a prefill, 5 passes
    assert runs["ar"]["error"] is None
