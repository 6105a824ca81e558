"""A request's whole answer (``CompleteResponse``) from its stream's messages: what ``Complete``
answers, and what the gateway assembles where it followed a ``Complete`` call's request with
``Resume`` after its scheduler replica went away."""

from __future__ import annotations

from common.keys import sample_id
from common.pb import generate_pb2 as pb
from common.stop_reason import read_stop_reason, write_stop_reason


def complete_response(request_id: str, chunks: list[pb.GenerateResponse]) -> pb.CompleteResponse:
    """A request's whole output from its stream's messages: sample 0's at the top level, and with
    several samples every sample's in ``samples``."""
    by_sample: dict[int, pb.CompleteResponse] = {}
    text: dict[int, list[str]] = {}
    for chunk in chunks:
        k = chunk.sample_index
        out = by_sample.setdefault(k, pb.CompleteResponse(request_id=sample_id(request_id, k), sample_index=k))
        out.token_ids.extend(chunk.token_ids)
        out.logprobs.extend(chunk.logprobs)
        out.prompt_logprobs.extend(chunk.prompt_logprobs)
        out.prompt_text = out.prompt_text or chunk.prompt_text
        if chunk.prompt_token_ids and not out.prompt_token_ids:
            out.prompt_token_ids.extend(chunk.prompt_token_ids)
        text.setdefault(k, []).append(chunk.text)
        if chunk.finish_reason:
            out.finish_reason = chunk.finish_reason
            out.usage.CopyFrom(chunk.usage)
            write_stop_reason(out, read_stop_reason(chunk))
    for k, out in by_sample.items():
        out.text = "".join(text[k])
    whole = pb.CompleteResponse()
    if 0 in by_sample:
        whole.CopyFrom(by_sample[0])
    if len(by_sample) > 1:
        whole.samples.extend(by_sample[k] for k in sorted(by_sample))
    return whole
