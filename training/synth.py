"""Synthetic speech corpora: espeak-ng, flite, festival and neural (Piper, hibari,
Kokoro) voices, speed, pitch and noise.

`synthesize_corpus(text_file, out_dir, SynthConfig(...))` reads sentences (one a
line), normalises them, and renders each `voices_per_sentence` times with a voice,
tempo and pitch drawn from a random generator seeded by (seed, variant_seed, line,
copy, text), so an utterance sounds the same whatever `jobs` or the order of work.
Optionally noise (white, pink or brown) is added at a random SNR.

Output in `out_dir`:

- `wavs/<line>-<copy>-<first words>-<hash>.wav` (`000012-0-the-quick-brown-fox-
  3f9c0a1b22d4.wav`): 16 kHz mono PCM16, named for a person (the sentence's line in
  the text file, which rendering of it, its first words) and for the rerun: the hash
  covers everything that decides the audio (text, line, copy, seeds, voice, tempo,
  pitch, noise), so a rerun maps to the same files, finds them and synthesises
  nothing; a changed setting maps to new files instead of silently reusing stale ones.
  Each file is written to a temporary name and renamed, so a killed run leaves no
  half-written WAV.
- `corpus.json`: the engines with their versions, the voices each offered, how many
  utterances each voice spoke, and the config.
- `manifest.jsonl`: one line per utterance in sentence order, NeMo style
  `{"audio_filepath", "duration", "text"}` with absolute paths (relative to the
  manifest's directory with `relative_paths=True`), plus what made the audio:
  `engine`, `voice`, `speed` (tempo factor, 1.0 = the engine's default rate),
  `pitch` (espeak-ng's 0-99 pitch, or flite's mean F0 in Hz), `noise` (kind or
  null), `snr_db` (or null) and `line` (1-based line in the text file); for the neural
  engines (`training/neural_tts.py`) also `noise_scale` and `noise_w` (Piper's VITS noise
  scales) or `f0_scale` (hibari's pitch factor; Kokoro has neither), and their `pitch` is
  0 (the voice's own).

`variant_seed` is the epoch knob: the same sentences with a new variant seed get
new voices, tempos and noise, in new files beside the old ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
from tqdm import tqdm

from echoic.model.core.configs import ConfigError
from echoic.training import neural_tts
from echoic.training.corpus import Sentence, read_sentences
from echoic.training.neural_tts import NEURAL_ENGINES


class SynthError(RuntimeError):
    """A synthesizer is missing or failed."""


ENGINES = ("espeak", "flite", "festival", *NEURAL_ENGINES)
DEFAULT_ENGINES = ("espeak", "flite")  # the others only when asked for (their voices are extra)
# Engines whose voices no recipe trains on: they judge a model on voices it never heard
# (scripts/heldout_sets.sh, the unseen-piper set).
UNSEEN_ENGINES = ("piper",)
PROGRAMS = {"espeak": "espeak-ng", "flite": "flite", "festival": "text2wave"}
INSTALL_HINT = {
    "espeak": "apt-get install espeak-ng",
    "flite": "apt-get install flite",
    "festival": "apt-get install festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts",
}
NOISE_KINDS = ("white", "pink", "brown")

# espeak-ng voice variants that sound like people (no whisper, robot or novelty voices).
ESPEAK_VARIANTS = (
    *(f"m{i}" for i in range(1, 9)),
    *(f"f{i}" for i in range(1, 6)),
    *("klatt", "klatt2", "klatt3", "klatt4", "klatt6"),
    *("adam", "Alex", "Andy", "Annie", "aunty", "belinda", "benjamin", "caleb", "david"),
    *("ed", "edward", "Gene", "grandma", "grandpa", "iven", "john", "linda", "max"),
    *("Michael", "Mike", "norbert", "paul", "quincy", "rob", "robert", "shelby"),
    *("steph", "travis", "victor", "zac"),
)
ESPEAK_DEFAULT_WPM = 175.0  # espeak-ng's default rate, words per minute
# flite voices used, with their mean F0 in Hz as measured on their default output (kal,
# the 8 kHz kal16, and awb_time, which only speaks the time, are left out; adding a voice
# would change the voices every existing seed draws, and so the bundled model's corpus).
FLITE_VOICES = {"kal16": 95.0, "slt": 170.0, "rms": 100.0, "awb": 125.0}
# Festival's English voices, with their mean F0 in Hz where the voice takes a target
# (diphone voices, through int_lr_params); None: an HTS voice, whose pitch stays its own.
FESTIVAL_VOICES = {"kal_diphone": 105.0, "ked_diphone": 105.0, "cmu_us_slt_arctic_hts": None}


@dataclass(frozen=True)
class SynthConfig:
    engines: tuple[str, ...] = DEFAULT_ENGINES  # synthesizers to draw voices from (ENGINES)
    voices_per_sentence: int = 1  # renderings of each sentence with distinct voices, count
    seed: int = 0  # corpus seed: voices, tempos, noise and file names follow from it
    variant_seed: int = 0  # epoch knob: a new value re-draws every voice and noise
    speed: tuple[float, float] = (0.75, 1.2)  # tempo factor range, 1.0 = engine default
    espeak_pitch: tuple[int, int] = (30, 70)  # espeak-ng -p range, 0-99 (50 = default)
    espeak_formants: tuple[float, float] = (1.0, 1.0)  # espeak-ng formant frequency factor
    # range, x the voice's own (a vocal-tract length: 0.9 longer, 1.1 shorter); 1 1 = off
    flite_f0_scale: tuple[float, float] = (0.85, 1.2)  # flite and festival mean F0 range,
    # x the voice's own
    noise_prob: float = 0.0  # chance that an utterance gets additive noise, 0-1
    snr_db: tuple[float, float] = (10.0, 30.0)  # speech-to-noise ratio range, dB
    noise_kinds: tuple[str, ...] = NOISE_KINDS  # noise colours to draw from
    piper_noise_scale: tuple[float, float] = (0.5, 0.8)  # Piper's VITS prior noise range
    # (the voice's own is 0.667)
    piper_noise_w: tuple[float, float] = (0.5, 1.0)  # Piper's duration noise range (own 0.8)
    hibari_f0_scale: tuple[float, float] = (0.85, 1.15)  # hibari pitch range, x the F0 the
    # network predicts
    sample_rate: int = 16000  # output rate, Hz

    def __post_init__(self) -> None:
        unknown = [e for e in self.engines if e not in ENGINES]
        if unknown or not self.engines:
            raise ConfigError(f"engines: {unknown or 'none'} (choose from {', '.join(ENGINES)})")
        if self.voices_per_sentence < 1:
            raise ConfigError("voices_per_sentence must be at least 1")
        if not 0.0 <= self.noise_prob <= 1.0:
            raise ConfigError(f"noise_prob must be in [0, 1], got {self.noise_prob}")
        bad_noise = [k for k in self.noise_kinds if k not in NOISE_KINDS]
        if bad_noise or not self.noise_kinds:
            raise ConfigError(f"noise_kinds: {bad_noise or 'none'} (from {NOISE_KINDS})")
        ranges = ("speed", "espeak_pitch", "espeak_formants", "flite_f0_scale", "snr_db")
        neural = ("piper_noise_scale", "piper_noise_w", "hibari_f0_scale")
        for name in (*ranges, *neural):
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ConfigError(f"{name}: low {lo} is above high {hi}")
        if min(self.speed) <= 0 or min(self.flite_f0_scale) <= 0 or min(self.hibari_f0_scale) <= 0:
            raise ConfigError("speed, flite_f0_scale and hibari_f0_scale must be positive")
        if min(self.piper_noise_scale) < 0 or min(self.piper_noise_w) < 0:
            raise ConfigError("piper_noise_scale and piper_noise_w must be 0 or more")
        if not 0.5 <= min(self.espeak_formants) <= max(self.espeak_formants) <= 2.0:
            raise ConfigError(f"espeak_formants must lie in [0.5, 2], got {self.espeak_formants}")


@dataclass(frozen=True)
class Voice:
    engine: str  # one of ENGINES
    name: str  # espeak-ng -v argument (e.g. "gmw/en-GB-x-rp+f2"), flite -voice name, ...
    formants: bool = False  # whether a formant factor moves it (espeak-ng, not Klatt)


NAME_WORDS = 5  # words of the sentence in a WAV's name, count
NAME_CHARS = 40  # at most this much of them, characters


@dataclass(frozen=True)
class Utterance:
    line: int  # 1-based line of the sentence in the text file
    copy: int  # which of the sentence's renderings, 0-based
    text: str  # normalised transcript
    engine: str  # synthesizer
    voice: str  # voice name as passed to the synthesizer
    speed: float  # tempo factor, 1.0 = engine default
    pitch: float  # espeak-ng pitch 0-99, or flite/festival mean F0 in Hz (0: the voice's own)
    noise: str | None  # noise colour, or None for clean audio
    snr_db: float | None  # speech-to-noise ratio, dB
    noise_seed: int  # seed of the noise samples
    formant: float = 1.0  # espeak-ng formant frequency factor, x the voice's own (1: none)
    noise_scale: float | None = None  # Piper's VITS prior noise (None: not Piper)
    noise_w: float | None = None  # Piper's duration noise (None: not Piper)
    f0_scale: float = 1.0  # hibari's pitch, x the predicted F0 (1: its own)

    @property
    def name(self) -> str:
        fields = asdict(self)
        # Fields at their defaults stay out: the names files had before they could vary.
        for key, default in UNVARIED.items():
            if fields[key] == default:
                del fields[key]
        blob = json.dumps(fields, sort_keys=True).encode()
        first = " ".join(self.text.split()[:NAME_WORDS]).replace("'", "")
        words = re.sub(r"[^a-z0-9]+", "-", first).strip("-")
        return (
            f"{self.line:06d}-{self.copy}-{words[:NAME_CHARS]}-"
            + (hashlib.sha256(blob).hexdigest()[:12])
        )


UNVARIED = {"formant": 1.0, "noise_scale": None, "noise_w": None, "f0_scale": 1.0}


@dataclass(frozen=True)
class SynthSummary:
    utterances: int  # manifest lines, count
    written: int  # WAVs synthesised by this run, count
    skipped_existing: int  # WAVs already present and valid, count
    skipped_text: int  # source lines skipped (empty or not encodable), count
    skipped_empty: int  # of which empty, count
    skipped_unencodable: int  # of which not encodable by the vocabulary, count
    first_unencodable: int | None  # 1-based line of the first unencodable one
    seconds: float  # audio in the manifest, s
    elapsed: float  # wall time of the run, s
    manifest: str  # path of manifest.jsonl


# --- engines ------------------------------------------------------------------


def find_program(engine: str) -> str:
    """The path of an engine's program (a neural engine: its package's name); SynthError
    naming it when it is not on PATH (or not installed)."""
    if engine in NEURAL_ENGINES:
        try:
            neural_tts.voices(engine)
        except neural_tts.MissingEngine as e:
            raise SynthError(str(e)) from e
        return neural_tts.PACKAGES[engine]
    program = PROGRAMS[engine]
    path = shutil.which(program)
    if path is None:
        raise SynthError(
            f"{program} not found on PATH (needed for --engines {engine}; "
            f"{INSTALL_HINT[engine]}, or leave {engine} out of --engines)"
        )
    return path


def _run(cmd: Sequence[str], stdin: bytes | None = None) -> str:
    try:
        done = subprocess.run(cmd, input=stdin, capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SynthError(f"{Path(cmd[0]).name} failed: {e}") from e
    stderr = done.stderr.decode(errors="replace").strip()
    if done.returncode != 0:
        raise SynthError(f"{Path(cmd[0]).name} exited with {done.returncode}: {stderr[-300:]}")
    return done.stdout.decode(errors="replace")


def espeak_voices(program: str) -> list[str]:
    """English espeak-ng voices (no MBROLA) crossed with the installed human-like variants.
    A voice is named by its file (`gmw/en-US+m3`): by language code, `en-gb+m3` would be
    British English without the variant, since no voice file is called `en-gb`."""
    accents: list[str] = []
    for row in _run([program, "--voices=en"]).splitlines()[1:]:
        cols = row.split()
        if len(cols) >= 5 and cols[1] != "variant" and not cols[4].startswith("mb/"):
            if cols[4] not in accents:
                accents.append(cols[4])
    installed = set()
    for row in _run([program, "--voices=variant"]).splitlines()[1:]:
        match = re.search(r"!v/(\S+)", row)
        if match:
            installed.add(match.group(1))
    variants = [""] + [f"+{v}" for v in ESPEAK_VARIANTS if v in installed]
    return [accent + variant for accent in sorted(accents) for variant in variants]


def flite_voices(program: str) -> list[str]:
    # flite falls back to its default voice for an unknown name, so ask what it has.
    listed = _run([program, "-lv"]).split(":", 1)[-1].split()
    return [v for v in FLITE_VOICES if v in listed]


def festival_voices(program: str) -> list[str]:
    """Festival's English voices that are installed (`festival` lists them)."""
    festival = shutil.which("festival", path=str(Path(program).parent)) or "festival"
    listed = _run([festival, "-b", "(print (voice.list))"]).strip().strip("()").split()
    return [v for v in FESTIVAL_VOICES if v in listed]


