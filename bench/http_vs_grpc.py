"""HTTP next to gRPC on one server: offline latency of a 5 s file, and live streams.

    python bench/http_vs_grpc.py [--model DIR] [--requests 40] [--concurrency 1,8]
                                 [--seconds 5] [--streams 32] [--rounds 2] [--threads 1]

Starts one `echoic serve` subprocess on free loopback ports (gRPC and HTTP), makes a
--seconds WAV (espeak-ng speech, padded with silence), and at each concurrency N runs
--requests requests per path from N threads, alternating the two paths request by
request so that both see the same machine: gRPC `Recognize` (with the HTTP door's
config: word times, its endpointing) and `POST /v1/audio/transcriptions` (multipart,
a kept-alive connection per thread, as `curl` or `openai` send it). Both transcripts
must be equal. Prints latency (request sent -> whole answer received, ms) per path
and level, and the HTTP cost over gRPC.

Then live: --streams concurrent streams (starts staggered over a second), each
sending the file's audio as PCM16 at real time in 0.1 s pieces and then ending it,
over gRPC StreamingRecognize (interim results on) and over the realtime WebSocket
(the same endpointing), one path after the other, --rounds times. Prints the final
result's latency (end of audio sent -> last final received, ms) per path.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import io
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import soundfile as sf
from serve_load import free_port, start_server, stop_server  # this folder, as a script

from echoic.model.core.audio import decode_audio
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc
from echoic.server.doors.openai_api import recognition_config, transcription_request

SENTENCE = "the quick brown fox jumps over the lazy dog and she sells sea shells by the shore"


def make_wav(seconds: float) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.wav"
        subprocess.run(["espeak-ng", "-w", str(path), SENTENCE], check=True)
        speech = decode_audio(path.read_bytes(), 16000)
    n = int(seconds * 16000)
    audio = np.zeros(n, np.float32)
    audio[: min(n, len(speech))] = speech[:n]
    buf = io.BytesIO()
    sf.write(buf, audio, 16000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def multipart(wav: bytes) -> tuple[bytes, str]:
    b = "bench-boundary"
    body = (
        (
            f'--{b}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
            f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            f"Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + wav
        + f"\r\n--{b}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={b}"


def wait_ready(http_port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the server did not become ready")
        time.sleep(0.2)


def run_level(target: str, http_port: int, wav: bytes, requests: int, threads: int):
    """Latencies (s) per path at `threads` concurrent clients, and the transcripts seen."""
    config = recognition_config(transcription_request({}))
    body, content_type = multipart(wav)
    latencies: dict[str, list[float]] = {"gRPC Recognize": [], "HTTP transcriptions": []}
    texts: set[tuple[str, str]] = set()
    lock = threading.Lock()
    per_thread = max(1, requests // threads)

    def worker() -> None:
        channel = grpc.insecure_channel(target)
        stub = pb_grpc.TranscriberStub(channel)
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        try:
            for _ in range(per_thread):
                t = time.perf_counter()
                r = stub.Recognize(
                    pb.RecognizeRequest(config=config, audio_content=wav), timeout=120
                )
                g = time.perf_counter() - t
                t = time.perf_counter()
                conn.request(
                    "POST", "/v1/audio/transcriptions", body, {"Content-Type": content_type}
                )
                response = conn.getresponse()
                data = response.read()
                h = time.perf_counter() - t
                assert response.status == 200, data
                with lock:
                    latencies["gRPC Recognize"].append(g)
                    latencies["HTTP transcriptions"].append(h)
                    texts.add((" ".join(x.alternatives[0].transcript for x in r.results),
                               json.loads(data)["text"]))  # fmt: skip
        finally:
            conn.close()
            channel.close()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return latencies, texts


CHUNK = 3200  # bytes of 16 kHz PCM16 per message: 0.1 s


async def grpc_stream(target: str, pcm: bytes, start_in: float) -> float:
    """One live gRPC stream; returns end of audio -> its last final, s."""
    await asyncio.sleep(start_in)
    config = pb.RecognitionConfig(encoding=pb.RecognitionConfig.LINEAR16, sample_rate_hertz=16000,
                                  endpointing=recognition_config(transcription_request({})).endpointing)  # fmt: skip  # noqa: E501
    ended = 0.0

    async def messages():
        nonlocal ended
        yield pb.StreamingRecognizeRequest(
            streaming_config=pb.StreamingRecognitionConfig(config=config, interim_results=True)
        )
        t0 = time.perf_counter()
        for k, i in enumerate(range(0, len(pcm), CHUNK)):
            await asyncio.sleep(max(0.0, t0 + k * 0.1 - time.perf_counter()))
            yield pb.StreamingRecognizeRequest(audio_content=pcm[i : i + CHUNK])
        ended = time.perf_counter()

    async with grpc.aio.insecure_channel(target) as channel:
        last = 0.0
        async for response in pb_grpc.TranscriberStub(channel).StreamingRecognize(messages()):
            if response.results and response.results[0].is_final:
                last = time.perf_counter()
    return last - ended


async def ws_stream(http_port: int, pcm: bytes, start_in: float) -> float:
    """One live realtime WebSocket; returns end of audio -> the last completed event, s."""
    import aiohttp

    await asyncio.sleep(start_in)
    url = f"ws://127.0.0.1:{http_port}/v1/realtime?intent=transcription"
    async with aiohttp.ClientSession() as http, http.ws_connect(url, protocols=("realtime",)) as ws:
        await ws.receive_json()  # conversation.created
        session = {"input_audio_format": "pcm16", "input_audio_params": {"sample_rate_hz": 16000}}
        await ws.send_json({"type": "transcription_session.update", "session": session})
        await ws.receive_json()  # transcription_session.updated
        ended = 0.0

        async def send() -> None:
            nonlocal ended
            t0 = time.perf_counter()
            for k, i in enumerate(range(0, len(pcm), CHUNK)):
                await asyncio.sleep(max(0.0, t0 + k * 0.1 - time.perf_counter()))
                audio = base64.b64encode(pcm[i : i + CHUNK]).decode()
                await ws.send_json({"type": "input_audio_buffer.append", "audio": audio})
            ended = time.perf_counter()
            await ws.send_json({"type": "input_audio_buffer.done"})

        sender = asyncio.ensure_future(send())
        while True:
            event = await ws.receive_json()
            if event.get("is_last_result"):
                last = time.perf_counter()
                break
        await sender
    return last - ended


async def live_level(target: str, http_port: int, pcm: bytes, streams: int, path: str):
    starts = [i / streams for i in range(streams)]
    if path == "gRPC StreamingRecognize":
        runs = [grpc_stream(target, pcm, s) for s in starts]
    else:
        runs = [ws_stream(http_port, pcm, s) for s in starts]
    return list(await asyncio.gather(*runs))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )  # noqa: E501
    ap.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--requests", type=int, default=40, help="requests per path per level")
    ap.add_argument("--concurrency", default="1,8", help="concurrent clients per level")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the file, s")
    ap.add_argument("--threads", type=int, default=1, help="server ONNX threads")
    ap.add_argument("--streams", type=int, default=32, help="concurrent live streams; 0 = none")
    ap.add_argument("--rounds", type=int, default=2, help="live rounds per path")
    args = ap.parse_args()
    wav = make_wav(args.seconds)
    http_port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = start_server(args.model, 32, 0.0, 256, args.threads, log,
                              ["--http-port", str(http_port)])  # fmt: skip
        try:
            wait_ready(http_port)
            run_level(server.target, http_port, wav, 4, 1)  # warm up both paths
            rows = []
            for level in [int(x) for x in args.concurrency.split(",")]:
                latencies, texts = run_level(server.target, http_port, wav, args.requests, level)
                assert len(texts) == 1 and len(set(next(iter(texts)))) == 1, texts
                rows.append((level, latencies))
            pcm = np.round(decode_audio(wav, 16000) * 32767).astype("<i2").tobytes()
            live: dict[str, list[float]] = {"gRPC StreamingRecognize": [], "realtime WebSocket": []}
            for _ in range(args.rounds if args.streams else 0):
                for path in live:
                    got = asyncio.run(live_level(server.target, http_port, pcm, args.streams, path))
                    live[path] += got
        finally:
            stop_server(server)
    print(f"offline latency, one {args.seconds:g} s WAV, ms (request -> whole answer)")
    print(f"{'clients':>7}  {'path':<20} {'n':>4} {'p50':>8} {'p95':>8} {'mean':>8}")
    for level, latencies in rows:
        p50 = {}
        for path, values in latencies.items():
            ms = np.array(values) * 1000
            p50[path] = np.percentile(ms, 50)
            print(f"{level:>7}  {path:<20} {len(ms):>4} {p50[path]:>8.1f} "
                  f"{np.percentile(ms, 95):>8.1f} {ms.mean():>8.1f}")  # fmt: skip
        cost = p50["HTTP transcriptions"] / p50["gRPC Recognize"] - 1
        print(f"{level:>7}  HTTP over gRPC at p50: {cost:+.1%}")
    if args.streams:
        print(f"\nlive, {args.streams} streams at real time, end of audio -> last final, ms")
        print(f"{'path':<24} {'n':>4} {'p50':>8} {'p95':>8} {'max':>8}")
        p95 = {}
        for path, values in live.items():
            ms = np.array(values) * 1000
            p95[path] = np.percentile(ms, 95)
            print(f"{path:<24} {len(ms):>4} {np.percentile(ms, 50):>8.1f} {p95[path]:>8.1f} "
                  f"{ms.max():>8.1f}")  # fmt: skip
        cost = p95["realtime WebSocket"] / p95["gRPC StreamingRecognize"] - 1
        print(f"WebSocket over gRPC at p95: {cost:+.1%}")


if __name__ == "__main__":
    main()
