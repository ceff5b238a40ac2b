"""The browser page at `/`, in a real headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium): a fake microphone that plays a known sentence
transcribed live over the realtime WebSocket, a file transcribed through
/v1/audio/transcriptions, and the transcript's downloads. Saves a screenshot of the
page (page.png in the test's temporary directory). Skips where Chromium is not
installed; scripts/bootstrap.sh installs it, and under CI its absence fails the run.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiohttp", reason="the HTTP door needs the serve extra (aiohttp)")
webdriver = pytest.importorskip("selenium.webdriver", reason="needs the dev extra (selenium)")

import soundfile as sf  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from echoic.model.core.audio import decode_audio  # noqa: E402
from tests.test_http import http_server, post_form  # noqa: E402

TIMEOUT = 90.0  # s for the page to show a result: generous on a loaded 2-core machine


def _chromium() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or shutil.which("chromium-driver")
    if not browser or not driver:
        pytest.skip("chromium and chromium-driver are not installed (scripts/bootstrap.sh)")
    return browser, driver


@pytest.fixture(scope="module")
def sentence(speech_corpus: Path, tmp_path_factory) -> tuple[str, Path]:
    """(text, WAV path): a corpus utterance with 1.5 s of silence after it, so that the
    live session's endpointing ends the utterance while the fake microphone loops it."""
    row = json.loads(speech_corpus.read_text().splitlines()[2])
    samples = decode_audio((speech_corpus.parent / row["audio_filepath"]).read_bytes(), 16000)
    audio = np.concatenate([np.zeros(8000, np.float32), samples, np.zeros(24000, np.float32)])
    path = tmp_path_factory.mktemp("browser") / "sentence.wav"
    sf.write(path, audio, 16000, subtype="PCM_16")
    return row["text"], path


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", text.lower()))


@pytest.mark.slow
def test_the_page_transcribes_the_microphone_and_a_file(sentence, tmp_path) -> None:
    browser, driver_path = _chromium()
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    text, wav = sentence
    options = Options()
    options.binary_location = browser
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
             f"--use-file-for-fake-audio-capture={wav}",
             "--autoplay-policy=no-user-gesture-required", "--window-size=1000,900"]  # fmt: skip
    for flag in flags:
        options.add_argument(flag)
    with http_server() as server:
        chrome = webdriver.Chrome(service=Service(driver_path), options=options)
        try:
            chrome.get(server.http_url + "/")
            assert chrome.title == "echoic"
            chrome.find_element(By.ID, "start").click()

            def heard(_) -> bool:  # most of the sentence's words in one final utterance
                finals = [e.text for e in chrome.find_elements(By.CSS_SELECTOR, "li.final")]
                return any(len(_words(f) & _words(text)) >= 0.6 * len(_words(text))
                           for f in finals)  # fmt: skip

            WebDriverWait(chrome, TIMEOUT).until(heard)
            chrome.find_element(By.ID, "stop").click()
            WebDriverWait(chrome, TIMEOUT).until(
                lambda _: chrome.find_element(By.ID, "status").text == "idle"
            )
            live = len(chrome.find_elements(By.CSS_SELECTOR, "li.final"))
            # A file, through /v1/audio/transcriptions: its utterance joins the transcript.
            chrome.find_element(By.ID, "file").send_keys(str(wav))
            chrome.find_element(By.ID, "transcribe").click()
            WebDriverWait(chrome, TIMEOUT).until(
                lambda _: len(chrome.find_elements(By.CSS_SELECTOR, "li.final")) > live
            )
            file_text = chrome.find_elements(By.CSS_SELECTOR, "li.final")[-1].text
            assert len(_words(file_text) & _words(text)) >= 0.6 * len(_words(text)), file_text
            # The page's decoding choice reaches the server: greedy is the HTTP door's greedy.
            Select(chrome.find_element(By.ID, "decoder")).select_by_value("greedy")
            before = len(chrome.find_elements(By.CSS_SELECTOR, "li.final"))
            chrome.find_element(By.ID, "transcribe").click()
            WebDriverWait(chrome, TIMEOUT).until(
                lambda _: len(chrome.find_elements(By.CSS_SELECTOR, "li.final")) > before
            )
            greedy = chrome.find_elements(By.CSS_SELECTOR, "li.final")[-1].text
            status, body = post_form(server, [("decoder", "greedy")], [("file", wav.read_bytes())])
            assert status == 200 and re.sub(r"^\d\d:\d\d\s*", "", greedy) == body["text"]
            # The downloads hold the transcript shown.
            fetch = "return await (await fetch(document.getElementById(arguments[0]).href)).text()"
            txt = chrome.execute_script(fetch, "download-txt")
            srt = chrome.execute_script(fetch, "download-srt")
            shown = [re.sub(r"^\d\d:\d\d\s*", "", e.text)
                     for e in chrome.find_elements(By.CSS_SELECTOR, "li.final")]  # fmt: skip
            assert txt.splitlines() == shown
            assert (
                re.findall(r"\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n(.+)\n", srt) == shown
            )
            chrome.save_screenshot(str(tmp_path / "page.png"))
            assert (tmp_path / "page.png").stat().st_size > 0
        finally:
            chrome.quit()
