"""Reads written once as *plans*, run by a sync or an async driver.

A plan is a generator: it yields a list of Redis commands (``(method, *args)``), receives
their replies, and finally returns its result. :func:`run_sync` runs a plan on a
``redis.Redis`` (workers, CLI, benchmarks); :func:`run_async` on a ``redis.asyncio``
client (the API, which must never block its event loop). Every command of one step goes
out in one pipeline (non-transactional: on a cluster the parts live on several nodes).
"""

from __future__ import annotations

import asyncio
from typing import Generator, Optional

import redis

__all__ = ["Plan", "run_sync", "run_async"]

Plan = Generator[list, list, object]


def run_sync(client, plan: Plan):
    """Run a plan on a synchronous client."""
    try:
        commands = next(plan)
        while True:
            with client.pipeline(transaction=False) as p:
                for name, *args in commands:
                    getattr(p, name)(*args)
                replies = p.execute() if commands else []
            commands = plan.send(replies)
    except StopIteration as stop:
        return stop.value


async def run_async(client, plan: Plan, timeout: Optional[float] = 10.0):
    """Run a plan on a ``redis.asyncio`` client, within ``timeout`` seconds as a whole
    (one timer per read, not one per command: ``redis.TimeoutError`` beyond it)."""
    try:
        async with asyncio.timeout(timeout):
            return await _drive(client, plan)
    except TimeoutError:
        raise redis.TimeoutError(f"the store did not answer within {timeout} s") from None


async def _drive(client, plan: Plan):
    try:
        commands = next(plan)
        while True:
            if commands:
                async with client.pipeline(transaction=False) as p:
                    for name, *args in commands:
                        getattr(p, name)(*args)
                    replies = await p.execute()
            else:
                replies = []
            commands = plan.send(replies)
    except StopIteration as stop:
        return stop.value
