"""The status page on the management listener: who may open it, what it shows, its buttons
with scripts off, and, in Debian's Chromium driven through selenium, a login, three
deployments, a park and a wake appearing live without a reload, a park by the button, and a
screenshot (written where CAPYCTL_PAGE_SCREENSHOT names, for the README)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cluster import FOURTEEN, SMALL, Cluster
from support import wait_for

HI: list[Any] = [{"role": "user", "content": "hi"}]
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


def page_url(cluster: Cluster, path: str = "/") -> str:
    return f"http://{cluster.role.management}{path}"


def admin_token(cluster: Cluster) -> str:
    return cluster.role.credentials()["admin_token"]


@contextmanager
def logged_in(cluster: Cluster) -> Iterator[httpx.Client]:
    """An HTTP client holding the session cookie of a login with the admin token."""
    with httpx.Client(base_url=page_url(cluster), timeout=30) as client:
        answer = client.post("/login", data={"token": admin_token(cluster)})
        assert answer.status_code == 303, answer.text
        yield client


def deploy_three(cluster: Cluster) -> None:
    cluster.deploy("alpha", model="small", engine_config=SMALL)
    cluster.deploy("beta", model="small", engine_config=SMALL)
    cluster.deploy("gamma", model="m14", engine_config=FOURTEEN)


def test_only_the_admin_token_opens_the_page(cluster: Cluster) -> None:
    deploy_three(cluster)
    url = page_url(cluster)
    # No token: the login form, and nothing of the role.
    answer = httpx.get(url)
    assert answer.status_code == 401
    assert 'action="/login"' in answer.text
    assert "alpha" not in answer.text
    # The API key opens the inference endpoint, not the page: by header or by the form.
    api = {"Authorization": f"Bearer {cluster.api_key}"}
    assert httpx.get(url, headers=api).status_code == 401
    refused = httpx.post(url + "login", data={"token": cluster.api_key})
    assert refused.status_code == 401
    assert "That is the API key" in refused.text
    assert "set-cookie" not in refused.headers
    wrong = httpx.post(url + "login", data={"token": "x" * 43})
    assert wrong.status_code == 401
    assert "not the admin token" in wrong.text
    # Nothing else of the page opens without it either.
    assert httpx.get(url + "events").status_code == 401
    assert httpx.post(url + "actions", data={"target": "deployment"}).status_code == 401
    assert httpx.get(url + "confirm").status_code == 401
    # The admin token in the header opens it.
    admin = {"Authorization": f"Bearer {admin_token(cluster)}"}
    shown = httpx.get(url, headers=admin)
    assert shown.status_code == 200
    assert 'data-deployment="alpha"' in shown.text
    assert "script-src 'self'" in shown.headers["content-security-policy"]
    # The login sets a session cookie no script reads and no other site sends.
    answer = httpx.post(url + "login", data={"token": admin_token(cluster)})
    assert answer.status_code == 303
    cookie = answer.headers["set-cookie"]
    assert "HttpOnly" in cookie, cookie
    assert "SameSite=strict" in cookie, cookie
    assert admin_token(cluster) not in cookie
    with logged_in(cluster) as client:
        assert client.get("/").status_code == 200
        # The cookie opens the page, not the management API.
        assert client.get("/management/v1/deployments").status_code == 401
        # A form that does not carry this session's key is refused.
        forged = client.post(
            "/actions",
            data={"target": "deployment", "name": "alpha", "action": "stop", "key": "k1"},
        )
        assert forged.status_code == 400
        assert "not from this session" in forged.text
        with logged_in(cluster) as other:
            kept = client.cookies["capyctl_session"]
            assert client.post("/logout").status_code == 303
            assert client.get("/").status_code == 401
            # The logout ended the session on the server: its cookie, replayed, opens
            # nothing; another login's session stays open.
            replayed = httpx.get(url, cookies={"capyctl_session": kept})
            assert replayed.status_code == 401
            assert 'action="/login"' in replayed.text
            assert other.get("/").status_code == 200


def test_the_page_shows_memory_and_acts_with_scripts_off(cluster: Cluster) -> None:
    deploy_three(cluster)
    cluster.openai().chat.completions.create(model="alpha", messages=HI, max_tokens=2)
    with logged_in(cluster) as client:
        shown = client.get("/").text
        for name in ("alpha", "beta", "gamma"):
            assert f'data-deployment="{name}"' in shown
        assert re.search(r'data-deployment="alpha" data-state="ready"', shown)
        # The GPU's bar: alpha's charge as ready, the reserve and what is free, each with
        # where its figure comes from; the engines registered on the host.
        assert '<figure class="bar" data-domain="gpu0">' in shown
        assert re.search(r'<li class="ready" data-kind="ready" data-bytes="\d+">', shown)
        assert "alpha ready" in shown
        assert "free reserve" in shown
        assert "simulated reading" in shown
        assert "<td>vllm</td>" in shown
        # The timeline has alpha's start and its readiness.
        assert 'data-what="start" data-deployment="alpha"' in shown
        assert 'data-what="ready" data-deployment="alpha"' in shown
        # A button asks first, on a page of its own.
        asked = client.get(
            "/confirm", params={"target": "deployment", "name": "alpha", "action": "park"}
        )
        assert asked.status_code == 200
        assert "gives its GPU memory back" in asked.text
        fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', asked.text))
        assert fields["action"] == "park"
        assert fields["form_key"]
        assert fields["key"]
        done = client.post("/actions", data=fields)
        assert done.status_code == 303, done.text
        wait_for(lambda: cluster.state("alpha") == "parked", 30, what="alpha to park")
        # The same form again is the same request: answered, not acted on twice.
        assert client.post("/actions", data=fields).status_code == 303
        bad = client.get(
            "/confirm", params={"target": "deployment", "name": "alpha", "action": "explode"}
        )
        assert bad.status_code == 400
        assert "invalid_request" in bad.text
        shown = client.get("/").text
        assert re.search(r'data-deployment="alpha" data-state="parked"', shown)
        assert 'data-what="park" data-deployment="alpha"' in shown


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (scripts/check)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="capy-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,1100",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_the_page_follows_parks_and_wakes_live_in_a_browser(
    cluster: Cluster, browser: Any, tmp_path: Path
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    deploy_three(cluster)
    browser.get(page_url(cluster))
    browser.find_element(By.ID, "token").send_keys(cluster.api_key)
    browser.find_element(By.CSS_SELECTOR, "form[action='/login'] button").click()
    # The click submits the form; the answer's page comes when it comes (a loaded machine).
    refused = wait_for(
        lambda: browser.find_elements(By.CSS_SELECTOR, ".refused"), 15, what="the refusal"
    )
    assert "That is the API key" in refused[0].text
    browser.find_element(By.ID, "token").send_keys(admin_token(cluster))
    browser.find_element(By.CSS_SELECTOR, "form[action='/login'] button").click()
    wait_for(lambda: browser.find_elements(By.ID, "live"), 10, what="the page")
    wait_for(
        lambda: browser.find_element(By.ID, "live").is_displayed(), 10, what="the live updates"
    )

    # The live updates replace whole sections at any moment: each read is one script, so no
    # element found is stale by the time it is read.
    def read(script: str) -> Any:
        return browser.execute_script(f"return {script}")

    def state(name: str) -> str:
        query = f"document.querySelector('article[data-deployment=\"{name}\"]')"
        return str(read(f"{query}?.dataset.state ?? ''"))

    def moments(name: str) -> list[str]:
        query = f"document.querySelectorAll('#timeline li[data-deployment=\"{name}\"]')"
        return list(read(f"Array.from({query}, (item) => item.dataset.what)"))

    assert {state(n) for n in ("alpha", "beta", "gamma")} == {"idle"}
    # A mark on the window: a reload would lose it.
    browser.execute_script("window.capyctlMark = 'kept';")
    client = cluster.openai()
    client.chat.completions.create(model="alpha", messages=HI, max_tokens=2)
    client.chat.completions.create(model="beta", messages=HI, max_tokens=2)
    wait_for(lambda: state("alpha") == "ready", 15, what="alpha ready on the page")
    cluster.ok("park", "deployment", "beta", "--wait")
    wait_for(lambda: state("beta") == "parked", 15, what="beta's park on the page")
    assert "park" in moments("beta")
    client.chat.completions.create(model="beta", messages=HI, max_tokens=2)
    wait_for(lambda: state("beta") == "ready", 15, what="beta's wake on the page")
    assert "wake" in moments("beta")
    # Times are shown relative to now by the script.
    shown = read("document.querySelector('#timeline time').textContent")
    assert shown.endswith(" ago") or shown == "just now", shown

    # The button parks alpha, after a confirmation (found again if an update replaced it).
    button = 'article[data-deployment="alpha"] button[data-action="park"]'
    for _ in range(5):
        try:
            browser.find_element(By.CSS_SELECTOR, button).click()
            break
        except StaleElementReferenceException:
            continue
    dialog = browser.switch_to.alert
    assert "Park alpha?" in dialog.text
    dialog.accept()
    wait_for(lambda: state("alpha") == "parked", 30, what="alpha parked by the button")
    assert cluster.state("alpha") == "parked"
    assert "Asked: park alpha." in browser.find_element(By.ID, "notice").text
    assert browser.execute_script("return window.capyctlMark") == "kept"
    parked = read("document.querySelectorAll('figure[data-domain=\"gpu0\"] li.parked').length")
    assert parked, "the GPU's bar shows the parked models"

    shot = Path(os.environ.get("CAPYCTL_PAGE_SCREENSHOT") or tmp_path / "page.png")
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Light and dark as the system is, and one column on a phone, with nothing wider.
    background = "return getComputedStyle(document.body).backgroundColor"
    assert browser.execute_script(background) == "rgb(255, 255, 255)"
    dark = {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", dark)
    assert browser.execute_script(background) == "rgb(13, 17, 23)"
    browser.set_window_size(390, 844)
    wide = "return document.documentElement.scrollWidth - window.innerWidth"
    assert wait_for(lambda: browser.execute_script(wide) <= 0 or None, 5, what="a narrow page")
    assert browser.save_screenshot(str(shot.with_name(f"{shot.stem}-phone-dark.png")))


def test_the_page_counts_the_requests_waiting_for_their_model(cluster: Cluster) -> None:
    cluster.deploy("slow", engine="slowload", model="small")  # loads for a minute
    client = cluster.openai(timeout=60)

    def ask() -> None:
        with contextlib.suppress(openai.APIError):
            client.chat.completions.create(model="slow", messages=HI, max_tokens=2)

    waiting = threading.Thread(target=ask, daemon=True)
    waiting.start()
    with logged_in(cluster) as page:

        def shown() -> bool:
            text = page.get("/").text
            starting = 'data-deployment="slow" data-state="starting"' in text
            return starting and '<span class="waiting">1</span> waiting' in text

        wait_for(shown, 15, what="the request waiting for the model's start on the page")
    cluster.ok("stop", "deployment", "slow", "--wait")
    waiting.join(30)


def test_a_switch_is_on_the_timeline_with_its_duration(cluster: Cluster) -> None:
    cluster.deploy("one", model="m14", engine_config=FOURTEEN)
    cluster.deploy("two", model="m14", engine_config=FOURTEEN)
    client = cluster.openai()
    client.chat.completions.create(model="one", messages=HI, max_tokens=2)
    client.chat.completions.create(model="two", messages=HI, max_tokens=2)  # one makes room
    with logged_in(cluster) as page:

        def switch() -> str | None:
            found = re.search(
                r'<li class="switch" data-what="switch" data-deployment="two">(.*?)</li>',
                page.get("/").text,
            )
            return found[1] if found else None

        shown = wait_for(switch, 15, what="the switch to two on the timeline")
    assert re.search(r"switch</span> in \d", shown), shown
    assert "ready: the switch to it ended" in shown
