# A thread alternating 4 ms of Python with 4 ms of sleep (truth: ~50/50), sampled every 1 ms
import sys, time, threading
sys.path.insert(0, "bench")
from thread_profile import StackSampler
def busy(d):
    end = time.perf_counter() + d
    while time.perf_counter() < end:
        pass
def waits(d):
    time.sleep(d)
def work():
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        busy(0.004); waits(0.004)
for sw in (0.005, 0.0002, 0.00002):
    sys.setswitchinterval(sw)
    s = StackSampler(0.001)
    def prof():
        s.enable(); work(); s.disable()
    t = threading.Thread(target=prof); t.start(); t.join()
    s._stop.set(); s._thread.join()
    print(f"switch interval {sw * 1e3:g} ms: {s.samples} samples, own share", {k[2]: f"{100 * v / s.samples:.0f} %" for k, v in s.own.items()})
