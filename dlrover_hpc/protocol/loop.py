"""The event loop the job master (``dlrover-hpc master``) serves on: uvloop's where it is
installed, else asyncio's own.  An agent's in-process master keeps asyncio's (see
``master.thread``).

uvloop runs the same asyncio API on libuv, at a fraction of the CPU per connection and per
frame: what a master answering thousands of agents spends most of its time on (issue 29).
``asyncio`` in :data:`environ.EVENT_LOOP` chooses asyncio's own loop; ``uvloop`` insists on uvloop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from dlrover_hpc import environ
from dlrover_hpc.errors import ConfigError

ENV = environ.EVENT_LOOP
CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory(environ: dict[str, str] | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new event loop, as :data:`environ.EVENT_LOOP` asks (default ``auto``)."""
    env = os.environ if environ is None else environ
    choice = env.get(ENV, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ConfigError(
            f"{ENV}={env.get(ENV)!r}: expected one of {', '.join(CHOICES)} (auto: uvloop "
            "where it is installed); unset it or pick one"
        )
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise ConfigError(
                f"{ENV}=uvloop, but uvloop is not installed ({exc}); pip install uvloop, "
                f"or set {ENV}=auto"
            ) from exc
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def name(factory: Callable[[], asyncio.AbstractEventLoop]) -> str:
    return "asyncio" if factory is asyncio.new_event_loop else "uvloop"
