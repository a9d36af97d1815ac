"""monai-fast: fast 3D medical-image training with MONAI and PyTorch-Ignite.

Handlers that ``attach(engine)`` to any ignite ``Engine`` (MONAI's trainers included), recipes that
build complete MONAI training set-ups, synthetic data in Decathlon layout, and the ``monai-fast``
command (``demo``, ``bench``, ``synth``).
"""

__version__ = "0.1.0"
