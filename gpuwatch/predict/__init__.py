"""Layer 2: features over telemetry windows and failure-risk scoring. Until a trained model is
loaded, the memory headroom and its trend (headroom.py) are what the UI shows."""
