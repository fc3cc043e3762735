"""Which event loop a master serves on (issue 29): uvloop's where installed, else asyncio's."""

from __future__ import annotations

import asyncio
import sys

import pytest

from dlrover_hpc.errors import ConfigError
from dlrover_hpc.protocol.loop import ENV, loop_factory, name


def test_auto_and_uvloop_choose_uvloop_where_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    for env in ({}, {ENV: "auto"}, {ENV: " UVLOOP "}):
        factory = loop_factory(env)
        assert factory is uvloop.new_event_loop and name(factory) == "uvloop"
        loop = factory()
        try:  # a working loop, not only the right class
            assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
        finally:
            loop.close()


def test_asyncio_chooses_asyncios_own_loop() -> None:
    factory = loop_factory({ENV: "asyncio"})
    assert factory is asyncio.new_event_loop and name(factory) == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert loop_factory({ENV: "auto"}) is asyncio.new_event_loop
    with pytest.raises(ConfigError, match=rf"{ENV}=uvloop, but uvloop is not installed"):
        loop_factory({ENV: "uvloop"})


def test_an_unknown_choice_says_what_is_expected() -> None:
    with pytest.raises(ConfigError, match=rf"{ENV}='libev': expected one of auto, uvloop, asyncio"):
        loop_factory({ENV: "libev"})
