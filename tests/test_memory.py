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
