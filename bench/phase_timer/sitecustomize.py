"""Where a served target's host time goes, timed inside the real engine process (a diagnostic,
not part of specwire).

Python imports `sitecustomize` at start-up from the path, so putting this directory first on
PYTHONPATH loads it into every process a benchmark starts — the spawned engine child too, whose
methods no wrapper in the benchmark's own process could reach:

    PHASES_DIR=/tmp/phases PYTHONPATH=bench/phase_timer:$PYTHONPATH python bench/serving.py \\
        --model smollm2-135m --device cuda --configs ngram,remote-ngram-socket ...

With PHASES_DIR set, the executor's phase methods (and the drafter intake's, the verifier's,
the runner's, the output thread's) are wrapped with wall-clock timers, keyed by thread and by
the wrapped method they were called from, and each process that ran any writes its table to
PHASES_DIR/phases-<pid>.txt every 3 s and at exit. The first line after the command is the
critical path of synchronous steps: from the end of a step's device wait to the next launch
(`ModelRunner.wait` inside `Executor._compute` -> the next `ModelRunner.forward`), with a
histogram in 10 us buckets (50: 500 us or more, idle gaps included; a runner that overrides
`forward`, as bench/host_only.py's simulated device does, is not marked). The timers cost about a
microsecond a call: compare configurations timed alike, not these figures with untimed runs.

PHASES_EXTRA="module:Class.method,..." times those methods too, nested under the phase that
calls them (e.g. `specwire.target_service.drafters.remote:RemoteDrafter._build`).

PHASES_NO_DEVICE_RUNNING=1 (an A/B switch for round 44's experiment): the drafter intake skips
`Drafter.device_running`, so a remote drafter does not take replies while the device runs.

Every import here is guarded: a process that cannot import specwire runs untouched.
"""

import os

if os.environ.get("PHASES_DIR"):
    try:
        import atexit
        import collections
        import sys
        import threading
        import time

        from specwire.target_service import drafts as _drafts
        from specwire.target_service import executor as _executor
        from specwire.target_service import output as _output
        from specwire.target_service import verifier as _verifier
        from specwire.target_service.runner import model_runner as _runner

        _TIMES = collections.defaultdict(lambda: [0, 0.0])  # label -> [calls, seconds]
        _CTX = threading.local()  # .name: the wrapped method running; .sync: in _compute
        _CRIT = {"from": None, "n": 0, "sum": 0.0, "hist": collections.Counter()}
        _clock = time.perf_counter

        def _wrap(cls, name):
            f = getattr(cls, name, None)
            if f is None:
                return
            label = f"{cls.__name__}.{name}"

            def timed(*a, **k):
                outer = getattr(_CTX, "name", "")
                _CTX.name = name
                t0 = _clock()
                try:
                    return f(*a, **k)
                finally:
                    thread = threading.current_thread().name[:10]
                    entry = _TIMES[f"{thread}:{label}" + (f"@{outer}" if outer else "")]
                    entry[0] += 1
                    entry[1] += _clock() - t0
                    _CTX.name = outer

            setattr(cls, name, timed)

        _E = _executor.Executor
        _compute = _E._compute

        def _sync_compute(self, *a, **k):
            _CTX.sync = True
            try:
                return _compute(self, *a, **k)
            finally:
                _CTX.sync = False

        _E._compute = _sync_compute
        for _name in (
            "_step_sync", "_compute", "_commit", "_append", "emit", "_schedule",
            "_admit_arrivals", "_launched", "_advance", "_drain_inbox", "_render",
            "_observe_gpu", "_count_step", "_step_overlapped", "_finish_inflight", "_complete",
        ):  # fmt: skip
            _wrap(_E, _name)
        for _name in ("prepare", "submit", "launched", "device_running", "arrived"):
            _wrap(_drafts.DraftIntake, _name)
        _wrap(_verifier.Verifier, "verify")
        _R = _runner.ModelRunner
        _wait, _forward = _R.wait, _R.forward

        def _marked_wait(self, step):
            out = _wait(self, step)
            if getattr(_CTX, "sync", False):
                _CRIT["from"] = _clock()
            return out

        def _marked_forward(self, *a, **k):
            start = _CRIT["from"]
            if start is not None:
                gap = _clock() - start
                _CRIT["n"] += 1
                _CRIT["sum"] += gap
                _CRIT["hist"][min(int(gap * 1e5), 50)] += 1
                _CRIT["from"] = None
            return _forward(self, *a, **k)

        _R.wait, _R.forward = _marked_wait, _marked_forward
        _wrap(_R, "wait")
        _wrap(_R, "forward")
        for _name in ("_render_many", "_run_held", "_call"):
            _wrap(_output.OutputWorker, _name)
        # PHASES_EXTRA: more methods to time, "module:Class.method,..." (e.g. the remote
        # drafter's pieces: specwire.target_service.drafters.remote:RemoteDrafter._build)
        import importlib

        for _spec in filter(None, os.environ.get("PHASES_EXTRA", "").split(",")):
            _mod, _, _attr = _spec.strip().partition(":")
            _cls_name, _, _meth = _attr.partition(".")
            try:
                _cls = getattr(importlib.import_module(_mod), _cls_name)
                getattr(_cls, _meth)  # a misspelt name says so instead of timing nothing
                _wrap(_cls, _meth)
            except Exception as exc:
                print(f"bench/phase_timer: cannot time {_spec}: {exc!r}", file=sys.stderr)

        _path = os.path.join(os.environ["PHASES_DIR"], f"phases-{os.getpid()}.txt")

        def _dump() -> None:
            if not _TIMES:
                return
            n, total = _CRIT["n"], _CRIT["sum"]
            lines = [
                " ".join(sys.argv[:3]),
                f"critical wait-end -> next forward: n={n} "
                f"mean={total / n * 1e6 if n else 0:.1f} us "
                f"hist(10us)={sorted(_CRIT['hist'].items())}",
            ]
            for label, (calls, secs) in sorted(_TIMES.items(), key=lambda kv: -kv[1][1]):
                lines.append(
                    f"{label:70s} n={calls:8d} total={secs * 1e3:10.1f} ms "
                    f"per={secs / calls * 1e6 if calls else 0:8.1f} us"
                )
            with open(_path + ".tmp", "w") as fh:
                fh.write("\n".join(lines) + "\n")
            os.replace(_path + ".tmp", _path)

        def _dump_every(seconds: float) -> None:
            while True:
                time.sleep(seconds)
                _dump()

        atexit.register(_dump)
        threading.Thread(target=_dump_every, args=(3.0,), daemon=True, name="phase-timer").start()
    except Exception as exc:  # never break the process it loads into
        print(f"bench/phase_timer: not installed: {exc!r}", file=sys.stderr)

if os.environ.get("PHASES_NO_DEVICE_RUNNING"):
    try:
        from specwire.target_service import drafts as _intake

        _init = _intake.DraftIntake.__init__

        def _init_without_device_running(self, *a, **k):
            _init(self, *a, **k)
            self._device_running = None

        _intake.DraftIntake.__init__ = _init_without_device_running
    except Exception as exc:
        import sys

        print(
            f"bench/phase_timer: PHASES_NO_DEVICE_RUNNING not installed: {exc!r}", file=sys.stderr
        )
