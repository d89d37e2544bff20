"""Helpers shared by the tests and the benchmarks, not shipped in the package: the one fake NVML
(fake_nvml.py) and the sampler tick profiler (sampler_profile.py)."""
