"""Connection-level limits uvicorn's h11 protocol lacks: a deadline for a request's headers.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive` seconds and refuses headers
larger than `h11_max_incomplete_event_size` bytes, but a connection that sends its headers slowly
(slowloris: a byte every few seconds, never the blank line) is held for good. `guarded_h11(t)` is
uvicorn's H11Protocol with a header deadline: the headers of every request (the first one, and
each one on a keep-alive connection, counted from its first byte) must be complete within `t`
seconds, else the connection is closed (no response: the request never started). The request body
has its own deadline, in serve/middleware.py.
"""
from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("serve.server")


def guarded_h11(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's H11Protocol whose requests must send their headers within `header_timeout` s
    (uvicorn.Config(http=...) takes the class)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()            # the next request on a keep-alive connection begins
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._cancel_header_timer()         # its headers are complete (or the connection failed)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.debug("closing a connection from %s: no complete request headers within %.0f s",
                          self.client, header_timeout)
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol
