"""gpuwatch: watch, record, replay and protect large-model GPU workloads from a terminal."""

__version__ = "0.1.0"
