"""echoic.clients: talk to an echoic server from Python (grpc and soundfile; no torch,
no onnxruntime).

    from echoic.clients import Client

    with Client("localhost:50051") as client:
        print(client.recognize("talk.wav").text)             # whole file, one call
        for response in client.stream_file("talk.wav"):      # live, at real time
            for result in response.results:
                print(result.is_final, result.alternatives[0].transcript)
        print([f"{m.name}/{m.version}" for m in client.list_models()])

`AsyncClient` offers the same calls on grpc.aio. Responses of streams are the
generated `StreamingRecognizeResponse` messages (echoic.protos.v1.transcriber_pb2);
`recognize` returns a `Recognition` (text, words, confidence, and the raw response).
"""

from echoic.clients.aio import AsyncClient
from echoic.clients.audio import AudioFileError, Chunk
from echoic.clients.client import Client, ClientError, ResponseStream, RetryPolicy
from echoic.clients.messages import Recognition, Word, recognition_config

__all__ = [
    "AsyncClient",
    "AudioFileError",
    "Chunk",
    "Client",
    "ClientError",
    "Recognition",
    "ResponseStream",
    "RetryPolicy",
    "Word",
    "recognition_config",
]
