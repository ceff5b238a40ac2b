"""The asyncio client: `AsyncClient`, the same calls as `Client` on grpc.aio.

One event loop thread carries hundreds of concurrent streams, which is what
load generators and asyncio applications want:

    async with AsyncClient("localhost:50051") as client:
        print((await client.recognize("talk.wav")).text)
        async for response in client.stream_file("talk.wav", realtime=True):
            ...
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import grpc
import grpc.aio

from echoic.clients.audio import Chunk
from echoic.clients.client import ClientError, Connection, Tries
from echoic.clients.messages import (
    AudioSource,
    Recognition,
    audio_request,
    config_request,
    final_response,
    open_file_stream,
    payload_of,
    pieces,
    recognize_requests,
    stream_config,
    streaming_requests,
)
from echoic.protos.v1 import transcriber_pb2 as pb


async def apaced(chunks: Iterable[Chunk]) -> AsyncIterator[Chunk]:
    """`audio.paced` for an event loop: chunk k is released once its audio has 'happened'."""
    loop = asyncio.get_running_loop()
    start, sent = loop.time(), 0.0
    for chunk in chunks:
        sent += chunk.seconds
        delay = start + sent - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield chunk


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def _requests(
    config: pb.RecognitionConfig,
    chunks: Iterable[bytes | Chunk] | AsyncIterable[bytes | Chunk],
    interim_results: bool,
    interim_interval_ms: int,
) -> AsyncIterator[pb.StreamingRecognizeRequest]:
    """`messages.streaming_requests` for chunks that may arrive asynchronously."""
    yield config_request(
        config, interim_results=interim_results, interim_interval_ms=interim_interval_ms
    )
    async for chunk in _aiter(chunks):
        if (request := audio_request(chunk)) is not None:
            yield request


class AsyncClient(Connection):
    """`Client` for asyncio (the same arguments); create it inside the running event loop."""

    channel_module = grpc.aio

    async def _unary(self, call: Any, request: Any, timeout: float | None) -> Any:
        tries = Tries(self.retry, self.timeout if timeout is None else timeout)
        while True:
            try:
                return await call(request, timeout=tries.time_left())
            except grpc.aio.AioRpcError as e:
                if (wait := tries.wait_after(e.code())) is None:
                    raise ClientError.from_rpc(e, self.target) from e
                await asyncio.sleep(wait)

    async def recognize(
        self,
        audio: AudioSource,
        *,
        encoding: str | int | None = None,
        sample_rate: int = 0,
        channels: int = 0,
        timeout: float | None = None,
        **config: Any,
    ) -> Recognition:
        """See `Client.recognize`."""
        payload = payload_of(audio, encoding, sample_rate, channels)
        cfg, request = recognize_requests(payload, config)
        if request is not None:
            response = await self._unary(self._stub.Recognize, request, timeout)
        else:

            async def by_stream(requests: list, timeout: float | None) -> pb.RecognizeResponse:
                call = self._stub.StreamingRecognize(iter(requests), timeout=timeout)
                return final_response([r async for r in call])

            messages = list(streaming_requests(cfg, pieces(payload.data), interim_results=False))
            response = await self._unary(by_stream, messages, timeout)
        return Recognition.from_response(response)

    async def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        response = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return list(response.models)

    async def wait_until_reachable(self, timeout: float | None = None) -> None:
        timeout = self.connect_timeout if timeout is None else timeout
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise ClientError(
                f"server {self.target} is unavailable (not reachable within {timeout:g} s)",
                grpc.StatusCode.UNAVAILABLE,
            ) from None

    async def stream(
        self,
        chunks: Iterable[bytes | Chunk] | AsyncIterable[bytes | Chunk],
        *,
        encoding: str | int | None = "linear16",
        sample_rate: int = 0,
        channels: int = 0,
        interim_results: bool = True,
        interim_interval_ms: int = 0,
        config: pb.RecognitionConfig | None = None,
        **options: Any,
    ) -> AsyncIterator[pb.StreamingRecognizeResponse]:
        """See `Client.stream`; an async generator (closing it cancels the call)."""
        config = stream_config(config, encoding, sample_rate, channels, options)
        await self.wait_until_reachable()
        call = self._stub.StreamingRecognize(
            _requests(config, chunks, interim_results, interim_interval_ms)
        )
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as e:
            raise ClientError.from_rpc(e, self.target) from e
        finally:
            call.cancel()  # a no-op once the call has ended

    async def stream_file(
        self,
        path: str | os.PathLike[str],
        *,
        realtime: bool = True,
        chunk_ms: float = 100.0,
        encoding: str | None = None,
        interim_results: bool = True,
        interim_interval_ms: int = 0,
        **options: Any,
    ) -> AsyncIterator[pb.StreamingRecognizeResponse]:
        """See `Client.stream_file`."""
        config, chunks = open_file_stream(
            path, realtime=False, chunk_ms=chunk_ms, encoding=encoding, config=options
        )
        source = apaced(chunks) if realtime else chunks
        async for response in self.stream(
            source,
            config=config,
            interim_results=interim_results,
            interim_interval_ms=interim_interval_ms,
        ):
            yield response

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