def engine_versions(programs: dict[str, str]) -> dict[str, str]:
    """Each engine's version line, as it reports it (recorded with the corpus)."""
    versions = {}
    for engine, program in programs.items():
        if engine in NEURAL_ENGINES:
            versions[engine] = neural_tts.version(engine)
            continue
        if engine == "festival":
            program = shutil.which("festival", path=str(Path(program).parent)) or "festival"
        try:  # flite prints its version and exits 1
            done = subprocess.run([program, "--version"], capture_output=True, timeout=30)
            text = done.stdout.decode(errors="replace")
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        lines = [line.strip() for line in text.splitlines() if "version" in line.lower()]
        versions[engine] = (lines or [line.strip() for line in text.splitlines()] or ["?"])[0]
    return versions


def find_programs(engines: Sequence[str]) -> dict[str, str]:
    """Program paths of the requested engines only; SynthError names a missing one."""
    return {engine: find_program(engine) for engine in engines}


def discover_voices(programs: dict[str, str]) -> dict[str, list[Voice]]:
    """The voices each engine (name -> program path) offers."""
    listers = {"espeak": espeak_voices, "flite": flite_voices, "festival": festival_voices}
    pools: dict[str, list[Voice]] = {}
    for engine, program in programs.items():
        if engine in NEURAL_ENGINES:
            names = [v.name for v in neural_tts.voices(engine)]
        else:
            names = listers[engine](program)
        if not names:
            raise SynthError(f"{program} reports none of the English voices used here")
        klatt = klatt_variants(program) if engine == "espeak" else set()
        pools[engine] = [
            Voice(engine, name, engine == "espeak" and name.partition("+")[2] not in klatt)
            for name in names
        ]
    return pools


