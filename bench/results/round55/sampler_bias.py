"""The stack sampler's GIL bias: a thread alternating 4 ms of Python with 4 ms of sleep (the
truth is about half and half), sampled every 1 ms, at three GIL switch intervals. Run from
the repository root: python bench/results/round55/sampler_bias.py"""

import sys
import threading
import time

sys.path.insert(0, "bench")
from thread_profile import StackSampler  # noqa: E402


def busy(d: float) -> None:
    end = time.perf_counter() + d
    while time.perf_counter() < end:
        pass


def waits(d: float) -> None:
    time.sleep(d)


def work() -> None:
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        busy(0.004)
        waits(0.004)


for switch in (0.005, 0.0002, 0.00002):
    sys.setswitchinterval(switch)
    sampler = StackSampler(0.001)

    def profiled(sampler: StackSampler = sampler) -> None:
        sampler.enable()
        work()
        sampler.disable()

    thread = threading.Thread(target=profiled)
    thread.start()
    thread.join()
    sampler.stop()
    shares = {k[2]: f"{100 * v / sampler.samples:.0f} %" for k, v in sampler.own.items()}
    print(f"switch interval {switch * 1e3:g} ms: {sampler.samples} samples, own share", shares)
