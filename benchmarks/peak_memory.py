"""Peak resident memory of this process above a starting point, exactly and without sampling.

Writing 5 to /proc/self/clear_refs (Linux >= 4.0) resets VmHWM (the RSS high-water mark) to the
current RSS; afterwards VmHWM - RSS_at_reset is the peak memory used on top of the start. Where
clear_refs is not writable, ru_maxrss (never reset) is the fallback: run each variant in a fresh
process so it stays meaningful.
"""

import resource


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Peak RSS above the moment of ``start()``, in bytes (see module docstring)."""

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after clear_refs"
            self.base = _status_kib("VmRSS")
        except OSError:
            self.method = "ru_maxrss"
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def peak_bytes(self) -> int:
        now = _status_kib("VmHWM") if self.method != "ru_maxrss" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, now - self.base) * 1024


class PeakAnonMemory:
    """Peak anonymous RSS (RssAnon: heap and tensors, not file pages) above start(), sampled.

    Reading safetensors maps the files, and VmHWM counts every touched, reclaimable page of
    the page cache; RssAnon does not. There is no kernel high-water mark for it, so a thread
    samples it every `interval` seconds (peaks shorter than that can be missed).
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval

    def start(self) -> None:
        import threading

        self.base = _status_kib("RssAnon")
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kib("RssAnon"))
            self._stop.wait(self.interval)

    def peak_bytes(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon"))
        return max(0, self.peak - self.base) * 1024
