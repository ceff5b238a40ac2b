"""The loaded models: one directory, or a repository polled for new versions (hot reload).

A repository is `MODEL_REPO/<name>/<version>/`, each version a directory written
by `echoic export` or `echoic deploy`; its rules (hidden dot-names, completeness,
version order, the default repository) are `echoic.model.runtime.repository`'s.
With neither `--model` nor `--model-repo` the server serves the default
repository, seeded with the bundled model on first use, so hot reload works out
of the box.

Per model name one version serves new requests: the newest one that loads.
Every `poll_seconds` the repository is scanned; a newer version loads beside
the serving one (in a worker thread: the event loop never blocks on a load),
then takes the new requests, while the streams already open on the old version
finish there (it is *draining*); once its last stream ends it is unloaded. A
version that fails to load is logged and skipped, and the old one keeps
serving; it is tried again when its files change. A version is loaded only once
it is complete (`repository.incomplete`), so a version copied file by file is
never loaded half-written (copy export.json last). SIGHUP scans at once. Removing the
serving version's directory falls back to the newest remaining one; removing a model's
whole directory drains and unloads it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from echoic.model.core.decoding import DecoderConfig
from echoic.model.core.lm import model_lm
from echoic.model.runtime.card import ModelCard
from echoic.model.runtime.chunking import ChunkConfig
from echoic.model.runtime.engine import Engine
from echoic.model.runtime.recognizer import Recognizer, default_model_dir
from echoic.model.runtime.repository import (
    check_name,
    default_model,
    default_repository,
    incomplete,
    read_default,
    scan_repository,
    seed_with_bundled,
    version_key,
)
from echoic.server.config import DECODER_THREADS, ServerConfig, ServerError
from echoic.server.core.beam_processes import BeamProcesses
from echoic.server.core.dispatcher import Dispatcher
from echoic.server.core.engine_process import EngineProcess, EngineSpec, RemoteRecognizer
from echoic.server.metrics import Metrics

log = logging.getLogger("echoic.server")

LOADED, DRAINING = "loaded", "draining"


class ModelLookupError(LookupError):
    """A request names a model or version that is not served; the message lists what is.
    `http`: the message in the HTTP door's words, where they differ (a form field, not
    RecognitionConfig)."""

    def __init__(self, message: str, *, http: str = "") -> None:
        super().__init__(message)
        self.http = http or message


class DecoderError(ValueError):
    """A decoder config this model cannot decode with (a boosted word it cannot spell)."""


def _signature(path: Path) -> tuple:
    """Changes when the directory's files do (a failed load is retried then)."""
    try:
        return tuple(
            sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir())
        )
    except OSError:
        return ()


def default_decoder(config: ServerConfig, has_lm: bool) -> DecoderConfig:
    """What a request that names no decoder gets from a model (`echoic serve --decoder`):
    auto is beam search for a model that ships a word LM, greedy for one without."""
    kind = config.decoder
    if kind == "auto":
        kind = "beam" if has_lm else "greedy"
    if kind == "greedy":
        return DecoderConfig()
    return DecoderConfig("beam", min(DecoderConfig.beam_size, config.max_beam_size))


@dataclass(eq=False)
class LoadedModel:
    """One model version in memory: what it is, its dispatcher (its batches, and its
    decoding beside them), its recognizers (one engine, a decoder each) and how many
    calls use it. The work itself is the dispatcher's: `dispatcher.step(stream)`."""

    name: str
    version: str
    path: Path
    # the engine's recognizer with greedy decoding, and the batches'; with --engine process,
    # the engine process's (server/core/engine_process.py), which is also the dispatcher
    greedy: Recognizer | RemoteRecognizer
    dispatcher: Dispatcher | EngineProcess
    # What builds a beam search: the decoder processes' (`--beam-processes`); None: in
    # this process, in the dispatcher's decoder threads.
    beam_decoders: Callable[..., Any] | None = None
    default_decoder: DecoderConfig = field(default_factory=DecoderConfig)  # `default_decoder`
    has_lm: bool = False  # the version ships a word LM (lm.bin or lm.arpa)
    state: str = LOADED
    active: int = 0  # open streams and requests on this version, count
    _recognizers: dict[DecoderConfig, Recognizer | RemoteRecognizer] = field(
        default_factory=dict, repr=False
    )
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def card(self) -> ModelCard:
        return self.greedy.card

    @property
    def streamable(self) -> bool:
        return self.greedy.streamable

    @property
    def streams_exactly(self) -> bool:
        """Streaming gives Recognize's log-probs (stream.onnx), not overlapped chunks'."""
        return self.greedy.streams_exactly

    async def _build(self, decoder: DecoderConfig) -> Recognizer | RemoteRecognizer:
        if isinstance(self.dispatcher, EngineProcess):
            return await self.dispatcher.recognizer(decoder)
        return await asyncio.to_thread(self._recognizer, decoder)

    def _recognizer(self, decoder: DecoderConfig) -> Recognizer:
        # here, in a worker thread, not in a request's decoding
        return self.greedy.with_decoder(decoder, self.beam_decoders)

    async def recognizer(self, decoder: DecoderConfig | None) -> Recognizer | RemoteRecognizer:
        """The recognizer for a decoder config (sharing this version's engine), built once;
        None: the server's default for this model."""
        decoder = decoder or self.default_decoder
        if decoder.kind == "greedy":
            return self.greedy
        if decoder.boost:  # one request's words: built for it, never cached; the LM comes
            # from the cached decoder without them, which holds it (loaded once, shared)
            await self.recognizer(replace(decoder, boost=()))
            try:
                return await self._build(decoder)
            except ValueError as e:
                raise DecoderError(f"decoder.boosts: {e}") from None
        async with self._lock:
            if decoder not in self._recognizers:
                self._recognizers[decoder] = await self._build(decoder)
            return self._recognizers[decoder]


