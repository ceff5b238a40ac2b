"""`echoic transcribe --ray`: a batch job spread over a Ray cluster (the `ray` extra).

The files are a Ray Data dataset; `map_batches` runs them through a pool of
`RecognizerActor`s, one per CPU slot (each loads the model once, with one ONNX Runtime
thread), and the results stream back to this process, which alone writes the output
and the job record, in input order, as a local job does (`cli/transcribe.py:Job`;
`RayBackend` extends `cli/transcribe_local.py:LocalBackend`). So a rerun skips what is
done and nothing is written twice. An actor that dies (its worker killed, its node
lost) is restarted and its batch run again, so a dead worker loses nothing.

Without `--ray-address` the command starts a local Ray of its own (`ray.init`) and
stops it at the end; with it, it joins that cluster, whose workers must have echoic
installed and see the same audio paths and model directory.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from echoic.cli.batch_io import InInputOrder, Item, transcript_record
from echoic.cli.transcribe_local import LONG_FILE_SECONDS, LocalBackend, Stats


class RecognizerActor:
    """One Ray actor: a Recognizer, loaded once, fed batches of paths."""

    def __init__(self, model: str, decoder: dict[str, Any]) -> None:
        from echoic.model.core.decoding import DecoderConfig
        from echoic.model.runtime.recognizer import Recognizer

        self.recognizer = Recognizer(model or None, DecoderConfig(**decoder), intra_op_threads=1)
        crash = os.environ.get("ECHOIC_RAY_CRASH_ONCE")  # tests: one actor dies once
        if crash and not Path(crash).exists():
            self._crash_file = crash
        else:
            self._crash_file = None

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        from echoic.model.core.audio import AudioError, audio_blocks, audio_duration, load_audio
        from echoic.model.core.decoding import FILE_ENDPOINTING

        if self._crash_file is not None and not Path(self._crash_file).exists():
            Path(self._crash_file).touch()
            os._exit(1)  # a worker lost mid-batch, as a killed process or a lost node is
        rec = self.recognizer
        out: dict[str, list] = {"index": [], "duration": [], "transcript": [], "error": []}
        audios, kept = [], []
        for index, path in zip(batch["index"], batch["path"], strict=True):
            try:
                if rec.engine.streamable and audio_duration(path) > LONG_FILE_SECONDS:
                    samples = [0]  # a block at a time: memory does not grow with the file

                    def counted(blocks, samples=samples):
                        for block in blocks:
                            samples[0] += len(block)
                            yield block

                    blocks = counted(audio_blocks(path, rec.sample_rate))
                    transcript = rec.transcribe_blocks(blocks, endpointing=FILE_ENDPOINTING)
                    self._put(out, index, samples[0] / rec.sample_rate, transcript, "")
                    continue
                audios.append(load_audio(path, rec.sample_rate))
                kept.append(index)
            except AudioError as e:
                self._put(out, index, 0.0, None, str(e))
        transcripts = rec.transcribe(audios, endpointing=FILE_ENDPOINTING)
        for index, audio, transcript in zip(kept, audios, transcripts, strict=True):
            self._put(out, index, len(audio) / rec.sample_rate, transcript, "")
        return out

    @staticmethod
    def _put(out: dict[str, list], index: int, seconds: float, transcript: Any, error: str):
        out["index"].append(int(index))
        out["duration"].append(float(seconds))
        out["error"].append(error)
        out["transcript"].append(
            ""
            if transcript is None
            else json.dumps(
                {
                    "text": transcript.text,
                    "confidence": transcript.confidence,
                    "words": [[w.text, w.start, w.end, w.confidence] for w in transcript.words],
                }
            )  # fmt: skip
        )


class RayBackend(LocalBackend):
    """The local job's settings and records; the recognition on Ray's actors."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)  # the model's name/version and decoder settings, as local
        try:
            import ray
        except ModuleNotFoundError as e:
            from echoic.cli.errors import missing_extra

            raise missing_extra("ray", "ray[data]") from e
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            workers = args.ray_workers or os.cpu_count() or 1
            kwargs: dict[str, Any] = {
                "include_dashboard": False, "log_to_driver": False,
                "logging_level": logging.WARNING,
            }  # fmt: skip
            if args.ray_address:
                ray.init(address=args.ray_address, **kwargs)
            else:
                ray.init(num_cpus=workers, **kwargs)
            self._started = True

    def transcribe(self, todo: list[Item], writer: InInputOrder, stats: Stats) -> None:
        import ray.data

        from echoic.model.core.decoding import Transcript, Word

        if not todo:
            return
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = not self.args.no_progress
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        a = self.args
        workers = a.ray_workers or max(1, int(self._ray.available_resources().get("CPU", 1)))
        decoder = {"kind": a.decoder, "beam_size": a.beam_size, "lm_path": a.lm or "",
                   "use_lm": not a.no_lm, "lm_weight": a.lm_weight,
                   "word_bonus": a.word_bonus}  # fmt: skip
        model = str(Path(a.model).resolve()) if a.model else ""
        rows = [{"index": i, "path": str(Path(item.path).resolve())} for i, item in enumerate(todo)]
        ds = ray.data.from_items(rows).map_batches(
            RecognizerActor,
            fn_constructor_kwargs={"model": model, "decoder": decoder},
            batch_size=a.batch_size,
            concurrency=workers,
            num_cpus=1,
            # A dead actor is restarted and its batch run again: nothing is lost.
            max_restarts=-1,
            max_task_retries=-1,
        )
        for row in ds.iter_rows():
            item = todo[int(row["index"])]
            if row["error"]:
                writer.write_error(item, row["error"])
                continue
            t = json.loads(row["transcript"])
            transcript = Transcript(
                t["text"], confidence=t["confidence"],
                words=tuple(Word(w, s, e, c) for w, s, e, c in t["words"]),
            )  # fmt: skip
            writer.write(item, transcript_record(item, transcript, row["duration"], self.model))
            stats.audio_seconds += row["duration"]

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()
