"""Layer 0: sampling GPUs (NVML) and the host (psutil), and the in-process bus that carries samples,
workload steps and events to the recorder, the UI and (later) the risk model."""
