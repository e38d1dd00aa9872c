"""`marin-rl rollouts view` in a real headless Chromium (Debian's chromium and chromium-driver), on a
run the quickstart made: filters, a rollout as a conversation, token colours, uid links, the HTML file."""

import io
import os
import shutil
import threading

import numpy as np
import pytest

from marin_rl import viewer
from marin_rl.storage import read_rollouts

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--window-size=1280,900"]  # fmt: skip


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        message = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run does)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(10)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(quickstart_run):
    run_dir, done = quickstart_run
    assert done.returncode == 0, done.stderr
    index, reader = viewer.open_run(run_dir)
    server = viewer.make_server(index, reader, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield run_dir, index, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def wait_for(driver, condition, timeout=10):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # An element found just before the page re-renders it is stale: look again.
    return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: condition())


def count_text(driver):
    return driver.find_element("id", "count").text


def test_the_list_and_its_filters_match_the_store(browser, served):
    run_dir, index, url = served
    rollouts = read_rollouts(run_dir)
    browser.get(url)
    wait_for(browser, lambda: count_text(browser).startswith(f"{len(rollouts)} of {len(rollouts)} rollouts"))
    assert browser.find_element("id", "run").text == run_dir.name
    browser.find_element("id", "rmin").send_keys("1")
    solved = sum(r.reward >= 1 for r in rollouts)
    wait_for(browser, lambda: count_text(browser).startswith(f"{solved} of {len(rollouts)}"))
    rewards = [row.find_elements("tag name", "td")[3].text for row in browser.find_elements("css selector", "tr.row")]
    assert rewards and set(rewards) == {"1.000"}
    browser.find_element("id", "rmin").clear()
    browser.find_element("id", "vmin").send_keys("2")
    newer = sum(r.policy_version >= 2 for r in rollouts)
    wait_for(browser, lambda: count_text(browser).startswith(f"{newer} of"))
    browser.find_element("id", "vmin").clear()
    search = browser.find_element("id", "text")
    prompt = rollouts[0].turns[0].content[-4:]  # e.g. `3+1=`: which problems came first depends on the seed
    search.send_keys(prompt + "\n")  # the prompt text, searched in the store by the server
    with_prompt = sum(any(prompt in t.content for t in r.turns) for r in rollouts)
    wait_for(browser, lambda: count_text(browser).startswith(f"{with_prompt} of"))
    assert 0 < with_prompt < len(rollouts)


def test_a_rollout_is_a_conversation_with_coloured_tokens_and_a_link(browser, served, tmp_path):
    run_dir, index, url = served
    # A rollout that did better than its group: positive advantage, so its tokens turn green.
    best = int(np.argmax([a if a is not None else -1 for a in index.columns["advantage"]]))
    uid, advantage = index.columns["rollout_uid"][best], index.columns["advantage"][best]
    assert advantage > 0
    (rollout,) = [r for r in read_rollouts(run_dir) if r.rollout_uid == uid]
    browser.get(f"{url}#uid={uid}")  # the link a uid gives
    wait_for(browser, lambda: browser.find_element("id", "permalink").text == uid)
    roles = [e.text for e in browser.find_elements("css selector", "#detail .role")]
    assert [r.split(" ·")[0].lower() for r in roles] == [t.role for t in rollout.turns]
    (token,) = browser.find_elements("css selector", "#detail .tok")  # the quickstart samples one token
    assert token.get_attribute("textContent") == rollout.turns[-1].content
    assert float(token.get_attribute("data-logprob")) == pytest.approx(float(rollout.turns[-1].logprobs[0]), abs=1e-4)
    assert float(token.get_attribute("data-advantage")) == pytest.approx(advantage, abs=1e-4)

    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", "colour")).select_by_value("advantage")
    token = browser.find_element("css selector", "#detail .tok")
    assert token.value_of_css_property("background-color").startswith("rgba(20, 160, 60")
    from PIL import Image

    shot = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    pixels = np.asarray(shot).reshape(-1, 3).astype(int)
    green = ((pixels[:, 1] > pixels[:, 0] + 60) & (pixels[:, 1] > pixels[:, 2] + 40)).sum()
    assert green > 40, "no green (positive advantage) token on the screenshot"
    assert len(np.unique(pixels, axis=0)) > 50, "the screenshot is nearly blank"

    # Clicking a row opens it and puts its uid in the address.
    row = browser.find_elements("css selector", "tr.row")[1]
    clicked = row.get_attribute("data-uid")
    row.click()
    wait_for(browser, lambda: browser.find_element("id", "permalink").text == clicked)
    assert browser.current_url.endswith("#uid=" + clicked)


