"""The Redis key schema, in one place (documented for operators in the README).

Keys that one Lua script touches together share the ``{prefix}`` hash tag, so every
script also runs on Redis Cluster. Per-request token streams carry no shared tag:
they are the hot path (one XADD per token event) and must spread over a cluster's shards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

# Names that clients and operators choose (request ids, tenants, executor ids) become parts of
# key names. Their alphabet leaves out the schema's separator ':', the hash-tag braces, glob
# characters, the estimator's field separator '|', whitespace and control characters, so no
# name can spell a key that another record owns ("abc:tokens" would be request abc's token list).
NAME_ALPHABET = "ASCII letters, digits and . _ - @"
MAX_NAME_CHARS = 128
_NAME = re.compile(rf"[A-Za-z0-9._@-]{{1,{MAX_NAME_CHARS}}}")


# A request with n > 1 samples keeps sample 0 under its own id and sample k under "ID~k". '~' lies
# outside the names' alphabet, so no client can choose a derived id (nor collide with one), and it
# is none of the characters above that a key must not hold. Sample indices stay below
# MAX_SAMPLES_BOUND, so a derived id is at most 4 characters longer than its request's.
SAMPLE_SEPARATOR = "~"
MAX_SAMPLES_BOUND = 1024
_SAMPLE_SUFFIX = rf"{SAMPLE_SEPARATOR}[1-9][0-9]{{0,3}}"
_REQUEST_ID = re.compile(rf"({_NAME.pattern})(?:{_SAMPLE_SUFFIX})?")


def sample_id(request_id: str, index: int) -> str:
    """Sample ``index`` of ``request_id``: the request's own id for sample 0, else ``ID~index``."""
    if not 0 <= index < MAX_SAMPLES_BOUND:
        raise ValueError(f"sample index must lie in [0, {MAX_SAMPLES_BOUND}), got {index}")
    return request_id if index == 0 else f"{request_id}{SAMPLE_SEPARATOR}{index}"


def split_sample_id(request_id: str) -> tuple[str, int]:
    """The request and sample index an id names: ``("ID", k)`` for ``ID~k``, ``(id, 0)`` otherwise."""
    head, sep, tail = request_id.rpartition(SAMPLE_SEPARATOR)
    if sep and tail.isdigit() and _REQUEST_ID.fullmatch(request_id):
        return head, int(tail)
    return request_id, 0


def is_request_id(text: str) -> bool:
    """Whether ``text`` names a request: a safe name, or ``ID~k`` for a later sample of one."""
    return _REQUEST_ID.fullmatch(text) is not None


def is_safe_name(name: str) -> bool:
    """Whether ``name`` may become part of a key: 1-128 characters of ``NAME_ALPHABET``."""
    return _NAME.fullmatch(name) is not None


def check_name(name: str, what: str) -> str:
    """``name`` if it is safe; else ``ValueError`` saying what is allowed."""
    if not is_safe_name(name):
        raise ValueError(f"{what} must be 1-{MAX_NAME_CHARS} characters of {NAME_ALPHABET}, got {name!r}")
    return name


@dataclass(frozen=True)
class KeySchema:
    """Builds every Redis key Baton uses from one configurable prefix."""

    prefix: str = "baton"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{} "):
            raise ValueError(f"key prefix must be non-empty without braces or spaces: {self.prefix!r}")

    def owns(self, key: str) -> bool:
        """Whether ``key`` is one this schema documents (what ``baton inspect`` and tests check)."""
        return self._documented.fullmatch(key) is not None

    @cached_property
    def _documented(self) -> re.Pattern[str]:
        name = _NAME.pattern
        request = rf"{name}(?:{_SAMPLE_SUFFIX})?"
        tag = re.escape(self._tagged)
        fixed = (
            "queue:pending|tenants:waiting|tenants:counter|tenants:vclock|tenants:running|tenants:seen"
            "|estimator|executors"
        )
        tagged = (
            rf"{tag}:(?:{fixed}|queue:tenant:{name}|req:{request}(?::tokens)?"
            rf"|executor:{name}(?::running)?|lease:executor:{name}|prefix:executor:{name})"
        )
        return re.compile(rf"{tagged}|{re.escape(self.prefix)}:req:{request}:out")

    @property
    def _tagged(self) -> str:
        return "{" + self.prefix + "}"

    @property
    def pending(self) -> str:
        """Sorted set of queued request ids, scored by adaptive priority (lower runs sooner)."""
        return f"{self._tagged}:queue:pending"

    @property
    def tenant_queue_prefix(self) -> str:
        """Prefix of the per-tenant queues; the scripts append the tenant name."""
        return f"{self._tagged}:queue:tenant:"

    def tenant_queue(self, tenant: str) -> str:
        """Sorted set of one tenant's queued request ids, by the same score as ``pending``."""
        return self.tenant_queue_prefix + tenant

    @property
    def tenants_waiting(self) -> str:
        """Sorted set of tenants with queued requests, scored by their virtual token counter."""
        return f"{self._tagged}:tenants:waiting"

    @property
    def tenant_counters(self) -> str:
        """Hash: tenant -> virtual token counter (weighted tokens served), kept while idle."""
        return f"{self._tagged}:tenants:counter"

    @property
    def tenant_vclock(self) -> str:
        """String: the counter of the tenant served last; an idle tenant that returns starts here."""
        return f"{self._tagged}:tenants:vclock"

    @property
    def tenant_running(self) -> str:
        """Hash: tenant -> requests assigned or running, for per-tenant caps."""
        return f"{self._tagged}:tenants:running"

    @property
    def tenants_seen(self) -> str:
        """Sorted set: tenant -> when it last queued a request (ms). A tenant idle past
        ``request_level.forget_idle_tenants_s`` loses its counter and its length estimates; none is
        kept where that is 0."""
        return f"{self._tagged}:tenants:seen"

    @property
    def estimator(self) -> str:
        """Hash: output-length estimator, ``tenant|bucket:n``, ``:mean`` and ``:err`` fields."""
        return f"{self._tagged}:estimator"

    def request(self, request_id: str) -> str:
        """Hash: one request's record (state, prompt ids, params JSON, tokens so far, ...)."""
        return f"{self._tagged}:req:{request_id}"

    def tokens(self, request_id: str) -> str:
        """List of the request's generated token ids, the source of truth a resumed request re-prefills."""
        return f"{self._tagged}:req:{request_id}:tokens"

    def output(self, request_id: str) -> str:
        """Stream of the request's token events, in order; any replica can serve or resume it."""
        return f"{self.prefix}:req:{request_id}:out"

    @property
    def executors(self) -> str:
        """Sorted set of executor ids scored by last heartbeat (epoch ms)."""
        return f"{self._tagged}:executors"

    def executor(self, executor_id: str) -> str:
        """Hash: an executor's address, model, capacity and latest load."""
        return f"{self._tagged}:executor:{executor_id}"

    def running(self, executor_id: str) -> str:
        """Set of request ids assigned to an executor, re-queued if it dies."""
        return f"{self._tagged}:executor:{executor_id}:running"

    def lease(self, executor_id: str) -> str:
        """String with PX: the scheduler replica that drives the executor."""
        return f"{self._tagged}:lease:executor:{executor_id}"

    def cached_blocks(self, executor_id: str) -> str:
        """Set of the names (hex) of the KV blocks an executor's prefix cache holds, from its reports."""
        return f"{self._tagged}:prefix:executor:{executor_id}"

    @property
    def control_channel(self) -> str:
        """Pub/sub channel on which replicas announce cancels to the replica driving the executor."""
        return f"{self.prefix}:control"