def espeak_data_dir(program: str) -> Path:
    """Where espeak-ng reads its voices and dictionaries (`espeak-ng --version` says)."""
    match = re.search(r"Data at:\s*(\S+)", _run([program, "--version"]))
    if match is None or not Path(match.group(1), "voices").is_dir():
        raise SynthError(f"{program} --version does not say where its espeak-ng-data is")
    return Path(match.group(1))


def espeak_overlay(program: str, root: str | Path) -> Path:
    """A copy of espeak-ng's data directory made of links, under `root`, whose voice
    variants (`voices/!v`) directory is a real one: `espeak-ng --path=<returned>` then
    finds the variants written there (`formant_variant`) beside the installed ones."""
    data = espeak_data_dir(program)
    top = Path(root) / "espeak-overlay"
    voices = top / "espeak-ng-data" / "voices"
    (voices / "!v").mkdir(parents=True, exist_ok=True)
    for entry in data.iterdir():
        if entry.name != "voices":
            (top / "espeak-ng-data" / entry.name).symlink_to(entry)
    for entry in (data / "voices").iterdir():
        if entry.name != "!v":
            (voices / entry.name).symlink_to(entry)
    for entry in (data / "voices" / "!v").iterdir():
        (voices / "!v" / entry.name).symlink_to(entry)
    return top


