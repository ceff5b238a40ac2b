"""Every error from below the doors as the core's `Refusal`, and a refusal's message as a
door says it.

The core and the parts beneath it raise `Refusal(kind, message)` for what a client can
act on, and their own exceptions for the rest (a model not served, a beam decoder
process that died, ...). `refusal_of` is the one place those become refusals; each door
then owns what it answers: its table from `RefusalKind` to its status (the gRPC doors'
`server/doors/service.py:GRPC_STATUS`, the HTTP door's `server/doors/openai_api.py:HTTP_STATUS`) and
its words for each `Remedy` (`GRPC_REMEDIES`, `HTTP_REMEDIES`), joined by `door_message`.
This module imports no grpc, protobuf or aiohttp.
"""

from __future__ import annotations

from collections.abc import Mapping

from echoic.model.core.audio import AudioError
from echoic.server.core.beam_processes import BeamProcessDied
from echoic.server.core.dispatcher import DispatcherClosed
from echoic.server.core.models import DecoderError, ModelLookupError
from echoic.server.core.types import Refusal, RefusalKind, Remedy

MAX_DETAILS = 1000  # characters of a refusal's message: enough to act on, never a whole input


def refusal_of(e: Exception) -> Refusal:
    """The refusal an error from below the doors is: itself when it is one; anything not
    known here is INTERNAL, with a message that leaks nothing (the server logs it)."""
    if isinstance(e, Refusal):
        return e
    if isinstance(e, (AudioError, ModelLookupError, DecoderError)):
        # A model that is not served is the request's mistake (gRPC's INVALID_ARGUMENT, as
        # clients have always got); the HTTP door answers it with OpenAI's 404 itself.
        return Refusal(RefusalKind.INVALID, str(e))
    if isinstance(e, BeamProcessDied):
        return Refusal(RefusalKind.UNAVAILABLE, str(e))
    if isinstance(e, DispatcherClosed):
        return Refusal(RefusalKind.UNAVAILABLE, f"{e}: retry the request")
    if isinstance(e, ImportError) and "pip install" in str(e):
        return Refusal(RefusalKind.UNSUPPORTED, f"not available on this server: {e}")
    return Refusal(RefusalKind.INTERNAL, f"internal error ({type(e).__name__}); see the server log")


def door_message(refusal: Refusal, remedies: Mapping[Remedy, str]) -> str:
    """The refusal's message with the door's words for its remedy (`remedies`: the door's
    table), cut to MAX_DETAILS characters."""
    message = str(refusal)
    if refusal.remedy is not None:
        message = f"{message}: {remedies[refusal.remedy]}"
    if len(message) > MAX_DETAILS:
        message = message[: MAX_DETAILS - 20] + " ... (message cut)"
    return message
