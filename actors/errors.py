"""Errors of pullers and pushers, each saying whether a retry can help."""

from __future__ import annotations

from typing import ClassVar

from wattflow.formats.errors import WattflowError


class PullError(WattflowError):
    """A puller cannot read its input."""

    retryable: ClassVar[bool] = False


class PullUnavailable(PullError):
    """The input is unreachable for now (server down, file not there yet)."""

    retryable = True


class PushError(WattflowError):
    """A pusher cannot write a batch; retrying will not help."""

    retryable: ClassVar[bool] = False


class PushUnavailable(PushError):
    """The sink is unreachable for now; the batch is retried with backoff."""

    retryable = True