def klatt_variants(program: str) -> set[str]:
    """The installed espeak-ng variants that use its Klatt synthesizer, which does not
    read a voice's formant settings (a formant factor would change nothing)."""
    variants = espeak_data_dir(program) / "voices" / "!v"
    klatt = set()
    for path in variants.iterdir():
        text = path.read_text(errors="replace") if path.is_file() else ""
        if any(line.split()[:1] == ["klatt"] for line in text.splitlines()):
            klatt.add(path.name)
    return klatt


FORMANTS = range(1, 6)  # the espeak-ng formants a vocal-tract factor moves (0 is a base)


def formant_variant(base: str | None, factor: float) -> str:
    """An espeak-ng voice variant file: `base` (the installed variant's text, or None for
    the accent's own voice) with formants 1-5 moved to `factor` x their frequency."""
    lines, seen = [], set()
    for line in (base or "language variant\n").splitlines():
        cols = line.split()
        if len(cols) == 5 and cols[0] == "formant" and int(cols[1]) in FORMANTS:
            cols[2] = str(round(int(cols[2]) * factor))
            seen.add(int(cols[1]))
            line = " ".join(cols)
        lines.append(line)
    lines += [f"formant {n} {round(100 * factor)} 100 100" for n in FORMANTS if n not in seen]
    return "\n".join(lines) + "\n"


