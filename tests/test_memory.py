import sys

import numpy as np
import pytest

from monai_fast.telemetry.memory import PeakRSS


def test_peak_rss_sees_a_transient_allocation():
    with PeakRSS(interval_s=0.005) as mem:
        buf = np.ones(200 * 2**20 // 8)  # 200 MiB, touched
        del buf
    assert mem.growth_mib > 150


def test_peak_rss_validates():
    with pytest.raises(ValueError, match="interval_s"):
        PeakRSS(interval_s=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's peak RSS (VmHWM) is Linux-only")
def test_peak_rss_catches_a_spike_between_readings():
    # one reading a minute: only the kernel's high-water mark can see a spike of a few milliseconds
    with PeakRSS(interval_s=60) as outer:
        with PeakRSS(interval_s=60) as inner:
            buf = np.ones(200 * 2**20 // 8)  # 200 MiB, touched, freed at once
            del buf
        after_inner = np.ones(8 * 2**20 // 8)
        del after_inner
    assert inner.exact and inner.growth_mib > 150
    assert outer.exact and outer.peak_bytes >= inner.peak_bytes  # the nested reset does not hide it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's peak RSS (VmHWM) is Linux-only")
def test_nested_block_keeps_the_outer_peak_from_before_it_and_runs_no_sampler():
    import threading

    with PeakRSS(interval_s=60) as outer:
        buf = np.ones(200 * 2**20 // 8)  # 200 MiB in the outer block only, freed before the inner starts
        del buf
        with PeakRSS(interval_s=60) as inner:
            assert not any(t.name == "monai-fast-rss" for t in threading.enumerate())  # the kernel counts
    assert inner.exact and inner.growth_mib < 100
    assert outer.exact and outer.growth_mib > 150  # the inner block's reset did not erase it