class ModelRegistry:
    def __init__(
        self,
        config: ServerConfig,
        metrics: Metrics,
        executor: Executor,
        decoders: Executor,
        beams: BeamProcesses | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._executor = executor  # batched model calls
        self._decoders = decoders  # beam searches, off the batches
        self._beams = beams  # --beam-processes: where the decoder threads send beam searches
        self.serving: dict[str, LoadedModel] = {}  # name -> the version new requests get
        self.loaded: list[LoadedModel] = []  # every version in memory, serving or draining
        self._failed: dict[Path, tuple] = {}  # directory -> its signature when it failed
        self._waiting: dict[Path, str] = {}  # incomplete directory -> why, as last logged
        self._tasks: set[asyncio.Task] = set()
        self._sync_lock = asyncio.Lock()  # scans (poller, SIGHUP) one at a time
        self._closed = False
        self._poll_task: asyncio.Task | None = None
        self.repo: Path | None = None  # the repository served; None: one --model directory
        self.repo_default = ""  # its .default-model, as of the last scan

    # ------------------------------------------------------------------ start, stop

    async def start(self) -> None:
        """Load the configured model(s); ServerError when nothing can be served."""
        cfg = self._config
        if cfg.model_dir is not None:
            model = await self._load(None, None, Path(cfg.model_dir).resolve())
            self._switch(model)
            self._check_default()
            return
        if cfg.model_repo is None:
            self.repo = await asyncio.to_thread(self._default_repository)
        else:
            self.repo = Path(cfg.model_repo).resolve()
        if not self.repo.is_dir():
            raise ServerError(f"{self.repo}: no such model repository directory")
        await self.sync()
        if not self.serving:
            raise ServerError(
                f"{self.repo}: no loadable model (expected {self.repo}/<name>/<version>/ "
                "directories written by `echoic export` or `echoic deploy`; see the log for "
                "why each failed)"
            )
        self._check_default()
        if cfg.poll_seconds > 0:
            self._poll_task = asyncio.create_task(self._poll(), name="model repository poll")

    @staticmethod
    def _default_repository() -> Path:
        """The default repository, seeded with the bundled model if it has no model (or
        only older versions of the bundled one: `seed_with_bundled`)."""
        repo, bundled = default_repository().resolve(), default_model_dir()
        if not (bundled / "model.onnx").is_file():
            raise ServerError(
                f"no model given and the bundled default model is not installed ({bundled}); "
                "pass --model DIR or --model-repo DIR (directories written by `echoic export`)"
            )
        try:
            seeded = seed_with_bundled(repo, bundled)
        except OSError as e:
            raise ServerError(
                f"the default model repository {repo} cannot be set up ({e}); set "
                "ECHOIC_MODEL_REPO to a writable directory, or pass --model-repo DIR"
            ) from e
        if seeded is not None:
            log.info("put the bundled model %s/%s into the model repository %s",
                     seeded.parent.name, seeded.name, repo)  # fmt: skip
        log.info("serving the model repository %s (echoic deploy publishes to it)", repo)
        return repo

    def _check_default(self) -> None:
        default = self._config.default_model
        if default and default not in self.serving:
            raise ServerError(
                f"--default-model {default}: no such model is served (loaded: "
                + ", ".join(sorted(self.serving))
                + ")"
            )

    async def close(self) -> None:
        self._closed = True
        if self._poll_task is not None:
            self._poll_task.cancel()
        async with self._sync_lock:  # a scan in progress ends first
            for model in list(self.loaded):
                await self._unload(model)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._config.poll_seconds)
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - a bad scan must not stop polling
                log.exception("scanning the model repository failed")

    # ------------------------------------------------------------------ requests

    def resolve(self, name: str, version: str) -> LoadedModel:
        default = self._config.default_model
        if not name and default:
            if default not in self.serving:
                served = ", ".join(sorted(self.serving)) or "none"
                raise ModelLookupError(
                    f"this server's default model {default!r} (--default-model) is not loaded "
                    f"(it serves {served}): name a model, or fix the server's --default-model"
                )
            name = default
        if not name:
            name, why = default_model(self.repo_default, self.serving)
            if not name:
                served = ", ".join(sorted(self.serving))
                raise ModelLookupError(
                    f"{why} (echoic serve --default-model, or echoic deploy --make-default):"
                    " name one, with --model NAME on the echoic command line or `model` in"
                    f" RecognitionConfig, from: {served}",
                    http=f"{why}: name one in the form field `model` (curl -F model=NAME),"
                    f" from: {served}",
                )  # fmt: skip
        model = self.serving.get(name)
        if model is None:
            served = ", ".join(sorted(self.serving)) or "none"
            raise ModelLookupError(f"unknown model {name!r}: this server serves {served}")
        if version and version != model.version:
            draining = any(m.name == name and m.version == version for m in self.loaded)
            why = "is draining (being replaced)" if draining else "is not loaded"
            raise ModelLookupError(
                f"model {name!r} version {version!r} {why}; the served version is "
                f"{model.version!r}: leave model_version empty or ask for {model.version!r}"
            )
        return model

    def acquire(self, model: LoadedModel) -> None:
        model.active += 1

    def release(self, model: LoadedModel) -> None:
        model.active -= 1
        if model.state == DRAINING and model.active == 0:
            self._spawn(self._unload(model))

    # ------------------------------------------------------------------ hot reload

    def rescan(self) -> None:
        """Scan the repository now, in the background (SIGHUP)."""
        self._spawn(self._logged_sync())

    async def _logged_sync(self) -> None:
        try:
            await self.sync()
        except Exception:  # noqa: BLE001 - a bad scan is logged; serving goes on
            log.exception("scanning the model repository failed")

    async def sync(self) -> None:
        """Scan the repository once and load, switch or drain to match it; one scan at a
        time (the poller and SIGHUP), none once the registry is closed."""
        async with self._sync_lock:
            if not self._closed:
                await self._sync()

    def _survey(self) -> dict[str, list[tuple[str, Path, str | None]]]:
        """In a worker thread (it reads every candidate's files): per model name, the
        versions newer than the serving one, newest first, each with why it is not to be
        loaded now (None: load it; "" : it failed as it is). A name or version that could
        not be a deployed one (a newline, an escape) is skipped with one log line."""
        plan: dict[str, list[tuple[str, Path, str | None]]] = {}
        for name, versions in scan_repository(self.repo).items():
            serving = self.serving.get(name)
            plan[name] = []
            for version in sorted(versions, key=version_key, reverse=True):
                path = versions[version]
                if serving is not None and serving.version == version:
                    break  # the newest loadable version is the one serving
                try:
                    check_name("name", name)
                    check_name("version", version)
                except ValueError as e:
                    why = f"skipped: {e}"
                else:
                    failed = self._failed.get(path) == _signature(path)
                    why = "" if failed else incomplete(path)
                plan[name].append((version, path, why))
        return plan

    async def _sync(self) -> None:
        plan = await asyncio.to_thread(self._survey)
        self.repo_default = await asyncio.to_thread(read_default, self.repo)
        for name, candidates in plan.items():
            current = self.serving.get(name)
            for version, path, why in candidates:
                if why == "":
                    continue  # failed to load as it is
                if why:
                    if self._waiting.get(path) != why:  # one line per change, not per poll
                        log.info("model %r version %r not loaded yet: %s", name, version, why)
                        self._waiting[path] = why
                    continue
                self._waiting.pop(path, None)
                try:
                    model = await self._load(name, version, path)
                except Exception as e:  # noqa: BLE001 - any broken directory is skipped
                    self._failed[path] = _signature(path)
                    keep = f"; {current.name} {current.version} keeps serving" if current else ""
                    log.error("model %s version %s not loaded: %s%s", name, version, e, keep)
                    continue
                self._failed.pop(path, None)
                self._switch(model)
                break
        for name in set(self.serving) - set(plan):
            gone = self.serving.pop(name)
            log.info("model %s: its directory is gone; draining version %s", name, gone.version)
            self._drain(gone)

    async def _load(self, name: str | None, version: str | None, path: Path) -> LoadedModel:
        cfg = self._config
        log.info("loading %s", path)
        chunking = (
            ChunkConfig(cfg.chunk_ms, cfg.chunk_left_ms, cfg.chunk_right_ms)
            if cfg.chunk_ms > 0
            else None
        )
        if cfg.engine_process:
            return await self._load_in_process(name, version, path, chunking)
        engine = await asyncio.to_thread(
            Engine, path, providers=cfg.providers, intra_op_threads=cfg.intra_op_threads,
            spin_wait=cfg.ort_spin_wait, io_binding=cfg.device == "cuda",
        )  # fmt: skip
        name = name or engine.card.name
        version = version or engine.card.version
        if (engine.card.name, engine.card.version) != (name, version):
            log.info(
                "%s: served as %s version %s (its card says %s version %s)",
                path, name, version, engine.card.name, engine.card.version,
            )  # fmt: skip
        greedy = Recognizer(engine, chunking=chunking)
        dispatcher = Dispatcher(
            greedy,
            max_batch=cfg.max_batch,
            max_wait_ms=cfg.max_wait_ms,
            executor=self._executor,
            decoders=self._decoders,
            metrics=self._metrics,
            labels=(name, version),
        )
        has_lm = model_lm(path) is not None
        model = LoadedModel(
            name, version, path, greedy, dispatcher,
            beam_decoders=self._beams.decoder if self._beams is not None else None,
            default_decoder=default_decoder(cfg, has_lm), has_lm=has_lm,
        )  # fmt: skip
        # The default decoder's LM loads now, beside the serving version, rather than in
        # the first request that names no decoder.
        await model.recognizer(None)
        return model

    async def _load_in_process(
        self, name: str | None, version: str | None, path: Path, chunking: ChunkConfig | None
    ) -> LoadedModel:
        """`_load` with the engine in a process of its own (`--engine process`)."""
        cfg = self._config
        if cfg.max_wait_ms:
            log.warning("--max-wait-ms applies to --engine thread; an engine process runs "
                        "whatever is queued the moment a lane is free")  # fmt: skip
        spec = EngineSpec(
            path, tuple(cfg.providers), cfg.intra_op_threads, cfg.ort_spin_wait,
            cfg.device == "cuda", chunking, cfg.max_batch, cfg.lanes, DECODER_THREADS,
            cfg.beam_decoder_processes,
        )  # fmt: skip
        if cfg.engine_dir:  # the workers of one supervisor: one engine for them all
            # the files' signature too: a version folder made again at the same path while
            # the old engine still drains in another worker gets an engine of its own
            key = hashlib.sha256(repr((spec, _signature(path))).encode()).hexdigest()[:16]
            spec = replace(spec, share=str(Path(cfg.engine_dir) / f"engine-{key}.sock"))
        engine = await EngineProcess.start(spec, self._metrics)
        card = engine.info.card
        name, version = name or card.name, version or card.version
        engine.labels = (name, version)
        has_lm = model_lm(path) is not None
        model = LoadedModel(
            name, version, path, RemoteRecognizer(engine, DecoderConfig()), engine,
            default_decoder=default_decoder(cfg, has_lm), has_lm=has_lm,
        )  # fmt: skip
        try:
            await model.recognizer(None)
        except BaseException:
            await engine.close()
            raise
        return model

    def _switch(self, model: LoadedModel) -> None:
        old = self.serving.get(model.name)
        self.serving[model.name] = model
        self.loaded.append(model)
        self._metrics.set_model_state(model.name, model.version, LOADED)
        log.info(
            "serving %s version %s from %s%s", model.name, model.version, model.path,
            f" (replacing version {old.version})" if old else "",
        )  # fmt: skip
        if old is not None:
            self._drain(old)

    def _drain(self, model: LoadedModel) -> None:
        model.state = DRAINING
        self._metrics.set_model_state(model.name, model.version, DRAINING)
        if model.active == 0:
            self._spawn(self._unload(model))
        else:
            log.info(
                "%s version %s: draining %d open stream(s)", model.name, model.version, model.active
            )

    async def _unload(self, model: LoadedModel) -> None:
        if model not in self.loaded:
            return
        self.loaded.remove(model)
        if self.serving.get(model.name) is model:
            del self.serving[model.name]
        await model.dispatcher.close()  # work still queued fails with DispatcherClosed
        self._metrics.set_model_state(model.name, model.version, None)
        log.info("unloaded %s version %s", model.name, model.version)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
