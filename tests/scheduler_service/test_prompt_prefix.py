"""scheduler_service.prompt_prefix and submit: a queued prompt's block names, as the executors
name the blocks they cache, stored on its record (capped), or none when the block size is unknown."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from common.block_hashing import BlockNaming, block_hashes, chain_root
from common.config import BatonConfig
from common.pb import generate_pb2 as pb
from scheduler_service.dispatcher import Dispatcher
from scheduler_service.frontend import Frontend
from scheduler_service.metrics import SchedulerMetrics
from scheduler_service.prompt_prefix import MAX_PREFIX_BLOCKS, name_text, prefix_fields
from scheduler_service.scoring import RequestScorer
from scheduler_service.store import Store
from scheduler_service.tokenizer_source import ModelLimits, TokenizerSource
from tests.scheduler_service.store_helpers import KEYS


def test_names_are_the_executors_block_names_in_hex() -> None:
    prompt = list(range(1, 40))
    fields = prefix_fields(prompt, 16)
    assert fields["prefix"].split(",") == [f"{n:x}" for n in block_hashes(prompt, 16)]
    assert len(fields["prefix"].split(",")) == 2 and fields["prefix_block"] == "16"  # the partial block has none
    assert name_text(255) == "ff"


def test_no_names_without_a_block_size_or_a_full_block() -> None:
    assert prefix_fields(list(range(40)), 0) == {}
    assert prefix_fields(list(range(15)), 16) == {}


def test_a_salted_prompt_is_named_from_its_salts_root_which_its_record_keeps() -> None:
    prompt, root = list(range(1, 40)), chain_root("s")
    fields = prefix_fields(prompt, 16, "s")
    assert fields["prefix"].split(",") == [name_text(n) for n in block_hashes(prompt, 16, parent=root)]
    assert fields["prefix_root"] == name_text(root)
    # With no full block, or no block size yet, the root is still kept: its output's blocks chain from it.
    assert prefix_fields(prompt[:10], 16, "s") == prefix_fields(prompt, 0, "s") == {"prefix_root": name_text(root)}


def test_a_fleet_with_a_secret_names_prompts_with_its_key() -> None:
    prompt, keyed = list(range(1, 40)), BlockNaming.for_fleet("0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    fields = prefix_fields(prompt, 16, "s", keyed)
    root = keyed.root("s")
    assert fields["prefix"].split(",") == [name_text(n) for n in keyed.block_hashes(prompt, 16, parent=root)]
    assert fields["prefix_root"] == name_text(root) != name_text(chain_root("s"))
    assert not set(fields["prefix"].split(",")) & set(prefix_fields(prompt, 16, "s")["prefix"].split(","))


def test_only_the_first_blocks_are_named() -> None:
    prompt = list(range((MAX_PREFIX_BLOCKS + 3) * 4))
    names = prefix_fields(prompt, 4)["prefix"].split(",")
    assert names == [name_text(n) for n in block_hashes(prompt, 4)[:MAX_PREFIX_BLOCKS]]


@dataclass
class _Tokenizers:
    limits: ModelLimits

    async def get(self) -> tuple[object, ModelLimits]:
        return object(), self.limits


class _Dispatcher:
    def work_queued(self) -> None:
        pass


def frontend(store: Store, block_size: int) -> Frontend:
    config = BatonConfig()
    limits = ModelLimits("m", 4096, 1000, block_size)
    # The fakes stand in for the only parts of the two that submit calls.
    return Frontend(
        store,
        cast(Dispatcher, _Dispatcher()),
        cast(TokenizerSource, _Tokenizers(limits)),
        config,
        RequestScorer(config),
        SchedulerMetrics(),
    )


async def test_submit_stores_the_prompts_block_names(store: Store) -> None:
    prompt = list(range(1, 101))
    await frontend(store, 16).submit(pb.GenerateRequest(request_id="named", prompt_token_ids=prompt))
    record = await store.requests.get("named")
    assert record is not None
    assert record["prefix"] == ",".join(name_text(n) for n in block_hashes(prompt, 16))
    assert record["prefix_block"] == "16"
    assert record["fair_cost"]  # the scheduling fields are still there


async def test_submit_names_nothing_while_the_block_size_is_unknown(store: Store) -> None:
    await frontend(store, 0).submit(pb.GenerateRequest(request_id="unnamed", prompt_token_ids=list(range(1, 101))))
    record = await store.requests.get("unnamed")
    assert record is not None and "prefix" not in record and "prefix_block" not in record
    assert await store.redis.exists(KEYS.request("unnamed"))
