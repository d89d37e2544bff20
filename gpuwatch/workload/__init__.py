"""Layer 3b: the DeepSeek-architecture stress workload. The only package that imports torch and
transformers, and only inside functions (`import gpuwatch.workload.presets` stays light)."""