def synth_command(
    utt: Utterance, program: str, wav_path: str, espeak_path: Path | None = None
) -> list[str]:
    """The command line that renders `utt`; an espeak-ng utterance with a formant factor
    names its variant `echoic-<name>`, which `render` writes under `espeak_path`."""
    if utt.engine == "espeak":
        wpm = round(ESPEAK_DEFAULT_WPM * utt.speed)
        pitch = str(int(utt.pitch))
        voice, data = utt.voice, []
        if utt.formant != 1.0:
            if espeak_path is None:
                raise ValueError("an espeak-ng formant factor needs the overlay's path")
            voice, data = f"{utt.voice.split('+')[0]}+x{utt.name[:12]}", [f"--path={espeak_path}"]
        return [
            program, *data, "-v", voice, "-s", str(wpm), "-p", pitch, "-w", wav_path, "--stdin"
        ]  # fmt: skip
    if utt.engine == "festival":  # the text comes on stdin
        evals = [f"(voice_{utt.voice})", f"(Parameter.set 'Duration_Stretch {1.0 / utt.speed:.4f})"]
        if FESTIVAL_VOICES[utt.voice] is not None:
            evals.append(
                f"(set! int_lr_params (list (list 'target_f0_mean {utt.pitch}) (list "
                "'target_f0_std 12) (list 'model_f0_mean 170) (list 'model_f0_std 34)))"
            )
        return [program, *(arg for e in evals for arg in ("-eval", e)), "-o", wav_path]
    return [
        program,
        "-voice",
        utt.voice,
        "--setf",
        f"duration_stretch={1.0 / utt.speed:.4f}",
        "--setf",
        f"int_f0_target_mean={utt.pitch}",
        "-t",
        utt.text,
        "-o",
        wav_path,
    ]


# --- planning -----------------------------------------------------------------