def test_the_html_file_holds_what_matters_and_works_offline(browser, served, tmp_path):
    run_dir, index, _ = served
    reader = viewer.RolloutReader(index, None, {})
    output = tmp_path / "rollouts.html"
    count, kept = viewer.write_html(index, reader, output, limit=50)
    assert count == 50 and kept.startswith(f"50 of {index.size} rollouts: the latest group of each of")
    browser.get(output.as_uri())
    wait_for(browser, lambda: count_text(browser) == f"50 of 50 rollouts (50 of the {index.size} on disk are in this file)")
    assert browser.find_element("id", "kept").text == "this file holds " + kept
    first = browser.find_element("css selector", "tr.row")
    clicked = first.get_attribute("data-uid")
    first.click()
    wait_for(browser, lambda: browser.find_element("id", "permalink").text == clicked)
    # The conversation, from the file. textContent keeps a sampled space or newline, which `.text` strips.
    (rollout,) = [r for r in read_rollouts(run_dir) if r.rollout_uid == clicked]
    contents = [e.get_attribute("textContent") for e in browser.find_elements("css selector", "#detail .turn .content")]
    assert contents == [turn.content for turn in rollout.turns]
    assert contents[0].strip(), "the prompt is missing"


@pytest.fixture(scope="module")
def stuck_run(tmp_path_factory):
    """20 policy versions of 5 problems in groups of 4: `3+1=` stays at reward 0, the others learn by v5."""
    from marin_rl.storage import RolloutWriter
    from marin_rl.testing import make_group

    run_dir = tmp_path_factory.mktemp("stuck")
    writer = RolloutWriter(run_dir / "rollouts" / "addition")
    for version in range(20):
        for a in range(5):
            rewards = [0.0] * 4 if a == 3 else [0.0, 1.0, 0.0, 0.0] if version < 5 else [1.0] * 4
            writer.append(make_group(rewards, env="addition", group_id=f"g{version}-{a}", problem_id=f"{a}+1=", policy_version=version, seed=version * 5 + a))
    writer.close()
    return run_dir


def test_the_problem_page_and_summary_name_the_problem_that_stays_at_zero(browser, stuck_run, tmp_path, capsys):
    from marin_rl.cli import main

    index, reader = viewer.open_run(stuck_run, tokenizer="char")
    server = viewer.make_server(index, reader, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        browser.get(url + "#problems")
        rows = wait_for(browser, lambda: browser.find_elements("css selector", "#problems tbody tr"))
        cells = [td.text for td in rows[0].find_elements("tag name", "td")]
        assert cells[:5] == ["addition", "3+1=", "0.000", "never", "100%"] and rows[0].get_attribute("class") == "failing"
        assert len(rows) == 5 and all(row.get_attribute("class") == "" for row in rows[1:])
        rows[0].find_element("tag name", "a").click()  # its page: the list narrows to it, its latest group beside
        wait_for(browser, lambda: browser.find_element("id", "problem-title").text == "problem 3+1= (addition)")
        assert "first solved: never" in browser.find_element("id", "problem-stats").text
        wait_for(browser, lambda: browser.find_element("id", "group-title").text == "group g19-3 · 4 samples")
        samples = browser.find_elements("css selector", ".sample .meta")
        assert len(samples) == 4 and all(m.text.startswith("reward 0.000") for m in samples)
        wait_for(browser, lambda: count_text(browser).startswith("80 of 400 rollouts"))

        # The list follows a rollout opened by its link, even one far down (the oldest; 200 rows a page).
        browser.get(url)
        oldest = index.columns["rollout_uid"][0]
        browser.get(f"{url}#uid={oldest}")
        selected = wait_for(browser, lambda: browser.find_element("css selector", "tr.selected"))
        assert selected.get_attribute("data-uid") == oldest
        visible = "const r = arguments[0].getBoundingClientRect(), l = document.getElementById('list').getBoundingClientRect();" \
                  "return r.top >= l.top && r.bottom <= l.bottom;"  # fmt: skip
        assert browser.execute_script(visible, selected)
    finally:
        server.shutdown()
        server.server_close()

    assert main(["rollouts", "summary", str(stuck_run), "--by", "problem"]) == 0
    first_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("│"))
    assert [c.strip() for c in first_row.strip("│").split("│")][1:4] == ["3+1=", "0.00", "never"]

    # A file small enough to keep only some groups still holds the failing problem's latest one, first.
    output = tmp_path / "stuck.html"
    viewer.write_html(index, reader, output, limit=40)
    browser.get(output.as_uri() + "#problem=3%2B1%3D&env=addition")
    wait_for(browser, lambda: browser.find_element("id", "group-title").text == "group g19-3 · 4 samples")
    assert [m.text[:12] for m in browser.find_elements("css selector", ".sample .meta")] == ["reward 0.000"] * 4
