"""The remote drafter's questions asked early (`RemoteDrafter.submit`) and their replies:
collecting them without waiting (`_take_answered`, and `device_running` while the device
runs a step), or waiting at most a patience or the deadline (`_use_prefetch`), and keeping
what they propose. A mixin of `RemoteDrafter`
(remote.py), which owns the state it uses: `config`, `connection` and its lock `_cv`,
`patience`, `_pending` (the questions in flight, oldest first), and `_count` / `_apply`."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from specwire.target_service.drafters.remote_sessions import Reply, Sent

_PENDING = object()  # a prefetch not answered within the step's patience: still awaited
# `device_running`: the longest a poll for a reply may keep the executor past the end of the
# device's step.
DEVICE_POLL_S = 20e-6


@dataclass
class Prefetch:
    """Drafts asked for at the end of a step (`submit`), collected by a later `submit` or
    `prepare_draft_tokens`."""

    step: int
    sent: Sent  # request -> (tokens the drafter was sent, drafts asked)
    stream: object | None  # stream mode: the stream it went on (its reader hands the reply)
    future: grpc.Future | None  # unary mode: the call
    since: float = 0.0  # time.monotonic() when it was sent
    answered_at: float = 0.0  # unary: when the call completed (gRPC's callback)
    at_launch: bool = False  # sent once the next step was launched (`RemoteDrafter.launched`)
    # Its round trip is a sample of the commit's (or the launch's): not for a new request's
    # first question (`RemoteDrafter.arrived`), which carries a whole prompt to index.
    timed: bool = True

    def mark_answered(self, _future) -> None:
        self.answered_at = time.monotonic()


class PrefetchReplies:
    """Collecting a `submit`'s reply (see the module docstring)."""

    @property
    def _prefetch(self) -> Prefetch | None:
        """The newest question asked early and not yet collected (None: none)."""
        return self._pending[-1] if self._pending else None

    def unanswered(self) -> int:
        """Questions asked early whose replies have not arrived, once every reply that has is
        kept (never waits; executor thread): what the next step would still find in flight."""
        self._take_answered()
        return len(self._pending)

    def _take_answered(self, branches: bool = True) -> None:
        """Keep the proposals of every `submit` the drafter has already answered, oldest
        first, then the branches that followed them (never waits): a branches-only reply
        attaches to the proposal its drafts' reply left, so that one is kept first. One still
        unanswered a deadline after it was sent is given up on (counted late).

        Framed modes read the descriptor once for all of it (`RemoteConnection.collect`):
        each read is a system call, and a system call lets go of the GIL, which another thread
        (the output's, gRPC's) may then keep for up to a switch interval while the step waits.
        It is read only when a reply is awaited, or branches are and `branches` says to look
        for them; a commit (`submit`) does not read for branches alone: the next step's
        collection reads them, and until then they serve nothing."""
        conn = self.connection
        if conn.framed:
            if not (self._pending or (branches and conn.branches_due)):
                return
            with self._cv:
                conn.collect()
        self._take_replies()
        if conn.branches_due:
            with self._cv:
                came = conn.take_branches()
            for reply in came:
                self.sessions.add_branches(reply)

    def _take_replies(self) -> None:
        """Keep the replies that came (framed: those `collect` just read)."""
        for pre in list(self._pending):
            if pre.future is not None:
                if pre.future.done():
                    self._use_prefetch(pre)
                    continue
            else:
                with self._cv:  # its reply, or None: the stream broke (no reply will come)
                    reply = self._stream_reply(pre.step, pre.stream, 0.0, True, pump=False)
                if reply is not _PENDING:
                    self._keep_prefetched(pre, reply)
                    continue
            if time.monotonic() - pre.since > self.config.deadline_ms / 1000:
                self._pending.remove(pre)
                if pre.future is not None:
                    pre.future.cancel()
                self._count("late")

    def device_running(self, done) -> None:
        """Framed modes (relay, socket): while the device runs the step the executor is about
        to wait for, take the replies that arrive (read, parse, keep their proposals), which
        the next commit's `submit` would otherwise do on the critical path. Polls the
        descriptor for at most DEVICE_POLL_S at a time between `done()` checks, and returns
        as soon as nothing is pending (no reply, no branches to follow one) or the device is
        done. (The stream's reader thread does this on its own thread; a unary call has
        nothing to take.)"""
        conn = self.connection
        if not conn.framed:
            return
        while (self._pending or conn.branches_due) and not done():
            with self._cv:
                conn.wait(DEVICE_POLL_S)
            self._take_answered()

    def _covering(self, requests) -> tuple[Prefetch | None, set[str]]:
        """The newest question in flight that was asked for some of `requests` at their
        current length, and those requests (the stream answers in order: the older questions'
        replies come first, and `_take_answered` keeps them). A pipelined step's request is
        asked about at its settled length (the step in flight's token is not known)."""
        for pre in reversed(self._pending):
            covered = {
                r.request_id
                for r in requests
                if pre.sent.get(r.request_id, (-1,))[0] == r.num_settled_tokens
            }
            if covered:
                return pre, covered
        return None, set()

    def _use_prefetch(self, pre: Prefetch, wait_s: float | None = None) -> bool:
        """Collect a `submit`'s reply and keep its proposals. Waits at most the deadline, or
        `wait_s` (the step's patience): then False, and the reply stays awaited — kept when it
        comes, for the steps after (`_take_answered`), instead of given up on."""
        reply = self._collect(pre, wait_s)
        if reply is _PENDING:
            self._count("deferred")
            return False
        self._keep_prefetched(pre, reply)
        return True

    def _use_prefetch_until(self, pre: Prefetch, done) -> bool:
        """`_use_prefetch`, waiting for the reply only until `done()` (the step in flight has
        finished on the device: a pipelined step is staged meanwhile, so waiting costs nothing
        until then; after that the rows go without these drafts and the reply serves the step
        after)."""
        while True:
            reply = self._collect(pre, DEVICE_POLL_S)
            if reply is not _PENDING:
                self._keep_prefetched(pre, reply)
                return True
            if done():
                self._count("deferred")
                return False

    def _keep_prefetched(self, pre: Prefetch, reply: Reply | None) -> None:
        """The `submit` is over: keep its reply's proposals (None: late or failed)."""
        self._pending.remove(pre)
        if reply is not None:
            arrived = pre.answered_at if pre.future is not None else self.connection.reply_at
            if pre.timed and arrived > pre.since:
                self.patience.replied(arrived - pre.since, pre.at_launch)
            self._apply(reply, pre.sent)
            self._count("prefetched")

    def _collect(self, pre: Prefetch, wait_s: float | None = None):
        """The reply to a `submit`, waiting at most the step deadline (None if late/failed),
        or at most `wait_s` (`_PENDING` if not answered by then)."""
        patient = wait_s is not None
        timeout = wait_s if patient else self.config.deadline_ms / 1000
        if pre.future is not None:
            if patient:
                try:
                    return pre.future.result(timeout=timeout)
                except grpc.FutureTimeoutError:
                    return _PENDING
                except grpc.RpcError as exc:
                    return self._call_failed(exc)
            return self._unary_reply(pre.future, timeout)
        with self._cv:
            return self._stream_reply(pre.step, pre.stream, time.monotonic() + timeout, patient)

    def _unary_reply(self, future, timeout: float):
        """The reply of a unary Draft call, waiting at most `timeout`; None if late/failed."""
        try:
            return future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            future.cancel()
            return self._count("late")
        except grpc.RpcError as exc:
            return self._call_failed(exc)

    def _call_failed(self, exc: grpc.RpcError) -> None:
        """A Draft call that raised: past its deadline it was late; otherwise the connection
        is suspect (reconnect in the background). None: the step goes without these drafts."""
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return self._count("late")
        self.connection.disconnect(f"Draft failed ({exc.code().name}: {exc.details()})")
        return self._count("failed")

    def _stream_reply(
        self, step: int, stream, end: float, patient: bool = False, pump: bool = True
    ):
        """The stream's reply for `step`, waiting until `end` (monotonic); None if late or the
        stream broke (`_PENDING` if late and `patient`). `pump`: framed, read the descriptor
        first (else the caller just did). Called with `_cv` held."""
        while True:
            reply = self.connection.reply(step, pump)
            pump = True
            if reply is not None:
                return reply
            if not self.connection.is_open(stream):
                return self._count("failed")
            left = end - time.monotonic()
            if left <= 0:
                return _PENDING if patient else self._count("late")
            self.connection.wait(left)
