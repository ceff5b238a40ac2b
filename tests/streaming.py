"""Running a whole utterance through a `Stream`, as the tests that compare paths need."""

from __future__ import annotations

import numpy as np

from echoic.model.core.decoding import Transcript
from echoic.model.runtime.recognizer import Recognizer


def stream_all(recognizer: Recognizer, audio: np.ndarray, chunk_samples: int = 1600) -> Transcript:
    """One utterance through a stream in pieces of `chunk_samples`, stepped as they come."""
    s = recognizer.stream()
    for i in range(0, len(audio), chunk_samples):
        s.accept_audio(audio[i : i + chunk_samples])
        while recognizer.step([s]):
            pass
    s.finish()
    while recognizer.step([s]):
        pass
    return s.result()
