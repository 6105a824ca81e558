"""gateway.served_model without a server: which names a request may use, and when ModelInfo is asked."""

from __future__ import annotations

import grpc
import pytest

from common.pb import generate_pb2 as pb
from gateway.errors import GatewayError, ModelNotFound
from gateway.served_model import Metadata, ServedModel, ServedModels


class Scheduler:
    """Answers ModelInfo with the model it serves now, and counts the calls."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.calls: list[Metadata] = []
        self.down = False

    async def model_info(self, metadata: Metadata) -> pb.ModelInfoResponse:
        self.calls.append(metadata)
        if self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")
        return pb.ModelInfoResponse(model=self.model, max_model_len=128, executors=1)


KEY = (("authorization", "Bearer k"),)


async def test_the_served_name_costs_one_call_and_an_absent_one_means_it() -> None:
    scheduler = Scheduler("/models/tiny")
    served = ServedModels(scheduler.model_info, aliases=("tiny",))
    assert await served.resolve("/models/tiny", KEY) == "/models/tiny"
    assert await served.resolve("tiny", ()) == "tiny"
    assert await served.resolve("", ()) == "/models/tiny"
    assert scheduler.calls == [KEY]  # the caller's credential, once


async def test_another_name_is_404_and_asks_again_at_most_every_refresh() -> None:
    scheduler = Scheduler("a")
    served = ServedModels(scheduler.model_info, refresh_s=3600.0)
    await served.resolve("a", ())
    for _ in range(3):
        with pytest.raises(ModelNotFound) as err:
            await served.resolve("b", ())
    assert err.value.status == 404 and err.value.body()["error"]["code"] == "model_not_found"
    assert len(scheduler.calls) == 1  # within the refresh interval a miss is answered from the cache
    eager = ServedModels(scheduler.model_info, refresh_s=0.0)
    await eager.resolve("a", ())
    scheduler.model = "b"  # the scheduler behind the balancer now serves another model
    assert await eager.resolve("b", ()) == "b"
    with pytest.raises(ModelNotFound):
        await eager.resolve("a", ())


async def test_an_unreachable_scheduler_is_its_http_status() -> None:
    scheduler = Scheduler("a")
    scheduler.down = True
    with pytest.raises(GatewayError) as err:
        await ServedModels(scheduler.model_info).resolve("a", ())
    assert err.value.status == 503


def test_cards_name_the_model_they_stand_for() -> None:
    model = ServedModel("/models/tiny", 4096, ("tiny",))
    assert model.names == ("/models/tiny", "tiny")
    card = model.card("tiny")
    assert (card["id"], card["root"], card["object"], card["max_model_len"]) == ("tiny", "/models/tiny", "model", 4096)
