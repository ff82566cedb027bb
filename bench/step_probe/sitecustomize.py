"""Where a target's steps spend their time, phase by phase, in a real serving target: loaded as
`sitecustomize` when this folder leads PYTHONPATH and `SPECWIRE_STEP_PROBE=DIR` is set (e.g.
by `bench/serving.py --step-probe DIR`, which passes both to the servers it starts). Off, and
nothing is patched, without the variable.

It wraps the executor's components once it is built: the scheduler, the resource managers'
prepare/update, the draft intake's prepare/submit/launched, the runner's forward and wait,
the verifier, the emit and the output hand-off, and the policy's per-step choice of k (and a
remote drafter's parts, as "remote.*" rows nested in the drafts' phases); and
records, separately for synchronous (drafting) and overlapped (plain) steps, each phase's
total time and count, plus the policy's host estimate and the request's acceptance
estimates (p: has a draft, a: per-draft acceptance) at every one-stream decision for a
request that may draft. Every
REPORT_EVERY steps it rewrites `DIR/<pid>.json`; `bench/step_probe.py DIR` prints the table.
The wrappers cost ~1 us a call (a perf_counter pair), on every side alike.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

ENV = "SPECWIRE_STEP_PROBE"
REPORT_EVERY = 500


def _install(out_dir: str) -> None:
    from specwire.target_service import executor as executor_mod

    stats: dict[str, dict[str, list[float]]] = {
        "sync": defaultdict(lambda: [0.0, 0]),
        "plain": defaultdict(lambda: [0.0, 0]),
    }
    policy_rows: list[tuple[float, float, float, int]] = []  # host s, p, a, k
    state = {"kind": "plain", "steps": 0}
    path = os.path.join(out_dir, f"{os.getpid()}.json")

    def dump() -> None:
        data = {
            "pid": os.getpid(),
            "drafter": state.get("drafter"),
            "steps": state["steps"],
            "phases": {kind: dict(phases) for kind, phases in stats.items()},
            "policy": policy_rows[-20000:],
        }
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="ascii") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cell = stats[state["kind"]][name]
                cell[0] += time.perf_counter() - t0
                cell[1] += 1

        return wrapper

    init = executor_mod.Executor.__init__

    def patched_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        mode = getattr(getattr(self.drafter, "config", None), "mode", "")
        state["drafter"] = f"{getattr(self.drafter, 'name', None)} {mode}".strip()
        self.scheduler.schedule = timed("schedule", self.scheduler.schedule)
        self.resources.prepare = timed("resources.prepare", self.resources.prepare)
        self.resources.update = timed("resources.update", self.resources.update)
        self.drafts.prepare = timed("drafts.prepare", self.drafts.prepare)
        self.drafts.submit = timed("drafts.submit", self.drafts.submit)
        self.drafts.launched = timed("drafts.launched", self.drafts.launched)
        self.runner.forward = timed("runner.forward", self.runner.forward)
        self.runner.wait = timed("runner.wait", self.runner.wait)
        self.verifier.verify = timed("verifier.verify", self.verifier.verify)
        self.emit = timed("emit", self.emit)
        self.output.render_many = timed("output.render_many", self.output.render_many)
        drafter = self.drafter
        if hasattr(drafter, "_take_answered"):  # a remote drafter: its parts, nested above
            conn = drafter.connection
            for obj, attr in (
                (drafter, "_take_answered"),
                (drafter, "_question"),
                (drafter, "_build"),
                (drafter, "_covered"),
                (drafter, "_from_run"),
                (drafter, "_use_prefetch"),
                (drafter, "_apply"),
                (conn, "send"),
                (conn, "_pump"),
                (conn, "wait"),
            ):
                setattr(obj, attr, timed(f"remote.{attr}", getattr(obj, attr)))
        policy = self.scheduler.policy
        choose = policy.step_draft_len

        def step_draft_len(decode, prefill_tokens=0):
            k = choose(decode, prefill_tokens)
            # One stream, speculating, a request that may draft (an off arm's requests never
            # do, and keep the population's estimate: they would blur the means).
            if decode and policy.mode == "spec" and len(decode) == 1 and decode[0].useful_drafts:
                est = policy.acceptance.estimate(decode[0])
                if est is not None:
                    policy_rows.append((policy._host(1), est.has_draft, est.accept, k))
            return k

        policy.step_draft_len = step_draft_len
        step_sync = self._step_sync

        def sync(*args, **kwargs):
            state["kind"] = "sync"
            t0 = time.perf_counter()
            try:
                return step_sync(*args, **kwargs)
            finally:
                cell = stats["sync"]["step"]
                cell[0] += time.perf_counter() - t0
                cell[1] += 1
                state["kind"] = "plain"

        self._step_sync = sync
        step = self.step

        def counted_step() -> None:
            step()
            state["steps"] += 1
            if state["steps"] % REPORT_EVERY == 0:
                dump()

        self.step = counted_step

    executor_mod.Executor.__init__ = patched_init


if os.environ.get(ENV):
    os.makedirs(os.environ[ENV], exist_ok=True)
    _install(os.environ[ENV])