def _rng(*key: object) -> np.random.Generator:
    digest = hashlib.sha256(json.dumps(key).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def plan_sentence(
    sentence: Sentence, pools: dict[str, list[Voice]], config: SynthConfig
) -> list[Utterance]:
    """The `voices_per_sentence` renderings of one sentence, each with its own voice."""
    engines = [e for e in config.engines if e in pools]
    voices = [v for e in engines for v in pools[e]]
    # Each engine gets an equal share, however many voices it has.
    weights = np.array([1.0 / (len(engines) * len(pools[v.engine])) for v in voices])
    k = config.voices_per_sentence
    rng = _rng("voices", config.seed, config.variant_seed, sentence.line, sentence.text)
    picks = rng.choice(len(voices), size=k, replace=k > len(voices), p=weights / weights.sum())
    plan = []
    for copy, pick in enumerate(picks):
        voice = voices[int(pick)]
        rng = _rng("utt", config.seed, config.variant_seed, sentence.line, copy, sentence.text)
        speed = round(float(rng.uniform(*config.speed)), 3)
        if voice.engine == "espeak":
            pitch = float(rng.integers(config.espeak_pitch[0], config.espeak_pitch[1] + 1))
        elif voice.engine in NEURAL_ENGINES:
            pitch = 0.0  # the voice's own (hibari's moves by f0_scale, drawn below)
        else:
            scale = rng.uniform(*config.flite_f0_scale)
            own = (FLITE_VOICES if voice.engine == "flite" else FESTIVAL_VOICES)[voice.name]
            pitch = round(float(own * scale), 1) if own is not None else 0.0
        noisy = rng.random() < config.noise_prob
        noise = str(rng.choice(config.noise_kinds)) if noisy else None
        snr = round(float(rng.uniform(*config.snr_db)), 2) if noisy else None
        formant = 1.0  # drawn apart, so that the other draws are what they were without it
        if voice.formants and config.espeak_formants != (1.0, 1.0):
            key = ("formant", config.seed, config.variant_seed, sentence.line, copy)
            formant = round(float(_rng(*key).uniform(*config.espeak_formants)), 3)
        neural = _rng("neural", config.seed, config.variant_seed, sentence.line, copy)
        noise_scale = noise_w = None
        f0_scale = 1.0
        if voice.engine == "piper":
            noise_scale = round(float(neural.uniform(*config.piper_noise_scale)), 3)
            noise_w = round(float(neural.uniform(*config.piper_noise_w)), 3)
        elif voice.engine == "hibari":
            f0_scale = round(float(neural.uniform(*config.hibari_f0_scale)), 3)
        plan.append(
            Utterance(
                line=sentence.line,
                copy=copy,
                text=sentence.text,
                engine=voice.engine,
                voice=voice.name,
                speed=speed,
                pitch=pitch,
                noise=noise,
                snr_db=snr,
                noise_seed=int(rng.integers(2**62)),
                formant=formant,
                noise_scale=noise_scale,
                noise_w=noise_w,
                f0_scale=f0_scale,
            )
        )
    return plan


# --- audio --------------------------------------------------------------------


def make_noise(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` samples of white, pink (1/f power) or brown (1/f^2 power) noise at unit RMS."""
    white = rng.standard_normal(n)
    if kind == "white" or n < 2:
        noise = white
    else:
        spectrum = np.fft.rfft(white)
        freqs = np.fft.rfftfreq(n)
        spectrum[0] = 0.0
        exponent = 0.5 if kind == "pink" else 1.0  # amplitude ~ f^-exponent
        spectrum[1:] /= freqs[1:] ** exponent
        noise = np.fft.irfft(spectrum, n)
    rms = float(np.sqrt(np.mean(noise**2))) if n else 0.0
    return (noise / rms if rms > 0 else noise).astype(np.float32)


def add_noise(speech: np.ndarray, kind: str, snr_db: float, seed: int) -> np.ndarray:
    """Speech plus noise at `snr_db` (against the speech's RMS), scaled down if it would clip."""
    noise = make_noise(kind, len(speech), np.random.default_rng(seed))
    speech_rms = float(np.sqrt(np.mean(speech.astype(np.float64) ** 2)))
    mixed = speech + noise * np.float32(speech_rms / 10 ** (snr_db / 20))
    return _fit_range(mixed)


def _fit_range(audio: np.ndarray, peak: float = 0.99) -> np.ndarray:
    top = float(np.max(np.abs(audio))) if audio.size else 0.0
    return (audio * np.float32(peak / top) if top > peak else audio).astype(np.float32)


def render_neural(utt: Utterance) -> tuple[np.ndarray, int]:
    """One utterance of a neural engine, float32 mono at the voice's own rate."""
    try:
        model = neural_tts.engine(neural_tts.find_voice(utt.engine, utt.voice))
    except neural_tts.MissingEngine as e:
        raise SynthError(str(e)) from e
    seed = int(np.random.default_rng([utt.noise_seed, 1]).integers(2**62))  # not the noise's
    if isinstance(model, neural_tts.PiperEngine):
        assert utt.noise_scale is not None and utt.noise_w is not None
        audio = model.render(utt.text, utt.speed, utt.noise_scale, utt.noise_w, seed)
    elif isinstance(model, neural_tts.KokoroEngine):
        audio = model.render(utt.text, utt.speed)
    else:
        audio = model.render(utt.text, utt.speed, utt.f0_scale, seed)
    return audio.astype(np.float32), model.sample_rate


def render_program(
    utt: Utterance, program: str, tmp_dir: str, espeak_path: Path | None = None
) -> tuple[np.ndarray, int]:
    """One utterance of espeak-ng, flite or festival, float32 mono at the program's rate."""
    fd, raw_path = tempfile.mkstemp(suffix=".wav", dir=tmp_dir)
    os.close(fd)
    variant = None
    if utt.engine == "espeak" and utt.formant != 1.0 and espeak_path is not None:
        variants = espeak_path / "espeak-ng-data" / "voices" / "!v"
        base = utt.voice.split("+")[1] if "+" in utt.voice else None
        text = (variants / base).read_text(errors="replace") if base else None
        variant = variants / f"x{utt.name[:12]}"
        variant.write_text(formant_variant(text, utt.formant))
    try:
        stdin = utt.text.encode() if utt.engine in ("espeak", "festival") else None
        _run(synth_command(utt, program, raw_path, espeak_path), stdin=stdin)
        try:
            audio, rate = sf.read(raw_path, dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise SynthError(f"{PROGRAMS[utt.engine]} wrote unreadable audio: {e}") from e
    finally:
        os.unlink(raw_path)
        if variant is not None:
            variant.unlink()
    return audio.mean(axis=1), rate


def render(
    utt: Utterance, program: str, sample_rate: int, tmp_dir: str, espeak_path: Path | None = None
) -> np.ndarray:
    """One utterance as float32 mono at `sample_rate` (`espeak_path`: `espeak_overlay`'s
    directory, needed for an espeak-ng formant factor)."""
    if utt.engine in NEURAL_ENGINES:
        audio, rate = render_neural(utt)
    else:
        audio, rate = render_program(utt, program, tmp_dir, espeak_path)
    if audio.size == 0:
        name = PROGRAMS.get(utt.engine, utt.engine)
        raise SynthError(f"{name} produced no audio for line {utt.line}")
    if rate != sample_rate:
        audio = soxr.resample(audio, rate, sample_rate).astype(np.float32)
    if utt.noise is not None and utt.snr_db is not None:
        return add_noise(audio, utt.noise, utt.snr_db, utt.noise_seed)
    return _fit_range(audio)


def write_wav_atomic(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    pcm = np.clip(np.round(audio * 32767.0), -32768, 32767).astype(np.int16)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    try:
        sf.write(tmp, pcm, sample_rate, subtype="PCM_16", format="WAV")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def existing_duration(path: Path, sample_rate: int) -> float | None:
    """Duration in seconds of a valid 16-bit mono WAV at `sample_rate`, else None."""
    try:
        info = sf.info(str(path))
    except (sf.LibsndfileError, RuntimeError, OSError):
        return None
    ok = info.samplerate == sample_rate and info.channels == 1 and info.subtype == "PCM_16"
    return info.frames / sample_rate if ok and info.frames > 0 else None


# --- the corpus ---------------------------------------------------------------


def manifest_entry(utt: Utterance, audio_path: str, duration: float) -> dict[str, object]:
    return {
        "audio_filepath": audio_path,
        "duration": round(duration, 6),
        "text": utt.text,
        "engine": utt.engine,
        "voice": utt.voice,
        "speed": utt.speed,
        "pitch": utt.pitch,
        "noise": utt.noise,
        "snr_db": utt.snr_db,
        "line": utt.line,
        **{
            key: getattr(utt, key)
            for key, default in UNVARIED.items()
            if getattr(utt, key) != default
        },
    }


def _write_corpus_record(
    out_dir: Path,
    config: SynthConfig,
    programs: dict[str, str],
    pools: dict[str, list[Voice]],
    plan: list[Utterance],
) -> None:
    """`corpus.json` beside the manifest: the engines and their versions, the voices each
    offered and how many utterances each voice spoke, the neural voices' speaker ids, and
    the config."""
    used: dict[str, int] = {}
    for utt in plan:
        key = f"{utt.engine}:{utt.voice}"
        used[key] = used.get(key, 0) + 1
    record = {
        "engines": engine_versions(programs),
        "voices": {engine: [v.name for v in voices] for engine, voices in pools.items()},
        "utterances_per_voice": dict(sorted(used.items())),
        # the Piper speaker id of each multi-speaker voice's speakers (`<voice>#<speaker>`)
        "speaker_ids": {
            engine: {v.name: v.speaker for v in neural_tts.voices(engine) if v.speaker is not None}
            for engine in pools
            if engine in NEURAL_ENGINES
        },
        "config": asdict(config),
    }
    path = out_dir / "corpus.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def synthesize_corpus(
    text_path: str | Path,
    out_dir: str | Path,
    config: SynthConfig | None = None,
    *,
    limit: int | None = None,
    jobs: int | None = None,
    progress: bool = False,
    relative_paths: bool = False,
) -> SynthSummary:
    """Render the first `limit` usable sentences of `text_path` into `out_dir`."""
    started = time.perf_counter()
    config = config or SynthConfig()
    sentences, skips = read_sentences(text_path, limit=limit)
    programs = find_programs(config.engines)
    pools = discover_voices(programs)
    plan = [utt for s in sentences for utt in plan_sentence(s, pools, config)]

    out_dir = Path(out_dir).resolve()
    wav_dir = out_dir / "wavs"
    wav_dir.mkdir(parents=True, exist_ok=True)
    durations: dict[int, float] = {}
    todo: list[int] = []
    for i, utt in enumerate(plan):
        found = existing_duration(wav_dir / f"{utt.name}.wav", config.sample_rate)
        if found is None:
            todo.append(i)
        else:
            durations[i] = found

    def work(i: int, tmp_dir: str, espeak_path: Path | None) -> float:
        utt = plan[i]
        audio = render(utt, programs[utt.engine], config.sample_rate, tmp_dir, espeak_path)
        write_wav_atomic(wav_dir / f"{utt.name}.wav", audio, config.sample_rate)
        return len(audio) / config.sample_rate

    if todo:
        jobs = max(1, jobs or os.cpu_count() or 1)
        with (
            tempfile.TemporaryDirectory(prefix="echoic-synth-") as tmp_dir,
            tqdm(total=len(todo), desc="synth", unit="utt", disable=not progress) as bar,
            ThreadPoolExecutor(max_workers=jobs) as pool,
        ):
            moved = any(plan[i].formant != 1.0 for i in todo)
            overlay = espeak_overlay(programs["espeak"], tmp_dir) if moved else None
            futures = {pool.submit(work, i, tmp_dir, overlay): i for i in todo}
            try:
                for future in as_completed(futures):
                    durations[futures[future]] = future.result()
                    bar.update(1)
            except BaseException:
                # Stop queued work at once (an error or Ctrl-C); running jobs finish.
                for future in futures:
                    future.cancel()
                raise

    _write_corpus_record(out_dir, config, programs, pools, plan)
    manifest = out_dir / "manifest.jsonl"
    lines = []
    for i, utt in enumerate(plan):
        path = wav_dir / f"{utt.name}.wav"
        shown = str(path.relative_to(out_dir)) if relative_paths else str(path)
        lines.append(json.dumps(manifest_entry(utt, shown, durations[i])) + "\n")
    tmp = manifest.with_name(f".{manifest.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, manifest)

    return SynthSummary(
        utterances=len(plan),
        written=len(todo),
        skipped_existing=len(plan) - len(todo),
        skipped_text=skips.total,
        skipped_empty=skips.empty,
        skipped_unencodable=skips.unencodable,
        first_unencodable=skips.first_unencodable,
        seconds=round(sum(durations.values()), 3),
        elapsed=round(time.perf_counter() - started, 3),
        manifest=str(manifest),
    )
