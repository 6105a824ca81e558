"""redis-py's async RedisCluster, plus the two things Baton needs from it that it lacks.

1. **Lua scripts inside pipelines.** redis-py's standalone pipeline loads missing scripts before
   it runs (SCRIPT EXISTS / SCRIPT LOAD); its cluster pipeline just sends EVALSHA, which fails
   with NOSCRIPT on any primary that never saw the script: a fresh node, a restarted one, or a
   replica promoted by a failover (Redis 7 does not replicate its script cache). Here a pipeline
   that meets NOSCRIPT loads every registered script on every primary and runs again exactly the
   commands that failed with it (they never ran), so nothing else in the pipeline runs twice.
2. **One error family.** A slot that no known node serves (mid-failover) raises redis-py's
   ``SlotNotCoveredError``, which is not a ``RedisError``; Baton's loops ride out ``RedisError``,
   so it is re-raised as ``ClusterDownError``.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ClusterDownError, NoScriptError, SlotNotCoveredError

log = logging.getLogger(__name__)


class BatonRedisCluster(RedisCluster):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scripts: dict[str, str | bytes] = {}  # sha -> source, for reloading after NOSCRIPT

    def register_script(self, script: str | bytes) -> AsyncScript:  # type: ignore[override]
        registered = AsyncScript(self, script)
        self._scripts[registered.sha] = script
        return registered

    async def load_scripts(self) -> None:
        """SCRIPT LOAD every registered script on every primary (redis-py routes SCRIPT LOAD to all)."""
        for script in self._scripts.values():
            await self.script_load(script)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # raises: cluster pipelines take no hint
        return ScriptLoadingPipeline(self, transaction)  # type: ignore[abstract]

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except SlotNotCoveredError as exc:
            raise ClusterDownError(str(exc)) from exc


class ScriptLoadingPipeline(ClusterPipeline):
    """A cluster pipeline that survives NOSCRIPT: it loads the scripts and re-runs the commands that hit it."""

    def __init__(self, client: BatonRedisCluster, transaction: bool | None = None) -> None:
        super().__init__(client, transaction)
        self._queued: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def execute_command(self, *args: Any, **kwargs: Any) -> ClusterPipeline:
        # Keep a copy: redis-py consumes the queue (and pops kwargs) when it executes.
        self._queued.append((args, dict(kwargs)))
        return super().execute_command(*args, **kwargs)

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> ClusterPipeline:  # type: ignore[override]
        """Queue an EVALSHA; awaited by ``AsyncScript.__call__(client=pipe)``.

        redis-py blocks EVALSHA in cluster pipelines for fear of NOSCRIPT, which this class
        handles; Baton's scripts keep all their keys in one slot, so routing by key is exact.
        A coroutine on purpose: awaiting the pipeline itself would re-initialise it and drop
        what was queued.
        """
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        queued, self._queued = self._queued, []
        results = await super().execute(False, allow_redirections)
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        client = self.cluster_client
        if missing and len(results) == len(queued) and isinstance(client, BatonRedisCluster):
            log.info("a Redis Cluster primary lacked Baton's scripts; loading them and running those again")
            await client.load_scripts()
            for i in missing:
                args, kwargs = queued[i]
                super().execute_command(*args, **kwargs)
            for i, result in zip(missing, await super().execute(False, allow_redirections), strict=True):
                results[i] = result
        if raise_on_error:
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results

    async def reset(self) -> None:  # type: ignore[override]
        self._queued = []
        await super().reset()
