"""The LMCache link opens its request client again when ZMQ finds the client's monitor endpoint in use:
pyzmq names that endpoint after the socket's file descriptor, and a socket closed just before under the
same descriptor releases it only when ZMQ's reaper thread gets to it (seen once in a CI run, as
``ZMQError: Address already in use`` from LMCache's ``MessageQueueClient``)."""

from __future__ import annotations

import errno
from typing import Any, cast

import pytest
import zmq
from lmcache.v1.multiprocess.transport.base import RequestClient

from kvcore_lmcache.link import CLIENT_ATTEMPTS, open_client


class Flaky:
    """A client factory that fails ``failures`` times with ``code``, then returns a client."""

    def __init__(self, failures: int, code: int) -> None:
        self.failures = failures
        self.code = code
        self.calls = 0
        self.client = cast(RequestClient, object())

    def __call__(self, url: str) -> RequestClient:
        self.calls += 1
        if self.calls <= self.failures:
            raise zmq.ZMQError(self.code)
        return self.client


def test_an_endpoint_in_use_is_tried_again_until_it_is_free() -> None:
    factory = Flaky(failures=2, code=errno.EADDRINUSE)
    assert open_client(factory, "tcp://127.0.0.1:1") is factory.client
    assert factory.calls == 3


def test_an_endpoint_that_stays_in_use_is_raised_after_the_last_attempt() -> None:
    factory = Flaky(failures=CLIENT_ATTEMPTS + 1, code=errno.EADDRINUSE)
    with pytest.raises(zmq.ZMQError, match="in use"):
        open_client(factory, "tcp://127.0.0.1:1")
    assert factory.calls == CLIENT_ATTEMPTS


def test_any_other_error_is_raised_at_once() -> None:
    factory: Any = Flaky(failures=1, code=errno.EINVAL)
    with pytest.raises(zmq.ZMQError):
        open_client(factory, "tcp://127.0.0.1:1")
    assert factory.calls == 1
