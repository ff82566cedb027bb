"""Telling the drafter service at once that requests finished (`FinishedNotices`), so that it
frees their sessions even when the target goes idle. A mixin of `RemoteDrafter` (remote.py),
which owns the state it uses: `config`, `name`, `connection` and its lock `_cv`, `sessions`,
`mode`, `_step`, `_prefetch` and `_notices` (the unary notices in flight)."""

from __future__ import annotations

import logging

from specwire.common.protogen import drafter_pb2

# The remote drafter's logger: these lines moved from remote.py, and their logger name stays.
log = logging.getLogger("specwire.target_service.drafters.remote")


class FinishedNotices:
    """The `finished` notices of freed requests (see the module docstring)."""

    def _send_finished(self) -> None:
        """Tell the drafter now that requests finished, so it frees their sessions even when
        the target goes idle (no next step to carry the notice). Runs on the executor thread
        when the registry frees a request; sends one small message and waits for nothing.

        Stream mode: the notice goes on the stream, after the request's last update (order
        kept); its empty reply carries a step nobody waits for and is dropped. Unary mode: a
        `Draft` call whose reply is ignored. Disconnected: the notices stay queued and ride on
        the first step after reconnecting.
        """
        with self._cv:
            if not self.connection.connected or self.connection.closed:
                return
            rids = self.sessions.take_finished()
            if not rids:
                return
            self._step += 1
            step = self._step
            updates = [drafter_pb2.SequenceUpdate(request_id=r, finished=True) for r in rids]
            if self.mode == "stream":
                notice = drafter_pb2.DraftStreamRequest(step=step, sequences=updates)
                self.connection.send(notice, awaited=False)
                return
        msg = drafter_pb2.DraftRequest(step=step, sequences=updates)
        pre = self._prefetch  # unary: at most one
        if pre is not None and pre.future is not None and any(r in pre.sent for r in rids):
            # A Draft call still in flight names some of these requests. The drafter serves
            # unary calls side by side, so a notice sent now could be applied before that call,
            # which would then re-create the session (until the TTL): send it after the call.
            pre.future.add_done_callback(lambda _done: self._send_notice(msg))
            return
        self._send_notice(msg)

    def _send_notice(self, msg: drafter_pb2.DraftRequest) -> None:
        """Unary mode: one `Draft` call of finished notices, reply ignored (any thread)."""
        try:
            future = self.connection.stub.Draft.future(msg, timeout=self.config.connect_timeout_s)
        except ValueError:  # the channel closed under us (shutdown): the drafter's TTL is left
            log.debug("drafter %s: finished notice not sent: channel closed", self.name)
            return
        self._notices.add(future)  # held until done; a lost notice only leaves it to the TTL
        future.add_done_callback(self._notices.discard)
